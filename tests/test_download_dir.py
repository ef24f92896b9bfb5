"""vLLM's download_dir and tokenizer_revision: hub ids are looked up in (and fetched to) the Hugging Face
cache ``download_dir`` names, at ``revision``; a hub-id tokenizer at ``tokenizer_revision``. The cache
here is a real huggingface_hub layout (refs, snapshots), read offline: no network is needed."""
from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest

from vllmini import LLM, EngineArgs


def cache_entry(cache: Path, repo_id: str, folder: Path, commit: str, ref: str = "main") -> Path:
    """``folder`` as huggingface_hub keeps a download of ``repo_id`` at ``ref``."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    shutil.copytree(folder, snapshot)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return snapshot


def test_hub_ids_resolve_in_download_dir(tiny_dir, tmp_path):
    cache = tmp_path / "hf"
    main = cache_entry(cache, "org/tiny", tiny_dir, "a" * 40)
    tagged = cache_entry(cache, "org/tiny", tiny_dir, "b" * 40, ref="v2")
    llm = LLM(model="org/tiny", download_dir=str(cache), kv_cache_memory=1 << 24)
    assert llm.llm_engine.model_dir == main
    assert LLM(model="org/tiny", download_dir=str(cache), revision="v2", kv_cache_memory=1 << 24).llm_engine.model_dir == tagged
    out = llm.generate("Hello", use_tqdm=False)[0]
    assert out.finished and out.outputs[0].token_ids
    with pytest.raises(ValueError, match="download_dir must be a folder path"):
        EngineArgs(model="org/tiny", download_dir="").validate()


def test_a_hub_id_tokenizer_takes_tokenizer_revision(tiny_dir, tmp_path, monkeypatch, caplog):
    from transformers import AutoTokenizer

    seen = {}
    real = AutoTokenizer.from_pretrained

    def spy(source, **kwargs):
        if source == "org/tok":
            seen.update(kwargs)
            return real(str(tiny_dir))
        return real(source, **kwargs)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", spy)
    LLM(model=str(tiny_dir), tokenizer="org/tok", tokenizer_revision="r1", download_dir=str(tmp_path), kv_cache_memory=1 << 24)
    assert (seen["revision"], seen["cache_dir"], seen["trust_remote_code"]) == ("r1", str(tmp_path), False)
    monkeypatch.setattr(logging.getLogger("vllmini"), "propagate", True)  # let caplog see our records
    with caplog.at_level("WARNING"):
        LLM(model=str(tiny_dir), tokenizer_revision="r1", kv_cache_memory=1 << 24)
    assert "tokenizer_revision='r1' is ignored: the tokenizer is read from a folder" in caplog.text
    with pytest.raises(ValueError, match="tokenizer_revision must be a hub branch"):
        EngineArgs(tokenizer_revision="").validate()
