"""Compile the Triton attention kernel's launches for a GPU this machine does not have, and
report what the compiler made of them: registers, spills (local memory), shared memory, and
whether K/V loads became asynchronous vector copies and the dots tensor-core instructions.

Triton's wheel carries its own ptxas and cuobjdump, so this runs on a CPU-only machine; it is
how the kernel's tile sizes were chosen without a GPU. Integer arguments are compiled with the
divisibility-by-16 hint that Triton's launcher gives any argument divisible by 16 at run time
(every pointer from torch, and the strides of caches and q/k/v whenever head_dim % 16 == 0).

    python -m bench.triton_compile_check                 # sm_90 (H100/H200), the shapes below
    python -m bench.triton_compile_check --arch 80 --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compile for real (tests set it when there is no CUDA)

import torch  # noqa: E402

# (name, dtype, head_dim, query heads per KV head, block size[, KV cache dtype (None: the model's)[, softcap[, sinks]]])
SHAPES = {
    "qwen3-0.6b-bf16": (torch.bfloat16, 128, 2, 256),
    "smollm2-bf16": (torch.bfloat16, 64, 3, 256),
    "llama-fp16-block16": (torch.float16, 128, 4, 16),
    "qwen3-0.6b-fp32": (torch.float32, 128, 2, 256),
    "qwen3-0.6b-bf16-fp8kv": (torch.bfloat16, 128, 2, 256, torch.float8_e4m3fn),
    "smollm2-bf16-fp8e5m2kv": (torch.bfloat16, 64, 3, 256, torch.float8_e5m2),
    "gemma2-2b-bf16-softcap": (torch.bfloat16, 256, 2, 256, None, True),  # attn_logit_softcapping
    "gemma3-1b-bf16": (torch.bfloat16, 256, 4, 256),
    "gemma3-1b-fp32": (torch.float32, 256, 4, 256),
    "gpt-oss-20b-bf16-sinks": (torch.bfloat16, 64, 8, 256, None, False, True),  # attention sinks, 64 / 8 heads
    "gpt-oss-20b-fp32-sinks": (torch.float32, 64, 8, 256, None, False, True),
}
POINTER_TYPES = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32",
                 torch.float8_e4m3fn: "*fp8e4nv", torch.float8_e5m2: "*fp8e5"}  # fmt: skip
SIZE_LIMITS = {"registers": 255, "shared_bytes": 227 * 1024}  # per thread / per block on sm_80 and sm_90


def launches(
    dtype: torch.dtype, head_dim: int, group: int, block_size: int, cache_dtype: torch.dtype | None = None,
    softcap: bool = False, sinks: bool = False,
) -> dict[str, tuple[str, dict]]:
    """(kernel, constants) of every launch the backend makes for this shape (see triton_attention)."""
    from vllmini.models.triton_attention import SPLIT_MAX, _next_pow2, kernel_constants, prefill_block_q

    def constants(block_q: int, block: int, **kw) -> dict:
        return kernel_constants(dtype, head_dim, group, block_q, block, softcap=softcap, sinks=sinks, **kw)

    prefill_q = prefill_block_q(dtype, group, head_dim)
    decode = constants(1, block_size, tile_is_seq=True, paged=True)
    attention = "_paged_attention_kernel"
    return {
        "decode": (attention, decode),
        "decode-split": (attention, constants(1, block_size, tile_is_seq=True, paged=True, split=True,
                                              cache_dtype=cache_dtype)),  # fmt: skip
        "merge-splits": ("_merge_splits_kernel", {"HEAD_DIM": head_dim, "HEAD_DIM_PAD": decode["HEAD_DIM_PAD"],
                                                  "SPLITS_PAD": _next_pow2(SPLIT_MAX), "SINKS": sinks}),  # fmt: skip
        "decode-in-mixed-step": (attention, constants(1, block_size, tile_is_seq=False, paged=True)),
        "prefill-paged": (attention, constants(prefill_q, block_size, tile_is_seq=False, paged=True)),
        "prefill-no-cache": (attention, constants(prefill_q, 1, tile_is_seq=False, paged=False)),
    }  # fmt: skip


def compile_one(
    kernel_name: str, constants: dict, dtype: torch.dtype, arch: int, cache_dtype: torch.dtype | None = None
) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import vllmini.models.triton_attention as module

    kernel = getattr(module, kernel_name)
    names = kernel.arg_names
    signature = {}
    for name in names:
        if name in constants:
            signature[name] = "constexpr"
        elif name in ("out_ptr", "q_ptr", "sinks_ptr"):  # (sinks: the model's dtype, widened in the kernel)
            signature[name] = POINTER_TYPES[dtype]
        elif name in ("k_ptr", "v_ptr"):
            signature[name] = POINTER_TYPES[cache_dtype or dtype]
        elif name in ("part_ptr", "ml_ptr"):  # split-KV partials are fp32
            signature[name] = "*fp32"
        elif name.endswith("_ptr"):
            signature[name] = "*i32"
        elif name in ("scale", "softcap"):
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
    # never specialized (see the kernels): the launcher gives these no divisibility hint
    unhinted = ("stride_bt", "tile_seq_ptr", "tile_start_ptr")
    hinted = [i for i, n in enumerate(names) if (n.endswith("_ptr") or n.startswith("stride")) and n not in unhinted]
    src = ASTSource(
        fn=kernel, signature=signature, constexprs={(names.index(n),): v for n, v in constants.items()},
        attrs={(i,): [["tt.divisibility", 16]] for i in hinted},
    )  # fmt: skip
    t0 = time.perf_counter()
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32))
    seconds = time.perf_counter() - t0
    ptx = compiled.asm["ptx"]
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        usage = subprocess.run([str(cuobjdump), "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    res = dict(re.findall(r"(REG|STACK|LOCAL):(\d+)", usage))
    return {
        "registers": int(res["REG"]), "spill_bytes": int(res["LOCAL"]) + int(res["STACK"]),
        "shared_bytes": compiled.metadata.shared, "num_warps": compiled.metadata.num_warps,
        "async_vector_loads": "cp.async" in ptx, "tensor_cores": bool(re.search(r"\bw?mma", ptx)),
        "compile_s": round(seconds, 2),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability x 10 (80: A100, 90: H100/H200)")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {list(SHAPES)}")
    ap.add_argument("--json", default=None, help="write the report here")
    args = ap.parse_args(argv)
    unknown = set(args.shapes.split(",")) - set(SHAPES)
    if unknown:
        ap.error(f"--shapes: unknown {sorted(unknown)}; choose from {list(SHAPES)}")
    try:
        import triton
    except ImportError:
        ap.error("triton is not installed (pip install triton)")

    report: dict = {"arch": args.arch, "triton": triton.__version__, "results": {}}
    failed = False
    for shape in args.shapes.split(","):
        dtype, head_dim, group, block_size, cache_dtype, softcap, sinks = (*SHAPES[shape], None, False, False)[:7]
        shape_launches = launches(dtype, head_dim, group, block_size, cache_dtype, softcap, sinks)
        for launch, (kernel_name, constants) in shape_launches.items():
            key = f"{shape}/{launch}"
            try:
                row = compile_one(kernel_name, constants, dtype, args.arch, cache_dtype)
                row["within_limits"] = all(row[k] <= v for k, v in SIZE_LIMITS.items())
            except Exception as exc:  # a compile error is the finding: report it, go on
                row, failed = {"error": f"{type(exc).__name__}: {exc}"[:500]}, True
            report["results"][key] = row
            print(f"{key:<40} " + ("  ".join(f"{k}={v}" for k, v in row.items())), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
