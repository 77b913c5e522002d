"""The draft worker's link to the cache service: register, take commands, publish layers.

One connection at a time:

    RegisterDraft -> worker_id, heartbeat interval
    Commands      (server stream)  start / advance / stop  ->  DraftWorker
    PublishLayers (client stream)  every layer the DraftWorker grows, any session
    Heartbeat     every half interval, with the number of live sessions

When the link breaks the worker is useless to any session it holds, so it reports NOT_SERVING at
once, drops them all and registers again with backoff; the cache hands its sessions' targets
empty chains meanwhile, which never changes their output. Broken means any of: the Commands
stream ends (error or not), the PublishLayers stream ends (its layers would go nowhere while
commands still arrive), a heartbeat is refused (NOT_FOUND, UNAVAILABLE), or no heartbeat has
reached the cache for three intervals (it has dropped the worker by then; e.g. a stopped cache,
whose streams would hang until the keepalives gave up). Health is SERVING only while one
registration holds both streams open.

Draining (``drain``, on SIGTERM): the next heartbeat, sent at once, says so; the cache assigns
the worker nothing more and moves its sessions to other workers, sending a StopSession for each;
the worker exits when it holds none, or when its drain timeout is up.

The long-lived streams carry no deadline on purpose: they live as long as the registration, and
channel keepalives (card.common.channels) detect a dead peer.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator

import grpc

from card.common.channels import channel
from card.common.convert import command_from_msg, layer_to_msg
from card.common.drafts import POOL_TOKEN_METADATA, WORKER_ID_METADATA
from card.common.status import error_from_rpc
from card.draft_service import metrics
from card.draft_service.config import DraftConfig
from card.engine.draft.worker import DraftWorker, Publish
from card.engine.shared.commands import StartDraft, StopDraft
from card.engine.shared.errors import CardError
from card.engine.shared.tree import Layer
from card.v1 import cache_pb2, cache_pb2_grpc

log = logging.getLogger(__name__)

RPC_TIMEOUT_S = 5.0
# Layers waiting for the PublishLayers stream: a cache that stops reading must not grow the worker's
# memory. A layer past the bound is dropped and counted (the cache's tree lacks it; layers grown
# under it are dropped there too; outputs never depend on a tree).
MAX_QUEUED_LAYERS = 4096


class _Connection:
    """State of one registration: its streams end together."""

    def __init__(self, worker_id: str, interval_s: float) -> None:
        self.worker_id = worker_id
        self.interval_s = interval_s
        self.layers: queue.Queue[cache_pb2.LayerMessage] = queue.Queue(MAX_QUEUED_LAYERS)
        self.closed = threading.Event()
        self.beat = threading.Event()  # heartbeat now (a drain)
        self.commands: grpc.Call | None = None

    def attach_commands(self, call: grpc.Call) -> None:
        """The Commands stream; cancelled at once when the connection closed meanwhile."""
        self.commands = call
        if self.closed.is_set():
            call.cancel()

    def requests(self) -> Iterator[cache_pb2.LayerMessage]:
        """The PublishLayers request stream; ends when the connection closes."""
        while not self.closed.is_set():
            try:
                yield self.layers.get(timeout=0.2)
            except queue.Empty:
                continue

    def close(self) -> None:
        self.closed.set()
        self.beat.set()  # the heartbeat thread returns at once
        if self.commands is not None:
            self.commands.cancel()


# builds the worker with the link's callbacks (publish, on_forward, on_drop); returns it and the
# fingerprint of the tokenizer it drafts for
BuildWorker = Callable[[Publish, Callable[[int], None], Callable[[str], None]], tuple[DraftWorker, str]]


class CacheLink:
    """Keeps a worker registered with the cache at ``config.cache_addr`` until ``close()``. The
    worker is built by ``build`` with this link's callbacks: its layers, forwards and dropped
    sessions reach the cache through the link."""

    def __init__(self, config: DraftConfig, build: BuildWorker,
                 on_serving: Callable[[bool], None] = lambda serving: None) -> None:
        self.config = config
        self.on_serving = on_serving
        self.worker, self.fingerprint = build(self._publish, self._on_forward, self._dropped)
        self._sessions: set[str] = set()
        self._lock = threading.Lock()
        self._conn: _Connection | None = None
        self._stop = threading.Event()
        self._draining = threading.Event()
        self._emptied = threading.Condition(self._lock)  # notified when a session leaves
        self._thread: threading.Thread | None = None
        self._prefix_seen = (0, 0)  # the worker's prefix-cache counters already counted
        metrics.ACTIVE_SESSIONS.set_function(lambda: self.worker.active_sessions)
        metrics.KV_SLOTS.set_function(self.worker.kv_slots_held)

    def _on_forward(self, sessions: int) -> None:
        metrics.FORWARDS.inc()
        metrics.BATCH_SESSIONS.inc(sessions)
        # the worker's thread, after a forward: the prefix-cache counters since the last one
        pool = self.worker.pool
        if pool is not None and pool.prefix is not None:
            queries, hits = pool.prefix.queries, pool.prefix.hits
            metrics.PREFIX_QUERIES.inc(queries - self._prefix_seen[0])
            metrics.PREFIX_HITS.inc(hits - self._prefix_seen[1])
            self._prefix_seen = (queries, hits)

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self.worker.start()
        self._thread = threading.Thread(target=self._run, name="cache-link", daemon=True)
        self._thread.start()

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop every session, end the streams (which unregisters the worker), stop the worker."""
        self._stop.set()
        self._drop_sessions("shutting down")
        with self._lock:
            conn = self._conn
        if conn is not None:
            conn.close()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self.worker.close()

    def drain(self, timeout_s: float) -> bool:
        """Stop taking sessions and hand the live ones over (the cache moves them to other workers
        and stops them here); True when none is left within ``timeout_s``. ``close()`` follows."""
        started = time.monotonic()
        self._draining.set()
        with self._lock:
            conn, held = self._conn, len(self._sessions)
        if conn is None or conn.closed.is_set():  # no cache to hand them to: they are lost either way
            return held == 0
        log.info("draining: %d session(s) to hand over, %.0fs at most", held, timeout_s)
        conn.beat.set()  # the heartbeat thread tells the cache now, not at its next period
        with self._lock:
            done = self._emptied.wait_for(lambda: not self._sessions or self._conn is not conn,
                                          timeout=timeout_s)
            left = len(self._sessions)
        if done and not left:
            log.info("drained in %.2fs: every session handed over", time.monotonic() - started)
            return True
        log.warning("drain ended after %.1fs with %d session(s) not handed over (they go on without a "
                    "draft until the cache reassigns them)", time.monotonic() - started, left)
        return False

    @property
    def draining(self) -> bool:
        return self._draining.is_set()

    @property
    def sessions(self) -> int:
        with self._lock:
            return len(self._sessions)

    # ---- the connection loop -----------------------------------------------------------------
    def _run(self) -> None:
        backoff = self.config.retry_initial_s
        while not self._stop.is_set():
            registered = False
            try:
                registered = self._serve_once()
            except grpc.RpcError as err:
                log.warning("cache at %s: %s", self.config.cache_addr,
                            error_from_rpc(err, self.config.cache_addr))
            except CardError as exc:
                log.warning("cache at %s sent a bad command: %s", self.config.cache_addr, exc)
            self.on_serving(False)
            metrics.REGISTERED.set(0)
            self._drop_sessions("lost the cache")
            if self._stop.is_set():
                break
            if registered:
                metrics.DISCONNECTS.inc()
                backoff = self.config.retry_initial_s
            log.info("registering again in %.1fs", backoff)
            self._stop.wait(backoff)
            backoff = min(backoff * 2, self.config.retry_max_s)

    def _serve_once(self) -> bool:
        """Register and serve commands until the cache goes away; True once registered."""
        cfg = self.config
        with channel(cfg.cache_addr, cfg.draft_token, cfg.tls) as ch:
            stub = cache_pb2_grpc.CacheServiceStub(ch)
            reply = stub.RegisterDraft(
                cache_pb2.RegisterDraftRequest(
                    name=cfg.name, model=cfg.label, tokenizer_fingerprint=self.fingerprint,
                    capacity=self.worker.slots, pool=cfg.pool,
                ),
                timeout=RPC_TIMEOUT_S,
                # the pool's credential, where the cache binds pools to tokens (--pool-tokens)
                metadata=((POOL_TOKEN_METADATA, cfg.pool_token),) if cfg.pool_token else None,
            )
            conn = _Connection(reply.worker_id, reply.heartbeat_interval_s or 5.0)
            with self._lock:
                self._conn = conn
            publish = stub.PublishLayers.future(conn.requests(),
                                                metadata=((WORKER_ID_METADATA, conn.worker_id),))
            publish.add_done_callback(lambda done: self._layers_ended(conn, done))
            conn.attach_commands(stub.Commands(cache_pb2.CommandsRequest(worker_id=conn.worker_id)))
            assert conn.commands is not None
            if self._stop.is_set():  # close() ran while we registered
                conn.close()
            # the cache sends its initial metadata once the stream is open on its side: from then
            # on it may assign sessions here, and only then is this worker SERVING
            conn.commands.initial_metadata()
            if self._draining.is_set():  # registered again while draining: say so at once
                conn.beat.set()
            heartbeat = threading.Thread(target=self._heartbeat, args=(stub, conn), name="heartbeat",
                                         daemon=True)
            heartbeat.start()
            metrics.REGISTRATIONS.inc()
            with self._lock:  # not when a stream already broke (_lose said NOT_SERVING)
                if not conn.closed.is_set():
                    metrics.REGISTERED.set(1)
                    self.on_serving(True)
            log.info("registered with the cache at %s as %s (worker %s, heartbeat every %.1fs)",
                     cfg.cache_addr, cfg.name, conn.worker_id, conn.interval_s)
            try:
                for command in conn.commands:
                    self._dispatch(command)
                if not conn.closed.is_set():
                    metrics.LINK_LOST.labels(cause="commands").inc()
                    log.warning("the cache at %s ended the command stream", cfg.cache_addr)
            except grpc.RpcError as err:
                if not conn.closed.is_set():
                    metrics.LINK_LOST.labels(cause="commands").inc()
                    raise
                log.info("command stream closed (%s)", err.code().name if isinstance(err, grpc.Call) else err)
            finally:
                with self._lock:  # NOT_SERVING now, before waiting on the other threads
                    self._conn = None
                    metrics.REGISTERED.set(0)
                    self.on_serving(False)
                    self._emptied.notify_all()
                conn.close()
                heartbeat.join(RPC_TIMEOUT_S)
                try:
                    publish.result(timeout=RPC_TIMEOUT_S)
                except grpc.RpcError as err:
                    log.debug("layer stream ended: %s", err)
                except grpc.FutureTimeoutError:
                    publish.cancel()
        return True

    def _lose(self, conn: _Connection, cause: str, why: str) -> None:
        """``conn``'s link to the cache is broken: NOT_SERVING now (one line), then end the
        connection, so that the loop drops its sessions and registers again. A no-op for a
        connection already ending (its other stream, shutdown)."""
        with self._lock:
            if self._conn is not conn or conn.closed.is_set():
                return
            conn.closed.set()  # from here nothing reports this connection SERVING
            metrics.REGISTERED.set(0)
            self.on_serving(False)
        metrics.LINK_LOST.labels(cause=cause).inc()
        log.warning("link to the cache at %s lost: %s; NOT_SERVING until registered again",
                    self.config.cache_addr, why)
        conn.close()  # cancels the command stream: _serve_once returns, _run registers again

    def _layers_ended(self, conn: _Connection, call: grpc.Future) -> None:
        """Done callback of the PublishLayers stream: unless the connection was ending anyway, the
        cache no longer hears this worker's layers, whatever the command stream still says."""
        if conn.closed.is_set():
            return
        if call.cancelled():
            why = "the layer stream was cancelled"
        else:
            err = call.exception()
            why = ("the cache ended the layer stream" if err is None else
                   f"the layer stream failed: {error_from_rpc(err, self.config.cache_addr)}")
        self._lose(conn, "layers", why)

    def _heartbeat(self, stub: cache_pb2_grpc.CacheServiceStub, conn: _Connection) -> None:
        # "at least every interval": beat at half of it so one slow beat does not expire us
        period = max(0.1, conn.interval_s / 2)
        expiry_s = 3 * conn.interval_s  # the cache drops a worker that misses three heartbeats
        last_ok = time.monotonic()
        failing = False
        while not conn.closed.is_set():
            conn.beat.wait(period)  # the period, or at once when drain() asks
            conn.beat.clear()
            if conn.closed.is_set():
                return
            try:
                stub.Heartbeat(cache_pb2.HeartbeatRequest(worker_id=conn.worker_id,
                                                          active_sessions=self.worker.active_sessions,
                                                          draining=self._draining.is_set()),
                               timeout=max(1.0, conn.interval_s))
            except grpc.RpcError as err:
                if conn.closed.is_set():
                    return
                code = err.code() if isinstance(err, grpc.Call) else None
                error = error_from_rpc(err, self.config.cache_addr)
                if code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE):
                    self._lose(conn, "heartbeat", f"heartbeat refused: {error}")  # forgot us, or gone
                    return
                silent_s = time.monotonic() - last_ok
                if silent_s >= expiry_s:  # e.g. a stopped cache: the streams hang, beats time out
                    self._lose(conn, "heartbeat", f"no heartbeat reached it for {silent_s:.1f}s ({error})")
                    return
                if not failing:  # one line per run of failures
                    log.warning("heartbeat failed: %s", error)
                    failing = True
            else:
                last_ok = time.monotonic()
                if failing:
                    log.info("heartbeats reach the cache again")
                    failing = False

    # ---- commands (link thread) --------------------------------------------------------------
    def _dispatch(self, msg: cache_pb2.DraftCommand) -> None:
        metrics.COMMANDS.labels(kind=msg.WhichOneof("command") or "none").inc()
        try:
            command = command_from_msg(msg)
        except CardError as exc:  # one bad command is not a reason to drop every session
            log.warning("ignoring a command from the cache: %s", exc)
            return
        with self._lock:
            if isinstance(command, StartDraft):
                self._sessions.add(command.session_id)
            elif isinstance(command, StopDraft):
                self._sessions.discard(command.session_id)
                if not self._sessions:
                    self._emptied.notify_all()
        self.worker.apply(command)
        log.debug("%s", type(command).__name__, extra={"session_id": command.session_id})

    def _drop_sessions(self, why: str) -> None:
        with self._lock:
            dropped, self._sessions = self._sessions, set()
            self._emptied.notify_all()
        for sid in dropped:
            self.worker.stop_session(sid)
        if dropped:
            log.warning("dropped %d session(s): %s", len(dropped), why)

    def _dropped(self, session_id: str) -> None:
        """The worker gave ``session_id`` up: tell the cache, which frees its place in our capacity."""
        with self._lock:
            held = session_id in self._sessions
            self._sessions.discard(session_id)
            if not self._sessions:
                self._emptied.notify_all()
            conn = self._conn
        if held and conn is not None and not conn.closed.is_set():
            try:  # it frees a place in our capacity: worth a wait where layers fill the queue
                conn.layers.put(cache_pb2.LayerMessage(worker_id=conn.worker_id, session_id=session_id,
                                                       dropped=True), timeout=RPC_TIMEOUT_S)
            except queue.Full:
                self._lose(conn, "layers", "the layer stream took nothing for a while")

    # ---- layers (worker thread) --------------------------------------------------------------
    def _publish(self, session_id: str, layer: Layer) -> None:
        with self._lock:
            conn = self._conn if session_id in self._sessions else None
        if conn is None or conn.closed.is_set():
            metrics.LAYERS_DROPPED.inc()
            return
        stats = self.worker.session_stats(session_id)
        msg = layer_to_msg(session_id, layer, conn.worker_id, stats.forwards if stats else 0,
                           stats.idle_s if stats else 0.0)
        try:
            conn.layers.put_nowait(msg)
        except queue.Full:
            metrics.LAYERS_DROPPED.inc()
            return
        metrics.LAYERS.inc()
