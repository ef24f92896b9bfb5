"""The CPU KV cache's memory: committed as it fills (an anonymous mapping, zero-filled by the
OS), and a budget that cannot fit in RAM refused at start-up, naming ``kv_cache_memory``."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

import vllmini.kv.cache as kv_cache
from vllmini import LLM, SamplingParams
from vllmini.kv.cache import zeros


def rss() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads the process's RSS from /proc (Linux)")
def test_the_cache_costs_ram_only_as_it_fills(tiny_dir):
    if kv_cache.physical_memory()[1] is not None and kv_cache.physical_memory()[1] < 3 * 2**30:
        pytest.skip("less than 3 GiB of RAM available")
    before = rss()
    llm = LLM(str(tiny_dir), kv_cache_memory=2 * 2**30)
    assert rss() - before < 2**30  # (torch.zeros wrote all 2 GiB at start-up)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    big = zeros((64, 1024, 1024), torch.float32, torch.device("cpu"))  # 256 MiB, all zeros
    assert not big.any() and big.is_contiguous()
    big[-1, -1, -1] = 2.0
    assert float(big.sum()) == 2.0


def test_a_budget_larger_than_ram_is_refused_and_one_larger_than_free_ram_warned(tiny_dir, monkeypatch, caplog):
    monkeypatch.setattr(kv_cache, "physical_memory", lambda: (2**30, 2**29))
    monkeypatch.setattr(logging.getLogger("vllmini"), "propagate", True)  # let caplog see our records
    with pytest.raises(ValueError, match=r"kv_cache_memory=1073741824 bytes is not less than this machine's RAM"):
        LLM(str(tiny_dir), kv_cache_memory=2**30)
    with caplog.at_level(logging.WARNING, logger="vllmini"):
        llm = LLM(str(tiny_dir), kv_cache_memory=2**29 + 2**20)
    assert "more than the RAM available now" in caplog.text
    assert llm.generate([[5, 6]], SamplingParams(max_tokens=2), use_tqdm=False)[0].finished
    monkeypatch.setattr(kv_cache, "physical_memory", lambda: (None, None))  # (no /proc/meminfo: nothing checked)
    LLM(str(tiny_dir), kv_cache_memory=2**20)
