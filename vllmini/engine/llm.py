"""Offline batch API (``LLM.generate`` / ``LLM.chat`` / ``LLM.beam_search``; with the pooling
runner ``LLM.embed`` / ``classify`` / ``score`` / ``encode`` / ``reward``), as in vLLM: the chat
calls in llm_chat.py, the pooling ones in llm_pooling.py (vLLM's mixins)."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import msgspec
from tqdm.auto import tqdm

from vllmini.config import EngineArgs
from vllmini.engine import beam_search
from vllmini.engine.beam_search import BeamSearchOutput, BeamSearchParams
from vllmini.engine.input_processor import as_prompt_list, per_prompt_loras
from vllmini.engine.llm_args import per_prompt, tokenization_changes
from vllmini.engine.llm_chat import ChatMixin
from vllmini.engine.llm_engine import LLMEngine, PromptType
from vllmini.engine.llm_pooling import PoolingMixin
from vllmini.engine.outputs import RequestOutput
from vllmini.engine.sampling_params import SamplingParams
from vllmini.lora.request import LoRARequest
from vllmini.metrics.reader import Metric



class LLM(ChatMixin, PoolingMixin):
    """``LLM(model="default", **engine_args)``; every EngineArgs field is a keyword argument."""

    def __init__(self, model: str = "default", **kwargs: Any) -> None:
        unknown = set(kwargs) - EngineArgs.field_names()
        if unknown:
            raise TypeError(f"unknown engine argument(s) {sorted(unknown)}; accepted: {sorted(EngineArgs.field_names())}")
        kwargs.setdefault("disable_log_stats", True)  # (vLLM's default offline: get_metrics() needs False)
        self.llm_engine = LLMEngine.from_engine_args(EngineArgs(model=model, **kwargs))
        self.model_config = self.llm_engine.model_config  # (vLLM's: the same object)
        self._enqueued: list[str] = []  # (enqueue's requests, until wait_for_completion)

    def get_tokenizer(self) -> Any:
        return self.llm_engine.get_tokenizer()

    @property
    def supported_tasks(self) -> tuple[str, ...]:
        """("generate",), or the pooling model's tasks: ("embed", "token_embed"), a sequence
        classifier's ("classify", "score", "token_classify") or a token classifier's ("token_classify",)."""
        return self.llm_engine.supported_tasks

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget every cached prefix; False (nothing done) while requests are unfinished, unless
        ``reset_running_requests`` (vLLM's: they are preempted, recomputed later)."""
        return self.llm_engine.reset_prefix_cache(reset_running_requests)

    def collective_rpc(self, method: str | Callable[..., Any], timeout: float | None = None, args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:  # fmt: skip
        """vLLM's: ``method`` (the name of a method of the worker, engine/worker.py, or a callable
        taking the worker first) run on the one worker; a list of its one result."""
        return self.llm_engine.collective_rpc(method, timeout, args, kwargs)

    def apply_model(self, func: Callable[[Any], Any]) -> list[Any]:
        """vLLM's: ``[func(model)]``. ``llm.apply_model(lambda m: m.load_weights(weights))`` updates
        the weights in place (HF names; call ``reset_prefix_cache()`` after, as with vLLM)."""
        return self.llm_engine.apply_model(func)

    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep mode (``enable_sleep_mode=True``): the KV cache's memory is given back and
        the prefix cache forgotten; level 1 keeps the weights, level 2 discards them."""
        self.llm_engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back ``"weights"``, ``"kv_cache"`` or both (None)."""
        self.llm_engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.llm_engine.is_sleeping()

    def start_profile(self, profile_prefix: str | None = None) -> None:
        """vLLM's: record the engine's steps with the torch profiler until ``stop_profile``
        (needs ``profiler_config``; engine/profiler.py)."""
        self.llm_engine.start_profile(profile_prefix)

    def stop_profile(self) -> None:
        """Stop recording and write the trace and the ops table into the profiler's folder."""
        self.llm_engine.stop_profile()

    def get_metrics(self) -> list[Metric]:
        """The engine's Prometheus metrics as objects (vLLM's Counter, Gauge, Histogram, Vector
        of ``vllmini.metrics.reader``); needs ``LLM(..., disable_log_stats=False)``."""
        return self.llm_engine.get_metrics()

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate/chat use when given no SamplingParams: the model's generation config
        (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens), as in vLLM."""
        return self.llm_engine.get_default_sampling_params()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
        priority: int | Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order. ``use_tqdm``: show a
        progress bar, or (as vLLM) the tqdm-like factory that makes it. ``priority``: one for
        every prompt or one per prompt (lower first), with ``scheduling_policy="priority"``.
        ``lora_request``: one adapter for every prompt, or one (or None) per prompt (needs
        ``enable_lora``). ``tokenization_kwargs``: vLLM 0.32's, of which vllmini takes
        ``truncate_prompt_tokens`` (as SamplingParams' field, for every prompt)."""
        if self.llm_engine.runner_type != "generate":
            raise ValueError("LLM.generate() is only supported for generative models: this LLM runs the pooling "
                             "runner (use embed / encode, or runner='generate' to generate)")  # fmt: skip
        return self._run(*self._generate_requests(prompts, sampling_params, priority, tokenization_kwargs),
                         lora_request, use_tqdm)  # fmt: skip

    def _generate_requests(
        self, prompts: PromptType | Sequence[PromptType], sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        priority: int | Sequence[int] | None, tokenization_kwargs: dict[str, Any] | None,
    ) -> tuple[list[PromptType], list[SamplingParams | None], list[int]]:  # fmt: skip
        """generate's arguments as one (prompt, params, priority) per request."""
        prompts = as_prompt_list(prompts)
        priority = 0 if priority is None else priority
        priorities = [priority] * len(prompts) if isinstance(priority, int) else list(priority)  # (a bool: refused later)
        if len(priorities) != len(prompts):
            raise ValueError(f"priority has {len(priorities)} entries but there are {len(prompts)} prompts")
        params_list = per_prompt(sampling_params, SamplingParams, "sampling_params", len(prompts))
        # generate() returns whole completions, whatever output_kind asks for streaming
        changes = {"output_kind": "final", **tokenization_changes(tokenization_kwargs, ("truncate_prompt_tokens",))}
        if len(changes) > 1:  # (the defaults, truncated too)
            params_list = [self.get_default_sampling_params() if p is None else p for p in params_list]
        params_list = [msgspec.structs.replace(p, **changes) if isinstance(p, SamplingParams) else p
                       for p in params_list]  # fmt: skip
        return prompts, params_list, priorities

    def _run(
        self, prompts: list[PromptType], params_list: list[Any], priorities: list[int],
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None, use_tqdm: bool | Callable[..., tqdm],
    ) -> list[Any]:  # fmt: skip
        """Add every request, then step the engine until all are finished; their final outputs in
        input order."""
        ids = self._add(prompts, params_list, priorities, lora_request)
        finals = self._wait(ids, use_tqdm)
        return [finals[i] for i in ids]

    def _add(
        self, prompts: list[PromptType], params_list: list[Any], priorities: list[int],
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
    ) -> list[str]:  # fmt: skip
        """Add every request (none stays queued if one is refused); their ids."""
        loras = per_prompt_loras(lora_request, len(prompts))
        engine = self.llm_engine
        if engine.is_sleeping():
            raise RuntimeError("the LLM is sleeping: call wake_up() (and, after sleep(level=2), load the weights) first")
        ids: list[str] = []
        try:
            for prompt, params, prio, lora in zip(prompts, params_list, priorities, loras):
                ids.append(engine.add_request(None, prompt, params, default_output_kind="final", priority=prio,
                                              lora_request=lora))  # fmt: skip
        except Exception:
            engine.abort_request(ids)  # nothing half-submitted stays queued
            raise
        return ids

    def _wait(self, ids: list[str], use_tqdm: bool | Callable[..., tqdm]) -> dict[str, Any]:
        """Step the engine until no request is left: the final output of each that finished, by id
        (a failure, or Ctrl-C, aborts ``ids``)."""
        engine, finals = self.llm_engine, {}
        bar_args: dict[str, Any] = {"total": len(ids), "desc": "Processed prompts"}
        with use_tqdm(**bar_args) if callable(use_tqdm) else tqdm(**bar_args, disable=not use_tqdm) as bar:
            try:
                while engine.has_unfinished_requests():
                    outputs = engine.step()
                    if engine.failed:  # a request failed alone (e.g. its detokenizer): report it
                        raise engine.failed.popitem()[1]
                    for out in outputs:
                        if out.finished:
                            finals[out.request_id] = out
                            bar.update(1)
            except BaseException:  # a failed step or request, or Ctrl-C: free everything of this call
                engine.abort_request(ids)
                raise
        return finals

    def enqueue(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: int | Sequence[int] | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> list[str]:
        """vLLM 0.32's: add the prompts' requests (checked as ``generate`` checks them) without
        running them; their ids. ``wait_for_completion`` runs them (a ``generate`` call before it
        runs them too, and keeps only its own outputs)."""
        if self.llm_engine.runner_type != "generate":
            raise ValueError("LLM.enqueue() is only supported for generative models: this LLM runs the pooling runner")
        ids = self._add(*self._generate_requests(prompts, sampling_params, priority, tokenization_kwargs), lora_request)
        self._enqueued += ids
        return ids

    def wait_for_completion(self, output_type: Any = None, *, use_tqdm: bool | Callable[..., tqdm] = True) -> list[Any]:
        """vLLM 0.32's: step until every request is finished; the final outputs, in request id order
        (``output_type`` is taken for vLLM's signature)."""
        ids, self._enqueued = self._enqueued, []
        return sorted(self._wait(ids, use_tqdm).values(), key=lambda out: int(out.request_id))

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        use_tqdm: bool = False,
        concurrency_limit: int | None = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's offline beam search, built on ``generate`` (engine/beam_search.py): one
        ``BeamSearchOutput`` per prompt, its ``sequences`` best first (vLLM's argument order).
        ``lora_request``: one adapter for every prompt, or one (or None) per prompt."""
        return beam_search.beam_search(self, prompts, params, use_tqdm, concurrency_limit, lora_request)

