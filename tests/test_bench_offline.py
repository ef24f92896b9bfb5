"""The offline benchmark runs end to end (tiny model, few requests) and writes its record."""
from __future__ import annotations

import json

import torch
from transformers import LlamaForCausalLM as HFLlama

from bench.offline import main, mixed_workload
from helpers import save_tiny_model, tiny_llama_config


def test_mixed_workload_is_seeded_and_in_range():
    a, b = mixed_workload(100, 20, seed=1), mixed_workload(100, 20, seed=1)
    assert a == b
    assert all(16 <= len(p) <= 512 for p in a.prompts) and all(16 <= n <= 256 for n in a.output_lens)
    assert a.requested_tokens == sum(a.output_lens)


def test_offline_bench_smoke(tmp_path, default_model_dir):
    torch.manual_seed(0)
    model_dir = save_tiny_model(HFLlama(tiny_llama_config(vocab_size=49152)).eval(), tmp_path / "tiny", default_model_dir)
    record = main(["--model", str(model_dir), "--num-requests", "4", "--hf-batch-size", "2", "--out", str(tmp_path / "res")])
    rows = {r["workload"]: r for r in record["results"]}
    assert set(rows) == {"uniform", "mixed"}
    assert rows["uniform"]["output_tokens"] == 4 * 64
    for r in rows.values():
        assert r["vllmini_tok_s"] > 0 and r["hf_static_tok_s"] > 0 and r["ratio"] > 0
    written = list((tmp_path / "res").glob("offline-*.json"))
    assert len(written) == 1 and json.loads(written[0].read_text())["results"] == record["results"]


def test_git_revision_says_when_the_code_differs_from_head(tmp_path, monkeypatch):
    """A record's "git" names the code it ran: "-dirty" when tracked vllmini/ or bench/ files
    were changed, not for untracked files or changes elsewhere."""
    import subprocess

    import bench.offline as offline

    def git(*args: str) -> str:
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path,
                              capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip

    for path in ("vllmini/a.py", "bench/b.py", "README.md"):
        (tmp_path / path).parent.mkdir(exist_ok=True)
        (tmp_path / path).write_text("x = 1\n")
    git("init", "-q")
    git("add", ".")
    git("commit", "-qm", "c")
    monkeypatch.setattr(offline, "HERE", tmp_path / "bench")
    head = git("rev-parse", "--short", "HEAD")
    assert offline.git_revision() == head
    (tmp_path / "README.md").write_text("changed\n")
    (tmp_path / "bench" / "new.py").write_text("untracked\n")
    assert offline.git_revision() == head
    (tmp_path / "vllmini" / "a.py").write_text("x = 2\n")
    assert offline.git_revision() == f"{head}-dirty"


def test_offline_measured_run_starts_from_a_cold_prefix_cache(tmp_path, default_model_dir, monkeypatch):
    """The warm-up runs the first two measured prompts: their cached prefixes must not carry into
    the measured run (HF prefills every prompt), and each row's preemptions are its own run's."""
    import bench.offline as offline

    torch.manual_seed(0)
    model_dir = save_tiny_model(HFLlama(tiny_llama_config(vocab_size=49152)).eval(), tmp_path / "tiny", default_model_dir)
    hits = []
    real = offline.run_vllmini

    def counting(llm, wl):
        bm = llm.llm_engine.block_manager
        h0 = bm.prefix_cache_hits
        elapsed = real(llm, wl)
        hits.append(bm.prefix_cache_hits - h0)
        return elapsed

    monkeypatch.setattr(offline, "run_vllmini", counting)
    record = main(["--model", str(model_dir), "--workload", "mixed", "--num-requests", "3", "--skip-hf",
                   "--out", str(tmp_path / "res")])  # fmt: skip
    assert len(hits) == 2 and hits[1] == 0  # random prompts share no prefix: any hit came from the warm-up
    assert record["results"][0]["prefix_cache_hits"] == 0
