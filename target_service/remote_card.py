"""CARD through the cache service: the target loop's chain source over gRPC.

    open   OpenSession(prompt)        -> session id, assigned draft worker (maybe none yet)
    step   Step(correction), deadline -> next chain (possibly empty) and the verdict
    close  CloseSession(final stats)  -> draft-side stats

The chain only decides how fast the target goes, never what it emits: the target verifies every
token. So every failure here degrades to plain decoding instead of failing the request:

- OpenSession fails (cache down, timeout, anything but NOT_FOUND / FAILED_PRECONDITION, which are
  the user's to see): this request decodes alone.
- Step fails (timeout, cache restarted, stale epoch): that step gets an empty chain; a step after a
  short pause re-opens a session at the committed text so far (retrying with backoff while the
  cache is down).

The source owns the session's epoch (a re-opened session starts again at 0, whatever the chains
before it said) and its round-trip times; the committed sequence is the generation's, read (never
copied) when a session must be re-opened.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from card.common.convert import chain_policy_to_msg, correction_to_msg, stats_to_msg, step_result_from_msg
from card.common.status import error_from_rpc, error_from_status, status_from_value
from card.common.tensors import ids_to_msg
from card.engine.shared.config import ChainPolicy
from card.engine.shared.errors import CardError, InvalidArgument
from card.engine.shared.stats import GenerationStats
from card.engine.shared.tree import Chain, Correction
from card.engine.target.chain_source import SourceStats, StepResult
from card.target_service import metrics
from card.v1 import cache_pb2, cache_pb2_grpc

log = logging.getLogger(__name__)

# refused to the user as they are: the request named a draft that cannot serve it
_USER_ERRORS = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION)


def _code(err: grpc.RpcError) -> grpc.StatusCode | None:
    return err.code() if isinstance(err, grpc.Call) else None


def session_idle_timeout_s(step_timeout_s: float) -> float:
    """How long the cache keeps one of this target's sessions without a Step or keepalive: ten
    Step deadlines, at least 5 s. A target that died frees its sessions' draft capacity this soon;
    a live one keeps every session it still serves alive (SessionKeeper), however long its prefill
    or its wait for a KV slot."""
    return max(5.0, 10.0 * step_timeout_s)


class SessionKeeper:
    """Sends the cache, every quarter of the idle timeout, the ids of this target's open sessions
    that had no Step or open in that time (one StepBatch with keepalive ids, no steps): a session
    is closed for idleness only when its target is gone."""

    def __init__(self, stub: cache_pb2_grpc.CacheServiceStub, idle_timeout_s: float, cache_addr: str) -> None:
        self.stub = stub
        self.period_s = idle_timeout_s / 4.0
        self.cache_addr = cache_addr
        self._sources: weakref.WeakSet[RemoteCard] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="session-keeper", daemon=True)
        self._thread.start()

    def add(self, source: RemoteCard) -> None:
        with self._lock:
            self._sources.add(source)

    def discard(self, source: RemoteCard) -> None:
        with self._lock:
            self._sources.discard(source)

    def stop(self) -> None:
        self._stop.set()

    def quiet_sessions(self) -> list[str]:
        now = time.monotonic()
        with self._lock:
            sources = list(self._sources)
        return [s.session_id for s in sources if s.session_id and now - s.last_contact >= self.period_s]

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            ids = self.quiet_sessions()
            if not ids:
                continue
            try:
                self.stub.StepBatch(cache_pb2.StepBatchRequest(keepalive_session_ids=ids),
                                    timeout=self.period_s)
            except grpc.RpcError as err:  # the cache is down: its sessions are lost anyway
                log.debug("keepalive of %d session(s) failed: %s", len(ids),
                          error_from_rpc(err, self.cache_addr))


@dataclass(frozen=True)
class CacheTarget:
    """What every session of one card-target tells the cache, and how long it waits: built once
    (target_service.frontend), shared by every RemoteCard. ``vocab_size`` and ``context_window``
    are the target's: the cache checks prompts and the draft's layers against them."""

    cache_addr: str
    target_model: str
    fingerprint: str
    vocab_size: int = 0
    context_window: int = 0
    step_timeout_s: float = 1.0
    open_timeout_s: float = 5.0
    retry_initial_s: float = 0.5
    retry_max_s: float = 5.0

    @property
    def idle_timeout_s(self) -> float:
        return session_idle_timeout_s(self.step_timeout_s)


class RemoteCard:
    """A ``ChainSource`` backed by the cache service for one request: ``draft`` is the worker it
    names ("" = any), ``chain`` its ChainPolicy, sent with every OpenSession."""

    def __init__(self, stub: cache_pb2_grpc.CacheServiceStub, target: CacheTarget, draft: str = "",
                 chain: ChainPolicy | None = None, keeper: SessionKeeper | None = None) -> None:
        self.stub = stub
        self.target = target
        self.cache_addr = target.cache_addr
        self.draft = draft
        self.chain = chain or ChainPolicy()
        self.step_timeout_s = target.step_timeout_s
        self.keeper = keeper
        self.last_contact = time.monotonic()  # the last open or answered Step (SessionKeeper)
        self.session_id = ""
        self.draft_name = ""  # the worker that served the (last) session
        self.epoch = 0  # of the current session's latest chain
        self.committed: Sequence[int] = ()  # the generation's (card.engine.target.chain_source)
        self.rtt_ms: list[float] = []
        self._degraded = False  # the first open failed: plain decoding for this request
        self._retry_at = 0.0
        self._retry_s = target.retry_initial_s
        self._draft_forwards = 0  # from sessions closed before the last one
        self._draft_idle_s = 0.0

    # ---- ChainSource -------------------------------------------------------------------------
    def open(self, committed: Sequence[int]) -> None:
        self.committed = committed
        if self.keeper is not None:
            self.keeper.add(self)
        try:
            self._open_session(list(committed))
        except grpc.RpcError as err:
            if _code(err) in _USER_ERRORS:
                raise error_from_rpc(err, self.cache_addr) from None
            self._degraded = True
            metrics.DEGRADED.inc()
            log.warning("cannot open a session at the cache %s, decoding without a draft: %s",
                        self.cache_addr, error_from_rpc(err, self.cache_addr))

    def step(self, correction: Correction) -> StepResult:
        return RemoteCard.step_batch([self], [correction])[0]

    @classmethod
    def step_batch(cls, sources: Sequence[RemoteCard], corrections: Sequence[Correction]) -> list[StepResult]:
        """Step every source, those with a live session in one StepBatch round trip per cache
        channel (one target iteration: one round trip, whatever the load)."""
        results: list[StepResult | None] = [None] * len(sources)
        by_stub: dict[int, list[tuple[int, cache_pb2.StepRequest]]] = {}
        for i, (src, correction) in enumerate(zip(sources, corrections, strict=True)):
            request = src._request(correction)
            if isinstance(request, StepResult):
                results[i] = request
            else:
                by_stub.setdefault(id(src.stub), []).append((i, request))
        for batch in by_stub.values():
            stub, timeout = sources[batch[0][0]].stub, sources[batch[0][0]].step_timeout_s
            t0 = time.perf_counter()
            try:
                if len(batch) == 1:  # a lone session: the plain Step, one message less
                    replies = [cache_pb2.StepResult(ok=stub.Step(batch[0][1], timeout=timeout))]
                else:
                    replies = list(stub.StepBatch(cache_pb2.StepBatchRequest(steps=[r for _, r in batch]),
                                                  timeout=timeout).results)
            except grpc.RpcError as err:
                code = _code(err) or grpc.StatusCode.UNKNOWN
                for i, _ in batch:
                    results[i] = sources[i]._failed(code, error_from_rpc(err, sources[i].cache_addr), t0)
                continue
            if len(replies) != len(batch):
                replies = [cache_pb2.StepResult()] * len(batch)  # malformed: each ends its session below
            for (i, _), reply in zip(batch, replies, strict=True):
                results[i] = sources[i]._answer(reply, t0)
        return results  # type: ignore[return-value]

    def _request(self, correction: Correction) -> cache_pb2.StepRequest | StepResult:
        """The Step to send for ``correction``, or the plain result when there is no session."""
        if self._degraded:
            return self._plain()
        if not self.session_id:
            # the committed text before next_token (the generation has committed this correction)
            if time.monotonic() < self._retry_at or not self._reopen(list(self.committed[:-1])):
                return self._plain()
            # the new session's committed text ends before next_token, at epoch 0
            correction = Correction(0, (), (), correction.next_token)
        else:
            correction = Correction(self.epoch, correction.accepted_tokens,
                                    correction.accepted_node_ids, correction.next_token)
        return correction_to_msg(self.session_id, correction)

    def _answer(self, reply: cache_pb2.StepResult, t0: float) -> StepResult:
        kind = reply.WhichOneof("result")
        if kind == "error":
            code = status_from_value(reply.error.code)
            return self._failed(code, error_from_status(code, reply.error.message, self.cache_addr), t0)
        try:
            if kind != "ok":
                raise InvalidArgument("a StepBatch result holds neither a response nor an error")
            result = step_result_from_msg(reply.ok)
        except CardError as exc:  # a malformed reply: a bug on the other side, not the user's
            log.error("bad Step reply for session %s: %s", self.session_id, exc)
            self._abandon(close=True)
            return self._plain()
        self._record_rtt(t0)
        self.epoch = result.chain.epoch
        self.last_contact = time.monotonic()
        return result

    def _failed(self, code: grpc.StatusCode, error: CardError, t0: float) -> StepResult:
        self._record_rtt(t0)
        metrics.STEP_FAILURES.labels(code=code.name).inc()
        log.warning("Step failed for session %s, plain decoding until it is re-opened: %s",
                    self.session_id, error, extra={"session_id": self.session_id})
        self._abandon(close=code is not grpc.StatusCode.NOT_FOUND)
        return self._plain()

    def close(self, stats: GenerationStats) -> SourceStats:
        if self.keeper is not None:
            self.keeper.discard(self)
        if self.session_id:
            self._close_session(dataclasses.replace(stats, step_rtt_ms=list(self.rtt_ms)))
        return SourceStats(draft_forwards=self._draft_forwards, draft_idle_s=self._draft_idle_s,
                           step_rtt_ms=self.rtt_ms)

    # ---- sessions ----------------------------------------------------------------------------
    def _open_session(self, committed: list[int], timeout_s: float | None = None) -> None:
        target = self.target
        reply = self.stub.OpenSession(
            cache_pb2.OpenSessionRequest(prompt_ids=ids_to_msg(committed), vocab_size=target.vocab_size,
                                         context_window=target.context_window,
                                         tokenizer_fingerprint=target.fingerprint,
                                         target_model=target.target_model, draft=self.draft,
                                         chain=chain_policy_to_msg(self.chain),
                                         idle_timeout_ms=round(target.idle_timeout_s * 1000)),
            timeout=timeout_s or target.open_timeout_s,
        )
        self.last_contact = time.monotonic()
        self.session_id = reply.session_id
        self.draft_name = reply.draft or self.draft_name
        self.epoch = 0
        self._retry_s = self.target.retry_initial_s
        log.debug("session %s opened (draft %s)", self.session_id, reply.draft or "none",
                  extra={"session_id": self.session_id})

    def _reopen(self, committed: list[int]) -> bool:
        try:
            # mid-generation every second counts: never stall the target longer than one Step may
            self._open_session(committed, timeout_s=min(self.step_timeout_s, self.target.open_timeout_s))
        except grpc.RpcError as err:
            self._retry_at = time.monotonic() + self._retry_s
            self._retry_s = min(self._retry_s * 2, self.target.retry_max_s)
            log.warning("re-opening a session at the cache %s failed (next try in %.1fs): %s",
                        self.cache_addr, self._retry_s, error_from_rpc(err, self.cache_addr))
            return False
        metrics.RESYNCS.inc()
        return True

    def _abandon(self, close: bool) -> None:
        if close:
            self._close_session(None)
        self.session_id = ""
        # not at once: a failed Step often means the cache is restarting, and a session opened on
        # a cache that is shutting down would be lost with it
        self._retry_at = time.monotonic() + self.target.retry_initial_s
        self._retry_s = self.target.retry_initial_s

    def _close_session(self, stats: GenerationStats | None) -> None:
        """End the session; ``stats`` (the generation's, at its end) are recorded by the cache."""
        request = cache_pb2.CloseSessionRequest(session_id=self.session_id)
        if stats is not None:
            request.stats.CopyFrom(stats_to_msg(stats))
        try:
            reply = self.stub.CloseSession(request, timeout=self.target.open_timeout_s)
            self._draft_forwards += reply.draft_forwards
            self._draft_idle_s += reply.draft_idle_s
        except grpc.RpcError as err:
            log.warning("CloseSession failed for session %s: %s", self.session_id,
                        error_from_rpc(err, self.cache_addr), extra={"session_id": self.session_id})
        self.session_id = ""

    # ---- helpers -----------------------------------------------------------------------------
    def _plain(self) -> StepResult:
        return StepResult(Chain(epoch=self.epoch))

    def _record_rtt(self, t0: float) -> None:
        ms = (time.perf_counter() - t0) * 1000.0
        metrics.STEP_RTT.observe(ms / 1000.0)
        self.rtt_ms.append(ms)
