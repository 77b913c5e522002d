"""Session records stay bounded and off the session RPCs (real redis-server processes, real gRPC).

Redis is run under a memory cap (here 20 MB, ``noeviction``: the strictest policy; deploy/ runs
``allkeys-lru``): records must not fill it, a Redis that refuses writes for memory must show on the
cache's Redis health name (one log line) while the cache's own health stays SERVING, and no
OpenSession / CloseSession may wait on (or fail for) Redis.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import threading
import time
from collections.abc import Iterator

import grpc
import pytest
import redis
from prometheus_client import REGISTRY

from card.cache_service.config import CacheConfig
from card.cache_service.records import HIST_CAP, FinishedRecord, RecordWriter, accepted_length_hist
from card.cache_service.server import REDIS_HEALTH_NAME, SERVICE_NAME
from card.cache_service.store import RedisStore
from card.common.channels import health_status
from card.common.convert import correction_to_msg, stats_to_msg
from card.common.tensors import ids_to_msg
from card.engine.shared.errors import CardError
from card.engine.shared.stats import GenerationStats
from card.engine.shared.tree import Correction
from card.v1 import cache_pb2
from tests.services.cache_helpers import (
    TIMEOUT,
    Cache,
    HandDraft,
    HandTarget,
    make_config,
    start_cache,
    wait_for,
    wait_rounds,
)
from tests.services.conftest import RedisServer, running_redis

PROMPT = [1, 2, 3]
MAXMEMORY = 20 * 2**20
SESSIONS = 5000
FORWARDS = 80  # per session: a short answer's (~200 tokens) accepted lengths and step round trips
OOM_LINE = "is out of memory"


def capped_redis(server: RedisServer) -> None:
    """The deploy/ policy at a test's scale: noeviction under a memory cap."""
    with server.client() as r:
        r.config_set("maxmemory", MAXMEMORY)
        r.config_set("maxmemory-policy", "noeviction")


def used_memory(server: RedisServer) -> int:
    with server.client() as r:
        return int(r.info("memory")["used_memory"])


def short_answer_stats(rng: random.Random, forwards: int = FORWARDS) -> GenerationStats:
    lengths = [rng.randint(1, 5) for _ in range(forwards)]
    return GenerationStats(mode="card", prompt_tokens=len(PROMPT), new_tokens=sum(lengths), wall_s=1.25,
                           prefill_s=0.05, target_forwards=forwards, hits=forwards // 2, misses=forwards // 4,
                           step_rtt_ms=[rng.uniform(0.2, 3.0) for _ in range(forwards)],
                           accepted_lengths=lengths)


def oom_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name.endswith("monitor") and OOM_LINE in r.getMessage()]


def back_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name.endswith("monitor") and "takes writes again" in r.getMessage()]


def health(cache: Cache) -> str:
    """The cache's own health: the overall status and the service's, which must agree."""
    service, overall = health_status(cache.addr, SERVICE_NAME), health_status(cache.addr)
    assert service == overall, f"health: the service says {service}, the server {overall}"
    return service


def store_health(cache: Cache) -> str:
    """Redis's state as the cache reports it, on a health name of its own."""
    return health_status(cache.addr, REDIS_HEALTH_NAME)


@pytest.fixture
def capped() -> Iterator[RedisServer]:
    with running_redis() as server:
        capped_redis(server)
        yield server


@pytest.mark.timeout(180)
def assert_opens_or_not_serving(cache: Cache, caplog: pytest.LogCaptureFixture) -> str:
    """The cache is SERVING and opens a session, whatever Redis does; Redis's health name says
    SERVING, or NOT_SERVING with the reason logged (once). Returns the opened session ("" if none)."""
    state, store = health(cache), store_health(cache)
    try:
        opened, error = cache.target.open(PROMPT).session_id, ""
    except grpc.RpcError as err:
        opened, error = "", f"{err.code()}: {err.details()}"
    assert state == "SERVING" and opened, f"{state}; OpenSession: {error or 'ok'}"
    if store != "SERVING":
        assert store == "NOT_SERVING" and len(oom_lines(caplog)) == 1, (store, oom_lines(caplog))
    return opened


def test_5000_short_sessions_do_not_fill_a_capped_redis(capped: RedisServer, redis_prefix: str,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    """5,000 short sessions (each closed with the stats of 80 target forwards) through a cache on a
    Redis capped at 20 MB: afterwards the cache still opens sessions and says SERVING, or says
    NOT_SERVING with the reason logged; never SERVING while opens fail. (With per-forward lists
    in the records, Redis ran out of memory near session 4,200: OpenSession failed with
    UNAVAILABLE while the cache said SERVING.)"""
    before = used_memory(capped)
    cache = start_cache(make_config(capped.url, redis_prefix))
    try:
        table = cache.server.sessions
        rng = random.Random(0)
        t0 = time.perf_counter()
        with caplog.at_level(logging.INFO):
            for i in range(SESSIONS):  # in process, for speed: the servicer only decodes around these
                try:
                    sid = table.open(PROMPT, "fp-records", "target-model").session_id
                except CardError as exc:  # the invariant must hold the moment opens fail
                    wait_rounds(cache, 3)
                    assert_opens_or_not_serving(cache, caplog)
                    pytest.fail(f"session {i}: OpenSession failed: {exc}")
                for epoch in range(3):
                    table.step(sid, Correction(epoch, (), (), 5))
                table.close(sid, short_answer_stats(rng))
            wait_rounds(cache, 3)  # monitor rounds probe the store after the last close
            opened = assert_opens_or_not_serving(cache, caplog)

            # records are bounded: they all fit, Redis never refused a write, each is there
            writer = cache.server.records
            assert writer.flush(60.0)
            elapsed = time.perf_counter() - t0
            assert writer.written + writer.failed + writer.dropped == SESSIONS
            grown = used_memory(capped) - before
            print(f"\n{SESSIONS} sessions in {elapsed:.1f}s: records written {writer.written}, failed "
                  f"{writer.failed}, dropped {writer.dropped}; Redis used_memory grew by {grown} bytes "
                  f"({grown / SESSIONS:.0f} per session)")
            assert store_health(cache) == "SERVING" and opened
            assert writer.failed == 0 and oom_lines(caplog) == []
            assert grown < MAXMEMORY / 2
            with capped.client() as r:
                assert len(list(r.scan_iter(f"{redis_prefix}finished:*", count=1000))) == writer.written
                assert set(r.scan_iter(f"{redis_prefix}session:*")) <= {f"{redis_prefix}session:{opened}"}
                assert float(r.hget(f"{redis_prefix}totals", "sessions") or 0) == writer.written
    finally:
        cache.close()


def test_redis_out_of_memory_turns_its_health_not_serving_with_one_line(
        capped: RedisServer, redis_prefix: str, caplog: pytest.LogCaptureFixture) -> None:
    """Negative control: Redis filled to its cap by someone else. PING still answers, writes are
    refused: the cache's Redis health name says NOT_SERVING with one log line naming the reason,
    the cache itself stays SERVING and keeps opening and closing sessions (records are written in
    the background), and Redis's name is SERVING again, with one line, once the junk is gone."""
    cache = start_cache(make_config(capped.url, redis_prefix))
    junk = f"{redis_prefix}junk"
    try:
        assert health(cache) == store_health(cache) == "SERVING" and cache.target.status().redis_connected
        with caplog.at_level(logging.INFO), capped.client() as r:
            # a tiny command that makes a value as big as the cap: Redis stays past it (a big SET would
            # be refused whole, its argument counted in the client's buffer)
            r.setrange(junk, MAXMEMORY, "x")
            with pytest.raises(redis.exceptions.OutOfMemoryError):  # every write is refused now
                r.set(f"{redis_prefix}more", "y")
            assert r.ping()  # why PING alone cannot tell
            wait_for(lambda: store_health(cache) == "NOT_SERVING", what="Redis NOT_SERVING under OOM")
            wait_rounds(cache, 5)  # five more monitor rounds: still one line
            assert len(oom_lines(caplog)) == 1, oom_lines(caplog)
            assert health(cache) == "SERVING"  # the cache serves on: readiness must not follow Redis
            status = cache.target.status()
            assert not status.redis_connected
            # sessions neither wait for nor fail on the refused writes
            rng = random.Random(1)
            sids = [cache.target.open(PROMPT).session_id for _ in range(3)]
            for sid in sids:
                cache.target.step(sid, 0, 5)
                cache.target.close_session(sid, short_answer_stats(rng))
            assert cache.server.records.flush(TIMEOUT)
            assert cache.server.records.failed >= 3
            # a rolled draft joins and heartbeats while Redis refuses its record (the old code
            # refused RegisterDraft: a full Redis kept every new draft out)
            draft = HandDraft(cache.addr, "rolled-in")
            try:
                draft.heartbeat()
                assert "rolled-in" in {d.name for d in cache.target.status().drafts}
                assert cache.target.open(PROMPT).draft == "rolled-in"
            finally:
                draft.close()
            assert REGISTRY.get_sample_value("card_cache_redis_out_of_memory") == 1.0
            assert len(oom_lines(caplog)) == 1 and back_lines(caplog) == []

            r.delete(junk)
            wait_for(lambda: store_health(cache) == "SERVING", what="SERVING once writes succeed again")
            wait_rounds(cache, 3)  # more rounds with the store up: still one line each way
            assert len(back_lines(caplog)) == 1 and len(oom_lines(caplog)) == 1
            assert cache.target.status().redis_connected
            sid = cache.target.open(PROMPT).session_id
            cache.target.close_session(sid, short_answer_stats(rng))
            assert cache.server.records.flush(TIMEOUT)
            assert r.hget(f"{redis_prefix}finished:{sid}", "status") == "finished"
            assert REGISTRY.get_sample_value("card_cache_redis_out_of_memory") == 0.0
    finally:
        cache.close()


def test_sessions_do_not_wait_for_a_stopped_redis(redis_prefix: str) -> None:
    """Redis SIGSTOPped (it accepts connections and never answers): OpenSession, Step and
    CloseSession answer within their deadlines all the same; Redis's health name goes NOT_SERVING,
    and back, the cache's own stays SERVING; the records of the sessions closed meanwhile are
    written once Redis answers again (they waited in the writer's queue)."""
    with running_redis() as own:
        cache = start_cache(make_config(own.url, redis_prefix))
        stopped = False
        try:
            os.kill(own.process.pid, signal.SIGSTOP)
            stopped = True
            deadline = 3.0  # the failure condition: a call that waits on Redis (1 s socket timeouts, retried)
            stub = cache.target.stub
            closed: list[str] = []
            for i in range(5):
                sid = stub.OpenSession(cache_pb2.OpenSessionRequest(
                    prompt_ids=ids_to_msg(PROMPT), tokenizer_fingerprint="fp-stop", target_model="t"),
                    timeout=deadline).session_id
                stub.Step(correction_to_msg(sid, Correction(0, (), (), 5)), timeout=deadline)
                request = cache_pb2.CloseSessionRequest(session_id=sid)
                request.stats.CopyFrom(stats_to_msg(short_answer_stats(random.Random(i))))
                stub.CloseSession(request, timeout=deadline)
                closed.append(sid)
                if i == 0:
                    wait_for(lambda: store_health(cache) == "NOT_SERVING", what="Redis NOT_SERVING, stopped")
                assert health(cache) == "SERVING"
            assert cache.server.sessions.sessions() == []
            os.kill(own.process.pid, signal.SIGCONT)
            stopped = False
            wait_for(lambda: store_health(cache) == "SERVING", what="SERVING with Redis answering again")
            sid = cache.target.open(PROMPT).session_id
            cache.target.close_session(sid)
            assert cache.server.records.flush(TIMEOUT)
            with own.client() as r:
                assert r.hget(f"{redis_prefix}finished:{sid}", "status") == "finished"
                # nothing lost: the records closed while Redis was stopped, written once
                assert [r.hget(f"{redis_prefix}finished:{s}", "status") for s in closed] == ["finished"] * 5
                assert float(r.hget(f"{redis_prefix}totals", "sessions") or 0) == 6
            assert cache.server.records.failed == cache.server.records.dropped == 0
        finally:
            if stopped:
                os.kill(own.process.pid, signal.SIGCONT)
            cache.close()


def test_sessions_open_and_close_with_no_redis_at_all(redis_prefix: str) -> None:
    """Redis gone (connection refused): the calls answer at once, in a thread joined with a timeout."""
    with running_redis() as own:
        cache = start_cache(make_config(own.url, redis_prefix))
        try:
            own.stop()
            wait_for(lambda: store_health(cache) == "NOT_SERVING", what="NOT_SERVING with Redis gone")
            assert health(cache) == "SERVING"
            done = threading.Event()

            def calls() -> None:
                target = HandTarget(cache.addr)
                sid = target.open(PROMPT).session_id
                target.step(sid, 0, 5)
                target.close_session(sid, short_answer_stats(random.Random(2)))
                target.close()
                done.set()

            worker = threading.Thread(target=calls, daemon=True)
            worker.start()
            worker.join(5.0)
            assert done.is_set(), "OpenSession / Step / CloseSession waited on the missing Redis"
        finally:
            cache.close()


def record_bytes(record: dict[str, str]) -> int:
    return sum(len(k) + len(v) for k, v in record.items())


def test_finished_record_is_a_bounded_summary(redis_server: RedisServer, redis_prefix: str) -> None:
    """A finished record holds counts, means, percentiles and a histogram of accepted lengths,
    lives at most the default TTL (an hour), and is no bigger for 1,000 target forwards than for 10."""
    config = make_config(redis_server.url, redis_prefix, session_ttl_s=CacheConfig().session_ttl_s)
    assert config.session_ttl_s == 3600
    cache = start_cache(config)
    try:
        records = {}
        for forwards in (10, 1000):
            lengths = [1 + i % 5 for i in range(forwards)]
            rtt = [0.5 + (i % 7) * 0.25 for i in range(forwards)]
            stats = GenerationStats(mode="card", prompt_tokens=3, new_tokens=sum(lengths), wall_s=2.0,
                                    target_forwards=forwards, hits=forwards // 2, step_rtt_ms=rtt,
                                    accepted_lengths=lengths)
            sid = cache.target.open(PROMPT).session_id
            cache.target.step(sid, 0, 5)
            cache.target.close_session(sid, stats)
            assert cache.server.records.flush(TIMEOUT)
            key = f"{redis_prefix}finished:{sid}"
            with redis_server.client() as r:
                record = r.hgetall(key)
                ttl = r.ttl(key)
                assert r.memory_usage(key) < 2048
            assert 3500 < ttl <= 3600
            assert "stats_json" not in record and not any(k.startswith("step_rtt_ms") for k in record)
            assert record["status"] == "finished" and record["target_model"] == "target-model"
            assert int(record["target_forwards"]) == forwards == int(record["accepted_length_count"])
            assert json.loads(record["accepted_length_hist"]) == {str(n): forwards // 5 for n in range(1, 6)}
            assert float(record["accepted_length_mean"]) == pytest.approx(3.0)
            assert int(record["accepted_length_max"]) == 5 and int(record["step_rtt_count"]) == forwards
            assert float(record["step_rtt_max_ms"]) == pytest.approx(2.0)
            assert float(record["step_rtt_p50_ms"]) in {0.5 + k * 0.25 for k in range(7)}
            assert float(record["mean_accepted_length"]) == pytest.approx(3.0)
            records[forwards] = record
        # only the digits of the counts grow
        assert record_bytes(records[1000]) <= record_bytes(records[10]) + 32
        assert set(records[1000]) == set(records[10])
        # a session shorter than a monitor round never had a live record
        assert list(redis.Redis.from_url(redis_server.url).scan_iter(f"{redis_prefix}session:*")) == []
    finally:
        cache.close()


def test_accepted_length_histogram_is_capped() -> None:
    hist = accepted_length_hist([1, 1, 2, HIST_CAP - 1, HIST_CAP, HIST_CAP + 7, 10_000])
    assert hist == {"1": 2, "2": 1, str(HIST_CAP - 1): 1, f"{HIST_CAP}+": 3}
    assert len(accepted_length_hist(range(100_000))) == HIST_CAP + 1


def test_a_full_writer_queue_drops_the_record_and_never_blocks(redis_url: str, redis_prefix: str) -> None:
    store = RedisStore(redis_url, redis_prefix)
    writer = RecordWriter(store, max_pending=2)  # not started: nothing drains the queue
    before = REGISTRY.get_sample_value("card_cache_records_dropped_total") or 0.0
    records = [FinishedRecord(f"s{i}", {"status": "finished"}, {"sessions": 1}, 60) for i in range(3)]
    t0 = time.monotonic()
    assert [writer.submit(rec) for rec in records] == [True, True, False]
    assert time.monotonic() - t0 < 1.0
    assert writer.dropped == 1
    assert REGISTRY.get_sample_value("card_cache_records_dropped_total") == before + 1
    writer.start()
    assert writer.flush(TIMEOUT) and writer.written == 2
    writer.stop()
    with redis.Redis.from_url(redis_url, decode_responses=True) as r:
        assert r.hget(f"{redis_prefix}finished:s1", "status") == "finished"
        assert not r.exists(f"{redis_prefix}finished:s2")
        assert r.hget(f"{redis_prefix}totals", "sessions") == "2"
    store.close()


def test_default_ttl_is_an_hour() -> None:
    assert CacheConfig().session_ttl_s == 3600
