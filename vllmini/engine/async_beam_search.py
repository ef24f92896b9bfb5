"""Beam search on the async engine: vLLM's ``EngineClient.beam_search``, which its server runs for
a request's ``use_beam_search``. The steps are the offline search's (engine/beam_search.py); each
step's beams go to the AsyncLLMEngine as concurrent one-token requests, so they batch with
whatever else it serves, and the prefix cache makes their shared prefixes cheap.
"""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, AsyncIterator

from vllmini.engine.beam_search import BeamSearch, BeamSearchParams
from vllmini.engine.input_processor import PromptType
from vllmini.engine.outputs import CompletionOutput, RequestOutput
from vllmini.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from vllmini.engine.async_engine import AsyncLLMEngine
    from vllmini.lora.request import LoRARequest


def start_beam_search(
    engine: AsyncLLMEngine, prompt: PromptType, request_id: str, params: BeamSearchParams,
    lora_request: LoRARequest | None = None,
) -> AsyncIterator[RequestOutput]:  # fmt: skip
    """``AsyncLLMEngine.beam_search``: the prompt and params are checked now (ValueError); the
    returned iterator runs the search and yields one final RequestOutput, its ``outputs`` the
    best ``beam_width`` beams, best first, as vLLM's: the generated tokens (a final EOS
    included), their text (without that EOS unless include_stop_str_in_output), cumulative
    logprob, each step's top ``2 * beam_width`` logprobs, finish reason and EOS id."""
    search = BeamSearch(engine.engine, [prompt], params, [lora_request])
    return _run(engine, search, prompt, request_id)


async def _run(engine: AsyncLLMEngine, search: BeamSearch, prompt: PromptType, request_id: str) -> AsyncIterator[RequestOutput]:
    prompt_ids = list(search.searches[0].live[0].tokens)
    for step in range(search.params.max_tokens):
        requests = search.requests()
        if not requests:
            break
        outs = await asyncio.gather(*(_final(engine, p, f"{request_id}-step{step}-beam{i}", params, lora)
                                      for i, (p, params, lora) in enumerate(requests)))  # fmt: skip
        search.advance(list(outs))
    (best,) = search.best(decode=False)  # (the outputs' text is theirs alone, decoded here)
    outputs = []
    for i, beam in enumerate(best.sequences):
        tokens = beam.tokens[len(prompt_ids) :]
        text = search.text(tokens, beam)
        outputs.append(CompletionOutput(i, text, tokens, beam.cum_logprob, beam.logprobs, beam.finish_reason,
                                        beam.stop_reason))  # fmt: skip
    text = prompt if isinstance(prompt, str) else prompt.get("prompt") if isinstance(prompt, dict) else None
    yield RequestOutput(request_id, text, prompt_ids, None, outputs, True)


async def _final(engine: AsyncLLMEngine, prompt: dict[str, Any], request_id: str, params: SamplingParams,
                 lora_request: LoRARequest | None) -> RequestOutput:  # fmt: skip
    """One beam's one-token request, to its final output (closing the stream early, as a cancelled
    search does, aborts it)."""
    final = None
    async for out in engine.generate(prompt, params, request_id=request_id, lora_request=lora_request):
        final = out
    assert final is not None
    return final
