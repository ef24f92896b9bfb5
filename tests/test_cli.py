"""The command line: the default job (generate) streams every prompt and prints a summary."""
from __future__ import annotations

import torch
from transformers import LlamaForCausalLM as HFLlama

from helpers import save_tiny_model, tiny_llama_config
from vllmini.cli import main


def test_generate_streams_each_prompt_and_summarizes(tmp_path, capsys, default_model_dir):
    torch.manual_seed(0)
    model_dir = save_tiny_model(HFLlama(tiny_llama_config(vocab_size=49152)).eval(), tmp_path / "m", default_model_dir)
    rc = main(["generate", "--model", str(model_dir), "--max-tokens", "5", "--ignore-eos", "first prompt", "second"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "[0] " in out and "[1] " in out
    assert "2 requests, 10 tokens" in out


def test_bad_option_value_is_a_clear_error(capsys):
    assert main(["generate", "--dtype", "int3", "x"]) == 2
    assert "dtype='int3'" in capsys.readouterr().err
