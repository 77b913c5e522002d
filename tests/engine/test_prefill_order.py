"""Which prompts an iteration prefills (card.engine.target.prefill_order): a burst of prompts gets
its first tokens shortest first, a few at a time, with the same tokens as in arrival order and
alone; a long prompt passed over by a stream of short ones still goes within a bound."""

from __future__ import annotations

import pytest

from card.engine.shared.config import GenerationRequest, SamplingParams, StopParams
from card.engine.shared.kv_pool import KVPool
from card.engine.target.chain_source import NoDraft
from card.engine.target.generation import Generation
from card.engine.target.prefill_order import MAX_PASSED, PrefillOrder
from card.engine.target.scheduler import TargetEngine, finish_alone
from card.engine.target.speculation import CostModel
from tests.engine.support import letters, target_model


class FixedCost(CostModel):
    """A forward's cost as the engine would measure it on a machine where a forward's fixed part
    is 10 ms and a row 1 ms: the grouping rule's input held still, so what it decides is known
    (the tiny test model's own timings are all fixed cost)."""

    def fit(self) -> tuple[float, float]:
        return 0.010, 0.001


def _generation(model, prompt: tuple[int, ...], new: int, seed: int | None = None) -> Generation:
    sampling = SamplingParams(0.8, seed=seed) if seed is not None else SamplingParams()
    request = GenerationRequest(prompt, sampling, StopParams(max_new_tokens=new, ignore_eos=True))
    return Generation(request, NoDraft(), eos_ids=frozenset(), decode=letters, context_window=512,
                      mode="vanilla", vocab_size=model.config.vocab_size)


def _prompt(n: int, salt: int) -> tuple[int, ...]:
    return tuple(3 + (salt * 7 + i * 5) % 50 for i in range(n))


def _burst(model, order: str, lengths: list[int], sampled: bool) -> tuple[list[int], list[list[int]]]:
    """All prompts admitted at once: the iteration of each one's first token, and its tokens."""
    engine = TargetEngine(model, KVPool(model, slots=len(lengths), max_len=512), max_batch_tokens=512,
                          prefill_order=order)
    engine.cost = FixedCost()
    gens = [_generation(model, _prompt(n, i), 10, seed=i if sampled else None) for i, n in enumerate(lengths)]
    for g in gens:
        engine.add(g)
    first: dict[int, int] = {}
    iteration = 0
    while not engine.idle:
        engine.step()
        iteration += 1
        for i, g in enumerate(gens):
            if i not in first and len(g.target.committed) > len(g.request.prompt_ids):
                first[i] = iteration
    return [first[i] for i in range(len(gens))], [g.result.token_ids for g in gens]


@pytest.mark.parametrize("sampled", [False, True])
def test_a_burst_gets_its_first_tokens_shortest_first_with_the_same_tokens(sampled: bool) -> None:
    model = target_model("llama", sharp=sampled)
    lengths = [120, 15, 60, 5, 90, 30]  # 320 tokens: the budget holds all of them at once
    shortest, tokens = _burst(model, "shortest", lengths, sampled)
    arrival, arrival_tokens = _burst(model, "arrival", lengths, sampled)
    alone = [finish_alone(model, _generation(model, _prompt(n, i), 10, seed=i if sampled else None)).token_ids
             for i, n in enumerate(lengths)]
    assert tokens == arrival_tokens == alone
    # at 10 ms a forward and 1 ms a row: 5 and 15 together (15 ms of rows against 40 ms of one
    # more forward for the four after), then one prompt an iteration, shortest first
    by_length = dict(zip(lengths, shortest, strict=True))
    assert by_length[5] == by_length[15] == 1
    assert [by_length[n] for n in (30, 60, 90, 120)] == [2, 3, 4, 5]
    # the negative control: in arrival order the budget takes the whole burst in one forward
    assert arrival == [1] * len(lengths)


@pytest.mark.parametrize("max_passed, bound", [(MAX_PASSED, MAX_PASSED + 4), (10**6, None)])
def test_a_long_prompt_is_not_starved_by_short_ones(max_passed: int, bound: int | None) -> None:
    """A 96-token prompt (three chunks of 32) beside a new 10-token prompt every iteration, a budget
    of 32 tokens: the short one is offered first and leaves no room, every time. After
    ``max_passed`` passes the long prompt goes first; the control, never aged, never goes."""
    model = target_model("llama")
    engine = TargetEngine(model, KVPool(model, slots=2, max_len=512), max_batch_tokens=32, prefill_chunk=32)
    engine.prefill_order = PrefillOrder("shortest", max_passed=max_passed)
    engine.cost = FixedCost()
    long = _generation(model, _prompt(96, 99), 4)
    engine.add(long)
    shorts = []
    first = None
    for iteration in range(1, 31):
        shorts.append(_generation(model, _prompt(10, iteration), 1))
        engine.add(shorts[-1])
        engine.step()
        if first is None and len(long.target.committed) > len(long.request.prompt_ids):
            first = iteration
    served = sum(g.result is not None for g in shorts)
    if bound is None:
        assert first is None and served >= 25  # starved while the short ones kept coming
    else:
        assert first is not None and first <= bound, first
        assert served >= 20  # and the short ones went on between its chunks
    expected = finish_alone(model, _generation(model, _prompt(96, 99), 4)).token_ids
    while not engine.idle:
        engine.step()
    assert long.result is not None and long.result.token_ids == expected


class _P:
    def __init__(self, left: int) -> None:
        self.prefill_left = left


def test_the_order_of_offers() -> None:
    a, b, c, d = _P(50), _P(10), _P(50), _P(5)
    assert PrefillOrder("arrival").ordered([a, b, c, d]) == [a, b, c, d]
    order = PrefillOrder("shortest", max_passed=2)
    assert order.ordered([a, b, c, d]) == [d, b, a, c]  # ties keep arrival order
    order.planned([a, b, c, d], [d, b])
    order.planned([a, c], [])
    assert order.ordered([a, c, _P(1)])[:2] == [a, c]  # passed over twice: ahead of shorter ones
    assert order.joins(a, 500, finishing=5, decoding=5, decoding_rows=5, waiting=1, cost=(0.01, 0.001))
    fresh = PrefillOrder("shortest")
    assert not fresh.joins(a, 500, finishing=5, decoding=5, decoding_rows=5, waiting=1, cost=(0.01, 0.001))
    assert fresh.joins(a, 500, finishing=5, decoding=5, decoding_rows=5, waiting=1, cost=None)  # not measured
    with pytest.raises(ValueError):
        PrefillOrder("longest")
