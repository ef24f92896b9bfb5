"""The synchronous engine core: add_request / step / abort.

One ``step()`` = schedule, one batched forward, sample, append tokens, check stop
conditions, free finished sequences, and report a ``RequestOutput`` for every
request that changed (the forward is ``_launch`` here; sampling and what follows it are in
engine/sample_step.py). The async engine drives this same loop from a worker thread.
With ``EngineArgs.async_scheduling``, a step first launches the next decode step (when it
does not depend on the tokens just sampled) and then processes those tokens, so that host
and device work overlap (engine/async_scheduling.py); the outputs are the same. With
``speculative_config``, a decode also verifies the tokens drafted for it (spec_decode/speculator.py). A
pooling engine's step pools hidden states instead of sampling (engine/pooling_step.py);
engine/engine_setup.py builds the KV cache, scheduler and runner around the model; the engine's
other calls (tokenizer, LoRA adapters, prefix-cache reset, profiling, metrics) are in
engine/llm_engine_calls.py.
"""
from __future__ import annotations

import gc
import itertools
import logging
import time
from collections.abc import Container, Iterable

import torch

from vllmini.config import EngineArgs, PoolerConfig, StructuredOutputsConfig, resolve_device
from vllmini.engine import prompt_logprobs, sample_step
from vllmini.engine.async_scheduling import launch_continuation, step_async
from vllmini.engine.detokenizer import IncrementalDetokenizer
from vllmini.engine.engine_setup import build_runtime
from vllmini.engine.errors import StepError
from vllmini.engine.forking import fork_children
from vllmini.engine.input_processor import InputProcessor, PromptType, default_sampling_params, load_generation_config
from vllmini.engine.llm_engine_calls import LLMEngineCalls
from vllmini.engine.model_config import ModelConfig
from vllmini.engine.logits_processor_state import LogitsProcessors, load_logits_processors
from vllmini.engine.model_loading import load_for_engine, load_speculative
from vllmini.engine.output_processor import OutputProcessor, RequestState
from vllmini.engine.outputs import PoolingRequestOutput, RequestOutput
from vllmini.engine.pooler import Pooler, PoolingRequestState, resolve_pooler_config
from vllmini.engine.pooling_params import PoolingParams
from vllmini.engine.pooling_step import pool_step, prepare_pooling
from vllmini.engine.profiler import Profiler, ProfilerConfig
from vllmini.engine.sample_step import LaunchedStep
from vllmini.engine.sampler import Sampler
from vllmini.engine.sampling_params import SamplingParams
from vllmini.engine.sampling_tensors import to_device
from vllmini.engine.skip_tokenizer import NoDetokenizer, eos_token_ids
from vllmini.engine.structured_outputs import StructuredOutputManager
from vllmini.engine.thinking_budget import ThinkingBudget
from vllmini.engine.worker import Worker
from vllmini.lora.request import LoRARequest
from vllmini.metrics.stat_logger import StatLogger
from vllmini.scheduler.scheduler import SchedulerOutput
from vllmini.scheduler.sequence import Sequence, SequenceStatus
from vllmini.spec_decode import SpecDecodingStats, SpeculativeConfig, Speculator
from vllmini.spec_decode.speculator import rows_with_drafts

logger = logging.getLogger("vllmini")


class LLMEngine(LLMEngineCalls):
    """add_request / step / abort_request over the model, KV cache and scheduler it builds."""

    def __init__(self, args: EngineArgs) -> None:
        args.validate()
        self.args = args
        self.device = resolve_device(args.device)
        torch.manual_seed(args.seed)
        loaded = load_for_engine(args, self.device)
        self.model_dir, self.model, self.hf_config = loaded.model_dir, loaded.model, loaded.hf_config
        self.dtype, self.tokenizer = loaded.dtype, loaded.tokenizer
        self.runner_type = loaded.runner  # "generate" or "pooling" (embeddings: engine/pooler.py), as vLLM's
        self.convert_type = loaded.convert  # "none", "embed" or "classify" (runner_config.py), as vLLM's
        self.pooler: Pooler | None = None
        if self.runner_type == "pooling":
            config = resolve_pooler_config(PoolerConfig.coerce(args.pooler_config), self.model_dir, self.hf_config)
            self.pooler = Pooler(config, getattr(self.model, "score", None), self.hf_config)
            logger.info("pooling runner: tasks %s, %s pooling, normalize / activation=%s", list(self.pooler.tasks),
                        config.pooling_type, config.normalize)  # fmt: skip

        self.max_model_len = loaded.max_model_len
        self.vocab_size = self.hf_config.vocab_size
        self.generation_config = load_generation_config(self.model_dir)
        self.eos_token_ids = self._eos_token_ids()

        # speculative decoding (spec_decode/): the config, and the draft model of method "draft_model"
        self.spec_config: SpeculativeConfig | None
        self.spec_config, draft_model = load_speculative(args, self.device, loaded, self.max_model_len)

        rt = build_runtime(args, self.model, self.hf_config, self.device, self.dtype, self.max_model_len, self.pooler,
                           draft_model)  # fmt: skip
        self.attention_backend, self.lora_manager, self.num_blocks = rt.attention_backend, rt.lora_manager, rt.num_blocks
        self.block_manager, self.scheduler, self.runner = rt.block_manager, rt.scheduler, rt.runner
        if (window := getattr(self.model, "sliding_window", None)) is not None:
            released = "released behind it" if self.model.kv_window else (
                "released behind it in the sliding layers' KV groups" if self.block_manager.num_groups > 1
                else "kept: some layers attend to all tokens")  # fmt: skip
            logger.info("sliding-window attention: %d tokens (KV blocks %s)", window, released)
        self.worker = Worker(self.runner, self.device, self.model_dir)  # collective_rpc's target; sleep mode
        self.input_processor = InputProcessor(
            self.tokenizer, self.vocab_size, self.max_model_len, self.capacity_tokens, args.max_logprobs,
            default_sampling_params(args.generation_config, self.generation_config, args.override_generation_config),
            self.eos_token_ids, self.hf_config.hidden_size if args.enable_prompt_embeds else None,
            "num_gpu_blocks_override" if args.num_gpu_blocks_override is not None else "kv_cache_memory",
        )  # fmt: skip
        self.sampler = Sampler(args.logprobs_mode)
        # the reasoning strings' tokens (engine/thinking_budget.py): SamplingParams.thinking_token_budget
        # counts from the start, a structured-output grammar begins after the end
        self.thinking = ThinkingBudget.from_config(args.resolved_reasoning_config(), self.tokenizer, self.vocab_size)
        so_config = StructuredOutputsConfig.coerce(args.structured_outputs_config)
        self.structured = StructuredOutputManager(self.tokenizer, self.vocab_size, self.eos_token_ids,
                                                  None if so_config.enable_in_reasoning else self.thinking,
                                                  so_config.disable_any_whitespace)  # fmt: skip
        self.speculator: Speculator | None = None
        if self.spec_config is not None:
            self.speculator = Speculator(self.spec_config, rt.drafter, self.block_manager, self.max_model_len,
                                         self.structured)  # fmt: skip
        self.spec_stats = SpecDecodingStats() if self.speculator is None else self.speculator.stats
        self.logits_processors: LogitsProcessors | None = None  # custom ones (engine/logits_processor.py)
        if processor_classes := load_logits_processors(args.logits_processors):
            if self.pooler is not None:
                raise ValueError("logits_processors: pooling models do not support custom logits processors")
            self.logits_processors = LogitsProcessors(processor_classes, args, self.device)
        self._in_flight: LaunchedStep | None = None  # async scheduling: launched, tokens not yet read
        self.profiler = Profiler(ProfilerConfig.coerce(args.profiler_config), self.device)
        self.output_processor = OutputProcessor(self.scheduler, self.eos_token_ids, self.max_model_len, self.tokenizer)
        self.requests: dict[str, RequestState] = {}
        self.failed: dict[str, Exception] = {}  # request id -> error, for the caller to report
        self.num_generated_tokens = 0  # every token sampled and kept since start (for throughput stats)
        self.stat_logger = None if args.disable_log_stats else StatLogger(self, args.get_served_model_name())
        self._seq_ids = itertools.count()
        self._request_ids = itertools.count()
        self.model_config = ModelConfig.from_engine(self)  # (vLLM's, for the user code that reads it)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLMEngine:
        """(vLLM's name for the argument, so that ``from_engine_args(engine_args=...)`` works too.)"""
        engine = cls(engine_args)
        # Everything alive now (imported modules, tokenizer, model) lives as long as the
        # process: moving it out of the collector's reach makes later full collections scan
        # only new objects. Without this a gen-2 collection took ~200 ms here, stalling
        # whichever thread triggered it (a step, or the event loop that streams outputs).
        gc.collect()
        gc.freeze()
        return engine

    def _eos_token_ids(self) -> tuple[int, ...]:
        return eos_token_ids(self.tokenizer, self.generation_config, self.hf_config)

    # ---- requests -------------------------------------------------------------------------
    def add_request(
        self, request_id: str | None, prompt: PromptType, params: SamplingParams | PoolingParams | None = None,
        arrival_time: float | None = None, default_output_kind: str | None = None, priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> str:  # fmt: skip
        """Validate and queue a request. Raises ValueError (naming the field) on bad input;
        nothing is queued then. ``arrival_time``: a ``time.time()`` value, as in vLLM (it is moved
        onto ``time.monotonic()``, the clock of ``RequestMetrics``; a future one counts as now).
        ``priority`` (lower first) needs ``scheduling_policy="priority"``, as in vLLM.
        ``lora_request``: run it with that LoRA adapter (needs ``enable_lora``)."""
        state = self.prepare_request(request_id, prompt, params, arrival_time, default_output_kind, priority,
                                     lora_request)  # fmt: skip
        self.enqueue(state)
        return state.request_id

    def prepare_request(
        self, request_id: str | None, prompt: PromptType, params: SamplingParams | PoolingParams | None = None,
        arrival_time: float | None = None, default_output_kind: str | None = None, priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> RequestState | PoolingRequestState:  # fmt: skip
        """Validate and tokenize without touching the scheduler, so that the async engine can
        do it on the caller's thread and raise right at the call. ``params`` None: the model's
        default sampling parameters (``get_default_sampling_params``), with
        ``default_output_kind`` when given. PoolingParams: a pooling request (a pooling engine
        takes nothing else)."""
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an int, got {priority!r}")
        if priority != 0 and self.args.scheduling_policy != "priority":
            raise ValueError(f"priority={priority} needs EngineArgs.scheduling_policy='priority' (it is "
                             f"{self.args.scheduling_policy!r})")  # fmt: skip
        if isinstance(params, PoolingParams) or self.pooler is not None:
            return prepare_pooling(self, request_id, prompt, params, arrival_time, priority, lora_request)
        inp = self.input_processor.process(prompt, params, default_output_kind)
        if self.logits_processors is not None:
            self.logits_processors.validate(inp.params)
        if inp.params.thinking_token_budget is not None and self.thinking is None:
            raise ValueError("thinking_token_budget is set but reasoning_config is not configured: start the engine with "
                             "EngineArgs.reasoning_config (the server: --reasoning-parser or --reasoning-config)")  # fmt: skip
        # (after the cheap checks: loading an adapter may read its files)
        adapter = None if lora_request is None else self._lora_adapter(lora_request)
        params, ids, max_tokens = inp.params, inp.prompt_token_ids, inp.max_tokens
        request_id, now = self._id_and_arrival(request_id, arrival_time)
        seqs = [
            Sequence(next(self._seq_ids), request_id, ids, params, max_tokens, index=i, arrival_time=now,
                     priority=priority, lora=adapter, cache_salt=inp.cache_salt, prompt_embeds=inp.prompt_embeds)
            for i in range(params.n)
        ]  # fmt: skip
        known = seqs[0].known_prompt_ids  # (none for prompt_embeds: the outputs' prompt_token_ids is None, as vLLM's)
        detoks = [NoDetokenizer() if self.tokenizer is None else  # (skip_tokenizer_init)
                  IncrementalDetokenizer(self.tokenizer, known, params.skip_special_tokens) for _ in seqs]  # fmt: skip
        # the outputs' prompt_token_ids is a copy: a caller changing it cannot reach the sequences'
        # list, which the sampler's penalties and the prompt logprobs read
        state = RequestState(request_id, inp.text, None if inp.prompt_embeds is not None else list(ids), params, seqs,
                             detoks, now)  # fmt: skip
        state.logprobs = [[] for _ in seqs]
        state.cumulative_logprobs = [0.0 for _ in seqs]
        state.sent = [(0, 0) for _ in seqs]
        state.stream_interval = max(self.args.stream_interval, params.stream_interval or 1)
        state.pending = seqs[1:]  # forked from seqs[0] once its prompt is computed
        state.bad_words_token_ids = inp.bad_words_token_ids
        if params.structured_outputs is not None:  # checked now, compiled in the background
            state.grammar = self.structured.submit(params.structured_outputs)
        prompt_logprobs.start(state)
        return state

    def _id_and_arrival(self, request_id: str | None, arrival_time: float | None) -> tuple[str, float]:
        """The request's id (a new one for None) and its arrival on ``time.monotonic()``'s clock."""
        request_id = self.new_request_id() if request_id is None else str(request_id)
        now = time.monotonic()
        if arrival_time is not None:  # vLLM's clock (time.time()), moved onto RequestMetrics' monotonic one
            now -= min(max(0.0, time.time() - arrival_time), now)
        return request_id, now

    def new_request_id(self, taken: Container[str] = ()) -> str:
        """The next counter value ("0", "1", ...) that no request holds, nor ``taken``."""
        while (rid := str(next(self._request_ids))) in self.requests or rid in taken:
            pass
        return rid

    def enqueue(self, state: RequestState) -> None:
        if state.request_id in self.requests:
            if state.grammar is not None:  # refused: its compile would only delay those queued behind it
                state.grammar.cancel()
            raise ValueError(f"request_id {state.request_id!r} is already in use")
        self.requests[state.request_id] = state
        if state.grammar is None or not self.structured.hold(state):
            self.scheduler.add(state.seqs[0])

    def _admit_compiled(self) -> None:
        """Queue the requests whose grammar has compiled since the last step (a compile error
        fails its request alone). With nothing else to run, wait a little for one."""
        idle = self._in_flight is None and not self.scheduler.running and not self.scheduler.waiting
        for state, error in self.structured.ready(wait=0.05 if idle else 0.0):
            if self.requests.get(state.request_id) is not state:
                continue  # aborted while its grammar compiled
            if error is not None:
                self.abort_request(state.request_id)
                self.failed[state.request_id] = ValueError(f"structured_outputs failed to compile: {error}")
            else:
                self.scheduler.add(state.seqs[0])

    def abort_request(self, request_ids: str | Iterable[str]) -> list[RequestOutput]:
        """Finish the request(s) with finish_reason "abort" and free their blocks now;
        returns their final outputs. Unknown or finished ids are ignored. (vLLM's argument
        name; one id may also be given alone.)"""
        outputs = []
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            state = self.requests.get(rid)
            if state is None:
                continue
            if state.grammar is not None:  # (still held while its grammar compiles)
                self.structured.drop(state)
            for seq in state.seqs:
                if not seq.status.finished:
                    self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
            outputs.append(self._report(state))  # finished now, so never None
        return outputs

    # ---- one step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput] | list[PoolingRequestOutput]:
        try:
            return self._step()
        finally:  # (a failed step's prefill counts too: the scheduler counted it)
            if self.stat_logger is not None:
                self.stat_logger.record_step(self.scheduler.stats, self.num_generated_tokens)

    def _step(self) -> list[RequestOutput] | list[PoolingRequestOutput]:
        if self.worker.sleeping_tags:
            raise RuntimeError(f"the engine is sleeping ({sorted(self.worker.sleeping_tags)} released): call "
                               "wake_up() before stepping it")  # fmt: skip
        if self.structured.waiting:
            self._admit_compiled()
        if self.pooler is not None:
            return pool_step(self)
        if self.args.async_scheduling:
            return step_async(self)
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        launched = self._launch(sched)
        return [] if launched is None else sample_step.complete(self, launched)

    def _launch_continuation(self, prev: LaunchedStep) -> LaunchedStep | None:
        return launch_continuation(self, prev)

    def _launch(self, sched: SchedulerOutput) -> LaunchedStep | None:
        """The step's forward and sampler, launched; None when no sequence samples a token."""
        try:
            if self.speculator is None:
                logits, flat = self.runner.execute(sched, self.block_manager)
            else:  # (a draft model drafts before the forward and mirrors it after)
                logits, flat = self.speculator.execute(self.runner, sched, self.requests)
            sample_idx, num_rows = flat.sample_indices, flat.num_sample_rows
            if flat.prompt_rows:
                prompt_logprobs.record(sched, flat.prompt_rows, logits[num_rows:], self.requests, self.output_processor)
                logits = logits[:num_rows]
        except Exception as exc:  # the step's requests fail; the engine stays up for the others
            failed = list(dict.fromkeys(s.seq.request_id for s in sched.scheduled))
            self.abort_request(failed)
            # the step's new full blocks were registered in the prefix cache before its forward
            # wrote them; its sequences (the only owners) are gone, so forgetting every unowned
            # block's hash keeps those out of later prompts' hits
            self.block_manager.reset_prefix_cache()
            raise StepError(failed, exc) from exc
        self.scheduler.update_computed(sched)
        if not sample_idx:
            return None
        seqs, drafts = rows_with_drafts(sched, sample_idx)  # speculative decoding: a sequence's rows, then its drafts'
        logit_rows = list(range(len(seqs)))
        for row, seq in enumerate(list(seqs)):
            state = self.requests[seq.request_id]
            # n > 1: siblings sample from the parent's prompt logits
            for child in fork_children(state, seq, self.scheduler, self.block_manager, self.runner,
                                       self.scheduler.config.max_num_seqs):
                seqs.append(child)
                logit_rows.append(row)
        if len(logit_rows) > logits.shape[0]:
            logits = logits[to_device(torch.tensor(logit_rows), logits.device)]
        try:
            sampled = sample_step.sample(self, logits, seqs, drafts=drafts)
        except Exception as exc:  # e.g. a custom logits processor's: the step's sampled requests fail alone
            failed = list(dict.fromkeys(seq.request_id for seq in seqs))
            self.abort_request(failed)
            raise StepError(failed, exc) from exc
        return LaunchedStep(seqs, sampled, forked=len(seqs) > num_rows, drafts=drafts)

    def _report(self, state: RequestState) -> RequestOutput | None:
        """The request's output for this step (None: nothing to report per its output_kind);
        a finished request leaves the engine here."""
        out = state.output() if isinstance(state, PoolingRequestState) else self.output_processor.make_output(state)
        if state.finished and self.requests.pop(state.request_id, None) is not None:  # (leaves once)
            if self.stat_logger is not None:
                self.stat_logger.record_finished(state.seqs, state.seqs[0].num_prompt_tokens, state.params)
        return out
