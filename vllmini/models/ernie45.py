"""Baidu ERNIE 4.5 dense (``Ernie4_5ForCausalLM``: ERNIE-4.5-0.3B): the Llama decoder with its
rotary embedding turning adjacent pairs of dims (GLM style, in float32) and one ``use_bias`` key
for every projection's bias, as transformers' modeling_ernie4_5.py."""
from __future__ import annotations

from vllmini.models.llama import DecoderVariant, LlamaForCausalLM


class Ernie4_5ForCausalLM(LlamaForCausalLM):
    variant = DecoderVariant(bias_key="use_bias", rope_interleaved=True)
