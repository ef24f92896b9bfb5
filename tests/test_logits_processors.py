"""Custom logits processors (vLLM v1's programming model): the persistent batch they see, where
they run, their per-request arguments (``extra_args`` / the server's ``vllm_xargs``), loading by
name, and refusals."""
from __future__ import annotations

import json

import httpx
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoConfig

from helpers import save_tiny_classifier
from test_engine import assert_no_leaks, kv_bytes
from vllmini import LLM, AsyncLLMEngine, EngineArgs, SamplingParams
from vllmini.engine.logits_processor import (AdapterLogitsProcessor, BatchUpdate, LogitsProcessor, MoveDirectionality,
                                             process_dict_updates)  # fmt: skip
from vllmini.engine.errors import StepError
from vllmini.engine.logits_processor_state import LogitsProcessors, load_logits_processors
from vllmini.entrypoints.openai.api_server import build_app

VOCAB = 49152


def target_of(params: SamplingParams, *_: object) -> int | None:
    return (params.extra_args or {}).get("target_token")


class TargetTokenProcessor(LogitsProcessor):
    """vLLM's example processor: a request with ``extra_args={"target_token": t}`` only samples t.
    It changes the logits in place and records every BatchUpdate."""

    def __init__(self, vllm_config, device, is_pin_memory):
        self.targets: dict[int, int] = {}
        self.updates: list[BatchUpdate] = []

    @classmethod
    def validate_params(cls, params):
        t = target_of(params)
        if t is not None and (not isinstance(t, int) or not 0 <= t < VOCAB):
            raise ValueError(f"extra_args.target_token must be a token id in [0, {VOCAB}), got {t!r}")

    def is_argmax_invariant(self):
        return False

    def update_state(self, batch_update):
        if batch_update is not None:
            self.updates.append(batch_update)
        process_dict_updates(self.targets, batch_update, target_of)

    def apply(self, logits):
        if self.targets:
            rows, cols = torch.tensor(list(self.targets)), torch.tensor(list(self.targets.values()))
            keep = logits[rows, cols].clone()
            logits[rows] = float("-inf")
            logits[rows, cols] = keep
        return logits


class CountingInvariantProcessor(LogitsProcessor):
    """Argmax-invariant (it lowers every logit by one): counts its ``apply`` calls."""

    def __init__(self, vllm_config, device, is_pin_memory):
        self.calls = 0

    def is_argmax_invariant(self):
        return True

    def update_state(self, batch_update):
        pass

    def apply(self, logits):
        self.calls += 1
        return logits.sub_(1.0)


class NoRepeatAdapter(AdapterLogitsProcessor):
    """Per-request functions, vLLM's older form: ``{"no_repeat": True}`` bans tokens already
    generated (two arguments); ``{"no_prompt_tokens": True}`` bans the prompt's (three)."""

    def is_argmax_invariant(self):
        return False

    def new_req_logits_processor(self, params):
        args = params.extra_args or {}
        if args.get("no_repeat"):
            def no_repeat(output_ids, row):
                if output_ids:
                    row[torch.tensor(output_ids)] = float("-inf")
                return row
            return no_repeat
        if args.get("no_prompt_tokens"):
            return lambda prompt_ids, output_ids, row: row.index_fill_(0, torch.tensor(prompt_ids), float("-inf"))
        return None


class FailingProcessor(LogitsProcessor):
    """Raises in ``apply`` while a request with ``extra_args={"boom": True}`` is in the batch."""

    def __init__(self, vllm_config, device, is_pin_memory):
        self.booms: dict[int, bool] = {}

    def is_argmax_invariant(self):
        return False

    def update_state(self, batch_update):
        process_dict_updates(self.booms, batch_update, lambda params, *_: (params.extra_args or {}).get("boom"))

    def apply(self, logits):
        if self.booms:
            raise RuntimeError("boom")
        return logits


def prompts(n: int) -> list[dict]:
    return [{"prompt_token_ids": [(7 * i + j) % 500 + 3 for j in range(4 + 5 * (i % 4))]} for i in range(n)]


def greedy(max_tokens: int, **extra) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **extra)


def token_ids(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def plain(tiny_dir):
    return LLM(str(tiny_dir), max_num_seqs=4, max_num_batched_tokens=64)


def test_each_request_keeps_its_own_row_through_admissions_finishes_and_preemptions(tiny_dir, plain):
    """Every request asks for a different target token, so a row mix-up in the persistent batch
    shows as a wrong token; requests without one decode as an engine without processors does.
    Four slots, twelve requests of different lengths and a small KV pool: rows leave, are
    refilled, condensed by moves, and preempted sequences come back."""
    n = 12
    config = AutoConfig.from_pretrained(tiny_dir)
    llm = LLM(str(tiny_dir), max_num_seqs=4, max_num_batched_tokens=64, logits_processors=[TargetTokenProcessor],
              kv_cache_memory=kv_bytes(config, 7))  # fmt: skip
    lengths = [3 + (5 * i) % 17 for i in range(n)]
    params = [greedy(m, extra_args=None if i % 3 == 2 else {"target_token": 100 + i}) for i, m in enumerate(lengths)]
    got = token_ids(llm.generate(prompts(n), params, use_tqdm=False))
    want = token_ids(plain.generate(prompts(n), [greedy(m) for m in lengths], use_tqdm=False))
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == (w if i % 3 == 2 else [100 + i] * lengths[i]), f"request {i}"
    updates = llm.llm_engine.logits_processors.processors[0].updates
    assert any(u.removed for u in updates) and any(u.moved for u in updates) and len(updates) > n
    assert llm.llm_engine.scheduler.stats.num_preemptions > 0
    assert_no_leaks(llm)


class FakeSeq:
    def __init__(self, seq_id: int) -> None:
        self.seq_id, self.params = seq_id, SamplingParams(extra_args={"id": seq_id})
        self.prompt_token_ids, self.output_token_ids = [seq_id], []
        self.known_prompt_ids = self.prompt_token_ids  # (Sequence: none for a prompt given as embeddings)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 15), min_size=1, max_size=10, unique=True), min_size=1, max_size=12))
def test_batch_updates_replay_to_the_batch_the_logits_are_in(batches):
    """Replaying each BatchUpdate (removed, added, moved, as a processor does) on a mirror gives
    the persistent rows; the logits reach the processors in that order and go back in the
    sampler's."""
    seen: list[ProcessorProbe] = []

    class ProcessorProbe(TargetTokenProcessor):
        def __init__(self, *args):
            super().__init__(*args)
            self.mirror: dict[int, int] = {}
            seen.append(self)

        def update_state(self, batch_update):
            process_dict_updates(self.mirror, batch_update, lambda params, *_: params.extra_args["id"])
            if batch_update is not None:
                assert all(src > dst and how is MoveDirectionality.UNIDIRECTIONAL for src, dst, how in batch_update.moved)
                assert sorted(self.mirror) == list(range(batch_update.batch_size))

        def apply(self, logits):
            assert logits[:, 0].tolist() == [float(self.mirror[i]) for i in range(logits.shape[0])]
            return logits.add_(1.0)

    state = LogitsProcessors([ProcessorProbe], None, torch.device("cpu"))
    seqs = {i: FakeSeq(i) for i in range(16)}
    for batch in batches:
        step = state.prepare([seqs[i] for i in batch])
        logits = torch.tensor([[float(i), 0.0] for i in batch])
        out = step(logits, all_greedy=False)
        assert out[:, 0].tolist() == [float(i) + 1 for i in batch]  # back in the sampler's row order
        assert state.rows == [seen[0].mirror[r] for r in range(len(batch))]


def test_argmax_invariant_processors_skip_all_greedy_steps(tiny_dir):
    llm = LLM(str(tiny_dir), max_num_seqs=4, logits_processors=[CountingInvariantProcessor])
    proc = llm.llm_engine.logits_processors.processors[0]
    llm.generate(prompts(2), greedy(4), use_tqdm=False)
    assert proc.calls == 0
    llm.generate(prompts(2), [greedy(4), SamplingParams(temperature=0.8, max_tokens=4, seed=1)], use_tqdm=False)
    assert proc.calls == 4


def test_adapter_runs_per_request_functions_of_two_and_three_arguments(tiny_dir, plain):
    llm = LLM(str(tiny_dir), max_num_seqs=4, max_num_batched_tokens=64, logits_processors=[NoRepeatAdapter])
    batch = prompts(3)
    # the second prompt runs on into the model's own greedy output, which then keeps repeating
    batch[1]["prompt_token_ids"] += token_ids(plain.generate(batch[1], greedy(24), use_tqdm=False))[0]
    extra = [{"no_repeat": True}, {"no_prompt_tokens": True}, None]
    got = token_ids(llm.generate(batch, [greedy(24, extra_args=e) for e in extra], use_tqdm=False))
    want = token_ids(plain.generate(batch, greedy(24), use_tqdm=False))
    assert len(set(want[0])) < 24 and len(set(got[0])) == 24  # (the random model repeats itself)
    assert set(want[1]) & set(batch[1]["prompt_token_ids"]) and not set(got[1]) & set(batch[1]["prompt_token_ids"])
    assert got[2] == want[2]


def test_processors_change_a_copy_raw_logprobs_stay_the_models(tiny_dir, plain):
    """TargetTokenProcessor writes -inf into its rows in place: the logprobs reported (vLLM's
    raw logprobs) are still those of the model's logits."""
    llm = LLM(str(tiny_dir), logits_processors=[TargetTokenProcessor])
    params = greedy(1, logprobs=0, extra_args={"target_token": 123})
    forced = llm.generate(prompts(1), params, use_tqdm=False)[0].outputs[0]
    free = plain.generate(prompts(1), SamplingParams(temperature=0.5, max_tokens=1, logprobs=0, allowed_token_ids=[123]),
                          use_tqdm=False)[0].outputs[0]  # fmt: skip
    assert forced.token_ids == free.token_ids == [123]
    assert forced.logprobs[0][123].logprob == pytest.approx(free.logprobs[0][123].logprob)
    assert free.logprobs[0][123].logprob < -1.0


def test_async_scheduling_gives_the_same_tokens(tiny_dir):
    params = [greedy(6 + i, extra_args={"target_token": 50 + i} if i % 2 else None) for i in range(6)]
    outs = [token_ids(LLM(str(tiny_dir), max_num_seqs=4, async_scheduling=flag, logits_processors=[TargetTokenProcessor])
                      .generate(prompts(6), params, use_tqdm=False)) for flag in (False, True)]  # fmt: skip
    assert outs[0] == outs[1] and outs[0][1] == [51] * 7


def test_bad_input_is_refused_naming_it_and_others_go_on(tiny_dir):
    with pytest.raises(ValueError, match="extra_args"):
        SamplingParams(extra_args=["target_token"])
    with pytest.raises(ValueError, match="extra_args"):
        SamplingParams(extra_args={1: 2})
    llm = LLM(str(tiny_dir), logits_processors=["test_logits_processors.TargetTokenProcessor"])  # loaded by name
    with pytest.raises(ValueError, match="extra_args.target_token"):
        llm.generate(prompts(2), [greedy(3), greedy(3, extra_args={"target_token": -5})], use_tqdm=False)
    assert_no_leaks(llm)
    assert token_ids(llm.generate(prompts(1), greedy(3, extra_args={"target_token": 9}), use_tqdm=False)) == [[9] * 3]
    params = SamplingParams(extra_args={"target_token": 9, "more": [1, 2]})
    clone = params.clone()
    params.extra_args["more"].append(3)
    assert clone.extra_args == {"target_token": 9, "more": [1, 2]}  # the engine's copy is its own


@pytest.mark.parametrize("spec, message", [
    (["no_such_module_xyz.Processor"], r"logits_processors\[0\]: cannot import"),
    (["test_logits_processors.NoSuchClass"], r"logits_processors\[0\]: cannot import"),
    ([TargetTokenProcessor, int], r"logits_processors\[1\] must be a subclass"),
    (["Processor"], r"logits_processors\[0\] must be a qualified name"),
    (7, "logits_processors must be a list"),
])  # fmt: skip
def test_bad_processor_specs_are_refused_naming_the_entry(spec, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(logits_processors=spec).validate()


def test_names_load_from_one_comma_separated_string_as_the_cli_gives():
    assert load_logits_processors("test_logits_processors.TargetTokenProcessor, test_logits_processors:NoRepeatAdapter") == [
        TargetTokenProcessor, NoRepeatAdapter]  # fmt: skip
    from vllmini.cli import build_parser

    ns = build_parser().parse_args(["serve", "--logits-processors", "a.B,c.D"])
    assert ns.logits_processors == "a.B,c.D"


def test_refused_with_speculative_decoding_and_pooling_models(tmp_path, default_model_dir):
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2, "prompt_lookup_min": 1}
    with pytest.raises(ValueError, match="logits_processors cannot be combined with speculative_config"):
        EngineArgs(speculative_config=spec, logits_processors=[TargetTokenProcessor]).validate()
    classifier, _ = save_tiny_classifier("llama", tmp_path / "cls", default_model_dir, 2)
    with pytest.raises(ValueError, match="pooling models do not support custom logits processors"):
        LLM(str(classifier), logits_processors=[TargetTokenProcessor])


async def test_server_passes_vllm_xargs_and_answers_400_for_bad_ones(tiny_dir):
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny_dir), served_model_name="tiny",
                                                        logits_processors=[TargetTokenProcessor]))  # fmt: skip
    transport = httpx.ASGITransport(app=build_app(engine, "tiny"))
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
            ok = await http.post("/v1/completions", json={**body, "vllm_xargs": {"target_token": 77}, "logprobs": 0})
            assert ok.status_code == 200, ok.text
            assert ok.json()["choices"][0]["logprobs"]["tokens"] == [engine.tokenizer.decode([77])] * 4
            bad = await http.post("/v1/completions", json={**body, "vllm_xargs": {"target_token": "x"}})
            assert bad.status_code == 400 and "extra_args.target_token" in bad.json()["error"]["message"]
            chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                    "temperature": 0, "ignore_eos": True, "vllm_xargs": {"target_token": 77}}  # fmt: skip
            out = await http.post("/v1/chat/completions", content=json.dumps(chat))
            assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] == 3
            assert out.json()["choices"][0]["message"]["content"] == engine.tokenizer.decode([77] * 3)
    finally:
        await engine.shutdown()
    assert_no_leaks(engine)


def test_a_failing_processor_fails_its_step_and_the_engine_goes_on(tiny_dir, plain):
    """A processor's exception fails the requests sampled in that step (their blocks freed, as for
    a failed forward); the engine then serves the next requests as before."""
    llm = LLM(str(tiny_dir), max_num_seqs=4, max_num_batched_tokens=64, logits_processors=[FailingProcessor])
    with pytest.raises(StepError, match="boom"):
        llm.generate(prompts(2), [greedy(3), greedy(3, extra_args={"boom": True})], use_tqdm=False)
    assert_no_leaks(llm)
    want = token_ids(plain.generate(prompts(2), greedy(5), use_tqdm=False))
    assert token_ids(llm.generate(prompts(2), greedy(5), use_tqdm=False)) == want


async def test_a_failing_processor_fails_only_its_streams_in_the_async_engine(tiny_dir, plain):
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny_dir), logits_processors=[FailingProcessor]))
    try:
        with pytest.raises(StepError, match="boom"):
            async for _ in engine.generate(prompts(1)[0], greedy(4, extra_args={"boom": True}), "bad"):
                pass
        outs = [out async for out in engine.generate(prompts(1)[0], greedy(4), "good")]
        assert list(outs[-1].outputs[0].token_ids) == token_ids(plain.generate(prompts(1), greedy(4), use_tqdm=False))[0]
    finally:
        await engine.shutdown()
    assert_no_leaks(engine)


def test_forked_completions_get_their_own_rows(tiny_dir):
    """n > 1 completions fork from the first one's prompt step: each is its own row from its
    first token on, beside a request of another target."""
    llm = LLM(str(tiny_dir), logits_processors=[TargetTokenProcessor])
    params = [SamplingParams(n=3, temperature=1.0, seed=2, max_tokens=5, ignore_eos=True, extra_args={"target_token": 61}),
              greedy(4, extra_args={"target_token": 62})]  # fmt: skip
    outs = llm.generate(prompts(2), params, use_tqdm=False)
    assert [list(c.token_ids) for c in outs[0].outputs] == [[61] * 5] * 3
    assert list(outs[1].outputs[0].token_ids) == [62] * 4
    assert_no_leaks(llm)
