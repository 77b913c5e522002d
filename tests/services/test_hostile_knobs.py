"""Hostile callers with huge knobs, against real services (a cache server in this process over a
real redis-server, card-target as a user starts it, real gRPC clients on loopback):

- ``max_chain`` 1,000,000 on Generate is refused (INVALID_ARGUMENT) while the cache's Status keeps
  answering within 2 s; at the cap (MAX_CHAIN) the same request generates;
- a raw cache client: OpenSession with ``max_chain`` 1,000,000 is refused; at the cap the
  model-free lookup of a repeating prompt stops at MAX_CHAIN tokens; a Step that would grow the
  session's text past its context window, or by a token outside its vocabulary, is refused, and
  the session goes on;
- a slow Step holding one session's lock stalls neither OpenSession, Status nor the Steps of other
  sessions, and a CloseSession waiting for that lock holds no other lock meanwhile;
- a draft that floods a session with full-size layers fills that tree to its bound, no further:
  the excess is counted, and that session's Step and every other's stay fast;
- a cache that stops reading a draft's layers: the draft's queue of them stops at its bound.

Every wait is bounded; each bound has its control (the same call within it goes through).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from prometheus_client import REGISTRY

from card.client.remote import build_request
from card.common.channels import channel
from card.common.convert import layer_to_msg
from card.common.tensors import ids_from_msg
from card.draft_service.config import DraftConfig
from card.draft_service.link import MAX_QUEUED_LAYERS, CacheLink, _Connection
from card.engine.draft.worker import DraftWorker
from card.engine.loading.models import ModelConfig
from card.engine.shared.config import (
    MAX_CHAIN,
    ChainPolicy,
    DrafterKind,
    NgramConfig,
    SamplingParams,
    StopParams,
    TreeParams,
)
from card.engine.shared.tree import MAX_LAYER_NODES, MAX_TREE_NODES, NO_NODE, virtual_root_id
from card.v1 import target_pb2, target_pb2_grpc
from tests.engine.test_bounds import flat_layer
from tests.services.cache_helpers import (
    TIMEOUT,
    Cache,
    expect_start,
    make_config,
    rpc_error,
    start_cache,
    wait_for,
)
from tests.services.test_target_auth import Target, serving, start_target
from tests.tiny_models import save_tiny_checkpoint

STATUS_BOUND_S = 2.0
REPEATING = [5, 6, 7, 8] * 16  # a text whose continuation never ends: the lookup would loop


def timed(fn, *args, **kw) -> float:
    started = time.perf_counter()
    fn(*args, **kw)
    return time.perf_counter() - started


# ---- a raw cache client -----------------------------------------------------------------------------
def test_open_session_refuses_a_huge_max_chain_and_the_lookup_stops_at_the_cap(cache: Cache) -> None:
    target = cache.target
    err = rpc_error(target.open, REPEATING, chain=ChainPolicy(max_chain=1_000_000), vocab_size=100)
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert f"max_chain must be in [0, {MAX_CHAIN}], got 1000000" in err.details()
    # control: at the cap the session opens, and its model-free chain is MAX_CHAIN long, no more
    sid = target.open(REPEATING, chain=ChainPolicy(max_chain=MAX_CHAIN), vocab_size=100).session_id
    result = target.step(sid, 0, 5)
    assert len(result.chain.tokens) == MAX_CHAIN
    assert list(result.chain.tokens) == (REPEATING * 4)[len(REPEATING) + 1:len(REPEATING) + 1 + MAX_CHAIN]
    assert timed(target.status) < STATUS_BOUND_S


def test_a_step_past_the_context_window_or_the_vocabulary_is_refused(cache: Cache) -> None:
    """...and the session goes on."""
    target = cache.target
    sid = target.open([1, 2, 3], vocab_size=100, context_window=16).session_id
    other = target.open([1, 2, 3], vocab_size=100, context_window=16).session_id
    err = rpc_error(target.step, sid, 0, 9, accepted=[4] * 13, accepted_ids=[NO_NODE] * 13)  # 3 + 14 > 16
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT and "context window 16" in err.details()
    # control: what fits goes through, in the same session, at the same epoch, and in another
    assert target.step(sid, 0, 9, accepted=[4] * 12, accepted_ids=[NO_NODE] * 12).chain.epoch == 1
    assert target.step(other, 0, 9).chain.epoch == 1
    err = rpc_error(target.step, sid, 1, 9)  # 16 tokens already: no room for one more
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT
    err = rpc_error(target.step, other, 1, 100)  # outside the vocabulary of 100
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT and "vocabulary" in err.details()
    assert target.step(other, 1, 99).chain.epoch == 2  # control: the session goes on


def test_a_slow_step_stalls_no_other_session_and_a_close_waiting_for_it_holds_no_lock(cache: Cache) -> None:
    """A session whose lock a slow Step holds (held here by the test) is closed meanwhile: the
    close waits for that lock alone, so OpenSession, Status and the Steps of other sessions answer
    at once. (Holding the table lock while waiting for the session's, as a close once did, would
    stall them all until the slow Step ended.)"""
    target = cache.target
    slow = target.open([1, 2, 3], vocab_size=100).session_id
    other = target.open([1, 2, 3], vocab_size=100).session_id
    session = cache.server.sessions.get(slow)
    held, release = threading.Event(), threading.Event()

    def slow_step() -> None:
        with session.lock:
            held.set()
            release.wait(30)

    with ThreadPoolExecutor(4) as pool:
        stepping = pool.submit(slow_step)
        assert held.wait(TIMEOUT)
        try:
            closing = pool.submit(target.close_session, slow)
            wait_for(lambda: slow not in {s.session_id for s in cache.server.sessions.sessions()},
                     what="the close to take the session out of the table")
            assert not closing.done()  # control: it waits for the slow session's lock
            for call in (lambda: target.open([4, 5, 6], vocab_size=100), target.status,
                         lambda: target.step(other, 0, 9)):
                assert timed(call) < STATUS_BOUND_S
            assert not closing.done()  # all of that while the close still waited
        finally:
            release.set()
        stepping.result(TIMEOUT)
        closing.result(TIMEOUT)
    assert rpc_error(target.step, slow, 0, 9).code() is grpc.StatusCode.NOT_FOUND


def _dropped(why: str) -> float:
    return REGISTRY.get_sample_value("card_cache_tree_entries_dropped_total",
                                     {"kind": "node", "why": why}) or 0.0


def test_a_flooding_draft_fills_its_session_tree_to_the_bound_and_steps_stay_fast(cache: Cache) -> None:
    draft = cache.draft("flood", capacity=4)
    target = cache.target
    flooded = target.open([1, 2, 3], vocab_size=100_000).session_id
    start = expect_start(draft)
    assert start.session_id == flooded
    quiet = target.open([1, 2, 3], vocab_size=100_000).session_id
    start_quiet = expect_start(draft)
    before = _dropped("session")
    ids = iter(range(10**6, 10**9))
    frontier = [virtual_root_id(start.epoch)]
    msgs = []
    for i in range(8):  # 8 x 1024 nodes, 16 tier-B entries under each: twice the tree's bound
        parents = [frontier[j % len(frontier)] for j in range(MAX_LAYER_NODES)]
        nodes = [next(ids) for _ in parents]
        b = [p for p in dict.fromkeys(parents) for _ in range(16)]
        msgs.append(layer_to_msg(flooded, flat_layer(parents, nodes, b_parents=b, seed=i), draft.worker_id))
        frontier = nodes
    assert draft.publish_msgs(msgs) == len(msgs)
    # control: a small layer in the other session is kept whole
    draft.publish_msgs([layer_to_msg(quiet, flat_layer([virtual_root_id(start_quiet.epoch)] * 3, [1, 2, 3]),
                                     draft.worker_id)])
    nodes = {s.session_id: s.tree_nodes for s in target.status().sessions}
    assert nodes[flooded] == MAX_TREE_NODES and nodes[quiet] == 3
    # the fifth layer is dropped past the bound (and counted); the later ones hang under its nodes,
    # which the tree never held
    assert _dropped("session") - before == MAX_LAYER_NODES
    took = [timed(target.step, flooded, 0, 99_999), timed(target.step, quiet, 0, 99_999)]
    assert max(took) < 0.5, f"Steps took {took}"


# ---- card-target, as a user starts it ---------------------------------------------------------------
@pytest.fixture(scope="module")
def target_with_cache(redis_url: str, tmp_path_factory: pytest.TempPathFactory
                      ) -> Iterator[tuple[Target, Cache]]:
    tmp = Path(tmp_path_factory.mktemp("knobs"))
    cache = start_cache(make_config(redis_url, f"knobs-{time.monotonic_ns()}:"))
    model = str(save_tiny_checkpoint(tmp / "target", seed=0))
    target = start_target(tmp / "logs", "--model", model, "--http-port", "0", "--cache", cache.addr,
                          "--speculation", "always")
    try:
        yield serving(target), cache
    finally:
        target.stop()
        cache.close()


@pytest.mark.slow
def test_generate_with_max_chain_a_million_is_refused_while_the_cache_answers(target_with_cache) -> None:
    target, cache = target_with_cache
    status_s: list[float] = []
    done = threading.Event()

    def poll_status() -> None:
        while not done.wait(0.05):
            status_s.append(timed(cache.target.status))

    def generate(max_chain: int) -> list[target_pb2.GenerateResponse]:
        request = build_request(REPEATING, chat=False, sampling=SamplingParams(),
                                stop=StopParams(max_new_tokens=12, ignore_eos=True), draft=None, mode="card",
                                chain=ChainPolicy(max_chain=max_chain))
        with channel(target.grpc_addr) as ch:
            return list(target_pb2_grpc.TargetServiceStub(ch).Generate(request, timeout=120))

    poller = threading.Thread(target=poll_status, daemon=True)
    poller.start()
    try:
        with pytest.raises(grpc.RpcError) as err:
            generate(1_000_000)
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert f"max_chain must be in [0, {MAX_CHAIN}], got 1000000" in err.value.details()
        # control: at the cap the request generates (the cache's lookup chains, no draft worker)
        final = generate(MAX_CHAIN)[-1].final
        assert final.finish_reason == "length" and len(ids_from_msg(final.token_ids)) == 12
        wait_for(lambda: len(status_s) >= 3, what="the cache's Status answers")
    finally:
        done.set()
        poller.join(TIMEOUT)
    assert max(status_s) < STATUS_BOUND_S, f"the cache's Status took up to {max(status_s):.2f}s"


# ---- the draft worker's layer queue -----------------------------------------------------------------
def test_a_cache_that_stops_reading_layers_never_grows_the_drafts_queue_past_its_bound() -> None:
    """The layers waiting for the PublishLayers stream are at most MAX_QUEUED_LAYERS: past them a
    layer is dropped and counted (its session goes on; the cache's tree only lacks it)."""
    config = DraftConfig(cache_addr="127.0.0.1:1", model=ModelConfig("ngram"), name="stalled",
                         drafter=DrafterKind.NGRAM, ngram=NgramConfig(table_mb=0.0), tokenizer="unused",
                         capacity=2)

    def build(publish, on_forward, on_drop):  # type: ignore[no-untyped-def]
        return DraftWorker.of_kind(DrafterKind.NGRAM, None, TreeParams(), publish, ngram_config=config.ngram,
                                   slots=2, max_len=256, vocab_size=1000, name=config.name), "fp"

    link = CacheLink(config, build)  # never started: a registration whose stream takes nothing
    conn = link._conn = _Connection("worker-1", 1.0)
    link._sessions.add("s")
    sample = lambda name: REGISTRY.get_sample_value(f"card_draft_layers_{name}_total") or 0.0  # noqa: E731
    published, dropped = sample("published"), sample("dropped")
    one = flat_layer([virtual_root_id(0)], [0])
    for _ in range(MAX_QUEUED_LAYERS + 5):
        link._publish("s", one)
    assert conn.layers.qsize() == MAX_QUEUED_LAYERS
    assert sample("published") - published == MAX_QUEUED_LAYERS  # control: those went in
    assert sample("dropped") - dropped == 5
