"""Metadata in Redis (DESIGN.md §6): session records, the draft registry, counters.

Keys, all under the configured prefix (default ``card:``):
    {prefix}session:{id}    hash, a live session (written once, after a monitor round; TTL as a crash guard)
    {prefix}live            sorted set, the index of live sessions (id -> expiry, unix ms)
    {prefix}finished:{id}   hash, a finished session's record and summary stats (bounded: counts,
                            means, a histogram; never per-forward lists), TTL ``session_ttl_s``
    {prefix}draft:{name}    hash, a registered draft worker; TTL 3 heartbeats, so it expires
    {prefix}drafts          sorted set, the index of draft records (name -> expiry, unix ms)
    {prefix}totals          hash of float counters over finished sessions (HINCRBYFLOAT)
    {prefix}probe           string, the monitor's write probe (a few rounds' TTL)

Nothing here SCANs the keyspace: the live sessions and the draft records are read through their
index (a sorted set pruned of expired members at each write, with a TTL of its own), so Status and
a start's retirement of old records cost what they list, not what Redis holds (an hour of finished
records is ~10^5 keys or more; a SCAN over them took ~1 s).

Redis holds no tensors and is off every RPC: OpenSession, Step, CloseSession, RegisterDraft and
Heartbeat never wait for it. Live records and draft records are written by the monitor's store
loop, finished records and totals by the cache's RecordWriter thread (card.cache_service.records).

Errors: every Redis failure is ``Unavailable``; a write Redis refuses for memory (``maxmemory``
with ``noeviction``: "OOM command not allowed") is its subclass ``StoreFull``, so the monitor can
say why the store takes no writes while PING still answers; a password Redis refuses (or one it
requires and the URL lacks) is ``StoreAuth``. The URL's password never appears in a message:
``url`` is ``redact_url``'s form of it.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol, TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from card.cache_service import metrics
from card.engine.shared.errors import Unauthenticated, Unavailable

log = logging.getLogger(__name__)

Fields = Mapping[str, str | int | float]
Finished = tuple[str, Fields, float]  # a finished session's id, whole record, TTL in seconds

MEMORY_URL = "memory://"
# finished records the in-process store keeps at most (the oldest go first, counted): Redis is
# bounded by its maxmemory, this one by a count (a record is ~1 KB)
MAX_MEMORY_RECORDS = 20_000

T = TypeVar("T")


class StoreFull(Unavailable):
    """Redis answers but refuses writes: it reached ``maxmemory`` (policy ``noeviction``)."""


class StoreAuth(Unavailable):
    """Redis refuses the URL's password, or requires one the URL does not give."""


def redact_url(url: str) -> str:
    """``url`` as logs, errors and Status show it: the password (in the user part, or a
    ``password=`` query parameter) replaced by ``***``. A user part without a colon is redacted
    whole, since ``redis://SECRET@host`` is a common slip for ``redis://:SECRET@host``."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<an unparseable URL>"
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, hostport = netloc.rpartition("@")
        user, colon, _ = userinfo.partition(":")
        netloc = f"{user}:***@{hostport}" if colon else f"***@{hostport}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        query = urlencode([(k, "***" if k.lower() == "password" else v) for k, v in pairs], safe="*")
    if "://" not in url:
        return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))
    # by hand: urlunsplit drops the empty authority of unix:///path
    return (f"{parts.scheme}://{netloc}{parts.path}" + (f"?{query}" if query else "")
            + (f"#{parts.fragment}" if parts.fragment else ""))


def has_password(url: str) -> bool:
    try:
        parts = urlsplit(url)
    except ValueError:
        return False
    return bool(parts.password) or any(k.lower() == "password" and v for k, v in parse_qsl(parts.query))


def _auth_message(url: str, exc: BaseException) -> str:
    text = str(exc)
    if "WRONGPASS" in text or "invalid username-password" in text or "invalid password" in text:
        return (f"redis at {url} refuses the password in the URL ({text.strip()}); check --redis-url / "
                f"CARD_CACHE_REDIS_URL against Redis's requirepass")
    return (f"redis at {url} requires a password the URL does not give ({text.strip()}); give it as "
            f"redis://:PASSWORD@HOST:PORT/DB in --redis-url / CARD_CACHE_REDIS_URL (in Kubernetes, the "
            f"card-redis Secret's url)")


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

    def put_drafts(self, drafts: Mapping[str, Fields], ttl_s: float, gone: Iterable[str] = ()) -> None: ...

    def delete_draft(self, name: str) -> None: ...

    def drafts(self) -> list[dict[str, str]]: ...

    def incr(self, amounts: Mapping[str, float]) -> None: ...

    def totals(self) -> dict[str, float]: ...

    def close(self) -> None: ...


def _strs(fields: Fields) -> dict[str, str]:
    return {k: str(v) for k, v in fields.items()}


def _ttl_ms(ttl_s: float) -> int:
    return max(1, math.ceil(ttl_s * 1000))


def _now_ms() -> int:
    return int(time.time() * 1000)


class RedisStore:
    def __init__(self, url: str, prefix: str = "card:", timeout_s: float = 1.0) -> None:
        self.url = redact_url(url)  # the password never reaches a log line or an error message
        self.prefix = prefix
        # Fail fast: the caller decides (the monitor reports it, writes wait for a later round). A
        # refused or reset connection (Redis restarted, a pooled socket gone stale) is retried once;
        # a timeout is not: the command may have reached Redis, and a stopped Redis must cost each
        # caller one timeout, not two. redis-py types every reply bytes | str; with
        # decode_responses=True each is str, so the client is untyped here and each method below
        # states what it returns
        self.client: Any = redis.Redis.from_url(
            url, decode_responses=True, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
            retry=Retry(ExponentialBackoff(cap=0.2, base=0.02), 1,
                        supported_errors=(redis.ConnectionError,)),
        )

    def _k(self, *parts: str) -> str:
        return self.prefix + ":".join(parts)

    def _call(self, what: str, fn: Callable[..., T], *args: Any) -> T:
        try:
            return fn(*args)
        except redis.AuthenticationError as exc:
            raise StoreAuth(_auth_message(self.url, exc)) from exc
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

    def check(self) -> None:
        """PING: Unavailable (StoreAuth for a password problem) when Redis does not answer it."""
        self._call("ping", self.client.ping)

    def _put(self, pipe: Any, key: str, fields: Fields, ttl_s: float) -> None:
        pipe.hset(key, mapping=_strs(fields))
        pipe.pexpire(key, _ttl_ms(ttl_s))

    def _index(self, pipe: Any, index: str, members: Iterable[str], ttl_s: float) -> None:
        """``members`` into the sorted set ``index`` with their expiry as score; members already
        expired leave (the index never outgrows what lives), and the index itself lives as long
        as its newest members."""
        now = _now_ms()
        pipe.zadd(index, dict.fromkeys(members, now + _ttl_ms(ttl_s)))
        pipe.zremrangebyscore(index, "-inf", now)
        pipe.pexpire(index, _ttl_ms(ttl_s))

    def put_session(self, session_id: str, fields: Fields, ttl_s: float) -> None:
        def run() -> None:
            pipe = self.client.pipeline(transaction=True)
            self._put(pipe, self._k("session", session_id), fields, ttl_s)
            self._index(pipe, self._k("live"), [session_id], ttl_s)
            pipe.execute()

        self._call("put session", run)

    def finish_session(self, session_id: str, fields: Fields, ttl_s: float) -> None:
        def run() -> None:
            live, done = self._k("session", session_id), self._k("finished", session_id)
            pipe = self.client.pipeline(transaction=True)
            pipe.hgetall(live)
            pipe.delete(live)
            pipe.zrem(self._k("live"), session_id)
            record, _, _ = pipe.execute()
            record.update(_strs(fields))
            pipe = self.client.pipeline(transaction=True)
            self._put(pipe, done, record, ttl_s)
            pipe.execute()

        self._call("finish session", run)

    def write_finished(self, records: Sequence[Finished], totals: Mapping[str, float]) -> None:
        """Whole finished records (each holds its live fields itself; the live keys go) and what
        they add to the totals: one transaction, one round trip for the lot."""
        def run() -> None:
            pipe = self.client.pipeline(transaction=True)
            for session_id, fields, ttl_s in records:
                pipe.delete(self._k("session", session_id))
                self._put(pipe, self._k("finished", session_id), fields, ttl_s)
            if records:
                pipe.zrem(self._k("live"), *[session_id for session_id, _, _ in records])
            for name, value in totals.items():
                pipe.hincrbyfloat(self._k("totals"), name, float(value))
            pipe.execute()

        self._call("write finished sessions", run)

    def probe(self, ttl_s: float) -> None:
        """A tiny write with a TTL: Unavailable when Redis is down, StoreFull when it refuses
        writes for memory (PING answers either way under ``noeviction``), StoreAuth when it
        refuses the password."""
        self._call("write probe", lambda: self.client.set(self._k("probe"), "1", px=_ttl_ms(ttl_s)))

    def session(self, session_id: str) -> dict[str, str]:
        return self._call("get session", self.client.hgetall, self._k("session", session_id))

    def finished_session(self, session_id: str) -> dict[str, str]:
        return self._call("get finished session", self.client.hgetall, self._k("finished", session_id))

    def live_session_ids(self) -> list[str]:
        """The live records' ids, from their index (no keyspace SCAN)."""
        ids = self._call("list live sessions", self.client.zrangebyscore, self._k("live"), _now_ms(), "+inf")
        return sorted(ids)

    def put_draft(self, name: str, fields: Fields, ttl_s: float) -> None:
        self.put_drafts({name: fields}, ttl_s)

    def put_drafts(self, drafts: Mapping[str, Fields], ttl_s: float, gone: Iterable[str] = ()) -> None:
        """Draft records (name -> fields), each with ``ttl_s``, and the records of ``gone``
        deleted: one transaction (the monitor's round writes every registered worker at once)."""
        gone = list(gone)

        def run() -> None:
            pipe = self.client.pipeline(transaction=True)
            for name, fields in drafts.items():
                self._put(pipe, self._k("draft", name), fields, ttl_s)
            if drafts:
                self._index(pipe, self._k("drafts"), drafts, ttl_s)
            if gone:
                pipe.delete(*[self._k("draft", name) for name in gone])
                pipe.zrem(self._k("drafts"), *gone)
            pipe.execute()

        if drafts or gone:
            self._call("put drafts", run)

    def delete_draft(self, name: str) -> None:
        self.put_drafts({}, 0.0, gone=[name])

    def drafts(self) -> list[dict[str, str]]:
        """Every draft record, by name, from the index (no keyspace SCAN): one ZRANGE and one
        pipelined read of the records it names."""
        def run() -> list[dict[str, str]]:
            names = self.client.zrangebyscore(self._k("drafts"), _now_ms(), "+inf")
            pipe = self.client.pipeline(transaction=False)
            for name in sorted(names):
                pipe.hgetall(self._k("draft", name))
            return [d for d in pipe.execute() if d]  # a record may expire between index and read

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
    """The same records in this process only: for a single-machine run without Redis. Bounded:
    finished records expire by their TTL and at most ``max_records`` are kept (the oldest go
    first, counted in ``evicted`` and ``card_cache_records_evicted_total``); live sessions and
    drafts are as many as the cache holds."""

    url = MEMORY_URL

    def __init__(self, prefix: str = "card:", max_records: int = MAX_MEMORY_RECORDS) -> None:
        self.prefix = prefix
        self.max_records = max_records
        # id or name -> (fields, expires_at); finished in the order written, which is expiry order
        # for one TTL, so expired ones leave from the front
        self._live: dict[str, tuple[dict[str, str], float]] = {}
        self._finished: OrderedDict[str, tuple[dict[str, str], float]] = OrderedDict()
        self._drafts: dict[str, tuple[dict[str, str], float]] = {}
        self._totals: dict[str, float] = {}
        self._lock = threading.Lock()
        self.evicted = 0

    @staticmethod
    def _get(table: dict[str, tuple[dict[str, str], float]], key: str) -> dict[str, str]:
        entry = table.get(key)
        if entry is None:
            return {}
        if entry[1] <= time.monotonic():
            del table[key]
            return {}
        return dict(entry[0])

    def _put(self, table: dict[str, tuple[dict[str, str], float]], key: str, fields: Fields,
             ttl_s: float) -> None:
        record = self._get(table, key)
        record.update(_strs(fields))
        table[key] = (record, time.monotonic() + ttl_s)

    def _finish(self, session_id: str, record: dict[str, str], ttl_s: float) -> None:
        self._live.pop(session_id, None)
        self._finished.pop(session_id, None)
        self._finished[session_id] = (record, time.monotonic() + ttl_s)
        now, evicted = time.monotonic(), 0
        while self._finished:
            oldest_id, (_, expires) = next(iter(self._finished.items()))
            if expires > now and len(self._finished) <= self.max_records:
                break
            del self._finished[oldest_id]
            evicted += expires > now
        if evicted:
            self.evicted += evicted
            metrics.RECORDS_EVICTED.inc(evicted)

    def ping(self) -> bool:
        return True

    def check(self) -> None:
        pass

    def put_session(self, session_id: str, fields: Fields, ttl_s: float) -> None:
        with self._lock:
            self._put(self._live, session_id, fields, ttl_s)

    def finish_session(self, session_id: str, fields: Fields, ttl_s: float) -> None:
        with self._lock:
            record = self._get(self._live, session_id)
            record.update(_strs(fields))
            self._finish(session_id, record, ttl_s)

    def write_finished(self, records: Sequence[Finished], totals: Mapping[str, float]) -> None:
        with self._lock:
            for session_id, fields, ttl_s in records:
                self._finish(session_id, _strs(fields), ttl_s)
        self.incr(totals)

    def probe(self, ttl_s: float) -> None:
        pass

    def session(self, session_id: str) -> dict[str, str]:
        with self._lock:
            return self._get(self._live, session_id)

    def finished_session(self, session_id: str) -> dict[str, str]:
        with self._lock:
            return self._get(self._finished, session_id)

    def live_session_ids(self) -> list[str]:
        with self._lock:
            return sorted(k for k in list(self._live) if self._get(self._live, k))

    def put_draft(self, name: str, fields: Fields, ttl_s: float) -> None:
        self.put_drafts({name: fields}, ttl_s)

    def put_drafts(self, drafts: Mapping[str, Fields], ttl_s: float, gone: Iterable[str] = ()) -> None:
        with self._lock:
            for name, fields in drafts.items():
                self._put(self._drafts, name, fields, ttl_s)
            for name in gone:
                self._drafts.pop(name, None)

    def delete_draft(self, name: str) -> None:
        self.put_drafts({}, 0.0, gone=[name])

    def drafts(self) -> list[dict[str, str]]:
        with self._lock:
            found = [self._get(self._drafts, name) for name in sorted(self._drafts)]
        return [d for d in found if d]

    def incr(self, amounts: Mapping[str, float]) -> None:
        with self._lock:
            for name, value in amounts.items():
                self._totals[name] = self._totals.get(name, 0.0) + float(value)

    def totals(self) -> dict[str, float]:
        with self._lock:
            return dict(self._totals)

    def close(self) -> None:
        pass


def open_store(url: str, prefix: str, allow_memory_fallback: bool = False,
               required: bool = True) -> MetadataStore:
    """Connect to ``url`` (or build the in-process store). Unauthenticated when Redis refuses
    the URL's password or requires one it lacks (a setting to fix, never a reason to fall back).
    Redis unreachable: the in-process store with ``allow_memory_fallback``, else the Redis store
    all the same when not ``required`` (it connects when Redis answers: the monitor reports it
    meanwhile), else Unavailable."""
    if url == MEMORY_URL:
        log.warning("using the in-process metadata store (memory://): records are lost on exit and "
                    "not shared with other cache replicas; use Redis in production")
        return MemoryStore(prefix)
    store = RedisStore(url, prefix)
    shown = store.url
    try:
        store.check()
    except StoreAuth as exc:
        store.close()
        raise Unauthenticated(str(exc)) from None
    except Unavailable:
        store.close()
    else:
        parts = urlsplit(url)
        if not has_password(url) and parts.scheme != "unix" and parts.hostname not in _LOOPBACK:
            log.warning("redis at %s takes no password: anyone who reaches it reads the draft registry "
                        "and the session records; set requirepass and give it in the URL "
                        "(redis://:PASSWORD@host, docs/deploy.md)", shown)
        return store
    if allow_memory_fallback:
        log.warning("redis at %s is unreachable; falling back to the in-process metadata store "
                    "(records are lost on exit)", shown)
        return MemoryStore(prefix)
    if not required:
        log.warning("redis at %s is unreachable; serving without it until it answers (--no-require-redis): "
                    "records wait in a bounded queue, card.v1.CacheService.redis says NOT_SERVING", shown)
        return RedisStore(url, prefix)
    raise Unavailable(
        f"redis at {shown} is unreachable. Start Redis (e.g. `redis-server`), point --redis-url / "
        f"CARD_CACHE_REDIS_URL at it, pass --allow-memory-fallback (CARD_CACHE_ALLOW_MEMORY_FALLBACK=1) "
        f"to run with an in-process store, or --no-require-redis to serve until it answers"
    )


_LOOPBACK = frozenset({"127.0.0.1", "::1", "localhost"})
