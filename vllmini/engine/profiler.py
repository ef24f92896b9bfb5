"""vLLM's engine profiling: ``LLM.start_profile()`` / ``stop_profile()`` (also on
``AsyncLLMEngine`` and the server's ``POST /start_profile`` / ``/stop_profile``) record a
torch profiler trace of the steps run in between, when the engine was started with
``profiler_config={"profiler": "torch", "torch_profiler_dir": DIR}`` (or, as vLLM's older
``VLLM_TORCH_PROFILER_DIR``, ``$VLLMINI_TORCH_PROFILER_DIR``).

``stop_profile`` writes into DIR a Chrome/Perfetto trace (``<name>.pt.trace.json.gz``, open it
in https://ui.perfetto.dev or TensorBoard) and ``<name>.txt``, the ops' totals sorted by self
time (device time on CUDA). The profiler runs on the engine's own thread (the one that steps
it), so the trace holds the forwards, the sampler and the host work between them.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from vllmini.config_fields import config_fields

logger = logging.getLogger("vllmini")
ENV_DIR = "VLLMINI_TORCH_PROFILER_DIR"


@dataclass(frozen=True)
class ProfilerConfig:
    """vLLM's ``ProfilerConfig``, its torch profiler's fields (``profiler`` None: off)."""

    profiler: str | None = None
    torch_profiler_dir: str = ""
    torch_profiler_record_shapes: bool = False
    torch_profiler_with_memory: bool = False
    torch_profiler_with_stack: bool = False  # (vLLM's default is True; stacks make traces far larger)
    torch_profiler_use_gzip: bool = True

    @classmethod
    def coerce(cls, value: ProfilerConfig | dict | str | None) -> ProfilerConfig:
        """From itself, a dict or its JSON; None: ``$VLLMINI_TORCH_PROFILER_DIR`` when set, else off."""
        if value is None:
            folder = os.environ.get(ENV_DIR, "")
            value = {"profiler": "torch", "torch_profiler_dir": folder} if folder else {}
        config = value if isinstance(value, ProfilerConfig) else cls(**config_fields(value, "profiler_config", cls))
        config._check()
        return config

    def _check(self) -> None:
        if self.profiler not in (None, "torch"):
            raise ValueError(f"profiler_config.profiler must be 'torch' or None, got {self.profiler!r}")
        if self.profiler and (not isinstance(self.torch_profiler_dir, str) or not self.torch_profiler_dir):
            raise ValueError("profiler_config.torch_profiler_dir must name a folder for the traces")
        for f in fields(self):
            if f.name.startswith("torch_profiler_") and f.name != "torch_profiler_dir" and not isinstance(getattr(self, f.name), bool):
                raise ValueError(f"profiler_config.{f.name} must be True or False, got {getattr(self, f.name)!r}")


class Profiler:
    """One engine's profiler: at most one recording at a time."""

    def __init__(self, config: ProfilerConfig, device: torch.device) -> None:
        self.config, self.device = config, device
        self._prof: Any = None
        self._name = ""

    def start(self, profile_prefix: str | None = None) -> None:
        """Start recording (RuntimeError when the engine has no profiler or one is recording)."""
        cfg = self.config
        if not cfg.profiler:
            raise RuntimeError("profiling is not enabled: start the engine with profiler_config={'profiler': 'torch', "
                               f"'torch_profiler_dir': DIR}} (or set ${ENV_DIR})")  # fmt: skip
        if self._prof is not None:
            raise RuntimeError("a profile is already being recorded: stop_profile() first")
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._name = f"{profile_prefix or 'vllmini'}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        self._prof = torch.profiler.profile(
            activities=activities, record_shapes=cfg.torch_profiler_record_shapes,
            profile_memory=cfg.torch_profiler_with_memory, with_stack=cfg.torch_profiler_with_stack,
        )  # fmt: skip
        self._prof.start()
        logger.info("profiling started (traces go to %s)", cfg.torch_profiler_dir)

    def stop(self) -> Path:
        """Stop recording and write the trace and the ops table; the trace's path."""
        if self._prof is None:
            raise RuntimeError("no profile is being recorded: start_profile() first")
        prof, self._prof = self._prof, None
        prof.stop()
        folder = Path(self.config.torch_profiler_dir)
        folder.mkdir(parents=True, exist_ok=True)
        trace = folder / f"{self._name}.pt.trace.json{'.gz' if self.config.torch_profiler_use_gzip else ''}"
        prof.export_chrome_trace(str(trace))
        sort = "self_cuda_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        (folder / f"{self._name}.txt").write_text(prof.key_averages().table(sort_by=sort, row_limit=50))
        logger.info("profile written: %s", trace)
        return trace
