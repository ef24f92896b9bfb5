"""Test utilities: tiny random HF models and an HF greedy oracle with near-tie checks."""
from __future__ import annotations

import contextlib
import math
import os
import re
import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from transformers import (Gemma2Config, Gemma3TextConfig, LlamaConfig, MistralConfig, MixtralConfig, Phi3Config,
                          Qwen2Config, Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig, SmolLM3Config)  # fmt: skip

from vllmini.models.backend_select import triton_interpreter_problem
from vllmini.models.base import AttentionMetadata

NEAR_TIE = 1e-4
# Set by conftest.py when there is no CUDA: Triton kernels then run in Triton's interpreter.
TRITON_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def triton_skip_reason(cpu_tensors: bool = False) -> str | None:
    """Why the Triton kernel cannot run in this process (None: it can). ``cpu_tensors``: the
    test hands it CPU tensors, which only the interpreter takes."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    if cpu_tensors and not TRITON_INTERPRETED:
        return "CPU tensors need Triton's interpreter (this machine has CUDA: tests/test_cuda.py runs the kernel)"
    return triton_interpreter_problem() if TRITON_INTERPRETED else None


def prompt_forward(model, prompts: list[list[int]]) -> torch.Tensor:
    """Last-position logits of whole prompts run as ONE flat batch without a cache."""
    lens = [len(p) for p in prompts]
    ids = torch.tensor([t for p in prompts for t in p])
    pos = torch.cat([torch.arange(n) for n in lens])
    with torch.no_grad():
        return model(ids, pos, AttentionMetadata.for_prompts(lens))


def hf_last_logits(hf_model, prompts: list[list[int]]) -> torch.Tensor:
    """transformers' last-position logits of each prompt, one forward per prompt: ``[len(prompts), vocab]``."""
    with torch.no_grad():
        return torch.stack([hf_model(torch.tensor([p])).logits[0, -1] for p in prompts])


def greedy_paged(model, prompts: list[list[int]], max_new: int, block_size: int = 16) -> list[list[int]]:
    """Greedy decoding over a paged KV cache, all sequences in one flat batch per step.

    Each sequence owns a contiguous range of blocks (no block manager needed); the
    first step prefills every prompt, the following ones decode one token each."""
    p = next(model.parameters())
    blocks_per_seq = math.ceil((max(map(len, prompts)) + max_new) / block_size)
    nb = blocks_per_seq * len(prompts)
    shape = (nb, block_size, model.num_kv_heads, model.head_dim)
    caches = [(torch.zeros(shape, dtype=p.dtype), torch.zeros(shape, dtype=p.dtype)) for _ in model.model.layers]
    tables = torch.arange(nb, dtype=torch.int32).view(len(prompts), blocks_per_seq)
    seqs = [list(x) for x in prompts]
    new = [list(x) for x in prompts]  # tokens to feed this step
    out: list[list[int]] = [[] for _ in prompts]
    for _ in range(max_new):
        q_lens = [len(n) for n in new]
        seq_lens = [len(s) for s in seqs]
        positions = [pos for s, q in zip(seqs, q_lens) for pos in range(len(s) - q, len(s))]
        slots = [int(tables[i, pos // block_size]) * block_size + pos % block_size
                 for i, (s, q) in enumerate(zip(seqs, q_lens)) for pos in range(len(s) - q, len(s))]  # fmt: skip
        meta = AttentionMetadata.paged(q_lens, seq_lens, slots, tables.tolist())
        ids = torch.tensor([t for n in new for t in n])
        with torch.no_grad():
            logits = model(ids, torch.tensor(positions), meta, caches)
        nxt = logits.argmax(-1).tolist()
        for i, t in enumerate(nxt):
            seqs[i].append(t)
            out[i].append(t)
        new = [[t] for t in nxt]
    return out


def hf_greedy(hf_model, prompt: list[int], max_new: int) -> tuple[list[int], list[float]]:
    """transformers' greedy continuation and, per step, the gap between its top-2 logits."""
    with torch.no_grad():
        res = hf_model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new,
            eos_token_id=None,  # run to max_new like ignore_eos (min_new_tokens would mask EOS instead)
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    tokens = res.sequences[0, len(prompt) :].tolist()
    gaps = []
    for step_logits in res.logits:
        top2 = step_logits[0].float().topk(2).values
        gaps.append(float(top2[0] - top2[1]))
    return tokens, gaps


def hf_greedy_logprobs(model, prompt: list[int], max_new: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and each chosen token's logprob, from transformers' generate."""
    with torch.no_grad():
        res = model.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=max_new, eos_token_id=None, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)  # fmt: skip
    tokens = res.sequences[0, len(prompt) :].tolist()
    return tokens, [float(torch.log_softmax(lg[0].float(), -1)[t]) for lg, t in zip(res.logits, tokens)]


def assert_greedy_matches(ours: list[int], theirs: list[int], gaps: list[float], what: str = "") -> None:
    """Equal tokens, except that a divergence is tolerated at a near tie of transformers' top-2 logits
    (after which the continuations are not comparable)."""
    for step, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            assert gaps[step] < NEAR_TIE, (
                f"{what}: greedy tokens diverge at step {step} ({a} vs transformers' {b}) "
                f"and transformers' top-2 gap there is {gaps[step]:.2e} (not a near tie)"
            )
            return
    assert len(ours) == len(theirs), f"{what}: {len(ours)} tokens vs transformers' {len(theirs)}"


def assert_engine_matches_transformers(llm, hf_model, prompts: list[list[int]], what: str, max_new: int = 16) -> None:
    """``llm``'s greedy tokens equal transformers' and its chosen tokens' logprobs within 2e-4, prompt by prompt."""
    from vllmini import SamplingParams

    params = SamplingParams(max_tokens=max_new, temperature=0, ignore_eos=True, logprobs=0)
    for p, out in zip(prompts, llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)):
        tokens, logprobs = hf_greedy_logprobs(hf_model, p, max_new)
        got = out.outputs[0]
        assert_greedy_matches(got.token_ids, tokens, [1.0] * len(tokens), f"{what}, prompt of {len(p)}")
        ours = [lp[t].logprob for lp, t in zip(got.logprobs, got.token_ids)]
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(logprobs), atol=2e-4, rtol=0)


# what every tiny test model shares: 3 layers, GQA, a large init so that logits are well separated
_TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_key_value_heads=2,
             max_position_embeddings=1024, initializer_range=0.3)  # fmt: skip


def _tiny(config_cls, arch: str, features: dict, overrides: dict):
    return config_cls(**{**_TINY, **features, "architectures": [arch], **overrides})


def tiny_llama_config(**overrides) -> LlamaConfig:
    """GQA, untied embeddings, llama3 rope scaling."""
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32}  # fmt: skip
    features = dict(num_attention_heads=8, tie_word_embeddings=False, rope_theta=500000.0, rope_scaling=rope)
    return _tiny(LlamaConfig, "LlamaForCausalLM", features, overrides)


def tiny_qwen3_config(**overrides) -> Qwen3Config:
    """head_dim != hidden/heads, tied embeddings, q/k norms."""
    features = dict(num_attention_heads=4, head_dim=24, tie_word_embeddings=True, rope_theta=1000000.0)
    return _tiny(Qwen3Config, "Qwen3ForCausalLM", features, overrides)


def tiny_qwen2_config(**overrides) -> Qwen2Config:
    """Bias on q/k/v (not o_proj), tied embeddings, a sliding window configured but off."""
    features = dict(num_attention_heads=4, tie_word_embeddings=True, rope_theta=1000000.0,
                    use_sliding_window=False, sliding_window=32)  # fmt: skip
    return _tiny(Qwen2Config, "Qwen2ForCausalLM", features, overrides)


def tiny_mistral_config(**overrides) -> MistralConfig:
    """Mistral-Nemo-like: head_dim set apart from hidden/heads; no sliding window unless given."""
    features = dict(num_attention_heads=8, head_dim=16, tie_word_embeddings=False, rope_theta=1000000.0,
                    sliding_window=None)  # fmt: skip
    return _tiny(MistralConfig, "MistralForCausalLM", features, overrides)


def tiny_phi3_config(**overrides) -> Phi3Config:
    """Phi-3: q/k/v and gate/up stored fused in the checkpoint."""
    features = dict(num_attention_heads=8, tie_word_embeddings=False, original_max_position_embeddings=1024,
                    pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip
    return _tiny(Phi3Config, "Phi3ForCausalLM", features, overrides)


def tiny_smollm3_config(**overrides) -> SmolLM3Config:
    """SmolLM3: every 4th layer without RoPE (no_rope_layers), tied embeddings; 4 layers so one is NoPE."""
    features = dict(num_attention_heads=4, num_hidden_layers=4, tie_word_embeddings=True, rope_theta=2000000.0,
                    pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip
    return _tiny(SmolLM3Config, "SmolLM3ForCausalLM", features, overrides)


# Gemma: head_dim apart from hidden/heads and a query_pre_attn_scalar apart from head_dim (the
# scale must come from it), a 12-token window; hidden 56, so the embedding scale sqrt(56) rounds in
# bfloat16 (7.5); initializer_range 0.3 would let the scaled embeddings swamp the layers
_GEMMA = dict(hidden_size=56, num_attention_heads=4, head_dim=24, query_pre_attn_scalar=20, sliding_window=12, initializer_range=0.05,
              tie_word_embeddings=True, pad_token_id=0, bos_token_id=2, eos_token_id=1)  # fmt: skip


def tiny_gemma3_config(**overrides) -> Gemma3TextConfig:
    """4 layers, every 3rd full (sliding_window_pattern, as gemma-3 configs state it: [s, s, f, s]);
    q/k norms; linear rope scaling on the full layers, another base on the sliding ones."""
    features = dict(_GEMMA, num_hidden_layers=4, sliding_window_pattern=3, rope_theta=1000000.0,
                    rope_local_base_freq=10000.0, rope_scaling={"rope_type": "linear", "factor": 4.0})  # fmt: skip
    return _tiny(Gemma3TextConfig, "Gemma3ForCausalLM", features, overrides)


def tiny_gemma2_config(**overrides) -> Gemma2Config:
    """3 layers alternating sliding and full; attention and final-logit softcaps low enough to bite (its scores are ~0.2)."""
    features = dict(_GEMMA, attn_logit_softcapping=0.3, final_logit_softcapping=2.0)
    return _tiny(Gemma2Config, "Gemma2ForCausalLM", features, overrides)


def randomize_norms(hf_model, std: float = 0.5):
    """transformers initialises Gemma's RMSNorm weights to zero (they scale by 1 + w), which would
    let a norm that is never loaded, or one without the offset, pass."""
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if "norm" in name:
                param.normal_(0.0, std)
    return hf_model


def tiny_qwen3_moe_config(**overrides) -> Qwen3MoeConfig:
    """Qwen3's attention; 8 experts, top 2 renormalised; layer 1 dense (mlp_only_layers)."""
    features = dict(num_attention_heads=4, head_dim=24, tie_word_embeddings=False, rope_theta=1000000.0,
                    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True,
                    decoder_sparse_step=1, mlp_only_layers=[1])  # fmt: skip
    return _tiny(Qwen3MoeConfig, "Qwen3MoeForCausalLM", features, overrides)


def tiny_qwen2_moe_config(**overrides) -> Qwen2MoeConfig:
    """q/k/v biases; 6 experts, top 3 not renormalised, a shared expert; every 2nd layer sparse."""
    features = dict(num_attention_heads=4, tie_word_embeddings=True, rope_theta=1000000.0, num_experts=6,
                    num_experts_per_tok=3, moe_intermediate_size=40, shared_expert_intermediate_size=96,
                    norm_topk_prob=False, decoder_sparse_step=2, use_sliding_window=False)  # fmt: skip
    return _tiny(Qwen2MoeConfig, "Qwen2MoeForCausalLM", features, overrides)


def tiny_mixtral_config(**overrides) -> MixtralConfig:
    """Mistral's attention; 4 experts, top 2, in every layer."""
    features = dict(num_attention_heads=8, head_dim=16, tie_word_embeddings=False, rope_theta=1000000.0,
                    sliding_window=None, num_local_experts=4, num_experts_per_tok=2, intermediate_size=96)  # fmt: skip
    return _tiny(MixtralConfig, "MixtralForCausalLM", features, overrides)


def randomize_biases(hf_model, std: float = 0.5):
    """transformers initialises biases to zero, which would let a bias that is never loaded pass."""
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, std)
    return hf_model


def save_random_model(config, out_dir: Path, tokenizer_dir: Path) -> tuple[str, Any]:
    """(folder, transformers model) of ``config`` with random weights, seed 0; norms (~1), biases and a
    router's ``e_score_correction_bias`` (~0) randomised too: transformers starts them at 1 and 0, which
    would let one never loaded pass."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, tensor in [*hf.named_parameters(), *hf.named_buffers()]:
            if "norm" in name:
                tensor.normal_(1.0, 0.3)
            elif name.endswith(".bias") or "e_score_correction_bias" in name:
                tensor.normal_(0.0, 0.3)
    return str(save_tiny_model(hf, out_dir, tokenizer_dir)), hf


def random_models(tiny_config: Callable[[str], Any] | None, tmp_path_factory, tokenizer_dir: Path,
                  save: Callable[[str, Path, Path], tuple[Any, Any]] | None = None) -> Callable[[str], tuple[Any, Any]]:  # fmt: skip
    """``get(kind)``: :func:`save_random_model` of ``tiny_config(kind)`` (or ``save(kind, out_dir,
    tokenizer_dir)``), built once per kind (a module fixture's body)."""
    built: dict[str, tuple[Any, Any]] = {}

    def get(kind: str) -> tuple[Any, Any]:
        if kind not in built:
            out = tmp_path_factory.mktemp(kind)
            built[kind] = (save(kind, out, tokenizer_dir) if save is not None
                           else save_random_model(tiny_config(kind), out, tokenizer_dir))  # fmt: skip
        return built[kind]

    return get


def seeded_prompts(*lengths: int, seed: int = 5, vocab: int = 500) -> list[list[int]]:
    """Random prompts of ``lengths`` (ids 5..vocab-1), the same for a seed."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, vocab, (n,), generator=g).tolist() for n in lengths]


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def save_tiny_model(hf_model, out_dir: Path, tokenizer_dir: Path) -> Path:
    """An HF directory (safetensors + the default model's tokenizer) that the engine can load."""
    hf_model.save_pretrained(out_dir)
    for name in TOKENIZER_FILES:  # copied as they are (a re-save by transformers 5 drops added_tokens_decoder)
        if (Path(tokenizer_dir) / name).is_file():
            shutil.copy(Path(tokenizer_dir) / name, out_dir / name)
    return out_dir


def checkpoint_like(model_dir: Path, out: Path, tensors: dict, quantization_config: dict | None = None) -> Path:
    """``model_dir``'s config and tokenizer with ``tensors`` as its one safetensors file (and a
    ``quantization_config`` in config.json): a quantized or dequantized twin of a test model."""
    from safetensors.torch import save_file

    out.mkdir()
    for f in Path(model_dir).iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    save_file({k: v.contiguous() for k, v in tensors.items()}, out / "model.safetensors", metadata={"format": "pt"})
    if quantization_config is not None:
        config = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config}))
    return out


def save_tiny_classifier(kind: str, out_dir: Path, tokenizer_dir: Path, num_labels: int, seed: int = 0,
                         head: str = "Sequence", **config):  # fmt: skip
    """A tiny random ``{Llama,Mistral,Qwen2,Qwen3,Gemma2,Gemma3Text}ForSequenceClassification`` (``head="Token"``: the
    ``*ForTokenClassification``, its head's bias random too) with the default model's vocabulary and
    tokenizer, saved by transformers; the ``score`` head is drawn wide (std 1) so that the
    probabilities are far apart. Returns (folder, the transformers model)."""
    import transformers

    torch.manual_seed(seed)
    name, make = {"llama": ("Llama", tiny_llama_config), "mistral": ("Mistral", tiny_mistral_config),
                  "qwen2": ("Qwen2", tiny_qwen2_config), "qwen3": ("Qwen3", tiny_qwen3_config),
                  "gemma2": ("Gemma2", tiny_gemma2_config), "gemma3": ("Gemma3Text", tiny_gemma3_config)}[kind]  # fmt: skip
    cls = getattr(transformers, f"{name}For{head}Classification")
    hf = cls(make(vocab_size=49152, initializer_range=0.05, num_labels=num_labels, **config)).eval()
    randomize_biases(hf, 0.05)
    with torch.no_grad():
        hf.score.weight.normal_(0.0, 1.0)
    return save_tiny_model(hf, out_dir, tokenizer_dir), hf


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_tiny_lora(model_dir: Path, out_dir: Path, seed: int, r: int = 8, **lora_config) -> str:
    """A PEFT LoRA adapter of the model in ``model_dir`` with random A and B
    (``init_lora_weights=False``: PEFT's default B is zero), so that it changes the output.
    ``lora_config``: more LoraConfig fields (lora_alpha, target_modules, use_rslora, ...)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_pretrained(model_dir)
    options = {"lora_alpha": 2 * r, "target_modules": LORA_TARGETS, **lora_config}
    config = LoraConfig(r=r, init_lora_weights=False, **options)
    get_peft_model(hf, config).save_pretrained(out_dir)
    return str(out_dir)


@contextlib.contextmanager
def vllmini_serve(*args: str) -> Iterator[str]:
    """``vllmini serve *args --port 0`` as a user runs it: yields its base URL (http, or https with
    --ssl-*) once uvicorn listens, then stops it with Ctrl-C (SIGINT) and checks that it exited cleanly."""
    cmd = [sys.executable, "-m", "vllmini", "serve", *args, "--port", "0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
    try:
        log = ""
        while (m := re.search(r"Uvicorn running on (https?://\S+)", log)) is None:
            line = proc.stdout.readline()
            assert line, f"the server did not start:\n{log}"
            log += line
        yield m.group(1)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
        proc.wait()


def fake_python(tmp_path: Path, driver_source: str, name: str = "fake_driver.py") -> str:
    """An executable that stands in for vLLM's interpreter: it runs ``driver_source`` (a stand-in
    for bench/vllm_driver.py) with this Python, whatever script it is handed."""
    script, exe = tmp_path / name, tmp_path / "python"
    script.write_text(driver_source)
    exe.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{script}" "$@"\n')
    exe.chmod(0o755)
    return str(exe)


def register_rounded_kv_attention(kv_cache_dtype: str, eager=None) -> str:
    """A transformers attention implementation (its SDPA, or the model module's ``eager``
    ``eager_attention_forward``, which Gemma 2's score softcap needs, after rounding K/V as a
    ``kv_cache_dtype`` cache holds them): the oracle for vllmini's fp8 / bfloat16 KV caches.
    Its mask function is registered too: without one transformers passes no mask, and a sliding
    window would be dropped. Returns the name to pass as ``attn_implementation``."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

    from vllmini.kv.cache_dtype import KV_CACHE_DTYPES, round_to_cache

    cache_dtype = KV_CACHE_DTYPES[kv_cache_dtype]
    attention = eager or sdpa_attention_forward

    def rounded(module, query, key, value, attention_mask, **kwargs):
        return attention(module, query, round_to_cache(key, cache_dtype), round_to_cache(value, cache_dtype),
                         attention_mask, **kwargs)  # fmt: skip

    name = f"vllmini_test_kv_{kv_cache_dtype}{'_eager' if eager else ''}"
    AttentionInterface.register(name, rounded)
    AttentionMaskInterface.register(name, eager_mask if eager else sdpa_mask)
    return name


def save_tiny_dense(tmp_path: Path, tokenizer_dir: Path, config, name: str = "dense") -> Path:
    """A tiny random float32 model of ``config`` (seed 0) saved by transformers under ``tmp_path / name``:
    the float twin a quantized-checkpoint test quantizes."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return save_tiny_model(AutoModelForCausalLM.from_config(config).float(), tmp_path / name, tokenizer_dir)


def assert_loads_as(got_dir: Path, want_dir: Path) -> None:
    """Every parameter vllmini loads from ``got_dir`` (a quantized checkpoint) equals ``want_dir``'s (its dense values)."""
    from vllmini.models.weight_loader import load_model

    got, _ = load_model(got_dir, torch.float32, torch.device("cpu"))
    want = dict(load_model(want_dir, torch.float32, torch.device("cpu"))[0].named_parameters())
    for name, p in got.named_parameters():
        assert torch.equal(p, want[name]), name
