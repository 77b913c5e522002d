"""A session that opens after its generation moved on (a fast target, a slow cache) catches up in
its first Step instead of being thrown away: the tokens committed meanwhile reach the cache as a
path the tree never held (a miss), the draft is told them, and the session serves from then on.
The cache is a real in-process server; the draft is driven by hand."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from prometheus_client import REGISTRY

from card.engine.shared.stats import GenerationStats
from card.engine.shared.tree import NO_NODE, Correction, Outcome
from card.target_service.cache_link import CacheClient, CacheTarget
from card.target_service.remote_card import RemoteCard
from card.v1 import cache_pb2_grpc
from tests.services.cache_helpers import (
    FP_A,
    Cache,
    expect_advance,
    expect_start,
    make_config,
    start_cache,
    wait_for,
)


@pytest.fixture
def cache(redis_url: str, redis_prefix: str) -> Iterator[Cache]:
    c = start_cache(make_config(redis_url, redis_prefix))
    yield c
    c.close()


def _catch_ups() -> float:
    return REGISTRY.get_sample_value("card_target_session_catch_ups_total") or 0.0


def test_a_late_open_catches_up_with_the_text_committed_meanwhile(cache: Cache) -> None:
    draft = cache.draft("d0")
    with grpc.insecure_channel(cache.addr) as ch:
        link = CacheClient(cache_pb2_grpc.CacheServiceStub(ch),
                         CacheTarget(cache.addr, "target-model", FP_A, vocab_size=1000))
        committed = [1, 2, 3]
        source = RemoteCard(link)
        source.open(committed)  # at admission, the prompt
        opening = source._opening
        assert opening is not None
        wait_for(opening.done, what="the OpenSession answer")
        # meanwhile the target committed 5 tokens with plain steps (the last is this step's)
        committed += [40, 41, 42, 43, 44]
        before = _catch_ups()
        result = source.step(Correction(0, (), (), 44))
        assert source.session_id, "the late session was kept"
        # the cache counts the catch-up as a miss; the target's stats get no verdict from it (no
        # chain of this session was judged)
        assert result.chain.epoch == 1 and result.outcome is None
        assert _catch_ups() == before + 1
        assert list(expect_start(draft).committed) == [1, 2, 3]
        advance = expect_advance(draft, source.session_id)
        assert advance.accepted_tokens == (40, 41, 42, 43) and advance.next_token == 44
        assert advance.accepted_node_ids == (NO_NODE,) * 4
        info = {s.session_id: s for s in cache.target.status().sessions}[source.session_id]
        assert info.committed_tokens == len(committed) and info.epoch == 1
        # and it goes on as any session: the next step is an ordinary correction
        committed.append(45)
        again = source.step(Correction(1, (), (), 45))
        assert again.chain.epoch == 2 and again.outcome is Outcome.MISS  # an ordinary verdict again
        assert _catch_ups() == before + 1
        stats = source.close(GenerationStats())
        assert len(stats.step_rtt_ms) == 2


@pytest.mark.parametrize("after_prefill", [True, False])
def test_after_prefill_the_session_opens_with_the_first_step(cache: Cache, after_prefill: bool) -> None:
    """card-target --draft-after-prefill (the default): admission sends nothing, so the draft does
    not prefill the prompt beside the target; the generation's first Step (its prompt prefilled,
    its first token committed) opens the session at the text so far, and it serves from then on.
    Without it (the control) the open goes at admission."""
    draft = cache.draft("d0")
    with grpc.insecure_channel(cache.addr) as ch:
        link = CacheClient(cache_pb2_grpc.CacheServiceStub(ch),
                           CacheTarget(cache.addr, "target-model", FP_A, vocab_size=1000,
                                       open_after_prefill=after_prefill))
        committed = [1, 2, 3]
        source = RemoteCard(link)
        source.open(committed)
        if after_prefill:
            assert source._opening is None and not cache.target.status().sessions
            committed.append(7)  # the prefill's token
            first = source.step(Correction(0, (), (), 7))
            assert first.chain.tokens == () and first.outcome is None  # plain while it opens
            opening = source._opening
            assert opening is not None
            wait_for(opening.done, what="the OpenSession answer")
            assert list(expect_start(draft).committed) == [1, 2, 3, 7]
            committed.append(8)
            source.step(Correction(0, (), (), 8))  # the open answered: this Step takes the session
        else:
            opening = source._opening
            assert opening is not None
            wait_for(opening.done, what="the OpenSession answer")
            assert list(expect_start(draft).committed) == [1, 2, 3]
            committed.append(7)
            source.step(Correction(0, (), (), 7))
        assert source.session_id
        info = {s.session_id: s for s in cache.target.status().sessions}[source.session_id]
        assert info.committed_tokens == len(committed)
        source.close(GenerationStats())
