"""CARD through the cache service: the target loop's chain source over gRPC.

    open   OpenSession(committed), under way while the generation prefills (cache_link.CacheLink)
    step   Step(correction), deadline -> next chain (possibly empty) and the verdict
    close  CloseSession(final stats), nobody waiting for it

The chain only decides how fast the target goes, never what it emits: the target verifies every
token. So every failure here degrades to plain decoding instead of failing the request, and the
engine's thread waits on the network in one place only: the Step of each iteration, with its
deadline.

- An open is a future the engine polls at the generation's next step; until it has answered, the
  step gets an empty chain. A session that answered after its generation committed more tokens
  catches up in its first Step: they go as an accepted path of NO_NODE (a miss; the draft
  restarts from the text now), so however fast the target commits, the open is never wasted.
- OpenSession fails (cache down, timeout): plain steps, and a new open after a backoff, while the
  breaker lets it (cache_link.Breaker). NOT_FOUND / FAILED_PRECONDITION (the named draft left
  after the front checked it): this request decodes without a draft.
- Step fails (timeout, cache restarted, stale epoch): that step gets an empty chain, the session is
  closed (fire-and-forget) and another opened at the committed text after a short pause.
- Paused by the engine's speculation controller (``Pausable``): one Step tells the cache
  (``pause_draft``: its worker stops drafting the session), then no Step goes at all while it
  lasts (plain decoding at plain decoding's cost; the keeper keeps the session). Resumed, the next
  Step carries the tokens committed since as a path the tree never held, as a late open does, and
  a worker drafts again from the whole text. A source paused before it opens opens paused.
- ``card-auto`` (``choice``, card.engine.target.drafter_choice): the session alternates between
  the cache's model-free lookup alone (every Step says ``pause_draft``: no worker spends anything
  on it, the chains come from its own text) and its worker, keeping whichever commits faster.

The source owns the session's epoch (a re-opened session starts again at 0, whatever the chains
before it said), its round-trip times and the draft's counters (from each Step's answer); the
committed sequence is the generation's, read (never copied) when a session must be opened.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence

import grpc

from card.common.convert import correction_to_msg, step_result_from_msg
from card.common.status import error_from_rpc, error_from_status, status_from_value
from card.engine.shared.config import ChainDraw, ChainPolicy
from card.engine.shared.errors import CardError, InvalidArgument
from card.engine.shared.stats import GenerationStats
from card.engine.shared.tree import NO_NODE, Chain, Correction
from card.engine.target.chain_source import SourceStats, StepResult
from card.engine.target.drafter_choice import MODEL_FREE, DrafterChoice
from card.target_service import metrics
from card.target_service.cache_link import CACHE_TROUBLE, CacheLink
from card.v1 import cache_pb2

log = logging.getLogger(__name__)

# refused to the user as they are: the request named a draft that cannot serve it
_USER_ERRORS = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION)


def _code(err: BaseException) -> grpc.StatusCode | None:
    return err.code() if isinstance(err, grpc.Call) else None


class RemoteCard:
    """A ``ChainSource`` backed by the cache service for one request: ``draft`` is the worker it
    names ("" = any), ``chain`` its ChainPolicy and ``draw`` how its chains are chosen (None: the
    best path), sent with every OpenSession; ``choice``: card-auto, the session's drafter chosen
    by pace (None: its worker throughout). Driven by the engine's thread only (the keeper reads
    ``session_id`` and ``last_contact``)."""

    def __init__(self, link: CacheLink, draft: str = "", chain: ChainPolicy | None = None,
                 draw: ChainDraw | None = None, choice: DrafterChoice | None = None) -> None:
        self.link = link
        self.stub = link.stub
        self.target = link.target
        self.cache_addr = link.target.cache_addr
        self.draft = draft
        self.chain = chain or ChainPolicy()
        self.draw = draw
        self.step_timeout_s = link.target.step_timeout_s
        self.last_contact = time.monotonic()  # the last open or answered Step (SessionKeeper)
        self.session_id = ""
        self.draft_name = ""  # the worker that served the (last) session
        self.epoch = 0  # of the current session's latest chain
        self.committed: Sequence[int] = ()  # the generation's (card.engine.target.chain_source)
        self.rtt_ms: list[float] = []
        self._opening: grpc.Future | None = None  # an OpenSession under way
        self._opened_at = 0  # committed tokens it opens at
        self._opens = 0  # opens sent (every one after the first is a resync)
        self._catching_up = False  # the Step in flight tells a late session the text it missed
        self._degraded = False  # the cache refused the named draft: plain decoding for this request
        self._retry_at = 0.0
        self._retry_s = link.target.retry_initial_s
        self._draft_done = (0, 0.0)  # draft forwards and idle seconds of sessions that ended
        self._draft_now = (0, 0.0)  # the current session's, from its latest Step
        self.choice = choice
        self._hold = False  # the engine's controller wants drafting paused: no Step at all
        self._silent_at: int | None = None  # committed tokens the cache holds while no Step goes

    def _draft_totals(self) -> tuple[int, float]:
        return self._draft_done[0] + self._draft_now[0], self._draft_done[1] + self._draft_now[1]

    # ---- ChainSource -------------------------------------------------------------------------
    def open(self, committed: Sequence[int]) -> None:
        """Start opening a session at ``committed`` (the engine admitted the generation); it
        serves from the first step after it has answered."""
        self.committed = committed
        self.link.keeper.add(self)
        self._begin_open()

    def step(self, correction: Correction) -> StepResult:
        return RemoteCard.step_batch([self], [correction])[0]

    def pause_drafting(self) -> None:
        self._hold = True

    def resume_drafting(self) -> None:
        self._hold = False

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

    @property
    def _model_free(self) -> bool:
        """card-auto has chosen the cache's model-free lookup alone: the worker stays paused."""
        return self.choice is not None and self.choice.current == MODEL_FREE

    def _choose(self, correction: Correction) -> None:
        """card-auto: time the step the session served and maybe switch drafters (the Step about
        to go says which: ``pause_draft`` for the lookup alone, none to draft again)."""
        if self.choice is None:
            return
        if self._hold or not self.session_id or self._silent_at is not None:
            self.choice.untimed()  # no drafter served this step
            return
        to = self.choice.step(len(correction.accepted_tokens) + 1)
        if to is not None:
            metrics.DRAFTER_SWITCHES.labels(to).inc()

    def _request(self, correction: Correction) -> cache_pb2.StepRequest | StepResult:
        """The Step to send for ``correction``, or the plain result when there is no session."""
        if self._degraded:
            return self._plain()
        self._choose(correction)
        if not self.session_id:
            if self._opening is None:
                if time.monotonic() >= self._retry_at:
                    self._begin_open()
                return self._plain()
            if not self._opened():
                return self._plain()
            if self._hold:  # opened paused: nothing to tell it yet
                self._silent_at = self._opened_at
                return self._plain()
            # the session's text ends where it opened, at epoch 0: the tokens committed since (all
            # but next_token) are a path the tree never held
            since = tuple(self.committed[self._opened_at:-1])
            correction = Correction(0, since, (NO_NODE,) * len(since), correction.next_token)
            self._catching_up = bool(since)
            if since:
                metrics.CATCH_UPS.inc()
        elif self._silent_at is not None:
            if self._hold:  # paused: no round trip at all
                return self._plain()
            # resumed: the text committed since the pause, as a path the tree never held
            since = tuple(self.committed[self._silent_at:-1])
            correction = Correction(self.epoch, since, (NO_NODE,) * len(since), correction.next_token)
            self._catching_up, self._silent_at = True, None
        else:
            correction = Correction(self.epoch, correction.accepted_tokens,
                                    correction.accepted_node_ids, correction.next_token)
            if self._hold:  # this Step pauses the session's draft; the next ones are not sent
                self._silent_at = len(self.committed)
        # the cache's session has no worker while the engine holds it or card-auto chose the lookup
        return correction_to_msg(self.session_id, correction, pause_draft=self._hold or self._model_free)

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
        self.link.breaker.success()
        if self._catching_up:  # no chain of this session was judged: its "miss" is no verdict
            self._catching_up = False
            result = dataclasses.replace(result, outcome=None)
        self.epoch = result.chain.epoch
        self.last_contact = time.monotonic()
        self._draft_now = (reply.ok.draft_forwards, reply.ok.draft_idle_s)
        self.draft_name = reply.ok.draft or self.draft_name
        return result

    def _failed(self, code: grpc.StatusCode, error: CardError, t0: float) -> StepResult:
        self._catching_up = False
        self._record_rtt(t0)
        metrics.STEP_FAILURES.labels(code=code.name).inc()
        if code in CACHE_TROUBLE:
            self.link.breaker.failure()
        log.warning("Step failed for session %s, plain decoding until it is re-opened: %s",
                    self.session_id, error, extra={"session_id": self.session_id})
        self._abandon(close=code is not grpc.StatusCode.NOT_FOUND)
        return self._plain()

    def close(self, stats: GenerationStats) -> SourceStats:
        """End the session; the cache records ``stats`` when CloseSession reaches it (nobody
        waits for that: the draft's counters came with each Step's answer)."""
        self.link.keeper.discard(self)
        if self._opening is not None:
            self.link.close_when_open(self._opening)
            self._opening = None
        if self.session_id:
            final = dataclasses.replace(stats, step_rtt_ms=list(self.rtt_ms))
            self.link.close_session(self.session_id, final)
            self.session_id = ""
        forwards, idle = self._draft_totals()
        return SourceStats(draft_forwards=forwards, draft_idle_s=idle, step_rtt_ms=self.rtt_ms)

    # ---- sessions ----------------------------------------------------------------------------
    def _begin_open(self) -> None:
        """Send OpenSession at the committed text now, when the breaker and the bound on calls in
        flight let it; otherwise try again after a pause."""
        if not self.link.breaker.allow():
            self._retry_at = time.monotonic() + max(self.link.breaker.retry_in(), self.target.retry_initial_s)
            return
        paused = self._hold or self._model_free
        future = self.link.open_session(list(self.committed), self.draft, self.chain, self.draw,
                                        paused=paused)
        if future is None:
            self._retry_at = time.monotonic() + self.target.retry_initial_s
            return
        self._opening, self._opened_at = future, len(self.committed)
        self._silent_at = None
        self._opens += 1

    def _opened(self) -> bool:
        """Whether the open under way answered with a session this step can use (non-blocking)."""
        future = self._opening
        assert future is not None
        if not future.done():
            return False
        self._opening = None
        err = future.exception() if not future.cancelled() else grpc.FutureCancelledError()
        if err is not None:
            code = _code(err)
            if code in _USER_ERRORS:  # the named draft left after the front checked it
                self._degraded = True
                metrics.DEGRADED.inc()
                log.warning("the cache refused this request's session, decoding without a draft: %s",
                            error_from_rpc(err, self.cache_addr))  # type: ignore[arg-type]
                return False
            self._backoff()
            log.info("opening a session at the cache %s failed (next try in %.1fs): %s", self.cache_addr,
                     self._retry_s, error_from_rpc(err, self.cache_addr) if isinstance(err, grpc.RpcError)
                     else err)
            return False
        reply = future.result()
        if self._opens > 1:
            metrics.RESYNCS.inc()
        self.session_id = reply.session_id
        self.draft_name = reply.draft or self.draft_name
        self.epoch = 0
        self.last_contact = time.monotonic()
        self._retry_s = self.target.retry_initial_s
        log.debug("session %s opened (draft %s)", self.session_id, reply.draft or "none",
                  extra={"session_id": self.session_id})
        return True

    def _backoff(self) -> None:
        self._retry_at = time.monotonic() + self._retry_s
        self._retry_s = min(self._retry_s * 2, self.target.retry_max_s)

    def _abandon(self, close: bool) -> None:
        if close and self.session_id:
            self.link.close_session(self.session_id)
        self.session_id = ""
        self._silent_at = None
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
