"""Metadata in Redis (DESIGN.md §6): session records, the draft registry, counters.

Keys, all under the configured prefix (default ``card:``):
    {prefix}session:{id}    hash, a live session (written once, after a monitor round; TTL as a crash guard)
    {prefix}finished:{id}   hash, a finished session's record and summary stats (bounded: counts,
                            means, a histogram; never per-forward lists), TTL ``session_ttl_s``
    {prefix}draft:{name}    hash, a registered draft worker; TTL 3 heartbeats, so it expires
    {prefix}totals          hash of float counters over finished sessions (HINCRBYFLOAT)
    {prefix}probe           string, the monitor's write probe (a few rounds' TTL)

Redis holds no tensors and is off every session RPC: OpenSession, Step and CloseSession never wait
for it. Live records are written by the monitor, finished records and totals by the cache's
RecordWriter thread (card.cache_service.records).

Errors: every Redis failure is ``Unavailable``; a write Redis refuses for memory (``maxmemory``
with ``noeviction``: "OOM command not allowed") is its subclass ``StoreFull``, so the monitor can
say why the store takes no writes while PING still answers.
"""

from __future__ import annotations

import fnmatch
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from card.engine.shared.errors import Unavailable

log = logging.getLogger(__name__)

Fields = Mapping[str, str | int | float]
Finished = tuple[str, Fields, float]  # a finished session's id, whole record, TTL in seconds

MEMORY_URL = "memory://"

T = TypeVar("T")


class StoreFull(Unavailable):
    """Redis answers but refuses writes: it reached ``maxmemory`` (policy ``noeviction``)."""


def out_of_memory(exc: BaseException) -> bool:
    """Is ``exc`` Redis refusing a write for memory? (redis-py maps "OOM ..." replies to
    OutOfMemoryError; a pipeline's error may come as a plain ResponseError naming it.)"""
    if isinstance(exc, redis.exceptions.OutOfMemoryError):
        return True
    text = str(exc)
    return isinstance(exc, redis.ResponseError) and (
        text.startswith("OOM") or "command not allowed when used memory" in text)


class MetadataStore(Protocol):
    url: str

    def ping(self) -> bool: ...

    def put_session(self, session_id: str, fields: Fields, ttl_s: float) -> None: ...

    def finish_session(self, session_id: str, fields: Fields, ttl_s: float) -> None: ...

    def write_finished(self, records: Sequence[Finished], totals: Mapping[str, float]) -> None: ...

    def probe(self, ttl_s: float) -> None: ...

    def session(self, session_id: str) -> dict[str, str]: ...

    def finished_session(self, session_id: str) -> dict[str, str]: ...

    def live_session_ids(self) -> list[str]: ...

    def put_draft(self, name: str, fields: Fields, ttl_s: float) -> None: ...

    def delete_draft(self, name: str) -> None: ...

    def drafts(self) -> list[dict[str, str]]: ...

    def incr(self, amounts: Mapping[str, float]) -> None: ...

    def totals(self) -> dict[str, float]: ...

    def close(self) -> None: ...


def _strs(fields: Fields) -> dict[str, str]:
    return {k: str(v) for k, v in fields.items()}


def _ttl_ms(ttl_s: float) -> int:
    return max(1, math.ceil(ttl_s * 1000))


class RedisStore:
    def __init__(self, url: str, prefix: str = "card:", timeout_s: float = 1.0) -> None:
        self.url = url
        self.prefix = prefix
        # fail fast when Redis is down: the caller decides (health flips, writes are retried later)
        # redis-py types every reply bytes | str; with decode_responses=True each is str, so the client
        # is untyped here and each method below states what it returns
        self.client: Any = redis.Redis.from_url(
            url, decode_responses=True, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
            retry=Retry(ExponentialBackoff(cap=0.2, base=0.02), 1),
        )

    def _k(self, *parts: str) -> str:
        return self.prefix + ":".join(parts)

    def _call(self, what: str, fn: Callable[..., T], *args: Any) -> T:
        try:
            return fn(*args)
        except redis.RedisError as exc:
            if out_of_memory(exc):
                raise StoreFull(f"redis at {self.url} refuses writes, out of memory (maxmemory reached; "
                                f"{what})") from exc
            raise Unavailable(f"redis at {self.url} is unreachable ({what}): {exc}") from exc

    def ping(self) -> bool:
        try:
            return bool(self.client.ping())
        except redis.RedisError:
            return False

    def _put(self, key: str, fields: Fields, ttl_s: float) -> None:
        pipe = self.client.pipeline(transaction=True)
        pipe.hset(key, mapping=_strs(fields))
        pipe.pexpire(key, _ttl_ms(ttl_s))
        pipe.execute()

    def put_session(self, session_id: str, fields: Fields, ttl_s: float) -> None:
        self._call("put session", self._put, self._k("session", session_id), fields, ttl_s)

    def finish_session(self, session_id: str, fields: Fields, ttl_s: float) -> None:
        def run() -> None:
            live, done = self._k("session", session_id), self._k("finished", session_id)
            pipe = self.client.pipeline(transaction=True)
            pipe.hgetall(live)
            pipe.delete(live)
            record, _ = pipe.execute()
            record.update(_strs(fields))
            self._put(done, record, ttl_s)

        self._call("finish session", run)

    def write_finished(self, records: Sequence[Finished], totals: Mapping[str, float]) -> None:
        """Whole finished records (each holds its live fields itself; the live keys go) and what
        they add to the totals: one transaction, one round trip for the lot."""
        def run() -> None:
            pipe = self.client.pipeline(transaction=True)
            for session_id, fields, ttl_s in records:
                done = self._k("finished", session_id)
                pipe.delete(self._k("session", session_id))
                pipe.hset(done, mapping=_strs(fields))
                pipe.pexpire(done, _ttl_ms(ttl_s))
            for name, value in totals.items():
                pipe.hincrbyfloat(self._k("totals"), name, float(value))
            pipe.execute()

        self._call("write finished sessions", run)

    def probe(self, ttl_s: float) -> None:
        """A tiny write with a TTL: Unavailable when Redis is down, StoreFull when it refuses
        writes for memory (PING answers either way under ``noeviction``)."""
        self._call("write probe", lambda: self.client.set(self._k("probe"), "1", px=_ttl_ms(ttl_s)))

    def session(self, session_id: str) -> dict[str, str]:
        return self._call("get session", self.client.hgetall, self._k("session", session_id))

    def finished_session(self, session_id: str) -> dict[str, str]:
        return self._call("get finished session", self.client.hgetall, self._k("finished", session_id))

    def live_session_ids(self) -> list[str]:
        start = len(self._k("session", ""))
        keys = self._call("scan sessions", lambda: list(self.client.scan_iter(self._k("session", "*"))))
        return sorted(k[start:] for k in keys)

    def put_draft(self, name: str, fields: Fields, ttl_s: float) -> None:
        self._call("put draft", self._put, self._k("draft", name), fields, ttl_s)

    def delete_draft(self, name: str) -> None:
        self._call("delete draft", self.client.delete, self._k("draft", name))

    def drafts(self) -> list[dict[str, str]]:
        def run() -> list[dict[str, str]]:
            keys = sorted(self.client.scan_iter(self._k("draft", "*")))
            pipe = self.client.pipeline(transaction=False)
            for k in keys:
                pipe.hgetall(k)
            return [d for d in pipe.execute() if d]  # a key may expire between scan and read

        return self._call("list drafts", run)

    def incr(self, amounts: Mapping[str, float]) -> None:
        def run() -> None:
            pipe = self.client.pipeline(transaction=True)
            for name, value in amounts.items():
                pipe.hincrbyfloat(self._k("totals"), name, float(value))
            pipe.execute()

        self._call("update totals", run)

    def totals(self) -> dict[str, float]:
        raw = self._call("read totals", self.client.hgetall, self._k("totals"))
        return {k: float(v) for k, v in raw.items()}

    def close(self) -> None:
        self.client.close()


class MemoryStore:
    """The same records in this process only: for a single-machine run without Redis."""

    url = MEMORY_URL

    def __init__(self, prefix: str = "card:") -> None:
        self.prefix = prefix
        self._hashes: dict[str, tuple[dict[str, str], float]] = {}  # key -> (fields, expires_at)
        self._totals: dict[str, float] = {}
        self._lock = threading.Lock()

    def _k(self, *parts: str) -> str:
        return self.prefix + ":".join(parts)

    def _get(self, key: str) -> dict[str, str]:
        entry = self._hashes.get(key)
        if entry is None:
            return {}
        if entry[1] <= time.monotonic():
            del self._hashes[key]
            return {}
        return dict(entry[0])

    def _put(self, key: str, fields: Fields, ttl_s: float) -> None:
        record = self._get(key)
        record.update(_strs(fields))
        self._hashes[key] = (record, time.monotonic() + ttl_s)

    def _keys(self, pattern: str) -> list[str]:
        return sorted(k for k in list(self._hashes) if fnmatch.fnmatchcase(k, pattern) and self._get(k))

    def ping(self) -> bool:
        return True

    def put_session(self, session_id: str, fields: Fields, ttl_s: float) -> None:
        with self._lock:
            self._put(self._k("session", session_id), fields, ttl_s)

    def finish_session(self, session_id: str, fields: Fields, ttl_s: float) -> None:
        with self._lock:
            record = self._get(self._k("session", session_id))
            self._hashes.pop(self._k("session", session_id), None)
            record.update(_strs(fields))
            self._put(self._k("finished", session_id), record, ttl_s)

    def write_finished(self, records: Sequence[Finished], totals: Mapping[str, float]) -> None:
        with self._lock:
            for session_id, fields, ttl_s in records:
                self._hashes.pop(self._k("session", session_id), None)
                self._hashes[self._k("finished", session_id)] = (_strs(fields), time.monotonic() + ttl_s)
        self.incr(totals)

    def probe(self, ttl_s: float) -> None:
        pass

    def session(self, session_id: str) -> dict[str, str]:
        with self._lock:
            return self._get(self._k("session", session_id))

    def finished_session(self, session_id: str) -> dict[str, str]:
        with self._lock:
            return self._get(self._k("finished", session_id))

    def live_session_ids(self) -> list[str]:
        start = len(self._k("session", ""))
        with self._lock:
            return [k[start:] for k in self._keys(self._k("session", "*"))]

    def put_draft(self, name: str, fields: Fields, ttl_s: float) -> None:
        with self._lock:
            self._put(self._k("draft", name), fields, ttl_s)

    def delete_draft(self, name: str) -> None:
        with self._lock:
            self._hashes.pop(self._k("draft", name), None)

    def drafts(self) -> list[dict[str, str]]:
        with self._lock:
            return [self._get(k) for k in self._keys(self._k("draft", "*"))]

    def incr(self, amounts: Mapping[str, float]) -> None:
        with self._lock:
            for name, value in amounts.items():
                self._totals[name] = self._totals.get(name, 0.0) + float(value)

    def totals(self) -> dict[str, float]:
        with self._lock:
            return dict(self._totals)

    def close(self) -> None:
        pass


def open_store(url: str, prefix: str, allow_memory_fallback: bool = False) -> MetadataStore:
    """Connect to ``url`` (or build the in-process store); Unavailable when Redis cannot be reached
    and the fallback is not allowed."""
    if url == MEMORY_URL:
        log.warning("using the in-process metadata store (memory://): records are lost on exit and "
                    "not shared with other cache replicas; use Redis in production")
        return MemoryStore(prefix)
    store = RedisStore(url, prefix)
    if store.ping():
        return store
    store.close()
    if allow_memory_fallback:
        log.warning("redis at %s is unreachable; falling back to the in-process metadata store "
                    "(records are lost on exit)", url)
        return MemoryStore(prefix)
    raise Unavailable(
        f"redis at {url} is unreachable. Start Redis (e.g. `redis-server`), point --redis-url / "
        f"CARD_CACHE_REDIS_URL at it, or pass --allow-memory-fallback (CARD_CACHE_ALLOW_MEMORY_FALLBACK=1) "
        f"to run with an in-process store"
    )
