"""card.v1.CacheService over SessionTable and Assignments: decode, call, encode. No tree logic here.

This is the cache's edge: requests are decoded into engine values once, here (with
card.common.convert), and the domain's answers are encoded here; SessionTable and Assignments
never see a card.v1 message. No lock is taken here.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import time
from collections.abc import Iterator, Mapping

import grpc

from card.cache_service import metrics
from card.cache_service.assignment import Assignments
from card.cache_service.config import CacheConfig
from card.cache_service.monitor import Monitor
from card.cache_service.pools import PoolCounters
from card.cache_service.registry import DraftRegistration, Worker
from card.cache_service.sessions import Session, SessionTable
from card.cache_service.store import MetadataStore
from card.common.convert import (
    chain_draw_from_msg,
    chain_policy_from_msg,
    chain_to_msg,
    command_to_msg,
    correction_from_msg,
    layer_from_msg,
    stats_from_msg,
    worker_off,
)
from card.common.drafts import POOL_TOKEN_METADATA, WORKER_ID_METADATA, check_pool_token
from card.common.status import grpc_errors, status_code
from card.common.tensors import ids_from_msg
from card.engine.shared.errors import (
    CardError,
    InvalidArgument,
    NotFound,
    Unavailable,
)
from card.v1 import cache_pb2, cache_pb2_grpc

log = logging.getLogger(__name__)


def session_to_msg(session: Session) -> cache_pb2.SessionInfo:
    return cache_pb2.SessionInfo(
        session_id=session.session_id, target_model=session.target_model, draft=session.serving_draft,
        epoch=session.card.epoch, committed_tokens=len(session.card.committed),
        tree_nodes=len(session.card.tree),
    )


def draft_record_to_msg(record: Mapping[str, str | int | float]) -> cache_pb2.DraftInfo:
    """A worker's registry entry (``Worker.record()``, or its copy in Redis: every value a string)."""
    return cache_pb2.DraftInfo(
        name=str(record.get("name", "")), model=str(record.get("model", "")),
        tokenizer_fingerprint=str(record.get("tokenizer_fingerprint", "")),
        capacity=int(record.get("capacity", 0)), active_sessions=int(record.get("active_sessions", 0)),
        last_heartbeat_unix=float(record.get("last_heartbeat_unix", 0.0)),
        pool=str(record.get("pool", "")),
        draining=bool(int(record.get("draining", 0))), live=bool(int(record.get("live", 0))),
    )


def pool_to_msg(name: str, workers: list[Worker], weight: float, counters: PoolCounters | None
                ) -> cache_pb2.PoolInfo:
    c = counters or PoolCounters()
    return cache_pb2.PoolInfo(
        name=name, weight=weight, workers=len(workers),
        live_workers=sum(w.streaming and not w.closed and not w.draining for w in workers),
        capacity=sum(w.capacity for w in workers), active_sessions=sum(len(w.sessions) for w in workers),
        steps=c.steps, chains=c.chains, chain_tokens=c.chain_tokens, accepted_tokens=c.accepted_tokens,
        committed_tokens=c.committed_tokens, hits=c.hits, busy_s=c.busy_s,
    )


class CacheServicer(cache_pb2_grpc.CacheServiceServicer):
    def __init__(self, config: CacheConfig, store: MetadataStore, assignments: Assignments,
                 sessions: SessionTable, monitor: Monitor) -> None:
        self.config = config
        self.store = store
        self.assignments = assignments
        self.sessions = sessions
        self.monitor = monitor
        self._internal_errors = 0  # steps of a StepBatch that failed with an unforeseen error

    # ---- target -------------------------------------------------------------------------------
    @grpc_errors
    def OpenSession(self, request: cache_pb2.OpenSessionRequest, context: grpc.ServicerContext
                    ) -> cache_pb2.OpenSessionResponse:
        # no Redis here: a session opens (and speculates) with the store down or full; its records
        # are written in the background (SessionTable, RecordWriter)
        session = self.sessions.open(ids_from_msg(request.prompt_ids), request.tokenizer_fingerprint,
                                     request.target_model, request.draft,
                                     chain_policy_from_msg(request.chain), request.vocab_size,
                                     request.context_window, request.idle_timeout_ms / 1000.0,
                                     chain_draw_from_msg(request.draw) if request.HasField("draw") else None,
                                     request.default_pool, worker_off(request.drafter))
        return cache_pb2.OpenSessionResponse(session_id=session.session_id, draft=session.serving_draft)

    @grpc_errors
    def Step(self, request: cache_pb2.StepRequest, context: grpc.ServicerContext) -> cache_pb2.StepResponse:
        return self._step(request)

    @grpc_errors
    def StepBatch(self, request: cache_pb2.StepBatchRequest, context: grpc.ServicerContext
                  ) -> cache_pb2.StepBatchResponse:
        metrics.STEP_BATCHES.inc()
        self.sessions.keep_alive(request.keepalive_session_ids)
        results = []
        for step in request.steps:
            try:
                results.append(cache_pb2.StepResult(ok=self._step(step)))
            except CardError as exc:  # this session's error; the others' steps stand
                results.append(cache_pb2.StepResult(error=cache_pb2.StepError(
                    code=status_code(exc).value[0], message=str(exc))))
            except Exception:  # a bug, or a tree a draft made that the code did not foresee: this
                # session's step fails INTERNAL, the batch (every other session of the target) stands
                self._internal_errors += 1
                if self._internal_errors == 1 or self._internal_errors % 1000 == 0:
                    log.exception("StepBatch: the step of session %s failed (%d such so far); the "
                                  "batch's other steps are answered", step.session_id, self._internal_errors,
                                  extra={"session_id": step.session_id})
                metrics.STEP_ERRORS.inc()
                results.append(cache_pb2.StepResult(error=cache_pb2.StepError(
                    code=grpc.StatusCode.INTERNAL.value[0],
                    message=f"the cache failed this session's step ({self._internal_errors} such); "
                            "its other sessions' steps are answered")))
        return cache_pb2.StepBatchResponse(results=results)

    def _step(self, request: cache_pb2.StepRequest) -> cache_pb2.StepResponse:
        chain, outcome = self.sessions.step(request.session_id, correction_from_msg(request),
                                            worker_off(request.drafter))
        reply = chain_to_msg(chain, outcome)
        with contextlib.suppress(NotFound):  # closed since: its counters are in its record
            session = self.sessions.get(request.session_id)
            reply.draft_forwards, reply.draft_idle_s = session.seat.totals()
            reply.draft = session.serving_draft
        return reply

    @grpc_errors
    def CloseSession(self, request: cache_pb2.CloseSessionRequest, context: grpc.ServicerContext
                     ) -> cache_pb2.CloseSessionResponse:
        stats = stats_from_msg(request.stats) if request.HasField("stats") else None
        forwards, idle = self.sessions.close(request.session_id, stats)
        return cache_pb2.CloseSessionResponse(draft_forwards=forwards, draft_idle_s=idle)

    # ---- draft workers ------------------------------------------------------------------------
    @grpc_errors
    def RegisterDraft(self, request: cache_pb2.RegisterDraftRequest, context: grpc.ServicerContext
                      ) -> cache_pb2.RegisterDraftResponse:
        registration = DraftRegistration(request.name, request.model, request.tokenizer_fingerprint,
                                         request.capacity, request.pool)
        # a pool bound to a credential (--pool-tokens) takes only workers that present it
        check_pool_token(self.config.pool_tokens, registration.pool_or_model,
                         next((str(v) for k, v in context.invocation_metadata() or ()
                               if k == POOL_TOKEN_METADATA), ""))
        worker, _ = self.assignments.register(registration, self.config.worker_ttl_s)
        self.monitor.kick()  # its Redis record: the monitor's store loop writes it, no RPC waits on Redis
        return cache_pb2.RegisterDraftResponse(worker_id=worker.worker_id,
                                               heartbeat_interval_s=self.config.heartbeat_interval_s)

    @grpc_errors
    def Commands(self, request: cache_pb2.CommandsRequest, context: grpc.ServicerContext
                 ) -> Iterator[cache_pb2.DraftCommand]:
        # the worker may take sessions from here (waiting ones at once): its initial metadata tells
        # it so (the draft link reports SERVING, and tests proceed, only once it has arrived)
        worker = self.assignments.open_stream(request.worker_id, context.cancel)
        context.add_callback(worker.close)  # wake the loop when the peer goes
        context.send_initial_metadata(())
        try:
            while context.is_active() and not worker.closed:
                try:
                    command = worker.commands.get(timeout=1.0)
                except queue.Empty:
                    continue
                if command is None or worker.closed:
                    break
                yield command_to_msg(command)
        finally:
            if self.assignments.gone(worker, "closed its command stream; unregistered"):
                self.monitor.kick()  # its Redis record goes in the store loop's next round

    @grpc_errors
    def PublishLayers(self, request_iterator: Iterator[cache_pb2.LayerMessage],
                      context: grpc.ServicerContext) -> cache_pb2.PublishLayersResponse:
        # the registered worker the stream belongs to: its metadata says which
        worker_id = next((v for k, v in context.invocation_metadata() or () if k == WORKER_ID_METADATA), "")
        if not worker_id:
            raise InvalidArgument(f"a layer stream must name its worker in the {WORKER_ID_METADATA!r} "
                                  f"metadata (a draft from before pools: upgrade it)")
        # ended by the cache when its worker goes (expired, replaced, its command stream ended)
        worker, key = self.assignments.open_layer_stream(str(worker_id), context.cancel)
        received = malformed = 0
        try:
            for msg in request_iterator:
                if worker.closed:  # gone meanwhile: its cancel is on its way; read no more
                    break
                received += 1
                metrics.LAYERS.inc()
                if msg.worker_id != worker.worker_id:  # one worker may not speak for another
                    metrics.LAYERS_MALFORMED.inc()
                    continue
                if msg.dropped:
                    self.assignments.dropped(msg.session_id, msg.worker_id)
                    continue
                try:
                    self.sessions.apply_layer(msg.session_id, msg.worker_id, layer_from_msg(msg),
                                              msg.draft_forwards, msg.draft_idle_s)
                except CardError as exc:  # a draft's bug (or worse): drop the layer, keep the stream
                    metrics.LAYERS_MALFORMED.inc()
                    malformed += 1
                    if malformed == 1 or malformed % 1000 == 0:  # one line, not one per message
                        log.warning("dropped %d malformed layer(s) from worker %s so far, latest for "
                                    "session %s: %s", malformed, msg.worker_id, msg.session_id, exc,
                                    extra={"session_id": msg.session_id})
        except grpc.RpcError:  # the worker went away mid-stream (a peer leaving, not a bug), or
            # the cache ended the stream because the worker is gone (Assignments.gone)
            log.info("layer stream of draft %s ended by %s after %d layers", worker.name,
                     "the cache (the worker is gone)" if worker.closed else "the worker", received)
        finally:
            self.assignments.layer_stream_closed(worker, key)
        return cache_pb2.PublishLayersResponse(layers_received=received)

    @grpc_errors
    def Heartbeat(self, request: cache_pb2.HeartbeatRequest, context: grpc.ServicerContext
                  ) -> cache_pb2.HeartbeatResponse:
        # draining: its SIGTERM: its sessions move to other workers, then it exits
        # no Redis here: the monitor's store loop refreshes every worker's record each round, so a
        # slow or stopped Redis cannot make a heartbeat miss its deadline
        self.assignments.heartbeat(request.worker_id, request.draining)
        return cache_pb2.HeartbeatResponse()

    # ---- operators ----------------------------------------------------------------------------
    @grpc_errors
    def Drain(self, request: cache_pb2.DrainRequest, context: grpc.ServicerContext
              ) -> cache_pb2.DrainResponse:
        if bool(request.name) == bool(request.pool):
            raise InvalidArgument("drain names one worker or one pool (name or pool, not both)")
        workers, moved = self.assignments.drain(request.name, request.pool, request.resume)
        self.monitor.kick()
        return cache_pb2.DrainResponse(workers=[w.name for w in workers], sessions_moved=moved)

    @grpc_errors
    def SetPoolWeights(self, request: cache_pb2.PoolWeightsRequest, context: grpc.ServicerContext
                       ) -> cache_pb2.PoolWeightsResponse:
        weights = self.assignments.set_weights(sorted(request.weights.items()))
        log.info("pool weights now %s", ", ".join(f"{p}={w:g}" for p, w in weights.items()) or "none")
        return cache_pb2.PoolWeightsResponse(weights=weights)

    @grpc_errors
    def Status(self, request: cache_pb2.StatusRequest, context: grpc.ServicerContext
               ) -> cache_pb2.StatusResponse:
        drafts = {w.name: draft_record_to_msg(w.record()) for w in self.assignments.workers()}
        totals: dict[str, float] = {}
        # connected: the store takes writes (the monitor's last probe; its log line says why not);
        # reads still work while Redis refuses writes for memory
        connected = self.monitor.store_up
        if connected or self.monitor.out_of_memory:
            try:
                totals = self.store.totals()
                # workers registered with other cache replicas (this one's are in memory), read
                # through the store's index of draft records: no keyspace SCAN
                for rec in self.store.drafts():
                    name = rec.get("name", "")
                    if name and name not in drafts and rec.get("cache") != self.monitor.instance:
                        drafts[name] = draft_record_to_msg(rec)
            except Unavailable:
                connected = False
        counters = self.sessions.pool_stats.snapshot()
        pools = self.assignments.pools()
        for name in counters:
            pools.setdefault(name, [])  # gone, but measured
        return cache_pb2.StatusResponse(
            pools=[pool_to_msg(p, pools[p], self.assignments.router.weight(p), counters.get(p))
                   for p in sorted(pools)],
            drafts=[drafts[n] for n in sorted(drafts)],
            sessions=[session_to_msg(s)
                      for s in sorted(self.sessions.sessions(), key=lambda s: s.opened_unix)],
            totals=totals, cache_device=self.config.device, redis_connected=connected,
        )

    # ---- shutdown -----------------------------------------------------------------------------
    def shutdown(self) -> None:
        """End every session (stop commands to the drafts, final records) and every command stream."""
        started = time.perf_counter()
        self.sessions.close_all(status="shutdown")
        for worker in self.assignments.workers():  # their records: CacheServer.shutdown_sessions
            self.assignments.gone(worker, "is let go (the cache shuts down)")
        log.info("cache state released in %.3fs", time.perf_counter() - started)
