"""Multimodal checkpoints (Gemma 3, Mistral 3, Llava, Qwen2.5-VL, Qwen3-VL and its MoE) served text-only:
their language model through the whole engine equals transformers' ConditionalGeneration model on
text-only input ids; the vision side is never read; image, video and audio inputs are refused by name."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest
import torch
import transformers as T
from safetensors.torch import load_file, save_file

from helpers import (TOKENIZER_FILES, hf_last_logits, prompt_forward, random_models, seeded_prompts, tiny_gemma3_config,
                     tiny_llama_config, tiny_mistral_config, tiny_qwen2_config, tiny_qwen3_config,
                     tiny_qwen3_moe_config)  # fmt: skip
from test_architectures import assert_engine_greedy
from vllmini import LLM, AsyncLLMEngine, EngineArgs
from vllmini.models import checkpoint_checks
from vllmini.models.weight_loader import load_model

KV = 64 << 20
_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
               patch_size=14)  # fmt: skip
_QWEN_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14,
                    spatial_merge_size=2, temporal_patch_size=2)  # fmt: skip
_QWEN_TOKENS = dict(image_token_id=511, video_token_id=510, vision_start_token_id=509)  # (above the prompts' ids)


def _text(config, **overrides) -> dict:
    text = {**config.to_dict(), **overrides}
    text.pop("architectures")
    return text


def tiny_config(kind: str):
    """A ConditionalGeneration config over a tiny text config (tests/helpers.py's) and a one-layer vision tower.
    The M-RoPE sections are not even (Qwen2.5-VL: [2, 3, 3] of 8 frequencies, Qwen3-VL interleaved [4, 4, 4]
    of 12), so that a wrong layout would show."""
    if kind == "gemma3":
        return T.Gemma3Config(text_config=_text(tiny_gemma3_config()), mm_tokens_per_image=4, image_token_index=511,
                              boi_token_index=510, eoi_token_index=509, architectures=["Gemma3ForConditionalGeneration"],
                              vision_config=dict(_VISION, model_type="siglip_vision_model"))  # fmt: skip
    if kind == "mistral3":
        return T.Mistral3Config(text_config=_text(tiny_mistral_config()), image_token_index=511, spatial_merge_size=2,
                                vision_config=dict(_VISION, head_dim=16, model_type="pixtral"), tie_word_embeddings=False,
                                architectures=["Mistral3ForConditionalGeneration"])  # fmt: skip
    if kind == "llava":
        return T.LlavaConfig(text_config=_text(tiny_llama_config()), image_token_index=511,
                             vision_config=dict(_VISION, model_type="clip_vision_model", projection_dim=32),
                             architectures=["LlavaForConditionalGeneration"])  # fmt: skip
    if kind == "qwen2_5_vl":
        rope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]}
        # (tied by the outer config alone, as transformers 5 saves it: the text config's flag is not the one read)
        text = _text(tiny_qwen2_config(), rope_parameters=rope, tie_word_embeddings=False)
        return T.Qwen2_5_VLConfig(text_config=text, **_QWEN_TOKENS,
                                  vision_config=dict(_QWEN_VISION, fullatt_block_indexes=[0], window_size=28),
                                  tie_word_embeddings=True, architectures=["Qwen2_5_VLForConditionalGeneration"])  # fmt: skip
    rope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 4, 4], "mrope_interleaved": True}
    vision = dict(_QWEN_VISION, num_position_embeddings=16, deepstack_visual_indexes=[0])
    if kind == "qwen3_vl":  # (its text config ties, the outer one does not: transformers unties, by the outer)
        return T.Qwen3VLConfig(text_config=_text(tiny_qwen3_config(), rope_parameters=rope), vision_config=vision,
                               **_QWEN_TOKENS, architectures=["Qwen3VLForConditionalGeneration"])  # fmt: skip
    # (norm_topk_prob=False: transformers' Qwen3-VL-MoE router renormalises anyway)
    text = _text(tiny_qwen3_moe_config(), rope_parameters=rope, norm_topk_prob=False)
    return T.Qwen3VLMoeConfig(text_config=text, vision_config=vision, **_QWEN_TOKENS,
                              architectures=["Qwen3VLMoeForConditionalGeneration"])  # fmt: skip


KINDS = ("gemma3", "mistral3", "llava", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
TEXT_MODEL = {"gemma3": "Gemma3ForCausalLM", "mistral3": "MistralForCausalLM", "llava": "LlamaForCausalLM",
              "qwen2_5_vl": "Qwen2ForCausalLM", "qwen3_vl": "Qwen3ForCausalLM", "qwen3_vl_moe": "Qwen3MoeForCausalLM"}  # fmt: skip


def save_random(kind: str, out: Path, tokenizer_dir: Path):
    """(folder, transformers model): seed 0, norms and biases randomised too (tests/helpers.py's
    save_random_model); saved by transformers 5.25 (Gemma 3, Mistral 3 and Llava with the older
    ``language_model.model.*`` names, Qwen2.5-VL with ``model.*`` and ``visual.*``, Qwen3-VL with
    ``model.language_model.*``). Qwen3-VL-MoE is written by hand (transformers 5.25 fails to save
    it) as its releases store it, experts transposed, and read back by transformers to check so."""
    torch.manual_seed(0)
    hf = T.AutoModelForImageTextToText.from_config(tiny_config(kind)).eval()
    with torch.no_grad():
        for name, tensor in hf.named_parameters():
            if "norm" in name:
                tensor.normal_(1.0, 0.3)
            elif name.endswith(".bias"):
                tensor.normal_(0.0, 0.3)
    if kind == "qwen3_vl_moe":
        out.mkdir(parents=True, exist_ok=True)
        hf.config.save_pretrained(out)
        save_file({n: (t.transpose(1, 2) if n.endswith(("experts.gate_up_proj", "experts.down_proj")) else t).contiguous()
                   for n, t in hf.state_dict().items()}, out / "model.safetensors", metadata={"format": "pt"})  # fmt: skip
        back = T.AutoModelForImageTextToText.from_pretrained(out)
        assert all(torch.equal(a, b) for a, b in zip(hf.state_dict().values(), back.state_dict().values()))
    else:
        hf.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (Path(tokenizer_dir) / name).is_file():
            shutil.copy(Path(tokenizer_dir) / name, out / name)
    return out, hf


@pytest.fixture(scope="module")
def tiny_mm(tmp_path_factory, default_model_dir):
    return random_models(None, tmp_path_factory, default_model_dir, save=save_random)


def _text_numel(hf) -> int:
    """The parameters of transformers' language model and head (each tied one once)."""
    params = {id(p): p for n, p in hf.named_parameters(remove_duplicate=False)
              if not n.startswith(("model.visual", "model.vision_tower", "model.multi_modal_projector"))}  # fmt: skip
    return sum(p.numel() for p in params.values())


def _assert_matches(model_dir, hf, kind: str) -> LLM:
    """Last-position logits of a flat batch within 1e-4; greedy tokens of a batch of mixed lengths,
    prefilled in chunks of 16 beside decode rows, equal to transformers' on the same input ids."""
    llm = LLM(model=str(model_dir), max_num_batched_tokens=16, max_num_seqs=4, kv_cache_memory=KV)
    model = llm.llm_engine.model
    assert type(model).__name__ == TEXT_MODEL[kind]
    prompts = seeded_prompts(1, 9, 37, 20, 3)
    torch.testing.assert_close(prompt_forward(model, prompts), hf_last_logits(hf, prompts), atol=1e-4, rtol=0)
    assert_engine_greedy(llm, hf, prompts, 8, kind)
    assert llm.llm_engine.scheduler.stats.num_chunked_prefills > 0
    return llm


@pytest.mark.parametrize("kind", KINDS)
def test_text_matches_transformers_and_vision_is_not_loaded(tiny_mm, kind, monkeypatch):
    """The text model's logits and greedy tokens are transformers' ConditionalGeneration model's
    on text-only ids; no vision tensor is read from the file (checked as each is read), and the
    model holds the language model's parameters only."""
    read = []
    check = checkpoint_checks.check_tensor
    monkeypatch.setattr(checkpoint_checks, "check_tensor", lambda path, name, *a: (read.append(name), check(path, name, *a)))
    model_dir, hf = tiny_mm(kind)
    llm = _assert_matches(model_dir, hf, kind)
    assert read and not [n for n in read if "visual" in n or "vision" in n or "multi_modal" in n]
    model, _ = load_model(Path(model_dir), torch.float32, torch.device("cpu"))  # (as the engine loads it, not prepacked)
    assert sum(p.numel() for p in model.parameters()) == _text_numel(hf)
    config = llm.llm_engine.hf_config
    assert (config.vocab_size, llm.llm_engine.max_model_len) == (512, 1024)
    # vLLM's model_config names the checkpoint's architecture and calls it multimodal
    assert llm.model_config.architecture == json.loads((Path(model_dir) / "config.json").read_text())["architectures"][0]
    assert llm.model_config.is_multimodal_model and llm.model_config.get_vocab_size() == 512


_NEWER = {"gemma3": (("language_model.model.", "model.language_model."), ("vision_tower.", "model.vision_tower."),
                     ("multi_modal_projector.", "model.multi_modal_projector.")),
          "qwen2_5_vl": (("model.", "model.language_model."), ("visual.", "model.visual."))}  # fmt: skip


@pytest.mark.parametrize("kind", sorted(_NEWER))
def test_other_naming_of_the_same_checkpoint(tiny_mm, kind, tmp_path):
    """The names transformers >= 4.52 saves (``model.language_model.*``, ``model.visual.*``), beside
    the older ones above: transformers reads them as the same model, and so does the engine."""
    model_dir, hf = tiny_mm(kind)
    out = shutil.copytree(model_dir, tmp_path / kind)
    renamed = {}
    for name, tensor in load_file(out / "model.safetensors").items():
        old, new = next(((o, n) for o, n in _NEWER[kind] if name.startswith(o)), ("", ""))
        renamed[new + name[len(old):]] = tensor
    save_file(renamed, out / "model.safetensors", metadata={"format": "pt"})
    assert any(n.startswith("model.language_model.") for n in renamed)
    back = T.AutoModelForImageTextToText.from_pretrained(out).eval()
    assert all(torch.equal(a, b) for a, b in zip(hf.state_dict().values(), back.state_dict().values()))
    _assert_matches(out, back, kind)


def test_flat_qwen2_5_vl_config(tiny_mm, tmp_path):
    """Qwen2.5-VL's first releases state the text model's fields at the top of config.json (no
    text_config; ``rope_scaling: {"type": "mrope", ...}``; bos/eos ids there): read as transformers reads them."""
    model_dir, hf = tiny_mm("qwen2_5_vl")
    out = shutil.copytree(model_dir, tmp_path / "flat")
    nested = json.loads((out / "config.json").read_text())
    text = nested.pop("text_config")
    rope = text.pop("rope_parameters")
    flat = {**text, **nested, "model_type": "qwen2_5_vl", "rope_theta": rope["rope_theta"], "bos_token_id": 3,
            "eos_token_id": 4, "rope_scaling": {"type": "mrope", "mrope_section": rope["mrope_section"]}}  # fmt: skip
    (out / "config.json").write_text(json.dumps(flat))
    back = T.AutoModelForImageTextToText.from_pretrained(out).eval()
    assert all(torch.equal(a, b) for a, b in zip(hf.state_dict().values(), back.state_dict().values()))
    llm = _assert_matches(out, back, "qwen2_5_vl")
    assert llm.llm_engine.hf_config.eos_token_id == 4


@pytest.mark.parametrize("kind", ["qwen2_5_vl", "qwen3_vl"])
def test_mrope_on_text_positions_is_plain_rope(kind):
    """Text positions carry three equal M-RoPE components: transformers' rotation (Qwen2.5-VL's
    sections, Qwen3-VL's interleaved layout) is then ordinary RoPE over the same inv_freq; with
    unequal components it is not (the check is not vacuous)."""
    from vllmini.models.rotary import RotaryEmbedding, apply_rotary, rope_parameters

    config = tiny_config(kind).text_config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    n, x = 40, torch.randn(1, 4, 40, head_dim)
    if kind == "qwen2_5_vl":  # (transformers 5.25 picks each section's component inside the rotary embedding)
        from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as M

        rope = M.Qwen2_5_VLRotaryEmbedding(config)
    else:
        from transformers.models.qwen3_vl import modeling_qwen3_vl as M

        rope = M.Qwen3VLTextRotaryEmbedding(config)

    def rotated(pos):
        cos, sin = rope(x, pos)
        return M.apply_rotary_pos_emb(x, x, cos, sin)[0]

    ours = RotaryEmbedding(head_dim, rope_parameters(config))  # (vllmini's rotation of the text model)
    want = apply_rotary(x[0].transpose(0, 1), *ours.cos_sin(torch.arange(n))).transpose(0, 1)[None]
    text = torch.arange(n).expand(3, 1, n)
    torch.testing.assert_close(rotated(text), want, atol=1e-5, rtol=0)
    assert not torch.allclose(rotated(torch.stack([text[0], text[1] * 2, text[2]])), want, atol=1e-3)


# ---- what is refused, and the chat template -------------------------------------------------

GEMMA3_TEMPLATE = (
    "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}{%- if messages[0]['content'] is string -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}{%- else -%}"
    "{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}{%- endif -%}"
    "{%- set loop_messages = messages[1:] -%}{%- else -%}{%- set first_user_prefix = \"\" -%}"
    "{%- set loop_messages = messages -%}{%- endif -%}{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif -%}"
    "{%- if (message['role'] == 'assistant') -%}{%- set role = \"model\" -%}{%- else -%}"
    "{%- set role = message['role'] -%}{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
    "{%- elif message['content'] is iterable -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}{{ '<start_of_image>' }}{%- elif item['type'] == 'text' -%}"
    "{{ item['text'] | trim }}{%- endif -%}{%- endfor -%}{%- else -%}{{ raise_exception('Invalid content type') }}"
    "{%- endif -%}{{ '<end_of_turn>\n' }}{%- endfor -%}{%- if add_generation_prompt -%}"
    "{{'<start_of_turn>model\n'}}{%- endif -%}"
)  # Gemma 3's chat template (google/gemma-3-*-it), as its processor ships it


@pytest.fixture(scope="module")
def gemma3_llm(tiny_mm, tmp_path_factory):
    """The tiny Gemma 3 with its chat template only in the processor's chat_template.json (the
    tokenizer does not read that file)."""
    model_dir, _ = tiny_mm("gemma3")
    out = shutil.copytree(model_dir, tmp_path_factory.mktemp("gemma3_chat") / "m")
    (out / "chat_template.jinja").unlink(missing_ok=True)
    (out / "chat_template.json").write_text(json.dumps({"chat_template": GEMMA3_TEMPLATE}))
    config = json.loads((out / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return LLM(model=str(out), kv_cache_memory=KV)


def test_chat_template_renders_text_only_messages(gemma3_llm):
    """Text messages (strings and text parts) render as transformers renders them with the template
    (found in chat_template.json)."""
    from vllmini.engine.chat import render_chat

    parts = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
             {"role": "user", "content": [{"type": "text", "text": "Hi there"}]}]  # fmt: skip
    tok = gemma3_llm.get_tokenizer()
    want = tok.apply_chat_template(parts, chat_template=GEMMA3_TEMPLATE, tokenize=False, add_generation_prompt=True)
    assert want.endswith("<start_of_turn>user\nBe brief.\n\nHi there<end_of_turn>\n<start_of_turn>model\n")
    strings = [{"role": m["role"], "content": m["content"][0]["text"]} for m in parts]
    for messages, fmt in ((parts, "string"), (strings, "string"), (parts, "openai")):
        assert render_chat(tok, messages, fmt, add_generation_prompt=True)["prompt"] == want


_IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}


def test_image_inputs_are_refused_by_name(gemma3_llm):
    """An image part in a chat message, or vLLM's multi_modal_data beside a prompt, is refused naming
    it and saying the model is served text-only (not run without it)."""
    text = {"type": "text", "text": "What is this?"}
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[1\]: 'image_url' parts are not accepted: vllmini serves text only"):
        gemma3_llm.chat([{"role": "user", "content": [text, _IMAGE]}], use_tqdm=False)
    with pytest.raises(ValueError, match=r"messages\[1\]\.content\[0\]: 'input_audio' parts are not"):
        gemma3_llm.chat([{"role": "system", "content": "x"}, {"role": "user", "content": [{"type": "input_audio"}]}])
    with pytest.raises(ValueError, match=r"prompt\['multi_modal_data'\]: image, video and audio inputs are not "
                                         r"accepted: vllmini serves text only"):  # fmt: skip
        gemma3_llm.generate({"prompt": "<start_of_image>", "multi_modal_data": {"image": None}}, use_tqdm=False)


async def test_server_refuses_image_parts_by_name(tiny_mm):
    """Through the OpenAI server: a 400 naming the part, for chat completions and Responses."""
    from vllmini.entrypoints.openai.api_server import build_app

    model_dir, _ = tiny_mm("qwen2_5_vl")
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(model_dir), kv_cache_memory=KV, served_model_name="m"))
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(engine, "m")), base_url="http://t") as http:
            chat = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}, _IMAGE]}]}
            r = await http.post("/v1/chat/completions", json=chat)
            assert r.status_code == 400 and "messages[0].content[1]: 'image_url' parts are not accepted" in r.text, r.text
            image = {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}
            r = await http.post("/v1/responses", json={"model": "m", "input": [{"role": "user", "content": [image]}]})
            assert r.status_code == 400 and "input[0].content[0].type: 'input_image' parts are not accepted: vllmini serves text only" in r.text, r.text
    finally:
        engine.shutdown()


def test_unserved_language_model_is_named(tmp_path):
    """A multimodal architecture over a language model not served here: refused naming text_config.model_type."""
    from vllmini.models.weight_loader import load_config

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlavaForConditionalGeneration"],
                                                      "model_type": "llava", "text_config": {"model_type": "phi"}}))  # fmt: skip
    with pytest.raises(ValueError, match=r"LlavaForConditionalGeneration with a 'phi' language model "
                                         r"\(text_config.model_type\) is not served"):  # fmt: skip
        load_config(tmp_path)
