"""RedisStore (real redis-server) and MemoryStore keep the same records the same way."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import redis

from card.cache_service.config import CacheConfig
from card.cache_service.store import MemoryStore, MetadataStore, RedisStore, StoreFull, open_store, redact_url
from card.engine.shared.errors import Unavailable
from tests.services.conftest import free_port, running_redis


@pytest.fixture(params=["redis", "memory"])
def store(request: pytest.FixtureRequest, redis_url: str, redis_prefix: str) -> Iterator[MetadataStore]:
    s: MetadataStore = (
        RedisStore(redis_url, redis_prefix) if request.param == "redis" else MemoryStore(redis_prefix)
    )
    yield s
    s.close()


def test_session_records(store: MetadataStore) -> None:
    store.put_session("s1", {"status": "live", "epoch": 0, "target_model": "t"}, ttl_s=60)
    store.put_session("s2", {"status": "live"}, ttl_s=60)
    store.put_session("s1", {"epoch": 4}, ttl_s=60)  # a flush updates fields, keeps the rest
    assert store.session("s1") == {"status": "live", "epoch": "4", "target_model": "t"}
    assert store.live_session_ids() == ["s1", "s2"]
    store.finish_session("s1", {"status": "finished", "new_tokens": 9}, ttl_s=60)
    assert store.session("s1") == {} and store.live_session_ids() == ["s2"]
    assert store.finished_session("s1") == {"status": "finished", "epoch": "4", "target_model": "t",
                                            "new_tokens": "9"}


def test_records_expire(store: MetadataStore) -> None:
    store.put_draft("d", {"name": "d", "model": "m"}, ttl_s=0.3)
    store.finish_session("s", {"status": "finished"}, ttl_s=0.3)
    assert [d["name"] for d in store.drafts()] == ["d"]
    time.sleep(0.6)
    assert store.drafts() == [] and store.finished_session("s") == {}


def test_drafts_and_totals(store: MetadataStore) -> None:
    store.put_draft("b", {"name": "b"}, ttl_s=60)
    store.put_draft("a", {"name": "a", "capacity": 2}, ttl_s=60)
    assert [d["name"] for d in store.drafts()] == ["a", "b"]
    store.delete_draft("b")
    assert [d["name"] for d in store.drafts()] == ["a"]
    store.incr({"sessions": 1, "hits": 2.5})
    store.incr({"sessions": 1})
    assert store.totals() == {"sessions": 2.0, "hits": 2.5}


def test_finished_records_are_written_whole_in_one_go(store: MetadataStore) -> None:
    """The RecordWriter's write: whole records (they carry their live fields), live keys gone,
    totals added, all at once."""
    store.put_session("a", {"status": "live", "epoch": 1, "target_model": "t"}, ttl_s=60)
    store.write_finished([("a", {"status": "finished", "epoch": 3}, 60), ("b", {"status": "abandoned"}, 60)],
                         {"sessions": 2, "hits": 1.5})
    assert store.session("a") == {} and store.live_session_ids() == []
    assert store.finished_session("a") == {"status": "finished", "epoch": "3"}
    assert store.finished_session("b") == {"status": "abandoned"}
    assert store.totals() == {"sessions": 2.0, "hits": 1.5}
    store.probe(1.0)  # the store takes writes


def test_a_full_redis_is_store_full_not_unreachable(redis_prefix: str) -> None:
    """Redis at maxmemory (noeviction) answers PING and reads and refuses writes: StoreFull, an
    Unavailable that says so; the probe tells it, PING cannot."""
    with running_redis() as own:
        with own.client() as r:
            r.config_set("maxmemory", 2 * 2**20)
            r.config_set("maxmemory-policy", "noeviction")
            r.setrange(f"{redis_prefix}junk", 4 * 2**20, "x")  # past the cap in one small command
        s = RedisStore(own.url, redis_prefix)
        assert s.ping() and s.session("x") == {} and s.totals() == {}
        with pytest.raises(StoreFull, match="out of memory"):
            s.probe(1.0)
        with pytest.raises(StoreFull, match="out of memory"):
            s.write_finished([("a", {"status": "finished"}, 60)], {"sessions": 1})
        with pytest.raises(StoreFull):
            s.put_session("a", {"status": "live"}, 60)
        with own.client() as r:
            r.delete(f"{redis_prefix}junk")
            s.probe(1.0)
            assert 0 < r.pttl(f"{redis_prefix}probe") <= 1000
        s.close()


def test_keys_stay_under_the_prefix(redis_url: str, redis_prefix: str) -> None:
    s = RedisStore(redis_url, redis_prefix)
    s.put_session("x", {"a": 1}, 60)
    s.put_draft("d", {"name": "d"}, 60)
    s.incr({"n": 1})
    with redis.Redis.from_url(redis_url, decode_responses=True) as r:
        keys = sorted(r.scan_iter(f"{redis_prefix}*"))
        assert keys == [f"{redis_prefix}{k}" for k in ("draft:d", "drafts", "live", "session:x", "totals")]
        assert 0 < r.ttl(f"{redis_prefix}session:x") <= 60
        # the indexes expire with their newest member: nothing is left behind without a cache
        assert 0 < r.ttl(f"{redis_prefix}live") <= 60 and 0 < r.ttl(f"{redis_prefix}drafts") <= 60
    s.close()


def test_unreachable_redis() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    with pytest.raises(Unavailable, match="--allow-memory-fallback"):
        open_store(url, "p:")
    assert isinstance(open_store(url, "p:", allow_memory_fallback=True), MemoryStore)
    assert isinstance(open_store("memory://", "p:"), MemoryStore)
    s = RedisStore(url, "p:")
    assert not s.ping()
    with pytest.raises(Unavailable, match=url):
        s.put_session("x", {"a": 1}, 60)
    with pytest.raises(Unavailable, match="unreachable") as info:
        s.probe(1.0)
    assert not isinstance(info.value, StoreFull)


@pytest.mark.parametrize(("url", "shown"), [
    ("redis://:s3cret@host:6379/0", "redis://:***@host:6379/0"),
    ("redis://user:s3cret@host:6379/0", "redis://user:***@host:6379/0"),
    ("redis://s3cret@host:6379/0", "redis://***@host:6379/0"),  # the slip for redis://:s3cret@host
    ("rediss://:s3cret@host/0?ssl_cert_reqs=none", "rediss://:***@host/0?ssl_cert_reqs=none"),
    ("unix:///run/redis.sock?db=0&password=s3cret", "unix:///run/redis.sock?db=0&password=***"),
    ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
])
def test_the_password_never_shows(url: str, shown: str) -> None:
    assert redact_url(url) == shown and "s3cret" not in repr(CacheConfig(redis_url=url))
    assert RedisStore(url, "p:").url == shown


def test_the_memory_store_is_bounded() -> None:
    """memory:// keeps at most ``max_records`` finished records (the oldest go, counted) and lets
    expired ones go as it writes: an hour of records cannot grow the cache without bound."""
    s = MemoryStore("p:", max_records=100)
    for i in range(250):
        s.write_finished([(f"s{i}", {"status": "finished"}, 60)], {"sessions": 1})
    assert s.evicted == 150 and s.finished_session("s149") == {} and s.finished_session("s150")
    assert s.totals() == {"sessions": 250.0}
    for i in range(10):
        s.write_finished([(f"short{i}", {"status": "finished"}, 0.01)], {})
    time.sleep(0.05)
    s.write_finished([("last", {"status": "finished"}, 60)], {})
    assert len(s._finished) <= 100 and s.finished_session("short0") == {}
