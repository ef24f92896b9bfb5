"""The ``cpu`` attention backend: the torch backend, with decode rows read straight from the
paged cache by a small C kernel (vllmini/kernels/paged_decode.c) instead of gather + SDPA.

Why: decode attention is memory-bound, and the torch path first copies every row's blocks into
a contiguous tensor that SDPA then reads again. On the 2-core CPU that copy made decode
attention about 40% of a serving step; the kernel reads each key and value once, from its
block, and is 1.5-4x faster per layer (``python -m bench.cpu_attention``; the range is mostly the
torch backend's own run-to-run variation).
torch.compile was tried first: inductor fuses the gather into the reductions, but its kernel
ran at 2-3 us per row-block plus ~0.1 ms per call, no faster than gather + SDPA in the engine.

How: the kernel includes no torch headers, so the system C compiler (``$CC``, else ``cc``)
builds it in a fraction of a second, once per process, into a temporary directory; ctypes
calls it with the tensors' data pointers. It links OpenMP, which resolves to the libgomp
torch has already loaded (one thread pool). Prefill chunks and the KV write stay on the torch
path. A softcap (Gemma 2's attn_logit_softcapping) is applied by both: in the kernel's scores
(a specialisation of its loop, so uncapped models run the loop they ran before) and in the
torch path's eager prefill. So are gpt-oss's attention sinks (the kernel's online softmax starts from
the sink's column; the torch path's prefill has it as one more key). No compiler, a failed build or
a wrong result: the engine's start-up check (models/backend_check.py) falls back to the torch
backend with one warning.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from vllmini.models.attention import KVCache, torch_attention
from vllmini.models.base import AttentionMetadata
from vllmini.models.eager_attention import SINK_BOUND

logger = logging.getLogger("vllmini")
SOURCE = Path(__file__).resolve().parent.parent / "kernels" / "paged_decode.c"
# -ffast-math when compiling only (it lets expf vectorise): linked with it, a shared library
# pulls in crtfastmath.o, which flushes subnormals to zero for the whole process on load.
_COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fPIC", "-c")
# The cache dtypes the kernel reads, in the order of its cache_kind codes (its math is float32 for all).
CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)
# The model dtypes the backend runs (float16: the torch backend).
MODEL_DTYPES = (torch.float32, torch.bfloat16)


class KernelBuildError(RuntimeError):
    """The C kernel could not be built or loaded (the message says why)."""


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        raise KernelBuildError("no C compiler found (set $CC or install gcc)")
    return cc


def _run(cmd: list[str]) -> str | None:
    """None when ``cmd`` succeeds, else what went wrong (a missing compiler raises)."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:  # no such compiler, or it hangs
        raise KernelBuildError(f"{' '.join(cmd)}: {exc}") from exc
    return None if proc.returncode == 0 else f"{' '.join(cmd)}: {proc.stderr.strip()[-500:]}"


@functools.cache
def load_kernel() -> ctypes.CDLL:
    """Build ``paged_decode.c`` and load it (once per process). With OpenMP if the compiler
    has it, else serial (the pragmas are then ignored)."""
    cc = _compiler()
    errors = []
    with tempfile.TemporaryDirectory(prefix="vllmini-kernel-") as tmp:
        obj, lib_path = Path(tmp) / "paged_decode.o", Path(tmp) / "paged_decode.so"
        for openmp in (["-fopenmp"], []):
            compile_cmd = [cc, *_COMPILE_FLAGS, *openmp, str(SOURCE), "-o", str(obj)]
            link_cmd = [cc, "-shared", *openmp, str(obj), "-o", str(lib_path), "-lm"]
            if (error := _run(compile_cmd) or _run(link_cmd)) is None:
                break
            errors.append(error)
        else:
            raise KernelBuildError("; ".join(errors))
        if not openmp:
            logger.warning("the CPU attention kernel was built without OpenMP (one thread): %s", errors[0])
        try:
            lib = ctypes.CDLL(str(lib_path))  # mapped now: the file may go
        except OSError as exc:
            raise KernelBuildError(f"built {lib_path.name} but could not load it: {exc}") from exc
    fn = lib.paged_decode
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 2
    fn.argtypes += [ctypes.c_int64] * 5 + [ctypes.c_float, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_float]
    fn.argtypes += [ctypes.c_void_p]  # sinks (NULL: none)
    lib.paged_decode_limits.restype = ctypes.c_int64
    lib.paged_decode_limits.argtypes = [ctypes.c_int64]
    return lib


@functools.cache
def kernel_limits() -> dict[str, int]:
    """The most query heads, the largest head_dim and block_size the kernel takes."""
    lib = load_kernel()
    return {name: lib.paged_decode_limits(i) for i, name in enumerate(("heads", "head_dim", "block_size"))}


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """``q [B, Hkv, G, D]``, caches ``[num_blocks, bs, Hkv, D]``, ``block_tables [B, nb]`` int32,
    ``seq_lens [B]`` int32 (each >= 1) -> ``[B, Hkv, G, D]`` in q's dtype (row b attends to
    its last ``window`` positions, or all ``seq_lens[b]`` with no window; ``softcap``: each score
    capped to ``softcap * tanh(score / softcap)``, Gemma 2's attn_logit_softcapping; ``sinks [Hkv * G]``:
    gpt-oss's sink logit per query head, one more softmax column whose value row is zero); CPU tensors, the
    caches float32, bfloat16 or fp8 (``CACHE_DTYPES``). The math is float32 either way: a bfloat16 q
    and the cache's elements are widened (exact) and the output rounded back. The kernel trusts its inputs, so shapes,
    dtypes and layouts are checked here: a wrong one would read out of bounds, not raise."""
    batch, num_kv_heads, group, head_dim = q.shape
    limits = kernel_limits()
    if k_cache.dtype not in CACHE_DTYPES or v_cache.dtype != k_cache.dtype or not q.dtype.is_floating_point:
        raise ValueError(
            f"the CPU attention kernel takes a float32, bfloat16 or fp8 cache (q {q.dtype}, cache {k_cache.dtype}/{v_cache.dtype})"
        )
    if block_tables.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise ValueError("block_tables and seq_lens must be int32")
    if k_cache.shape != v_cache.shape or k_cache.shape[2:] != (num_kv_heads, head_dim):
        raise ValueError(f"cache shape {tuple(k_cache.shape)} does not match q {tuple(q.shape)}")
    if block_tables.shape[0] != batch or seq_lens.shape != (batch,):
        raise ValueError("block_tables and seq_lens need one row per query row")
    too_big = {"heads": num_kv_heads * group, "head_dim": head_dim, "block_size": k_cache.shape[1]}
    if over := [f"{k}={v} > {limits[k]}" for k, v in too_big.items() if v > limits[k]]:
        raise ValueError("the CPU attention kernel's limits: " + ", ".join(over))
    tensors = (q, k_cache, v_cache, block_tables, seq_lens)
    if any(t.device.type != "cpu" or not t.is_contiguous() for t in tensors):
        raise ValueError("the CPU attention kernel needs contiguous CPU tensors")
    q32 = q.to(torch.float32)  # no copy when q is float32 already
    out = torch.empty_like(q32)
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be positive (got {softcap})")
    if sinks is not None:
        if sinks.shape != (num_kv_heads * group,) or sinks.device.type != "cpu":
            raise ValueError(f"sinks must be one logit per query head on the CPU (got {tuple(sinks.shape)}, "
                             f"{num_kv_heads * group} heads)")  # fmt: skip
        sinks = sinks.to(torch.float32).clamp(-SINK_BOUND, SINK_BOUND)  # (a copy: contiguous, finite)
    if batch:
        threads, block_size = torch.get_num_threads(), k_cache.shape[1]
        keys = min(int(seq_lens.max()), window or 2**62)
        splits = num_splits(batch, -(-keys // block_size) + (window is not None), threads)
        load_kernel().paged_decode(
            q32.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), CACHE_DTYPES.index(k_cache.dtype),
            block_tables.data_ptr(), block_tables.stride(0), seq_lens.data_ptr(), out.data_ptr(),
            batch, num_kv_heads, group, head_dim, block_size, scale, threads, splits, window or 0, softcap or 0.0,
            None if sinks is None else sinks.data_ptr(),
        )  # fmt: skip
    return out.to(q.dtype)


# Fewest blocks a split of one row's keys takes: below it the merge costs more than a thread saves.
SPLIT_MIN_BLOCKS = 8


def num_splits(batch: int, max_blocks: int, threads: int) -> int:
    """Ranges to cut each row's keys into: with fewer rows than threads (one long stream,
    say) rows alone would leave threads idle, so each row is split until there is one work
    item per thread, as long as every range keeps ``SPLIT_MIN_BLOCKS`` blocks."""
    if batch >= threads:
        return 1
    return max(1, min(-(-threads // batch), max_blocks // SPLIT_MIN_BLOCKS))


def cpu_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata, kv_cache: KVCache | None,
    scale: float, window: int | None = None, softcap: float | None = None, sinks: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """The torch backend with every decode row in one kernel call (no padding, no groups);
    ``softcap`` caps the scores in both (Gemma 2), ``sinks`` join both softmaxes (gpt-oss)."""
    return torch_attention(q, k, v, meta, kv_cache, scale, window, decode=paged_decode, softcap=softcap, sinks=sinks)
