"""The engine's side of custom logits processors (engine/logits_processor.py holds the API).

vLLM's processors are written against a persistent batch: a request keeps its row from step
to step. vllmini's sampler is stateless and orders rows as the scheduler does, so this keeps
that persistent batch beside it: each step that samples, the sequences sampled are matched to
their rows of the last step, a sequence that left frees its row, a new one takes the lowest free
row (or a new one at the end), and the last rows move down into the rows still free. The
processors hear of it in one ``BatchUpdate`` and see the logits in persistent-row order (one
gather there and one back, skipped when the two orders agree, as they do in steady decoding).
"""
from __future__ import annotations

import importlib
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from vllmini.engine.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality
from vllmini.engine.sampling_params import SamplingParams
from vllmini.scheduler.sequence import Sequence as Seq


def load_logits_processors(spec: Any) -> list[type[LogitsProcessor]]:
    """``EngineArgs.logits_processors``: LogitsProcessor subclasses or their qualified names
    ("package.module.Class"; one string may list several, comma-separated, as the CLI gives
    them). A name is imported as the user's own code is: vllmini runs nothing else."""
    if spec is None:
        return []
    if isinstance(spec, str):
        spec = [name.strip() for name in spec.split(",") if name.strip()]
    if not isinstance(spec, (list, tuple)):
        raise ValueError(f"logits_processors must be a list of LogitsProcessor classes or qualified names, got {spec!r}")
    classes = []
    for i, item in enumerate(spec):
        cls = _import(f"logits_processors[{i}]", item) if isinstance(item, str) else item
        if not (isinstance(cls, type) and issubclass(cls, LogitsProcessor)):
            raise ValueError(f"logits_processors[{i}] must be a subclass of vllmini's LogitsProcessor "
                             f"(vllmini.engine.logits_processor), got {item!r}")  # fmt: skip
        classes.append(cls)
    return classes


def _import(field: str, name: str) -> Any:
    module, _, attr = name.replace(":", ".").rpartition(".")
    if not module:
        raise ValueError(f"{field} must be a qualified name 'package.module.Class', got {name!r}")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{field}: cannot import {name!r} ({type(exc).__name__}: {exc})") from exc


class ProcessorStep:
    """This step's processors over the sampler's rows: ``slot_rows[i]`` is the row (in the
    sampler's order) of persistent row i (None: the same order)."""

    def __init__(self, processors: list[LogitsProcessor], slot_rows: list[int] | None) -> None:
        self.processors = processors
        self.slot_rows = slot_rows

    def __call__(self, logits: torch.Tensor, all_greedy: bool) -> torch.Tensor:
        """The processors applied to ``logits`` (the sampler's own copy: changed in place)."""
        run = [p for p in self.processors if not (all_greedy and p.is_argmax_invariant())]
        if not run:
            return logits
        if self.slot_rows is None:
            for p in run:
                logits = p.apply(logits)
            return logits
        index = torch.tensor(self.slot_rows, device=logits.device)
        batch = logits[index]
        for p in run:
            batch = p.apply(batch)
        return logits.index_copy_(0, index, batch)


class LogitsProcessors:
    """One instance of each processor class, and the persistent batch they see."""

    def __init__(self, classes: Sequence[type[LogitsProcessor]], vllm_config: Any, device: torch.device) -> None:
        self.classes = list(classes)
        self.processors = [cls(vllm_config, device, device.type == "cuda") for cls in self.classes]
        self.rows: list[int | None] = []  # persistent row -> sequence id

    def validate(self, params: SamplingParams) -> None:
        """Each class's ``validate_params`` (ValueError: the request is refused)."""
        for cls in self.classes:
            cls.validate_params(params)

    def prepare(self, seqs: list[Seq]) -> ProcessorStep:
        """Move the persistent batch to ``seqs`` (this step's sampled sequences), tell the
        processors how it changed, and return the step that applies them."""
        update = self._update(seqs)
        for p in self.processors:
            p.update_state(update)
        where = {seq.seq_id: row for row, seq in enumerate(seqs)}
        slot_rows = [where[sid] for sid in self.rows]
        return ProcessorStep(self.processors, None if slot_rows == list(range(len(seqs))) else slot_rows)

    def _update(self, seqs: Iterable[Seq]) -> BatchUpdate | None:
        by_id = {seq.seq_id: seq for seq in seqs}
        if len(by_id) == len(self.rows) and all(sid in by_id for sid in self.rows):
            return None  # the same sequences in the same rows
        removed = [row for row, sid in enumerate(self.rows) if sid not in by_id]
        for row in removed:
            self.rows[row] = None
        free = list(removed)  # ascending: a new sequence takes the lowest free row
        placed = set(self.rows)
        added = []
        for sid, seq in by_id.items():
            if sid in placed:
                continue
            row = free.pop(0) if free else len(self.rows)
            if row == len(self.rows):
                self.rows.append(None)
            self.rows[row] = sid
            added.append((row, seq.params, seq.known_prompt_ids, seq.output_token_ids))
        moved = []
        for hole in free:  # condense: the last row moves down into each row still free
            while self.rows and self.rows[-1] is None:
                self.rows.pop()
            if hole >= len(self.rows):
                break
            moved.append((len(self.rows) - 1, hole, MoveDirectionality.UNIDIRECTIONAL))
            self.rows[hole] = self.rows.pop()
        while self.rows and self.rows[-1] is None:
            self.rows.pop()
        return BatchUpdate(len(self.rows), removed, added, moved)
