"""Model-free drafting and the cascade (engine.draft.ngram, engine.draft.drafter): the n-gram tables' counts,
scores and memory budget; the trees they grow; a cascade's KV rows and logits equal plain forwards
across corrections; card with either drafter equals vanilla, greedy and seeded sampling."""

from __future__ import annotations

import gc
import math
import tracemalloc

import pytest
import torch

from card.engine.draft.ngram import NgramDrafter
from card.engine.draft.worker import DraftWorker
from card.engine.inprocess.sources import AutoCard, NgramCard
from card.engine.shared.config import NgramConfig, SamplingParams, TreeParams
from card.engine.shared.ngram_stats import NgramTable, Proposer, top_followers
from card.engine.shared.tree import Advance, Outcome, TwoTierTree
from card.engine.target.chain_source import DraftKind, NoDraft
from card.engine.target.drafting_policy import DraftingConfig, DraftingPolicy
from tests.engine.support import (
    VOCAB,
    DraftSession,
    card_source,
    draft_model,
    generate,
    target_model,
    wait_until,
)

CFG = NgramConfig(max_order=3, min_order=1, table_mb=1.0)


def test_followers_of_the_longest_known_order_with_witten_bell_scores() -> None:
    table = NgramTable(VOCAB, CFG)
    table.observe([1, 2, 3, 1, 2, 4, 1, 2, 3, 9, 2, 5])
    # after (1, 2): 3 twice, 4 once; order 3 "(3, 1, 2)" -> 4 only once
    assert table.followers([7, 1, 2]) == {4: 1, 3: 2}
    assert table.followers([3, 1, 2]) == {4: 1}
    assert table.followers([9, 9, 2]) == {5: 1}  # order 2 "(9, 2)"
    assert table.followers([8, 8, 2]) == {3: 2, 4: 1, 5: 1}  # order 1 "(2,)"
    assert table.followers([8, 8, 8]) is None
    tokens, logps = top_followers({4: 1, 3: 2}, 2)
    assert tokens == [3, 4]  # by count; N + T = 3 + 2
    assert logps == pytest.approx([math.log(2 / 5), math.log(1 / 5)])
    tokens, _ = top_followers({4: 1, 3: 1}, 1)
    assert tokens == [3]  # a tie goes to the most recent sighting


def test_min_order_and_follower_cap() -> None:
    table = NgramTable(VOCAB, NgramConfig(max_order=2, min_order=2, max_followers=2))
    table.observe([5, 6, 1, 5, 6, 2, 5, 6, 2, 5, 6, 3])
    assert table.followers([0, 6]) is None  # order 1 is below min_order
    assert table.followers([5, 6]) == {2: 2, 3: 1}  # 1 (the rarest, oldest) gave way to 3


def test_session_text_before_the_shared_table() -> None:
    shared = NgramTable(VOCAB, CFG, budget_bytes=10**6)
    shared.observe([1, 2, 8, 1, 2, 8])
    p = Proposer(VOCAB, CFG, shared)
    p.extend([1, 2, 7, 0])
    assert p.chain(p.tail([1, 2]), 3)[0] == 7  # the session's own sighting wins
    q = Proposer(VOCAB, CFG, shared)
    q.extend([3, 4])
    assert q.followers([1, 2]) == {8: 2, 7: 1}  # p's text went into the shared table too
    assert q.chain([1, 2], 3) == [8, 1, 2]


def test_shared_table_stays_within_its_budget_as_tracemalloc_measures() -> None:
    budget = 256 * 1024
    gen = torch.Generator().manual_seed(0)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        table = NgramTable(50_000, NgramConfig(max_order=4, min_order=2), budget_bytes=budget)
        for _ in range(200):
            table.observe(torch.randint(0, 50_000, (200,), generator=gen).tolist())
            assert table.nbytes <= budget
        gc.collect()
        measured = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert table.evictions > 0
    # the estimate the budget is enforced on is no smaller than what the table really holds
    assert measured <= budget, (measured, table.nbytes)
    assert table.nbytes >= 0.6 * measured


def grow_all(d: NgramDrafter) -> list:
    layers = []
    while (layer := d.plan()) is not None:
        layer.check(VOCAB)
        layers.append(layer)
    return layers


def test_ngram_drafter_grows_the_copy_and_follows_corrections() -> None:
    params = TreeParams(width=2, branch=2, max_depth=6, max_chain=6)
    d = NgramDrafter(params, VOCAB, CFG, None, max_len=512)
    text = [10, 11, 12, 13, 14, 15, 16, 17, 3, 4, 10, 11]
    d.start(text)
    layers = grow_all(d)
    assert len(layers) == 6
    mirror = TwoTierTree()
    for layer in layers:
        mirror.apply_layer(layer)
    chain = mirror.best_chain(6)
    assert list(chain.tokens) == [12, 13, 14, 15, 16, 17]
    # the target accepts 3 and says 15: a hit, the subtree below survives and regrows
    adv = mirror.apply_correction(_correction(mirror, chain, 3, 15))
    assert adv.outcome is Outcome.HIT
    d.advance(adv)
    more = grow_all(d)
    for layer in more:
        mirror.apply_layer(layer)
    assert list(mirror.best_chain(6).tokens)[:3] == [16, 17, 3]
    # a miss: the tree restarts at the virtual root of the new epoch, from the committed text
    adv = mirror.apply_correction(_correction(mirror, mirror.best_chain(6), 0, 50))
    assert adv.outcome is Outcome.MISS
    d.advance(adv)
    assert d.tree.root_id == mirror.root_id and len(d.tree) == 0
    assert grow_all(d) == []  # nothing follows 50 in this text
    d.release()


def _correction(tree: TwoTierTree, chain, accepted: int, next_token: int):
    from card.engine.shared.tree import Correction

    return Correction(tree.epoch, chain.tokens[:accepted], chain.node_ids[:accepted], next_token)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_cascade_kv_rows_and_logits_equal_plain_forwards(kind: str) -> None:
    """A self-draft over repeated text: the n-gram's continuations are the draft's own choices, so
    one forward grows several layers; every expanded node's logits and KV row equal a plain
    causal forward, before and after hits and misses."""
    model = target_model(kind)
    base = [5, 9, 2, 7, 3, 8, 1]
    run = list(generate(model, NoDraft(), base, max_new_tokens=10).tokens)
    prompt = base + run + base + run[:3]  # the draft's own continuation, seen once already
    cfg = NgramConfig(max_order=3, min_order=1, table_mb=0, lookahead=4)
    s = DraftSession(model, TreeParams(width=2, branch=2, max_depth=8), prompt, ngram=cfg)
    checked = 0
    for _ in range(3):
        if s.grow() is None:
            break
        checked += s.check_last_logits()
        s.check_kv()
    assert s.drafter.adopted > 0, "no continuation was adopted"
    assert s.drafter.forwards < s.mirror.sizes().depth, "the cascade grew no faster than one layer a forward"
    s.hit(s.random_node(min_depth=2))
    s.check_kv()
    for _ in range(2):
        if s.grow() is not None:
            checked += s.check_last_logits()
            s.check_kv()
    s.miss()
    s.check_kv()
    while s.grow() is not None:
        checked += s.check_last_logits()
        s.check_kv()
    assert checked > 10


def repetitive_cases(n: int, seed: int) -> list[tuple[list[int], int]]:
    """Prompts that repeat a phrase (so the n-gram tables have matches) and budgets."""
    gen = torch.Generator().manual_seed(seed)
    cases = []
    for _ in range(n):
        phrase = torch.randint(0, VOCAB, (int(torch.randint(3, 9, (1,), generator=gen)),), generator=gen)
        reps = int(torch.randint(2, 5, (1,), generator=gen))
        cases.append((phrase.repeat(reps).tolist(), int(torch.randint(20, 60, (1,), generator=gen))))
    return cases


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.9, top_k=20, seed=7)],
                         ids=["greedy", "seeded"])
@pytest.mark.parametrize("drafter", ["ngram", "cascade"])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_card_with_ngram_drafters_equals_vanilla(kind: str, drafter: str, sampling: SamplingParams) -> None:
    target = target_model(kind, sharp=True)  # sharp: the tiny model repeats itself, so drafts hit
    draft = None if drafter == "ngram" else draft_model(kind, "perturbed", sharp=True)
    cfg = NgramConfig(max_order=3, min_order=1, table_mb=1.0, lookahead=3)
    table = NgramTable(VOCAB, cfg, cfg.budget_bytes)
    params = TreeParams(width=3, branch=3, max_depth=12, max_chain=6)
    accepted = 0
    with card_source(draft, params, ngram=cfg, table=table) as card:
        for prompt, budget in repetitive_cases(6, seed=len(kind) + len(drafter)):
            want = generate(target, NoDraft(), prompt, max_new_tokens=budget, sampling=sampling).tokens
            run = generate(target, card, prompt, max_new_tokens=budget, sampling=sampling)
            assert run.tokens == want, f"prompt {prompt}"
            accepted += sum(run.result.stats.accepted_lengths)
    assert accepted > 0, "no drafted token was ever accepted: the test would not see a wrong one"
    assert len(table) > 0


def test_model_free_worker_soak_keeps_the_table_within_budget() -> None:
    """10,000 sessions through one model-free worker (start, corrections, stop): the shared
    table never exceeds its budget and no session is left behind."""
    cfg = NgramConfig(max_order=4, min_order=2, table_mb=0.25)
    table = NgramTable(5000, cfg, cfg.budget_bytes)
    published = []
    worker = DraftWorker(None, TreeParams(width=2, max_depth=4), lambda sid, layer: published.append(sid),
                         slots=64, max_len=4096, ngram_config=cfg, ngram=table, vocab_size=5000)
    worker.start()
    gen = torch.Generator().manual_seed(1)
    peak = 0
    try:
        for i in range(10_000):
            sid = f"s{i}"
            text = torch.randint(0, 5000, (10,), generator=gen).repeat(4).tolist()  # repeats: layers
            worker.start_session(sid, text[:30])
            if i % 500 == 0:  # now and then, let the session grow before its corrections
                assert wait_until(lambda sid=sid: sid in published)
            for epoch, t in enumerate(text[30:], start=1):
                worker.advance(sid, Advance(epoch, (), (), t, Outcome.MISS))
            worker.stop_session(sid)
            if i % 500 == 0:
                assert wait_until(lambda: worker.active_sessions == 0)
                peak = max(peak, table.nbytes)
        assert wait_until(lambda: worker.active_sessions == 0)
    finally:
        worker.close()
    assert table.evictions > 0 and 0 < max(peak, table.nbytes) <= cfg.budget_bytes
    assert published, "the worker grew nothing"


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9, seed=3)],
                         ids=["greedy", "seeded"])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_inline_ngram_card_equals_vanilla(kind: str, sampling: SamplingParams) -> None:
    """NgramCard (in-process --draft-model ngram) with one shared table across generations."""
    target = target_model(kind, sharp=True)
    cfg = NgramConfig(max_order=3, min_order=1, table_mb=1.0)
    table = NgramTable(VOCAB, cfg, cfg.budget_bytes)
    accepted = 0
    for prompt, budget in repetitive_cases(8, seed=11):
        want = generate(target, NoDraft(), prompt, max_new_tokens=budget, sampling=sampling).tokens
        card = NgramCard(TreeParams(width=3, branch=3, max_depth=24, max_chain=6), VOCAB, cfg, table, 512)
        run = generate(target, card, prompt, max_new_tokens=budget, sampling=sampling)
        assert run.tokens == want, f"prompt {prompt}"
        accepted += sum(run.result.stats.accepted_lengths)
    assert accepted > 0


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.9, top_k=20, seed=9)],
                         ids=["greedy", "seeded"])
def test_policy_card_switching_drafters_equals_vanilla(sampling: SamplingParams) -> None:
    """AutoCard (card-auto) tries the model-free drafter, then the draft model, and the drafting
    policy switches between them mid-generation: every output equals vanilla, and switches happened."""
    kind = "llama"
    target = target_model(kind, sharp=True)
    cfg = NgramConfig(max_order=3, min_order=1, table_mb=1.0)
    params = TreeParams(width=3, branch=3, max_depth=8, max_chain=4)
    switched: list[DraftKind] = []
    with card_source(draft_model(kind, "perturbed", sharp=True), params) as neural:
        for prompt, budget in repetitive_cases(6, seed=5):
            budget += 40  # long enough for a trial of each drafter and a decision
            want = generate(target, NoDraft(), prompt, max_new_tokens=budget, sampling=sampling).tokens
            ngram = NgramCard(params.with_overrides(max_depth=24), VOCAB, cfg, None, 512)
            policy = DraftingPolicy(DraftingConfig(speculation="always"), on_switch=switched.append)
            run = generate(target, AutoCard(ngram, neural), prompt, max_new_tokens=budget, sampling=sampling,
                           policy=policy)
            assert run.tokens == want, f"prompt {prompt}"
    assert len(switched) >= 6
