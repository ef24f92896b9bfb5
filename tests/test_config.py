"""EngineArgs validation: bad values fail at start-up with the field named."""
from __future__ import annotations

import pytest
import torch

from vllmini import LLM, EngineArgs
from vllmini.config import resolve_dtype


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"dtype": "float8"}, "dtype='float8'.*accepted: auto, float32, bfloat16, float16"),
        ({"dtype": 3}, "dtype must be a string"),
        ({"device": "tpu"}, "device must be 'auto', 'cpu' or 'cuda"),
        ({"max_num_seqs": 0}, "max_num_seqs must be a positive integer"),
        ({"max_num_batched_tokens": -5}, "max_num_batched_tokens must be a positive integer"),
        ({"max_model_len": 1.5}, "max_model_len must be a positive integer"),
        ({"block_size": True}, "block_size must be a positive integer"),
        ({"kv_cache_memory": 0}, "kv_cache_memory must be a positive integer"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization must be in"),
        ({"seed": "x"}, "seed must be an integer"),
        ({"model": ""}, "model must be"),
    ],
)
def test_engine_args_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineArgs(**kwargs).validate()


def test_dtype_resolution():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_dtype("auto", cpu) == torch.float32
    assert resolve_dtype("auto", cuda) == torch.bfloat16
    assert resolve_dtype("bfloat16", cpu) == torch.bfloat16
    assert resolve_dtype("float16", cpu) == torch.float16
    assert resolve_dtype(torch.float32, cpu) == torch.float32
    # auto follows a 16-bit checkpoint on CUDA, as vLLM (float16 models stay float16); the CPU keeps float32
    assert resolve_dtype("auto", cuda, torch.float16) == torch.float16
    assert resolve_dtype("auto", cuda, "float16") == torch.float16
    assert resolve_dtype("auto", cuda, torch.bfloat16) == torch.bfloat16
    assert resolve_dtype("auto", cuda, torch.float32) == torch.bfloat16
    assert resolve_dtype("auto", cpu, torch.bfloat16) == torch.float32
    assert resolve_dtype("float32", cuda, torch.float16) == torch.float32


def test_llm_rejects_unknown_keyword_and_bad_model(tmp_path):
    with pytest.raises(TypeError, match="unknown engine argument.*max_batch"):
        LLM(max_batch=3)
    with pytest.raises((ValueError, FileNotFoundError), match="no-such-model"):
        LLM(model="no-such-model", cache_dir=str(tmp_path))
    with pytest.raises(ValueError, match="dtype='int8'"):
        LLM(dtype="int8")


def test_max_model_len_is_derived_as_vllm_does(caplog, monkeypatch):
    import logging
    from types import SimpleNamespace

    from transformers import LlamaConfig

    from vllmini.config import resolve_max_model_len

    plain = LlamaConfig(max_position_embeddings=4096)
    assert resolve_max_model_len(None, plain) == 4096
    assert resolve_max_model_len(1000, plain) == 1000
    with pytest.raises(ValueError, match=r"max_model_len=4097 exceeds the model's context length 4096 \(config.json\)"):
        resolve_max_model_len(4097, plain)
    # linear scaling: max_position_embeddings is the unscaled length (Vicuna-v1.5-16k)
    linear = LlamaConfig(max_position_embeddings=4096, rope_scaling={"rope_type": "linear", "factor": 4.0})
    assert resolve_max_model_len(None, linear) == 16384
    assert resolve_max_model_len(16384, linear) == 16384
    with pytest.raises(ValueError, match=r"context length 16384 \(config.json, x4.0 linear rope scaling\)"):
        resolve_max_model_len(16385, linear)
    # llama3 configs state the scaled length already
    llama3 = LlamaConfig(max_position_embeddings=131072, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192})  # fmt: skip
    assert resolve_max_model_len(None, llama3) == 131072
    # no length key at all: vLLM's 2048, with a warning
    bare = SimpleNamespace(rope_theta=10000.0)
    monkeypatch.setattr(logging.getLogger("vllmini"), "propagate", True)  # let caplog see our records
    with caplog.at_level("WARNING", logger="vllmini"):
        assert resolve_max_model_len(None, bare) == 2048
    assert "states no context length" in caplog.text
