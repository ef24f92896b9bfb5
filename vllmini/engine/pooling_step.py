"""The pooling runner's side of the engine (``runner="pooling"``, embeddings): a pooling
request is checked and queued as one prompt-only sequence, and a pooling step pools the
hidden states its chunks computed instead of sampling (engine/pooler.py holds the pooling)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from vllmini.engine.errors import StepError
from vllmini.engine.input_processor import PromptType, cache_salt_of
from vllmini.engine.outputs import PoolingRequestOutput
from vllmini.engine.pooler import TOKEN_TASKS, PoolingRequestState
from vllmini.engine.pooling_params import PoolingParams
from vllmini.lora.request import LoRARequest
from vllmini.scheduler.scheduler import ScheduledSeq
from vllmini.scheduler.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from vllmini.engine.llm_engine import LLMEngine


def prepare_pooling(
    engine: LLMEngine, request_id: str | None, prompt: PromptType, params: PoolingParams | None, arrival_time: float | None,
    priority: int, lora_request: LoRARequest | None,
) -> PoolingRequestState:  # fmt: skip
    """A pooling request (PoolingParams, on a pooling engine; either alone is refused, as vLLM's
    LLM refuses generate on a pooling model and encode on a generating one)."""
    if engine.pooler is None:
        raise ValueError("PoolingParams (encode / embed) need an engine started with runner='pooling'; this one "
                         "generates (vLLM: --runner pooling)")  # fmt: skip
    if not isinstance(params, PoolingParams):
        raise ValueError(f"this engine runs the pooling runner (embeddings): requests take PoolingParams (encode / "
                         f"embed), got {type(params).__name__}; generation needs runner='generate'")  # fmt: skip
    params = engine.pooler.resolve(params, engine.hf_config)
    _, ids = engine.input_processor.process_pooling(prompt, params)
    cache_salt = cache_salt_of(prompt)  # (checked before an adapter is loaded for it)
    adapter = None if lora_request is None else engine._lora_adapter(lora_request)
    request_id, now = engine._id_and_arrival(request_id, arrival_time)
    seq = Sequence(next(engine._seq_ids), request_id, ids, params, 0, arrival_time=now, priority=priority,
                   lora=adapter, cache_salt=cache_salt)  # fmt: skip
    # a token task pools every position: a prefix-cache hit would skip some (vLLM's skip_reading_prefix_cache)
    seq.skip_reading_prefix_cache = params.task in TOKEN_TASKS
    return PoolingRequestState(request_id, list(ids), params, [seq])


def pool_step(engine: LLMEngine) -> list[PoolingRequestOutput]:
    """A pooling engine's step: the scheduled chunks' wanted hidden states are pooled, and each
    request whose prompt is now computed finishes with its embedding (engine/pooler.py)."""
    sched = engine.scheduler.schedule()
    if sched.is_empty:
        return []
    pooler = engine.pooler
    assert pooler is not None

    def wanted(s: ScheduledSeq) -> tuple[int, int]:
        return pooler.wanted_rows(s.seq.params.task, s.seq.num_computed_tokens, s.num_new_tokens,
                                  s.seq.num_prompt_tokens)  # fmt: skip

    try:
        hidden, spans = engine.runner.execute_pooling(sched, engine.block_manager, wanted)
    except Exception as exc:  # (as in _launch: the step's requests fail, the engine stays up)
        failed = list(dict.fromkeys(s.seq.request_id for s in sched.scheduled))
        engine.abort_request(failed)
        engine.block_manager.reset_prefix_cache()
        raise StepError(failed, exc) from exc
    outputs = []
    for i, first, count in spans:
        s = sched.scheduled[i]
        state = engine.requests[s.seq.request_id]
        pooler.accumulate(state, s.seq.num_computed_tokens, hidden[first : first + count])
        if s.completes:
            state.result = pooler.finish(state)
    engine.scheduler.update_computed(sched)
    for s in sched.scheduled:
        state = engine.requests[s.seq.request_id]
        if state.result is not None:
            engine.scheduler.finish(s.seq, SequenceStatus.FINISHED_STOPPED)
            outputs.append(engine._report(state))
    return outputs
