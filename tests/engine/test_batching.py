"""The target engine under batching: every generation equals the same request served alone,
whatever joins or leaves beside it (greedy and seeded sampling, vanilla and card), prompts longer
than a prefill chunk, requests that wait for a KV slot, a failing or cancelled neighbour."""

from __future__ import annotations

import pytest
import torch

from card.engine.inprocess.runner import InProcessRunner, RunnerConfig
from card.engine.loading.models import LoadedModel
from card.engine.shared.config import GenerationRequest, Mode, SamplingParams, StopParams, TreeParams
from card.engine.shared.kv_pool import PREFILL_CHUNK, KVPool
from card.engine.target.chain_source import NoDraft
from card.engine.target.generation import Generation
from card.engine.target.scheduler import TargetEngine, finish_alone
from tests.engine.support import (
    LetterTokenizer,
    draft_model,
    letters,
    prompt_cases,
    run_batched,
    target_model,
)


def _loaded(model: torch.nn.Module) -> LoadedModel:
    return LoadedModel("tiny", model, LetterTokenizer(), "fp", frozenset(), 512)


def _requests(n: int, seed: int, sampled: bool) -> list[GenerationRequest]:
    # prompts from 1 to 300 tokens: some take two prefill chunks
    cases = prompt_cases(n, seed=seed, max_prompt=300, max_new=40)
    return [GenerationRequest(tuple(p), SamplingParams(0.8, seed=i) if sampled else SamplingParams(),
                              StopParams(max_new_tokens=b, ignore_eos=True))
            for i, (p, b) in enumerate(cases)]



@pytest.mark.parametrize("sampled", [False, True])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_vanilla_batched_equals_alone(kind: str, sampled: bool) -> None:
    model = target_model(kind, sharp=sampled)
    requests = _requests(8, seed=3, sampled=sampled)
    assert any(len(r.prompt_ids) > PREFILL_CHUNK for r in requests)

    def gen(r: GenerationRequest) -> Generation:
        return Generation(r, NoDraft(), eos_ids=frozenset(), decode=letters, context_window=512,
                          mode="vanilla", vocab_size=model.config.vocab_size)

    alone = [finish_alone(model, gen(r)).token_ids for r in requests]
    # 3 slots for 8 requests: some wait for a slot; a small token budget splits prefills across
    # iterations
    engine = TargetEngine(model, KVPool(model, slots=3, max_len=512), max_batch_tokens=300)
    batched = run_batched(engine, [gen(r) for r in requests], join_every=2)
    assert [batched[i] for i in range(len(requests))] == alone
    assert engine.pool.free_slots == 3


@pytest.mark.parametrize("sampled", [False, True])
def test_card_batched_equals_alone_and_vanilla(sampled: bool) -> None:
    target = _loaded(target_model("llama", sharp=sampled))
    draft = _loaded(draft_model("llama", "perturbed", sharp=sampled))
    requests = _requests(6, seed=9, sampled=sampled)
    vanilla = InProcessRunner(target, None, RunnerConfig(mode=Mode.VANILLA))
    want = [vanilla.run(r).token_ids for r in requests]
    runner = InProcessRunner(target, draft, RunnerConfig(mode=Mode.CARD,
                                                         tree=TreeParams(width=2, max_depth=4),
                                                         backoff=False))
    try:
        engine = TargetEngine(target.model, KVPool(target.model, slots=4, max_len=512))
        gens = [runner.generation(r) for r in requests]
        batched = run_batched(engine, gens, join_every=3)
        assert [batched[i] for i in range(len(requests))] == want
        assert sum(g.stats.draft_forwards for g in gens) > 0  # the draft really ran
    finally:
        runner.close()


class _Failing(NoDraft):
    def __init__(self, after: int) -> None:
        self.left = after

    def step(self, correction):
        self.left -= 1
        if self.left < 0:
            raise RuntimeError("the chain source broke")
        return super().step(correction)


def test_a_failing_or_cancelled_generation_leaves_the_others_alone() -> None:
    model = target_model("llama")
    requests = _requests(3, seed=4, sampled=False)
    stop = StopParams(max_new_tokens=30, ignore_eos=True)
    requests = [GenerationRequest(r.prompt_ids, r.sampling, stop) for r in requests]

    def gen(r: GenerationRequest, source: NoDraft) -> Generation:
        return Generation(r, source, eos_ids=frozenset(), decode=letters, context_window=512,
                          mode="vanilla", vocab_size=model.config.vocab_size)

    alone = finish_alone(model, gen(requests[0], NoDraft())).token_ids
    engine = TargetEngine(model, KVPool(model, slots=3, max_len=512))
    good, bad = gen(requests[0], NoDraft()), gen(requests[1], _Failing(3))
    cancelled = gen(requests[2], NoDraft())
    for g in (good, bad, cancelled):
        engine.add(g)
    got, errors, steps = [], [], 0
    while not engine.idle:
        for event in engine.step():
            if event.generation is good and event.chunk is not None:
                got += event.chunk.token_ids
            if event.error is not None:
                errors.append((event.generation, str(event.error)))
        steps += 1
        if steps == 5:
            event = engine.cancel(cancelled)
            assert event.done and cancelled.result is not None
            assert cancelled.result.finish_reason == "aborted"
    assert got == alone
    assert errors == [(bad, "the chain source broke")] and bad.result is not None
    assert engine.pool.free_slots == 3


class _Rogue(NoDraft):
    """A source whose chains hold a token far outside the vocabulary after a real-looking one."""

    def step(self, correction):
        from card.engine.shared.tree import Chain
        from card.engine.target.chain_source import StepResult

        return StepResult(Chain((5, 10**9, 7), (0, 1, 2), correction.epoch))


def test_a_chain_token_outside_the_vocabulary_fails_nobody() -> None:
    """One request's source hands out a token no embedding row has: that chain is cut before it,
    and neither that request nor its neighbour in the same forward fails or changes."""
    model = target_model("llama")
    stop = StopParams(max_new_tokens=20, ignore_eos=True)
    requests = [GenerationRequest(r.prompt_ids, r.sampling, stop)
                for r in _requests(2, seed=6, sampled=False)]

    def gen(r: GenerationRequest, source: NoDraft) -> Generation:
        return Generation(r, source, eos_ids=frozenset(), decode=letters, context_window=512,
                          mode="vanilla", vocab_size=model.config.vocab_size)

    alone = [finish_alone(model, gen(r, NoDraft())).token_ids for r in requests]
    engine = TargetEngine(model, KVPool(model, slots=2, max_len=512))
    batched = run_batched(engine, [gen(requests[0], _Rogue()), gen(requests[1], NoDraft())], join_every=1)
    assert [batched[0], batched[1]] == alone
