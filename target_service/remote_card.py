"""CARD through the cache service: the target loop's chain source over gRPC, a state machine.

    open   OpenSession(committed), sent with the first Step, once the prompt is prefilled
           (CacheTarget.open_after_prefill; else at once, under way while the generation prefills)
    step   Step(correction), deadline -> next chain (possibly empty) and the verdict
    close  CloseSession(final stats), nobody waiting for it

The chain only decides how fast the target goes, never what it emits: the target verifies every
token. So every failure here degrades to plain decoding instead of failing the request, and the
engine's thread waits on the network in one place only: the Step of each iteration, with its
deadline. Each step, by state (``State``):

    WAITING    no session: a plain step; an OpenSession goes once ``retry_at`` has passed and the
               breaker (cache_link.Breaker) and the bound on calls in flight let it -> OPENING
    OPENING    an OpenSession under way (a future polled, never waited for): a plain step until
               it answers -> RESYNCING; a failure -> WAITING after a backoff; NOT_FOUND /
               FAILED_PRECONDITION (the named draft left after the front checked it) -> REFUSED
    RESYNCING  the cache holds the text up to ``synced`` tokens (a late open, or drafting again
               after NO_DRAFT): the Step carries every token committed since as an accepted path
               of NO_NODE (a miss: the draft restarts from the text now), so however fast the
               target commits, the session is never wasted; its answer judged no chain of the
               session (outcome None) -> DRAFTING
    DRAFTING   every Step an ordinary correction of the session's latest chain; drafting turned
               off: this Step says so (the worker stops) -> NO_DRAFT
    NO_DRAFT   ``draft_with(None)``: no Step at all while it lasts (plain decoding at plain
               decoding's cost; the keeper keeps the session); drafting again -> RESYNCING
    REFUSED    plain decoding to the end of the request
    CLOSED     the generation ended

A failed Step (timeout, cache restarted, stale epoch) gets an empty chain; the session is closed
(fire-and-forget) and the source goes WAITING for a short pause before it re-opens (a resync).
Every Step names the drafter the engine's policy chose (``draft_with``: the worker, the cache's
model-free lookup alone, or none), and so does the open.

The source owns the session's epoch (a re-opened session starts again at 0, whatever the chains
before it said), its round-trip times and the draft's counters (from each Step's answer); the
committed sequence is the generation's, read (never copied) when a session must be opened.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import time
from collections.abc import Sequence

import grpc

from card.common.convert import correction_to_msg, step_result_from_msg
from card.common.status import error_from_rpc, error_from_status, status_from_value
from card.engine.shared.config import ChainDraw, ChainPolicy
from card.engine.shared.errors import CardError, InvalidArgument
from card.engine.shared.sampling import private_seed
from card.engine.shared.stats import GenerationStats
from card.engine.shared.tree import NO_NODE, Chain, Correction
from card.engine.target.chain_source import DraftKind, SourceStats, StepResult
from card.target_service import metrics
from card.target_service.cache_link import CACHE_TROUBLE, CacheClient
from card.v1 import cache_pb2

log = logging.getLogger(__name__)

# refused to the user as they are: the request named a draft that cannot serve it
_USER_ERRORS = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION)


def _code(err: BaseException) -> grpc.StatusCode | None:
    return err.code() if isinstance(err, grpc.Call) else None


class State(enum.Enum):
    WAITING = "waiting"
    OPENING = "opening"
    RESYNCING = "resyncing"
    DRAFTING = "drafting"
    NO_DRAFT = "no_draft"
    REFUSED = "refused"
    CLOSED = "closed"


class RemoteCard:
    """A ``ChainSource`` backed by the cache service for one request: ``requested_draft`` is the
    pool or worker it names ("" = any), ``chain`` its ChainPolicy and ``draw`` how its chains are
    chosen (None: the best path), sent with every OpenSession; ``drafters``: what it may draft
    with (card-auto: the cache's lookup alone and its worker). ``serving_draft``: the worker that
    served it last. Driven by the engine's thread only (the keeper reads ``session_id`` and
    ``last_contact``)."""

    def __init__(self, client: CacheClient, requested_draft: str = "", chain: ChainPolicy | None = None,
                 draw: ChainDraw | None = None, drafters: tuple[DraftKind, ...] = (DraftKind.WORKER,),
                 ) -> None:
        self.client = client
        self.stub = client.stub
        self.target = client.target
        self.cache_addr = client.target.cache_addr
        self.requested_draft = requested_draft
        self.chain = chain or ChainPolicy()
        # the request's seed stays here: the cache and the draft get one of their own
        self.draw = None if draw is None else ChainDraw(draw.temperature, private_seed())
        self.drafters = drafters
        self.step_timeout_s = client.target.step_timeout_s
        self.state = State.WAITING
        self.last_contact = time.monotonic()  # the last open or answered Step (SessionKeeper)
        self.session_id = ""
        self.serving_draft = ""
        self.epoch = 0  # of the current session's latest chain
        self.committed: Sequence[int] = ()  # the generation's (card.engine.target.chain_source)
        self.rtt_ms: list[float] = []
        self._kind: DraftKind | None = drafters[0]  # the drafter the engine's policy chose
        self._opening: grpc.Future | None = None  # OPENING: the OpenSession under way
        self._synced = 0  # committed tokens the session holds (OPENING, RESYNCING, NO_DRAFT)
        self._opens = 0  # opens sent (every one after the first is a resync)
        self._retry_at = 0.0
        self._retry_s = client.target.retry_initial_s
        self._draft_done = (0, 0.0)  # draft forwards and idle seconds of sessions that ended
        self._draft_now = (0, 0.0)  # the current session's, from its latest Step

    def _draft_totals(self) -> tuple[int, float]:
        return self._draft_done[0] + self._draft_now[0], self._draft_done[1] + self._draft_now[1]

    # ---- ChainSource -------------------------------------------------------------------------
    def draft_with(self, kind: DraftKind | None) -> None:
        self._kind = kind

    def open(self, committed: Sequence[int]) -> None:
        """The engine admitted the generation at ``committed``: start opening its session now, or,
        with ``open_after_prefill``, at its first Step (the engine steps a generation once its
        prompt is prefilled), so that the draft's prefill of the prompt does not run beside the
        target's where they share cores. It serves from the first step after the open answered."""
        self.committed = committed
        self.client.keeper.add(self)
        if not self.target.open_after_prefill:
            self._begin_open()  # else WAITING with retry_at 0: the first Step opens it

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
        answered = [r for r in results if r is not None]
        assert len(answered) == len(sources)
        return answered

    def _request(self, correction: Correction) -> cache_pb2.StepRequest | StepResult:
        """The Step to send for ``correction`` in this state, or the plain result without one."""
        if self.state is State.WAITING and time.monotonic() >= self._retry_at:
            self._begin_open()
        if self.state is State.OPENING:
            self._opened()
        if self.state is State.NO_DRAFT and self._kind is not None:
            self.state = State.RESYNCING
        if self.state is State.RESYNCING:
            if self._kind is None:  # opened while drafting is off: nothing to tell it yet
                self.state = State.NO_DRAFT
                return self._plain()
            # the session's text ends at ``synced``: the tokens committed since (all but
            # next_token) are a path the tree never held
            since = tuple(self.committed[self._synced:-1])
            correction = Correction(self.epoch, since, (NO_NODE,) * len(since), correction.next_token)
        elif self.state is State.DRAFTING:
            correction = dataclasses.replace(correction, epoch=self.epoch)
            if self._kind is None:  # this Step stops the session's draft; the next ones are not sent
                self.state, self._synced = State.NO_DRAFT, len(self.committed)
        else:
            return self._plain()
        return correction_to_msg(self.session_id, correction, self._kind)

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
        self.client.breaker.success()
        if self.state is State.RESYNCING:
            self.state = State.DRAFTING
            if len(self.committed) - 1 > self._synced:  # no chain of this session was judged
                result = dataclasses.replace(result, outcome=None)
        self.epoch = result.chain.epoch
        self.last_contact = time.monotonic()
        self._draft_now = (reply.ok.draft_forwards, reply.ok.draft_idle_s)
        self.serving_draft = reply.ok.draft or self.serving_draft
        return result

    def _failed(self, code: grpc.StatusCode, error: CardError, t0: float) -> StepResult:
        self._record_rtt(t0)
        metrics.STEP_FAILURES.labels(code=code.name).inc()
        if code in CACHE_TROUBLE:
            self.client.breaker.failure()
        log.warning("Step failed for session %s, plain decoding until it is re-opened: %s",
                    self.session_id, error, extra={"session_id": self.session_id})
        self._abandon(close=code is not grpc.StatusCode.NOT_FOUND)
        return self._plain()

    def close(self, stats: GenerationStats) -> SourceStats:
        """End the session; the cache records ``stats`` when CloseSession reaches it (nobody
        waits for that: the draft's counters came with each Step's answer)."""
        self.client.keeper.discard(self)
        if self._opening is not None:
            self.client.close_when_open(self._opening)
            self._opening = None
        if self.session_id:
            final = dataclasses.replace(stats, step_rtt_ms=list(self.rtt_ms))
            self.client.close_session(self.session_id, final)
            self.session_id = ""
        self.state = State.CLOSED
        forwards, idle = self._draft_totals()
        return SourceStats(draft_forwards=forwards, draft_idle_s=idle, step_rtt_ms=self.rtt_ms)

    # ---- sessions ----------------------------------------------------------------------------
    def _begin_open(self) -> None:
        """Send OpenSession at the committed text now, when the breaker and the bound on calls in
        flight let it (-> OPENING); otherwise try again after a pause."""
        breaker = self.client.breaker
        if not breaker.allow():
            self._retry_at = time.monotonic() + max(breaker.retry_in(), self.target.retry_initial_s)
            return
        future = self.client.open_session(list(self.committed), self.requested_draft, self.chain, self.draw,
                                          self._kind)
        if future is None:
            self._retry_at = time.monotonic() + self.target.retry_initial_s
            return
        self.state, self._opening, self._synced = State.OPENING, future, len(self.committed)
        self._opens += 1

    def _opened(self) -> None:
        """OPENING: whether the open answered (non-blocking): RESYNCING with its session, WAITING
        after a failure, REFUSED when the cache refused this request's draft."""
        future = self._opening
        assert future is not None
        if not future.done():
            return
        self._opening = None
        err = future.exception() if not future.cancelled() else grpc.FutureCancelledError()
        if err is not None:
            message = error_from_rpc(err, self.cache_addr) if isinstance(err, grpc.RpcError) else err
            if _code(err) in _USER_ERRORS:  # the named draft left after the front checked it
                self.state = State.REFUSED
                metrics.DEGRADED.inc()
                log.warning("the cache refused this request's session, decoding without a draft: %s", message)
                return
            self.state = State.WAITING
            self._backoff()
            log.info("opening a session at the cache %s failed (next try in %.1fs): %s", self.cache_addr,
                     self._retry_s, message)
            return
        reply = future.result()
        if self._opens > 1:
            metrics.RESYNCS.inc()
        if len(self.committed) - 1 > self._synced:
            metrics.CATCH_UPS.inc()
        self.state = State.RESYNCING
        self.session_id = reply.session_id
        self.serving_draft = reply.draft or self.serving_draft
        self.epoch = 0
        self.last_contact = time.monotonic()
        self._retry_s = self.target.retry_initial_s
        log.debug("session %s opened (draft %s)", self.session_id, reply.draft or "none",
                  extra={"session_id": self.session_id})

    def _backoff(self) -> None:
        self._retry_at = time.monotonic() + self._retry_s
        self._retry_s = min(self._retry_s * 2, self.target.retry_max_s)

    def _abandon(self, close: bool) -> None:
        if close and self.session_id:
            self.client.close_session(self.session_id)
        self.session_id, self.state = "", State.WAITING
        self._draft_done, self._draft_now = self._draft_totals(), (0, 0.0)
        # not at once: a failed Step often means the cache is restarting, and a session opened on
        # a cache that is shutting down would be lost with it
        self._retry_at = time.monotonic() + self.target.retry_initial_s
        self._retry_s = self.target.retry_initial_s

    # ---- helpers -----------------------------------------------------------------------------
    def _plain(self) -> StepResult:
        return StepResult(Chain(epoch=self.epoch))

    def _record_rtt(self, t0: float) -> None:
        ms = (time.perf_counter() - t0) * 1000.0
        metrics.STEP_RTT.observe(ms / 1000.0)
        self.rtt_ms.append(ms)
