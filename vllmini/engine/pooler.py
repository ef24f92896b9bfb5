"""The pooling runner (vLLM's ``runner="pooling"``): from a prompt's hidden states to one embedding,
or, for a ``*ForSequenceClassification`` checkpoint, to its classifier head's probabilities; vLLM's
token-level tasks give one row per prompt token instead: ``token_embed`` (each token's hidden state,
normalized) and ``token_classify`` (each token's head logits through the activation).

A pooling request is prefill-only. The scheduler runs its prompt like any other (chunked prefill,
batching, paged KV, preemption); for each scheduled chunk the model runner asks the model for the
final-normed hidden states of only the rows the pooling type needs (``Pooler.wanted_rows``): LAST
the prompt's last position (in the chunk that completes it), CLS its first, MEAN every position
(summed chunk by chunk in float32; a recompute after a preemption starts the sum again), and ALL
(the token tasks', whatever the engine's pooling type) every position. Once the last chunk is
computed, the vector is cut to ``dimensions`` (matryoshka), L2-normalized when asked, and the
request finishes (its blocks freed); a classifier's pooled state goes through its ``score`` head and
the task's activation instead (engine/classifier_activation.py). ALL does the same to each chunk's
rows at once (row by row) and keeps them on the CPU until the last one. The model knows nothing
of requests: it returns the hidden states of the rows it is given. MEAN and CLS read positions a prefix-cache hit would skip,
so the engine runs them without prefix caching, as vLLM does; a token task's request, as vLLM's
``skip_reading_prefix_cache``, reads no cached prefix (it still leaves its blocks for others).

The defaults, as vLLM reads them: ``PoolerConfig`` fields the user leaves None come from the
model's sentence-transformers files (``modules.json`` and its Pooling module's ``config.json``),
else LAST and normalized.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from vllmini.config import PoolerConfig
from vllmini.engine.classifier_activation import Activation, classifier_activation
from vllmini.engine.outputs import PoolingOutput, PoolingRequestOutput
from vllmini.engine.pooling_params import PoolingParams
from vllmini.models.registry import is_classifier_architecture, is_token_classifier_architecture
from vllmini.scheduler.sequence import Sequence

# sentence-transformers' pooling modes -> vLLM's pooling types (the others have no equivalent here)
_ST_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN", "pooling_mode_cls_token": "CLS"}
_ST = "sentence_transformers.models."
# vLLM's token-level tasks: one output row per prompt token (ALL pooling)
TOKEN_TASKS = ("token_embed", "token_classify")
_EMBED_TASKS = ("embed", "token_embed")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} cannot be read as JSON: {exc}") from exc


def sentence_transformers_pooling(model_dir: Path) -> dict[str, Any]:
    """``{"pooling_type", "normalize"}`` as a sentence-transformers model folder states them (empty
    without ``modules.json``): the Pooling module's mode, and whether a Normalize module follows.
    What the engine would compute differently is refused, naming the file: another pooling mode
    (max, weighted mean, several at once), a Pooling module that leaves the prompt out, a Dense
    projection (vLLM applies it; it is not built here)."""
    modules_path = Path(model_dir) / "modules.json"
    if not modules_path.is_file():
        return {}
    modules = _read_json(modules_path)
    modules = modules.get("modules", []) if isinstance(modules, dict) else modules
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise ValueError(f"{modules_path} must list the model's modules")
    types = [str(m.get("type", "")) for m in modules]
    if others := [t for t in types if t.startswith(_ST) and t.removeprefix(_ST) not in ("Transformer", "Pooling", "Normalize")]:
        raise ValueError(f"{modules_path}: module(s) {others} are not supported (only Transformer, Pooling, Normalize)")
    found: dict[str, Any] = {"normalize": f"{_ST}Normalize" in types}
    pooling = next((m for m in modules if m.get("type") == f"{_ST}Pooling"), None)
    if pooling is None:
        return found
    config_path = Path(model_dir) / str(pooling.get("path", "")) / "config.json"
    if not config_path.is_file():
        return found
    config = _read_json(config_path)
    modes = sorted(key for key, on in config.items() if key.startswith("pooling_mode_") and on is True)
    if len(modes) != 1 or modes[0] not in _ST_MODES:
        raise ValueError(f"{config_path}: pooling mode {modes} is not supported (one of {sorted(_ST_MODES)})")
    if config.get("include_prompt", True) is not True:
        raise ValueError(f"{config_path}: include_prompt=false (pooling without the instruction) is not supported")
    found["pooling_type"] = _ST_MODES[modes[0]]
    return found


def resolve_pooler_config(given: PoolerConfig | None, model_dir: Path, hf_config: Any) -> PoolerConfig:
    """Every field filled: the user's, else the sentence-transformers files', else vLLM's defaults
    for a decoder (LAST, normalized). A default ``dimensions`` is checked as a request's would be."""
    given = given or PoolerConfig()
    st = sentence_transformers_pooling(model_dir)
    if is_classifier_architecture(getattr(hf_config, "architectures", None)):
        st.pop("normalize", None)  # (a Normalize module is an embedder's: a classifier's activation is on by default)
    normalize = given.normalize if given.normalize is not None else st.get("normalize", True)
    config = PoolerConfig(given.pooling_type or st.get("pooling_type", "LAST"), normalize, normalize, given.dimensions)
    if config.dimensions is not None:
        check_dimensions(config.dimensions, hf_config, "pooler_config.dimensions")
    return config


def check_dimensions(dimensions: int, hf_config: Any, field: str = "dimensions") -> None:
    """vLLM's rule: an embedding may be cut only for a matryoshka model (config.json's
    ``is_matryoshka`` or ``matryoshka_dimensions``), to one of its ``matryoshka_dimensions`` when it
    lists them; and never past the hidden size."""
    listed = getattr(hf_config, "matryoshka_dimensions", None)
    if not listed and not getattr(hf_config, "is_matryoshka", False):
        raise ValueError(f"{field}={dimensions}: this model does not support matryoshka representation (its "
                         "config.json sets neither is_matryoshka nor matryoshka_dimensions); changing the output "
                         "dimensions would give poor embeddings")  # fmt: skip
    if listed and dimensions not in listed:
        raise ValueError(f"{field}={dimensions}: this model supports only the matryoshka dimensions {list(listed)}")
    if dimensions > hf_config.hidden_size:
        raise ValueError(f"{field}={dimensions} exceeds the model's hidden size {hf_config.hidden_size}")


@dataclass
class PoolingRequestState:
    """A pooling request in the engine: its one sequence and what is pooled so far. (``grammar``:
    the engine core's paths shared with generation read it of every request.)"""

    request_id: str
    prompt_token_ids: list[int]
    params: PoolingParams  # resolved: normalize set, dimensions checked
    seqs: list[Sequence]
    total: torch.Tensor | None = None  # float32: the pooled row, or (MEAN) the sum of the rows so far
    count: int = 0  # positions summed (MEAN) or kept (ALL)
    rows: list[torch.Tensor] = field(default_factory=list)  # ALL: each chunk's output rows (on the CPU)
    result: torch.Tensor | None = None
    grammar: None = None

    @property
    def finished(self) -> bool:
        return self.seqs[0].status.finished

    def output(self) -> PoolingRequestOutput:
        data = None if self.result is None else PoolingOutput(self.result)
        return PoolingRequestOutput(self.request_id, data, self.prompt_token_ids, self.seqs[0].num_cached_tokens,
                                    self.finished)  # fmt: skip


class Pooler:
    """One engine's pooling type and tasks, and how each chunk's hidden states feed it. ``head``: a
    classifier's ``score`` layer (models/score_head.py); the engine then classifies and scores
    (cross-encoder) instead of embedding, as vLLM's ``*ForSequenceClassification`` models do, or
    (``*ForTokenClassification``) classifies each token. The token tasks pool ALL positions."""

    def __init__(self, config: PoolerConfig, head: torch.nn.Module | None = None, hf_config: Any = None) -> None:
        self.config = config
        self.pooling_type = config.pooling_type
        self.head = head
        if head is None:
            self.tasks: tuple[str, ...] = _EMBED_TASKS
        elif is_token_classifier_architecture(getattr(hf_config, "architectures", None)):
            self.tasks = ("token_classify",)
        else:  # (as vLLM's classify models: the sequence's head over each token too)
            self.tasks = ("classify", "score", "token_classify")
        # token_classify's activation is classify's (vLLM: softmax by default)
        self.activations: dict[str, Activation] = {
            task: classifier_activation(hf_config, "score" if task == "score" else "classify")
            for task in self.tasks if task not in _EMBED_TASKS}  # fmt: skip

    def resolve(self, params: PoolingParams, hf_config: Any) -> PoolingParams:
        """The request's own params with the engine's defaults filled in (``task``, ``normalize`` /
        ``use_activation``, ``dimensions``), checked against the model."""
        task = params.task if params.task is not None else self.tasks[0]
        if task not in self.tasks:
            raise ValueError(f"pooling_task={task!r} is not supported by this model; supported: {list(self.tasks)}")
        if task not in _EMBED_TASKS:  # (vLLM: classify, score and token_classify take use_activation only)
            for name in ("dimensions", "normalize"):
                if getattr(params, name) is not None:
                    raise ValueError(f"{name}: the {task} task does not take it (only embed and token_embed do); "
                                     "use_activation turns the softmax / sigmoid off")  # fmt: skip
        activate = params.wants_normalize
        activate = self.config.normalize if activate is None else activate
        dimensions = params.dimensions if params.dimensions is not None else self.config.dimensions
        if params.dimensions is not None:
            check_dimensions(params.dimensions, hf_config)
        if task not in _EMBED_TASKS:
            return params.clone(task=task, use_activation=activate)
        return params.clone(task=task, normalize=activate, use_activation=activate, dimensions=dimensions)

    def pooling_type_of(self, task: str | None) -> str:
        """ALL for a token task, else the engine's pooling type."""
        return "ALL" if task in TOKEN_TASKS else self.pooling_type

    def wanted_rows(self, task: str | None, start: int, num_new: int, num_prompt: int) -> tuple[int, int]:
        """(first row in the chunk, count): the rows of a chunk of ``num_new`` prompt positions from
        ``start`` whose hidden states a request of ``task`` pools."""
        kind = self.pooling_type_of(task)
        if kind in ("MEAN", "ALL"):
            return 0, num_new
        if kind == "CLS":
            return 0, int(start == 0)
        return num_new - 1, int(start + num_new == num_prompt)

    def accumulate(self, state: PoolingRequestState, start: int, hidden: torch.Tensor) -> None:
        """Take a chunk's wanted rows (``hidden``, from ``wanted_rows``)."""
        if hidden.shape[0] == 0:
            return
        kind = self.pooling_type_of(state.params.task)
        if kind in ("LAST", "CLS"):
            state.total = hidden[0].float()
            return
        if start == 0:  # (again, after a preemption: the prompt is recomputed from its start)
            state.total, state.rows, state.count = None, [], 0
        if start != state.count:
            raise RuntimeError(f"{kind} pooling of request {state.request_id!r} skipped positions {state.count}..{start}")
        if kind == "ALL":  # each row's output at once, to the CPU: a long prompt's rows wait in no device memory
            state.rows.append(self._output(state.params, hidden.float()).to("cpu", copy=True))
        else:
            rows = hidden.float().sum(0)
            state.total = rows if state.total is None else state.total + rows
        state.count += hidden.shape[0]

    def finish(self, state: PoolingRequestState) -> torch.Tensor:
        """The request's output (float32, on the CPU): its pooled state's (``_output``), or a token
        task's rows, one per prompt token: [num_tokens, hidden or dimensions or num_labels]."""
        kind = self.pooling_type_of(state.params.task)
        if kind == "ALL":
            rows, state.rows = torch.cat(state.rows), []
            return rows
        assert state.total is not None
        return self._output(state.params, state.total / state.count if kind == "MEAN" else state.total).cpu()

    def _output(self, params: PoolingParams, vector: torch.Tensor) -> torch.Tensor:
        """An embedding ([..., hidden], float32) cut to ``dimensions`` and normalized; or (classify,
        score, token_classify) the head's logits over it, through the task's activation."""
        if params.task not in _EMBED_TASKS:
            assert self.head is not None
            logits = self.head(vector)
            return self.activations[params.task](logits) if params.use_activation else logits
        if params.dimensions is not None:
            vector = vector[..., : params.dimensions]
        return F.normalize(vector, p=2, dim=-1) if params.normalize else vector
