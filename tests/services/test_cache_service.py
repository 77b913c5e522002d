"""The cache service against a real redis-server, driven by real gRPC clients (no model needed)."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest
import redis
from click.testing import CliRunner, Result
from grpc_health.v1 import health_pb2
from prometheus_client import REGISTRY

from card.cache_service.server import REDIS_HEALTH_NAME, SERVICE_NAME, create_server
from card.client.cli import cli
from card.common.channels import health_status, wait_serving
from card.common.convert import layer_to_msg
from card.common.drafts import WORKER_ID_METADATA
from card.common.tensors import ids_to_msg
from card.engine.shared.commands import AdvanceDraft, StopDraft
from card.engine.shared.config import ChainPolicy
from card.engine.shared.stats import GenerationStats
from card.engine.shared.tree import NO_NODE, Outcome, virtual_root_id
from card.v1 import cache_pb2
from tests.services.cache_helpers import (
    FP_A,
    FP_B,
    TIMEOUT,
    Cache,
    HandTarget,
    expect_advance,
    expect_start,
    layer,
    make_config,
    rpc_error,
    start_cache,
    wait_for,
    wait_rounds,
)
from tests.services.conftest import RedisServer, free_port, running_redis

PROMPT = [1, 2, 3]


def rkeys(url: str, pattern: str) -> list[str]:
    with redis.Redis.from_url(url, decode_responses=True) as r:
        return sorted(r.scan_iter(pattern))


def rhash(url: str, key: str) -> dict[str, str]:
    with redis.Redis.from_url(url, decode_responses=True) as r:
        return r.hgetall(key)


def wait_live_record(url: str, prefix: str, sid: str) -> dict[str, str]:
    """The live record the monitor writes once the session has lived through one of its rounds."""
    wait_for(lambda: bool(rhash(url, f"{prefix}session:{sid}")), what=f"the live record of {sid}")
    return rhash(url, f"{prefix}session:{sid}")


# ---- the tree through the wire ---------------------------------------------------------------
def test_chains_outcomes_and_advances(cache: Cache) -> None:
    draft = cache.draft("d0")
    opened = cache.target.open(PROMPT)
    sid = opened.session_id
    assert opened.draft == "d0"
    start = expect_start(draft)
    assert start.session_id == sid and start.epoch == 0
    assert start.committed == tuple(PROMPT)

    root = virtual_root_id(0)
    assert draft.publish(sid, layer([root, root], [0, 1], [10, 11], [0.6, 0.3],
                                    b=[(root, 10, 0.6), (root, 11, 0.3), (root, 12, 0.1)])) == 1
    draft.publish(sid, layer([0, 0], [2, 3], [20, 21], [0.7, 0.2],
                             b=[(0, 20, 0.7), (0, 21, 0.2), (0, 22, 0.1)]))

    # next token 10 is node 0: a hit; the subtree below node 0 survives and the chain descends it
    r = cache.target.step(sid, 0, 10)
    assert r.outcome is Outcome.HIT and r.chain.epoch == 1
    assert r.chain.tokens == (20,) and r.chain.node_ids == (2,)
    adv = expect_advance(draft, sid)
    assert (adv.epoch, adv.next_token, adv.outcome, adv.hit_node_id) == (1, 10, Outcome.HIT, 0)

    draft.publish(sid, layer([2], [4], [30], [0.9], b=[(2, 30, 0.9), (2, 31, 0.05)]))
    # accepted node 2, next token 31 is only a tier-B child of node 2: secondary hit, fresh tree
    r = cache.target.step(sid, 1, 31, accepted=[20], accepted_ids=[2])
    assert r.outcome is Outcome.SECONDARY_HIT and r.chain.tokens == () and r.chain.epoch == 2
    adv = expect_advance(draft, sid)
    assert adv.outcome is Outcome.SECONDARY_HIT and adv.hit_node_id is None
    assert adv.accepted_tokens == (20,) and adv.accepted_node_ids == (2,) and adv.epoch == 2

    r = cache.target.step(sid, 2, 50)
    assert r.outcome is Outcome.MISS and r.chain.epoch == 3
    assert expect_advance(draft, sid).outcome is Outcome.MISS

    # a tier-B extension below the last chain node, then acceptance of that B token
    root3 = virtual_root_id(3)
    draft.publish(sid, layer([root3], [10], [60], [0.8], b=[(root3, 60, 0.8)]))
    draft.publish(sid, layer([], [], [], [], b=[(10, 70, 0.5), (10, 71, 0.4)]))
    r = cache.target.step(sid, 3, 60)
    assert r.outcome is Outcome.HIT and r.chain.tokens == (70,) and r.chain.node_ids == (NO_NODE,)
    expect_advance(draft, sid)
    r = cache.target.step(sid, 4, 80, accepted=[70], accepted_ids=[NO_NODE])
    assert r.outcome is Outcome.MISS and r.chain.tokens == ()
    expect_advance(draft, sid)

    info = {s.session_id: s for s in cache.target.status().sessions}[sid]
    assert info.epoch == 5 and info.draft == "d0"
    assert info.committed_tokens == len([*PROMPT, 10, 20, 31, 50, 60, 70, 80])


# "5 6 7 8 9" twice: after "... 7 8" the session's own text says "9 2 3"
REPEATING = [1, 5, 6, 7, 8, 9, 2, 3, 5, 6]


@pytest.mark.parametrize("lookup", [True, False], ids=["model-free-chains", "none"])
def test_a_step_with_no_tree_answers_from_the_sessions_own_text(redis_url: str, redis_prefix: str,
                                                                lookup: bool) -> None:
    """No worker serves the session: the chain after each step is the model-free continuation of
    its text (prompt lookup), accepted tokens land as usual; without --model-free-chains (the
    negative control) the chain stays empty."""
    c = start_cache(make_config(redis_url, redis_prefix, model_free_chains=lookup))
    try:
        sid = c.target.open(REPEATING, vocab_size=100).session_id
        r = c.target.step(sid, 0, 7)  # "... 5 6 7": then "8 9 2 3 5 6 7 8 ..." (the text repeats)
        assert r.outcome is Outcome.MISS
        assert r.chain.tokens == (((8, 9, 2, 3, 5, 6, 7) * 4)[:len(r.chain.tokens)] if lookup else ())
        if lookup:
            assert len(r.chain.tokens) >= 2 and set(r.chain.node_ids) == {NO_NODE}
            r = c.target.step(sid, 1, 3, accepted=[8, 9, 2], accepted_ids=[NO_NODE] * 3)
            assert r.chain.epoch == 2 and r.chain.tokens[:1] == (5,)
            info = {s.session_id: s for s in c.target.status().sessions}[sid]
            assert info.committed_tokens == len(REPEATING) + 5
    finally:
        c.close()


def test_an_accepted_lookup_chain_is_a_hit_on_what_the_worker_grew(redis_url: str, redis_prefix: str) -> None:
    """The worker restarts after a miss; the lookup's chain fills that step. Its tokens, accepted,
    are found in the layers the worker published meanwhile: a hit, and the worker is told the
    nodes (it keeps their KV), not a miss that throws its work away."""
    c = start_cache(make_config(redis_url, redis_prefix))
    try:
        draft = c.draft("d0")
        sid = c.target.open(REPEATING, vocab_size=100).session_id
        expect_start(draft)
        r = c.target.step(sid, 0, 7)
        assert r.chain.tokens[:2] == (8, 9) and r.chain.node_ids[0] == NO_NODE
        expect_advance(draft, sid)
        root = virtual_root_id(1)
        draft.publish(sid, layer([root], [0], [8], [0.9], b=[(root, 8, 0.9)], epoch=1))
        draft.publish(sid, layer([0], [1], [9], [0.9], b=[(0, 9, 0.9)], epoch=1))
        draft.publish(sid, layer([1], [2], [2], [0.9], b=[(1, 2, 0.9)], epoch=1))
        wait_for(lambda: {s.session_id: s for s in c.target.status().sessions}[sid].tree_nodes == 3)
        r = c.target.step(sid, 1, 2, accepted=[8, 9], accepted_ids=[NO_NODE, NO_NODE])
        assert r.outcome is Outcome.HIT
        adv = expect_advance(draft, sid)
        assert adv.outcome is Outcome.HIT and adv.accepted_node_ids == (0, 1) and adv.hit_node_id == 2
    finally:
        c.close()


def test_layers_for_pruned_parents_are_dropped(cache: Cache) -> None:
    draft = cache.draft("d0")
    sid = cache.target.open(PROMPT).session_id
    draft.next_command()
    root = virtual_root_id(0)
    draft.publish(sid, layer([root, root], [0, 1], [10, 11], [0.6, 0.4]))
    cache.target.step(sid, 0, 11)  # hit on node 1: node 0 is pruned
    draft.publish(sid, layer([0, 1], [2, 3], [20, 21], [0.9, 0.5]))  # built before the correction
    r = cache.target.step(sid, 1, 21)
    assert r.outcome is Outcome.HIT  # node 3 (under the kept node 1) survived, node 2 did not
    assert {s.session_id: s for s in cache.target.status().sessions}[sid].tree_nodes == 0


def test_malformed_layers_are_dropped_and_the_stream_goes_on(cache: Cache, caplog: pytest.LogCaptureFixture
                                                              ) -> None:
    draft = cache.draft("d0")
    sid = cache.target.open(PROMPT).session_id
    expect_start(draft)
    root = virtual_root_id(0)
    good = layer([root], [0], [10], [0.9])
    short = layer_to_msg(sid, good, draft.worker_id)
    short.tokens.CopyFrom(ids_to_msg([10, 11]))  # columns disagree in length
    torn = layer_to_msg(sid, good, draft.worker_id)
    torn.node_ids.data = torn.node_ids.data[:4]  # 4 bytes for one int64
    before = REGISTRY.get_sample_value("card_cache_layers_malformed_total") or 0.0
    with caplog.at_level(logging.WARNING, logger="cache_service"):
        received = draft.publish_msgs([short, torn, layer_to_msg(sid, good, draft.worker_id)])
    assert received == 3
    assert REGISTRY.get_sample_value("card_cache_layers_malformed_total") == before + 2
    dropped = [r for r in caplog.records if "malformed layer" in r.getMessage()]
    # one line for the stream, not one per message (a fuzzing peer must not fill the log)
    assert len(dropped) == 1 and all(r.exc_info is None and "\n" not in r.getMessage() for r in dropped)
    assert all(sid in r.getMessage() and draft.worker_id in r.getMessage() for r in dropped)
    # the good layer after them was applied
    assert {s.session_id: s for s in cache.target.status().sessions}[sid].tree_nodes == 1
    assert cache.target.step(sid, 0, 10).outcome is Outcome.HIT


# ---- per-session chain policy ----------------------------------------------------------------
def test_chain_policy_per_session(cache: Cache, redis_url: str, redis_prefix: str) -> None:
    draft = cache.draft("d0")
    short = cache.target.open(PROMPT, chain=ChainPolicy(max_chain=1)).session_id
    full = cache.target.open(PROMPT).session_id
    assert {expect_start(draft).session_id for _ in range(2)} == {short, full}
    root = virtual_root_id(0)
    for sid in (short, full):  # the same full tree, four layers deep, under both sessions
        draft.publish(sid, layer([root, root], [0, 1], [10, 11], [0.6, 0.3]))
        draft.publish(sid, layer([0, 0], [2, 3], [20, 21], [0.7, 0.2]))
        draft.publish(sid, layer([2], [4], [30], [0.9]))
        draft.publish(sid, layer([4], [5], [40], [0.9], b=[(4, 40, 0.9), (4, 41, 0.05)]))
    chains = {sid: cache.target.step(sid, 0, 10) for sid in (short, full)}
    assert all(r.outcome is Outcome.HIT for r in chains.values())
    assert len(chains[short].chain) <= 1 and chains[short].chain.tokens == (20,)
    assert chains[full].chain.tokens == (20, 30, 40)  # the cache's max_chain (8): the whole path
    assert wait_live_record(redis_url, redis_prefix, short)["max_chain"] == "1"
    assert wait_live_record(redis_url, redis_prefix, full)["max_chain"] == "8"

    open_before = len(cache.server.sessions)
    for bad, field_name in ((ChainPolicy(min_path_prob=2.0), "min_path_prob"),
                            (ChainPolicy(max_chain=-1), "max_chain")):
        err = rpc_error(cache.target.open, PROMPT, chain=bad)
        assert err.code() is grpc.StatusCode.INVALID_ARGUMENT and field_name in err.details()
    assert len(cache.server.sessions) == open_before


def test_a_rejection_session_draws_its_chains_and_sends_their_proposals(cache: Cache) -> None:
    """verify rejection: below the hit, the chain is drawn from tier B at the session's
    temperature (each session's generator seeded by its ChainDraw), and each token's
    distribution crosses the wire with it (engine.target.verify divides by it)."""
    draft = cache.draft("d0", capacity=32)
    sessions = [cache.target.open(PROMPT, draw=cache_pb2.ChainDraw(temperature=0.5, seed=s)).session_id
                for s in range(24)]
    best = cache.target.open(PROMPT).session_id
    assert {expect_start(draft).session_id for _ in range(25)} == {*sessions, best}
    root = virtual_root_id(0)
    for sid in (*sessions, best):
        draft.publish(sid, layer([root, root], [0, 1], [10, 11], [0.6, 0.3],
                                 b=[(root, 10, 0.6), (root, 11, 0.3), (root, 12, 0.1)]))
        draft.publish(sid, layer([0], [2], [20], [0.7], b=[(0, 20, 0.7), (0, 21, 0.3)]))
    r = cache.target.step(best, 0, 10)
    assert r.chain.tokens == (20,) and r.chain.proposal is None, "the best path, as before"
    q = [0.7 ** 2 / (0.7 ** 2 + 0.3 ** 2), 0.3 ** 2 / (0.7 ** 2 + 0.3 ** 2)]  # temperature 0.5
    drawn = set()
    for sid in sessions:
        r = cache.target.step(sid, 0, 10)  # a hit on node 0: its tier B is what is drawn from
        assert r.outcome is Outcome.HIT and r.chain.proposal is not None
        assert r.chain.proposal.tokens.tolist() == [[20, 21]]
        assert r.chain.proposal.probs[0].tolist() == pytest.approx(q, abs=1e-6)
        assert r.chain.node_ids == ((2,) if r.chain.tokens == (20,) else (NO_NODE,))
        drawn.add(r.chain.tokens)
    assert drawn == {(20,), (21,)}, "both tokens are drawn over 24 seeds"
    err = rpc_error(cache.target.open, PROMPT, draw=cache_pb2.ChainDraw(temperature=0.0))
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT and "temperature" in err.details()


# ---- errors ----------------------------------------------------------------------------------
def test_error_codes(cache: Cache) -> None:
    cache.draft("d-b", fingerprint=FP_B, model="other-draft-model")
    err = rpc_error(cache.target.step, "no-such-session", 0, 5)
    assert err.code() is grpc.StatusCode.NOT_FOUND and "no-such-session" in err.details()

    err = rpc_error(cache.target.open, PROMPT, draft="nobody")
    assert err.code() is grpc.StatusCode.NOT_FOUND and "nobody" in err.details()

    err = rpc_error(cache.target.open, PROMPT, fingerprint=FP_A, draft="d-b", target_model="big-target")
    assert err.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert "other-draft-model" in err.details() and "big-target" in err.details()

    err = rpc_error(cache.target.open, [])
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT

    sid = cache.target.open(PROMPT).session_id  # no draft with FP_A: opens without speculation
    assert cache.target.step(sid, 0, 7).chain.tokens == ()
    err = rpc_error(cache.target.step, sid, 0, 7)  # epoch 0 again: stale
    assert err.code() is grpc.StatusCode.ABORTED and "stale epoch" in err.details()
    err = rpc_error(cache.target.step, sid, 1, 7, accepted=[5], accepted_ids=[99])
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT

    err = rpc_error(cache.target.close_session, "no-such-session")
    assert err.code() is grpc.StatusCode.NOT_FOUND

    for name, fingerprint in (("", FP_A), ("no-fp", "")):
        err = rpc_error(cache.target.stub.RegisterDraft, cache_pb2.RegisterDraftRequest(
            name=name, model="m", tokenizer_fingerprint=fingerprint, capacity=1), timeout=TIMEOUT)
        assert err.code() is grpc.StatusCode.INVALID_ARGUMENT


# ---- worker lifecycle ------------------------------------------------------------------------
def test_worker_leaving_and_joining_mid_session(cache: Cache, redis_url: str) -> None:
    d1 = cache.draft("d1")
    sid = cache.target.open(PROMPT).session_id
    d1.next_command()
    root = virtual_root_id(0)
    d1.publish(sid, layer([root], [0], [10], [0.9]))
    d1.publish(sid, layer([0], [1], [20], [0.9]))
    r = cache.target.step(sid, 0, 9)  # miss
    assert r.chain.tokens == ()
    root1 = virtual_root_id(1)
    d1.publish(sid, layer([root1], [2], [30], [0.9]))
    d1.publish(sid, layer([2], [3], [40], [0.9]))
    r = cache.target.step(sid, 1, 8)  # miss again, at epoch 2
    root2 = virtual_root_id(2)
    d1.publish(sid, layer([root2], [4], [50], [0.9]))
    r = cache.target.step(sid, 2, 7)
    d1.publish(sid, layer([virtual_root_id(3)], [5], [60], [0.9]))
    d1.publish(sid, layer([5], [6], [61], [0.9]))
    # the target holds a chain made of the leaving worker's nodes when the worker goes
    r = cache.target.step(sid, 3, 60)
    assert r.chain.tokens == (61,)
    old_worker = d1.worker_id
    d1.leave()
    wait_for(lambda: not cache.target.status().drafts, what="the worker to be unregistered")

    # the in-flight chain is still judged against the old tree; from then on chains are empty
    r = cache.target.step(sid, 4, 70, accepted=[61], accepted_ids=[6])
    assert r.outcome is Outcome.MISS and r.chain.tokens == ()
    # a departed worker's late layers are refused with their stream (it is no longer registered)
    err = rpc_error(d1.publish, sid, layer([virtual_root_id(5)], [7], [80], [0.9]), worker_id=old_worker)
    assert err.code() is grpc.StatusCode.NOT_FOUND
    r = cache.target.step(sid, 5, 71)
    assert r.chain.tokens == ()
    info = {s.session_id: s for s in cache.target.status().sessions}[sid]
    assert info.draft == "" and info.tree_nodes == 0

    # a new worker with the same tokenizer picks the session up where it is
    d2 = cache.draft("d2")
    start = expect_start(d2)
    assert start.session_id == sid
    assert start.epoch == 6
    committed = [*PROMPT, 9, 8, 7, 60, 61, 70, 71]
    assert start.committed == tuple(committed)
    d2.publish(sid, layer([virtual_root_id(6)], [0], [90], [0.9]))
    r = cache.target.step(sid, 6, 72)
    assert r.outcome is Outcome.MISS
    d2.publish(sid, layer([virtual_root_id(7)], [1], [91], [0.9]))
    r = cache.target.step(sid, 7, 73)
    assert expect_advance(d2, sid).epoch == 7
    d2.publish(sid, layer([virtual_root_id(8)], [2], [92], [0.9]))
    d2.publish(sid, layer([2], [3], [93], [0.9]))
    r = cache.target.step(sid, 8, 92)
    assert r.outcome is Outcome.HIT and r.chain.tokens == (93,)
    assert {s.session_id: s for s in cache.target.status().sessions}[sid].draft == "d2"
    # the records of the registry: written by the monitor's store loop (no RPC waits on Redis)
    prefix = cache.server.config.redis_prefix
    wait_for(lambda: rkeys(redis_url, f"{prefix}draft:*") == [f"{prefix}draft:d2"], what="d2's record alone")


def test_named_draft_waits_for_its_worker_and_replacement(cache: Cache) -> None:
    d1 = cache.draft("named", pool="solo")
    sid = cache.target.open(PROMPT, draft="named").session_id
    d1.next_command()
    other = cache.draft("other", pool="elsewhere")  # same tokenizer, another pool
    # a second registration cannot take a live worker's name (no eviction, no name war)
    err = rpc_error(cache.draft, "named")
    assert err.code() is grpc.StatusCode.ALREADY_EXISTS and "held by a live worker" in err.details()
    assert not d1.stream_ended.is_set()
    d1.leave()  # the worker stops: its name is free for its successor
    d2 = cache.draft("named", pool="solo")
    assert expect_start(d2).session_id == sid
    assert other.no_command()
    names = sorted(d.name for d in cache.target.status().drafts)
    assert names == ["named", "other"]


def test_a_session_fails_over_inside_its_pool(cache: Cache) -> None:
    """A session that named a pool (or one worker of it) moves to a pool peer when its worker
    goes; a worker of another pool never takes it."""
    a = cache.draft("a", pool="p")
    b = cache.draft("b", pool="p")
    c = cache.draft("c", pool="q")
    by_name = cache.target.open(PROMPT, draft="a")
    by_pool = cache.target.open(PROMPT, draft="p")
    assert (by_name.draft, by_pool.draft) == ("a", "b")  # b is the pool's least loaded now
    assert expect_start(a).session_id == by_name.session_id
    a.leave()
    assert {expect_start(b).session_id for _ in range(2)} == {by_name.session_id, by_pool.session_id}
    assert {s.session_id: s.draft for s in cache.target.status().sessions}[by_name.session_id] == "b"
    assert c.no_command()  # another pool's worker never takes them


def test_unknown_pool_is_refused_and_empty_pool_waits(cache: Cache) -> None:
    cache.draft("a", pool="p")
    err = rpc_error(cache.target.open, PROMPT, draft="nope")
    assert err.code() is grpc.StatusCode.NOT_FOUND and "pools: p" in err.details()
    err = rpc_error(cache.target.open, PROMPT, draft="p", fingerprint=FP_B)
    assert err.code() is grpc.StatusCode.FAILED_PRECONDITION and "pool 'p'" in err.details()


def test_drain_moves_sessions_and_resume_takes_them_again(cache: Cache) -> None:
    a = cache.draft("a", pool="p")
    sids = [cache.target.open(PROMPT).session_id for _ in range(2)]
    assert {expect_start(a).session_id for _ in sids} == set(sids)
    b = cache.draft("b", pool="p")
    reply = cache.target.stub.Drain(cache_pb2.DrainRequest(name="a"), timeout=TIMEOUT)
    assert list(reply.workers) == ["a"] and reply.sessions_moved == 2
    assert {a.next_command().session_id for _ in sids} == set(sids)  # StopDraft, each
    assert {expect_start(b).session_id for _ in sids} == set(sids)
    status = {d.name: d for d in cache.target.status().drafts}
    assert status["a"].draining and not status["b"].draining
    # a drained worker takes nothing new, until resumed
    new = cache.target.open(PROMPT)
    assert new.draft == "b"
    cache.target.stub.Drain(cache_pb2.DrainRequest(pool="p"), timeout=TIMEOUT)
    assert cache.target.open(PROMPT).draft == ""
    resumed = cache.target.stub.Drain(cache_pb2.DrainRequest(pool="p", resume=True), timeout=TIMEOUT)
    assert list(resumed.workers) == ["a", "b"]
    assert cache.target.open(PROMPT).draft in ("a", "b")
    err = rpc_error(cache.target.stub.Drain, cache_pb2.DrainRequest(pool="nope"), timeout=TIMEOUT)
    assert err.code() is grpc.StatusCode.NOT_FOUND


def test_a_draining_heartbeat_hands_sessions_over(cache: Cache) -> None:
    """What a draft's SIGTERM sends: its sessions move, and it is told to stop each."""
    a = cache.draft("a", pool="p")
    sid = cache.target.open(PROMPT).session_id
    expect_start(a)
    b = cache.draft("b", pool="p")
    a.heartbeat(draining=True)
    assert isinstance(a.next_command(), StopDraft)
    assert expect_start(b).session_id == sid
    assert cache.target.open(PROMPT).draft == "b"


def test_default_pool_and_weights(redis_url: str) -> None:
    weights = (("stable", 3.0), ("canary", 1.0))
    cache = start_cache(make_config(redis_url, "card-weights:", pool_weights=weights))
    try:
        for name, pool in (("s", "stable"), ("c", "canary"), ("o", "other")):
            cache.draft(name, pool=pool, capacity=64)
        drafts = [cache.target.open(PROMPT).draft for _ in range(8)]
        assert drafts.count("s") == 6 and drafts.count("c") == 2  # 3:1, round robin, no drift
        assert cache.target.open(PROMPT, default_pool="other").draft == "o"
        pools = {p.name: p for p in cache.target.status().pools}
        assert pools["stable"].weight == 3.0 and pools["other"].weight == 0.0
        assert pools["stable"].active_sessions == 6 and pools["canary"].workers == 1
    finally:
        cache.close()


def test_pool_acceptance_is_counted(cache: Cache) -> None:
    d = cache.draft("d", pool="p")
    sid = cache.target.open(PROMPT).session_id
    expect_start(d)
    root = virtual_root_id(0)
    d.publish(sid, layer([root], [0], [10], [0.9]))
    d.publish(sid, layer([0], [1], [20], [0.9]))
    r = cache.target.step(sid, 0, 10)  # no chain verified yet: the target's token was in the tree
    assert r.chain.tokens == (20,)
    cache.target.step(sid, 1, 30, accepted=[20], accepted_ids=[1])
    pool = {p.name: p for p in cache.target.status().pools}["p"]
    assert pool.steps == 1 and pool.chains == 1 and pool.chain_tokens == 1
    assert pool.accepted_tokens == 1 and pool.committed_tokens == 2


def test_layer_streams_only_from_registered_workers(cache: Cache) -> None:
    d = cache.draft("d")
    stub = d.stub
    err = rpc_error(lambda: stub.PublishLayers(iter([]), timeout=TIMEOUT))
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT and "card-worker-id" in err.details()
    err = rpc_error(lambda: stub.PublishLayers(iter([]), timeout=TIMEOUT,
                                               metadata=((WORKER_ID_METADATA, "not-a-worker"),)))
    assert err.code() is grpc.StatusCode.NOT_FOUND


def test_least_loaded_worker_and_capacity(cache: Cache) -> None:
    a = cache.draft("a", capacity=1)
    sid1 = cache.target.open(PROMPT).session_id
    a.next_command()
    b = cache.draft("b", capacity=2)
    opened = [cache.target.open(PROMPT) for _ in range(2)]
    assert [o.draft for o in opened] == ["b", "b"]  # a is full
    overflow = cache.target.open(PROMPT)
    assert overflow.draft == ""  # every worker is full: no speculation
    err = rpc_error(cache.target.open, PROMPT, draft="a")
    assert err.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    cache.target.close_session(sid1)  # frees a's slot: the waiting session moves there
    assert isinstance(a.next_command(), StopDraft)
    assert expect_start(a).session_id == overflow.session_id
    assert expect_start(b).session_id == opened[0].session_id


def test_missed_heartbeats_unregister(redis_url: str, redis_prefix: str) -> None:
    c = start_cache(make_config(redis_url, redis_prefix, heartbeat_interval_s=0.2))
    try:
        d = c.draft("beats")
        quiet = c.draft("quiet")
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            d.heartbeat()
            time.sleep(0.1)
        assert quiet.stream_ended.wait(TIMEOUT)  # no heartbeat for 3 intervals: dropped
        assert [x.name for x in c.target.status().drafts] == ["beats"]
        wait_for(lambda: rkeys(redis_url, f"{redis_prefix}draft:*") == [f"{redis_prefix}draft:beats"],
                 what="the records of the live worker alone")
        err = rpc_error(quiet.heartbeat)
        assert err.code() is grpc.StatusCode.NOT_FOUND
    finally:
        c.close()


# ---- records ---------------------------------------------------------------------------------
def test_close_session_leaves_no_state(cache: Cache, redis_url: str, redis_prefix: str) -> None:
    draft = cache.draft("d0")
    sids = [cache.target.open(PROMPT).session_id for _ in range(3)]
    for _ in sids:
        draft.next_command()
    wait_for(lambda: len(rkeys(redis_url, f"{redis_prefix}session:*")) == 3, what="three live records")
    sid = sids[0]
    root = virtual_root_id(0)
    draft.publish(sid, layer([root], [0], [10], [0.9]), draft_forwards=3, draft_idle_s=0.5)
    draft.publish(sid, layer([0], [1], [11], [0.9]), draft_forwards=5, draft_idle_s=0.25)
    cache.target.step(sid, 0, 10)
    expect_advance(draft, sid)
    stats = GenerationStats(mode="card", prompt_tokens=3, new_tokens=4, target_forwards=2, hits=1)
    resp = cache.target.close_session(sid, stats)
    assert (resp.draft_forwards, resp.draft_idle_s) == (5, 0.25)
    assert draft.next_command() == StopDraft(sid)
    for other in sids[1:]:
        cache.target.close_session(other)

    assert cache.server.records.flush(TIMEOUT)  # finished records are written in the background
    assert rkeys(redis_url, f"{redis_prefix}session:*") == []
    assert len(cache.server.sessions) == 0 and cache.target.status().sessions == []
    with redis.Redis.from_url(redis_url, decode_responses=True) as r:
        record = r.hgetall(f"{redis_prefix}finished:{sid}")
        ttl = r.ttl(f"{redis_prefix}finished:{sid}")
    assert 0 < ttl <= 600
    assert record["status"] == "finished" and record["new_tokens"] == "4" and record["cache_hits"] == "1"
    assert record["draft_forwards"] == "5" and record["target_model"] == "target-model"
    totals = cache.target.status().totals
    assert totals["sessions"] == 3 and totals["hits"] == 1 and totals["new_tokens"] == 4


def test_status(cache: Cache) -> None:
    cache.draft("d0", model="smol-draft", capacity=3)
    sid = cache.target.open(PROMPT, target_model="smol-target").session_id
    st = cache.target.status()
    assert st.redis_connected and st.cache_device == "cpu"
    (d,) = st.drafts
    assert (d.name, d.model, d.tokenizer_fingerprint, d.capacity, d.active_sessions) == (
        "d0", "smol-draft", FP_A, 3, 1)
    (s,) = st.sessions
    assert (s.session_id, s.target_model, s.draft, s.epoch, s.committed_tokens) == (
        sid, "smol-target", "d0", 0, 3)


def test_live_records_are_written_once(cache: Cache, redis_url: str, redis_prefix: str) -> None:
    """OpenSession writes nothing; a session that lives through a monitor round gets its live
    record, once (Redis holds what a debugger needs, not every step's progress)."""
    sid = cache.target.open(PROMPT).session_id
    cache.target.step(sid, 0, 4)
    cache.target.step(sid, 1, 5)
    key = f"{redis_prefix}session:{sid}"
    record = wait_live_record(redis_url, redis_prefix, sid)
    assert record["status"] == "live" and record["target_model"] == "target-model"
    assert (record["epoch"], record["committed_tokens"]) == ("2", "5")
    with redis.Redis.from_url(redis_url, decode_responses=True) as r:
        assert 0 < r.ttl(key) <= 600
    cache.target.step(sid, 2, 6)
    wait_rounds(cache, 5)  # five monitor rounds: the record is not rewritten
    assert rhash(redis_url, key)["epoch"] == "2"
    cache.target.close_session(sid)
    assert cache.server.records.flush(TIMEOUT)
    assert rkeys(redis_url, f"{redis_prefix}session:*") == []
    assert rhash(redis_url, f"{redis_prefix}finished:{sid}")["epoch"] == "3"


def test_a_session_lives_by_its_targets_idle_timeout_and_keepalives(cache: Cache) -> None:
    """The cache's own timeout is 600 s; the target asks for 0.4 s: a session without Step or
    keepalive is gone within a second and its draft slot serves the next session."""
    draft = cache.draft("d0", capacity=2)
    kept = cache.target.open(PROMPT, idle_timeout_ms=400).session_id
    dead = cache.target.open(PROMPT, idle_timeout_ms=400).session_id
    assert {expect_start(draft).session_id for _ in range(2)} == {kept, dead}
    waiting = cache.target.open(PROMPT)
    assert waiting.draft == ""  # the draft is full
    deadline = time.monotonic() + 1.2
    while time.monotonic() < deadline:  # the target prefills `kept` (no Step yet) and keeps it alive
        cache.target.keepalive(kept, "no-such-session")
        time.sleep(0.1)
    live = {s.session_id for s in cache.target.status().sessions}
    assert kept in live and dead not in live
    assert draft.next_command() == StopDraft(dead)
    assert expect_start(draft).session_id == waiting.session_id  # the abandoned session's slot


def test_a_session_the_draft_drops_frees_its_place_and_is_not_offered_again(cache: Cache) -> None:
    draft = cache.draft("d0", capacity=1)
    dropped = cache.target.open(PROMPT).session_id
    assert expect_start(draft).session_id == dropped
    waiting = cache.target.open(PROMPT).session_id  # the draft is full
    stranger = cache.draft("d1", capacity=1)
    assert expect_start(stranger).session_id == waiting
    # only the worker serving the session can give it up
    drop = cache_pb2.LayerMessage(worker_id=stranger.worker_id, session_id=dropped, dropped=True)
    assert draft.publish_msgs([drop]) == 1
    assert {d.name: d.active_sessions for d in cache.target.status().drafts} == {"d0": 1, "d1": 1}
    drop.worker_id = draft.worker_id  # e.g. a prompt token outside the draft's vocabulary
    assert draft.publish_msgs([drop]) == 1
    wait_for(lambda: {d.name: d.active_sessions for d in cache.target.status().drafts} == {"d0": 0, "d1": 1},
             what="d0's capacity freed")
    assert draft.no_command()  # the session is not offered to it again
    assert cache.target.step(dropped, 0, 5).chain.tokens == ()  # it goes on, without a draft
    assert {s.session_id: s.draft for s in cache.target.status().sessions}[dropped] == ""
    fresh = cache.target.open(PROMPT)
    assert fresh.draft == "d0", fresh
    assert expect_start(draft).session_id == fresh.session_id  # a new one is


def test_abandoned_sessions_are_closed(redis_url: str, redis_prefix: str) -> None:
    c = start_cache(make_config(redis_url, redis_prefix, session_idle_timeout_s=0.5))
    try:
        draft = c.draft("d0")
        stepping = c.target.open(PROMPT).session_id
        abandoned = c.target.open(PROMPT).session_id
        assert {expect_start(draft).session_id for _ in range(2)} == {stepping, abandoned}
        deadline = time.monotonic() + 1.5
        epoch = 0
        while time.monotonic() < deadline:  # one target keeps stepping, the other died
            epoch = c.target.step(stepping, epoch, 5).chain.epoch
            time.sleep(0.1)
        assert [s.session_id for s in c.target.status().sessions] == [stepping]
        commands: list = []

        def all_delivered() -> bool:
            while not draft.commands.empty():
                commands.append(draft.next_command())
            kinds = [type(x) for x in commands]
            return kinds.count(AdvanceDraft) == epoch and StopDraft in kinds

        wait_for(all_delivered, what="every advance and the stop")
        assert [x for x in commands if isinstance(x, StopDraft)] == [StopDraft(abandoned)]
        assert c.server.records.flush(TIMEOUT)
        with redis.Redis.from_url(redis_url, decode_responses=True) as r:
            assert r.hget(f"{redis_prefix}finished:{abandoned}", "status") == "abandoned"
            assert not r.exists(f"{redis_prefix}session:{abandoned}")
    finally:
        c.close()


# ---- Redis's health is its own --------------------------------------------------------------
def test_redis_health_is_its_own_name(redis_prefix: str) -> None:
    """Redis down: its health name (card.v1.CacheService.redis) says NOT_SERVING; the cache's own
    ("" and card.v1.CacheService, which the probes ask) stays SERVING: no request needs Redis."""
    with running_redis() as own:
        c = start_cache(make_config(own.url, redis_prefix))
        try:
            live = c.target.open(PROMPT, target_model="kept-target").session_id
            assert health_status(c.addr) == "SERVING"
            assert health_status(c.addr, SERVICE_NAME) == "SERVING"
            assert health_status(c.addr, REDIS_HEALTH_NAME) == "SERVING"
            port = own.port
            own.stop()
            wait_for(lambda: health_status(c.addr, REDIS_HEALTH_NAME) == "NOT_SERVING", what="NOT_SERVING")
            assert health_status(c.addr) == health_status(c.addr, SERVICE_NAME) == "SERVING"
            assert not c.target.status().redis_connected
            # sessions do not wait for Redis: one opens, steps and closes while it is down
            down = c.target.open(PROMPT).session_id
            c.target.step(down, 0, 5)
            c.target.close_session(down)
            again: RedisServer
            with running_redis(port) as again:
                assert again.port == port
                wait_for(lambda: health_status(c.addr, REDIS_HEALTH_NAME) == "SERVING", what="SERVING again")
                assert c.target.open(PROMPT).session_id
                # the restarted Redis lost every record; the live session's is written again
                key = f"{redis_prefix}session:{live}"
                wait_for(lambda: again.client().hget(key, "target_model") == "kept-target",
                         what="the live record to be rewritten")
                assert again.client().hget(key, "status") == "live"
        finally:
            c.close()


# ---- the entry point as a user runs it -------------------------------------------------------
def _card_cache(*args: str, **env_vars: str) -> subprocess.Popen:
    exe = os.path.join(os.path.dirname(sys.executable), "card-cache")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CARD_")} | env_vars
    return subprocess.Popen([exe, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def test_card_cache_process(redis_url: str, redis_prefix: str) -> None:
    metrics_port = free_port()
    # settings by flag and by CARD_CACHE_<OPTION> variable alike
    proc = _card_cache("--port", "0", "--metrics-port", str(metrics_port), "--device", "cpu", "--json-logs",
                       CARD_CACHE_REDIS_URL=redis_url, CARD_CACHE_REDIS_PREFIX=redis_prefix,
                       CARD_CACHE_MIN_PATH_PROB="0.25")
    try:
        line = proc.stdout.readline().strip()
        assert line.startswith("card-cache listening on 127.0.0.1:"), line
        addr = line.rsplit(" ", 1)[1]
        wait_serving(addr, TIMEOUT)
        target = HandTarget(addr)
        sid = target.open(PROMPT).session_id
        target.step(sid, 0, 5)
        target.close()
        record = wait_live_record(redis_url, redis_prefix, sid)  # the CPU default under the flag
        assert (record["max_chain"], record["min_path_prob"], record["b_extension"]) == ("6", "0.25", "1")
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=TIMEOUT) as resp:
            exposition = resp.read().decode()
        assert "card_cache_steps_total 1.0" in exposition
        assert 'card_cache_outcomes_total{outcome="miss"} 1.0' in exposition
        assert "card_cache_sessions_open 1.0" in exposition
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        logs = [json.loads(x) for x in proc.stderr.read().splitlines() if x.strip()]
        assert logs and all({"ts", "level", "logger", "msg"} <= set(entry) for entry in logs)
        assert any(entry.get("session_id") == sid for entry in logs)
        # the session still open at shutdown was ended cleanly
        assert rkeys(redis_url, f"{redis_prefix}session:*") == []
        with redis.Redis.from_url(redis_url, decode_responses=True) as r:
            assert r.hget(f"{redis_prefix}finished:{sid}", "status") == "shutdown"
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        proc.stdout.close()
        proc.stderr.close()


def test_a_restarted_cache_retires_live_records_of_a_killed_one(redis_url: str, redis_prefix: str) -> None:
    """SIGKILL leaves the session's live record behind; the next cache on the prefix retires it at
    start (abandoned), instead of it staying 'live' for a day."""
    procs = []
    try:
        for _ in range(2):
            proc = _card_cache("--port", "0", "--metrics-port", "0", "--device", "cpu",
                               CARD_CACHE_REDIS_URL=redis_url, CARD_CACHE_REDIS_PREFIX=redis_prefix)
            procs.append(proc)
            line = proc.stdout.readline().strip()
            addr = line.rsplit(" ", 1)[1]
            wait_serving(addr, TIMEOUT)
            if len(procs) == 1:
                target = HandTarget(addr)
                sid = target.open(PROMPT).session_id
                target.close()
                wait_live_record(redis_url, redis_prefix, sid)  # it lived through a monitor round
                proc.kill()
                proc.wait(10)
                assert rkeys(redis_url, f"{redis_prefix}session:*") == [f"{redis_prefix}session:{sid}"]
        assert rkeys(redis_url, f"{redis_prefix}session:*") == []
        with redis.Redis.from_url(redis_url, decode_responses=True) as r:
            assert r.hget(f"{redis_prefix}finished:{sid}", "status") == "abandoned"
            assert r.ttl(f"{redis_prefix}finished:{sid}") > 0
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)
            proc.stdout.close()
            proc.stderr.close()


def test_card_cache_help_names_its_variables() -> None:
    proc = _card_cache("--help")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0
    for option in ("PORT", "REDIS_URL", "MIN_PATH_PROB", "LOG_LEVEL"):
        assert f"CARD_CACHE_{option}" in out, option
    assert "CARD_REDIS_URL" not in out and "CARD_METRICS_PORT" not in out


@pytest.mark.parametrize(("args", "env", "expected"), [
    (("--port", "70000"), {}, "card-cache: INVALID_ARGUMENT: port must be in [0, 65535], got 70000"),
    ((), {"CARD_CACHE_REDIS_URL": "http://nowhere"}, "card-cache: INVALID_ARGUMENT: redis URL must start"),
    (("--device", "tpu:9"), {}, "card-cache: INVALID_ARGUMENT: unknown device 'tpu:9'"),
], ids=["port", "redis-url", "device"])
def test_card_cache_startup_errors_are_one_line(args: tuple[str, ...], env: dict[str, str],
                                                expected: str) -> None:
    proc = _card_cache("--metrics-port", "0", *args, **env)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith(expected), err


def test_card_cache_without_redis() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    proc = _card_cache("--port", "0", "--redis-url", url, "--metrics-port", "0")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and out == ""
    assert url in err and "--allow-memory-fallback" in err and "Traceback" not in err
    assert err.splitlines()[-1].startswith("card-cache: UNAVAILABLE: ")

    proc = _card_cache("--port", "0", "--redis-url", url, "--metrics-port", "0", "--allow-memory-fallback")
    try:
        line = proc.stdout.readline().strip()
        addr = line.rsplit(" ", 1)[1]
        wait_serving(addr, TIMEOUT)
        with grpc.insecure_channel(addr) as ch:
            from grpc_health.v1 import health_pb2_grpc

            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert "falling back to the in-process metadata store" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        proc.stdout.close()
        proc.stderr.close()


def test_port_conflict_fails_at_startup(cache: Cache) -> None:
    from card.engine.shared.errors import InvalidArgument

    config = cache.server.config
    with pytest.raises(InvalidArgument, match="cannot listen on"):
        create_server(cache.addr, config)


def test_step_batch_answers_each_session_on_its_own(cache: Cache) -> None:
    """One StepBatch round trip for several sessions: each result is what its own Step would
    have returned; an unknown session's NOT_FOUND and a stale epoch's ABORTED leave the rest be."""
    from card.common.convert import correction_to_msg, step_result_from_msg
    from card.engine.shared.tree import Correction

    draft = cache.draft("d0")
    a = cache.target.open(PROMPT).session_id
    b = cache.target.open(PROMPT).session_id
    for sid in (a, b):
        assert expect_start(draft).session_id in (a, b)
        root = virtual_root_id(0)
        draft.publish(sid, layer([root], [0], [10], [0.6], b=[(root, 10, 0.6)]))
        draft.publish(sid, layer([0], [1], [20], [0.7], b=[(0, 20, 0.7)]))
    request = cache_pb2.StepBatchRequest(steps=[
        correction_to_msg(a, Correction(0, (), (), 10)),   # hit on node 0
        correction_to_msg("nobody", Correction(0, (), (), 10)),
        correction_to_msg(b, Correction(5, (), (), 10)),   # stale epoch
    ])
    reply = cache.target.stub.StepBatch(request, timeout=TIMEOUT)
    kinds = [r.WhichOneof("result") for r in reply.results]
    assert kinds == ["ok", "error", "error"]
    ok = step_result_from_msg(reply.results[0].ok)
    assert ok.outcome is Outcome.HIT and ok.chain.tokens == (20,)
    assert reply.results[1].error.code == grpc.StatusCode.NOT_FOUND.value[0]
    assert reply.results[2].error.code == grpc.StatusCode.ABORTED.value[0]
    # b was untouched by its failed step: its own Step at the right epoch still hits
    assert cache.target.step(b, 0, 10).outcome is Outcome.HIT


def test_card_client_drafts_drain_and_weights(cache: Cache) -> None:
    """The operator's commands, run as a user runs them, against the real cache."""
    a = cache.draft("a", pool="stable")
    cache.draft("b", pool="canary")
    sid = cache.target.open(PROMPT, draft="stable").session_id
    expect_start(a)

    runner = CliRunner()

    def client(*args: str) -> Result:  # card-client's own command, in this process (no start-up cost)
        return runner.invoke(cli, ["drafts", *args, "--cache", cache.addr])

    shown = client()
    assert shown.exit_code == 0, shown.output
    pools = {line.split()[0]: line.split() for line in shown.stdout.splitlines()[1:3]}
    assert set(pools) == {"canary", "stable"} and pools["stable"][3] == "1/4"  # sessions/capacity
    assert "serving" in shown.stdout and "tok/s" in shown.stdout
    weighted = client("weights", "stable=90,canary=10")
    assert weighted.exit_code == 0 and "canary=10, stable=90" in weighted.stdout
    assert {p.name: p.weight for p in cache.target.status().pools} == {"canary": 10.0, "stable": 90.0}
    bad = client("weights", "stable=-1")
    assert bad.exit_code == 2 and "must be >= 0" in bad.stderr
    drained = client("drain", "--pool", "stable")
    assert drained.exit_code == 0 and "drained a; 0 live session(s) moved" in drained.stdout
    assert isinstance(a.next_command(), StopDraft)  # its session was stopped there
    assert {s.session_id: s.draft for s in cache.target.status().sessions}[sid] == ""  # no stable peer
    assert "draining" in client().stdout
    assert client("resume", "a").exit_code == 0
    assert expect_start(a).session_id == sid  # the waiting session takes it again
    missing = client("drain", "nobody")
    assert missing.exit_code == 2 and "NOT_FOUND" in missing.stderr
