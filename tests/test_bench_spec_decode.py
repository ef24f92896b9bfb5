"""bench.spec_decode end to end on a tiny model: every row runs the requested tokens, the vLLM
rows hand the ngram settings (or none) to the driver (a stand-in here), and ``--draft-model``
adds vllmini with a draft model (a layer-truncated copy made by bench.truncated_draft, checked
here against the target's own first layers)."""
from __future__ import annotations

import json
import textwrap

import pytest
import torch
from helpers import fake_python, save_tiny_model, tiny_llama_config

FAKE_DRIVER = textwrap.dedent(
    """
    import json, sys
    if sys.argv[1] == "-c":
        sys.exit(0)
    job = json.load(open(sys.argv[2]))
    spec = job["engine_extra"].get("speculative_config")
    assert spec in (None, {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}), spec
    runs = []
    for run in job["runs"]:
        assert run["concurrency"] in (1, None)
        recs = [{"send_time": 0.0, "chunk_times": [0.1] * n, "prompt_len": len(p), "output_len": n, "error": None}
                for p, n in zip(run["prompts"], run["output_lens"])]
        runs.append({"label": run["label"], "duration_s": 1.0 if spec else 2.0, "records": recs, "peak_rss_bytes": 1})
    json.dump({"startup_s": 1.0, "runs": runs}, open(sys.argv[3], "w"))
    """
)


def test_bench_spec_decode_rows(tmp_path, default_model_dir):
    from transformers import LlamaForCausalLM

    from bench.spec_decode import main
    from bench.truncated_draft import truncate

    torch.manual_seed(0)
    model = save_tiny_model(LlamaForCausalLM(tiny_llama_config(vocab_size=49152)).eval(), tmp_path / "m", default_model_dir)
    draft = truncate(model, 1, tmp_path / "draft")
    exe = fake_python(tmp_path, FAKE_DRIVER)
    record = main(["--model", str(model), "--num-requests", "2", "--output-len", "5", "--num-speculative-tokens", "3",
                   "--prompt-lookup-min", "1", "--prompt-lookup-max", "2", "--vllm-python", str(exe),
                   "--draft-model", str(draft), "--out", str(tmp_path / "res")])  # fmt: skip
    rows = record["results"]
    engines = {(r["workload"], r["mode"], r["engine"]) for r in rows}
    for wl in ("quote", "chat"):
        for mode in ("one at a time", "batch"):
            for engine in ("vllmini", "vllmini ngram", "vllmini draft", "vLLM CPU eager", "vLLM CPU eager ngram"):
                assert (wl, mode, engine) in engines
        assert (wl, "one at a time", "transformers prompt lookup") in engines
    assert all(r["tok_s"] > 0 for r in rows)
    # the draft rows ran with drafts (a 1-layer draft of a random model agrees now and then, or never)
    draft_rows = [r for r in rows if r["engine"] == "vllmini draft"]
    assert len(draft_rows) == 4 and all(0 <= r["acceptance_rate"] <= 1 for r in draft_rows)
    assert record["args"]["draft_model"] == str(draft)
    vllm = {r["engine"]: r["tok_s"] for r in rows if r["engine"].startswith("vLLM") and r["workload"] == "quote" and r["mode"] == "batch"}
    assert vllm == {"vLLM CPU eager": pytest.approx(10 / 2.0), "vLLM CPU eager ngram": pytest.approx(10 / 1.0)}
    (path,) = (tmp_path / "res").glob("spec_decode-*.json")
    assert json.loads(path.read_text())["results"] == rows


def test_truncated_draft_is_the_targets_first_layers(tmp_path, default_model_dir):
    from transformers import LlamaForCausalLM

    from bench.truncated_draft import main

    torch.manual_seed(0)
    target = LlamaForCausalLM(tiny_llama_config()).eval()  # 3 layers, untied lm_head
    model = save_tiny_model(target, tmp_path / "m", default_model_dir)
    with pytest.raises(ValueError, match="--layers must be in 1..3"):
        main(["--model", str(model), "--layers", "4", str(tmp_path / "bad")])
    out = main(["--model", str(model), "--layers", "2", str(tmp_path / "draft")])
    draft = LlamaForCausalLM.from_pretrained(out).eval()
    assert draft.config.num_hidden_layers == 2 and (out / "tokenizer.json").exists()
    target.model.layers = target.model.layers[:2]  # the same forward, cut after two layers
    ids = torch.tensor([[1, 5, 9, 200, 7]])
    with torch.inference_mode():
        torch.testing.assert_close(draft(ids).logits, target(ids).logits)
