"""The thread that owns the target model: it runs card.engine.target.scheduler.TargetEngine iterations while
there is work, and sleeps when there is none.

Fronts (gRPC and HTTP threads) never touch the model: ``submit`` queues a generation with the
sink its events go to (a queue's ``put``, or a hand-off to an asyncio loop) and, optionally, a
callback for when it is admitted to a KV slot; ``cancel`` asks for it to end (applied between
iterations, so a cancelled request stops within one forward and gives back its KV slot, its cache
session and its draft session at once).

Bounded: past ``max_waiting`` generations waiting for a slot, ``submit`` refuses at once
(ResourceExhausted). A submit after ``stop`` or after the thread died is refused (Unavailable),
never left hanging; a thread that dies ends every generation with Unavailable and calls
``on_death`` (card-target's health goes NOT_SERVING).

Metrics in vLLM's shape (card.target_service.metrics.ServedModel) are observed here, where every
generation's events pass whatever its front: time to first token and between commits, the request
intervals, tokens, and the spec-decode counters, labelled with the served model name.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable

import torch

from card.engine.shared.config import MAX_CHAIN
from card.engine.shared.errors import ResourceExhausted, Unavailable
from card.engine.shared.thread_governor import ProcCores, ShapeGovernors, decoder_layers
from card.engine.shared.torch_threads import name_os_thread
from card.engine.target.chain_source import DraftKind
from card.engine.target.drafting_policy import Decision, DraftingConfig, DraftingPolicy, Regime
from card.engine.target.generation import Generation
from card.engine.target.scheduler import Event, TargetEngine
from card.target_service import metrics

log = logging.getLogger(__name__)


class LoopSink:
    """A generation's sink on an asyncio event loop (the HTTP front's streams): ``put`` runs on
    ``aio``. Called alone it is one ``call_soon_threadsafe``; the engine's thread hands every
    stream of one loop an iteration's events in ONE call instead (``EngineLoop._deliver_all``):
    each call writes the loop's wake-up pipe and wakes its thread, which takes the GIL from the
    forward's Python; one per iteration, not one per stream (its gain is small: docs/performance.md,
    "What the services add per token"). Each stream still gets its events in order: the loop runs
    its callbacks in the order they were scheduled."""

    __slots__ = ("aio", "put")

    def __init__(self, aio: asyncio.AbstractEventLoop, put: Callable[[Event], None]) -> None:
        self.aio = aio
        self.put = put

    def __call__(self, event: Event) -> None:
        self.aio.call_soon_threadsafe(self.put, event)


def _put_all(items: list[tuple[Callable[[Event], None], Event]]) -> None:
    """On the event loop: one iteration's events of its streams, in order."""
    for put, event in items:
        try:
            put(event)
        except Exception:  # one stream's failure must not keep the others' events from them
            log.exception("delivering a generation's event failed")


def drafting_policy(speculation: str) -> DraftingPolicy:
    """The engine's drafting policy, its decisions counted and logged."""

    def decided(d: Decision) -> None:
        metrics.SPECULATION_DECISIONS.labels(d.regime.value, d.why).inc()
        if not (d.spec_rate or d.plain_rate):
            log.debug("speculation: probing %s (%s)", d.regime.value, d.why)
            return
        metrics.SPECULATION_RATE.labels(Regime.SPEC.value).set(d.spec_rate)
        metrics.SPECULATION_RATE.labels(Regime.PLAIN.value).set(d.plain_rate)
        verdict = "switches to" if d.why == "won" else "stays"
        log.info("speculation %s %s: %.1f tok/s speculating, %.1f tok/s plain", verdict, d.regime.value,
                 d.spec_rate, d.plain_rate)

    def switched(to: DraftKind) -> None:
        metrics.DRAFTER_SWITCHES.labels(to.value).inc()

    return DraftingPolicy(DraftingConfig(speculation=speculation), on_decision=decided, on_switch=switched)


class EngineLoop:
    """``threads``: torch intra-op threads of the engine's thread; None: those of the thread that
    builds the loop (card-target's main thread: --threads, or torch's default, the machine's cores).
    ``model_name``: the ``model_name`` label of its request metrics (the name clients call it by)."""

    def __init__(self, engine: TargetEngine, threads: int | None = None, max_waiting: int | None = None,
                 on_death: Callable[[BaseException], None] | None = None, model_name: str = "",
                 adaptive_threads: bool = False) -> None:
        self.engine = engine
        # torch's count is per thread, and a thread that never sets its own takes the process-wide
        # value of the moment it first runs an op in parallel (its first forward, at the first
        # request): resolved now and set by the engine's thread itself, so nothing another thread
        # does to torch's setting in between decides how many cores the forwards get
        self.threads = threads or torch.get_num_threads()
        self._threads_now = 0  # what the engine's thread last read back (the gauge's value)
        self.adaptive_threads = adaptive_threads
        self.governor: ShapeGovernors | None = None  # set on the engine's thread (its /proc entries)
        self.max_waiting = max_waiting
        self.on_death = on_death
        self._cv = threading.Condition()
        self._inbox: list[Generation] = []
        self._cancels: list[Generation] = []
        self._sinks: dict[Generation, Callable[[Event], None]] = {}
        self._on_admit: dict[Generation, Callable[[], None]] = {}
        self._tracks: dict[Generation, metrics.Track] = {}  # beside _sinks: one per generation
        self._stopping = False
        self.died: BaseException | None = None
        metrics.ENGINE_ALIVE.set(1)
        self._thread = threading.Thread(target=self._run, name="target-engine", daemon=True)
        metrics.KV_SLOTS.set(engine.pool.slots)
        metrics.KV_SLOTS_FREE.set_function(lambda: engine.pool.free_slots)
        metrics.KV_CACHED_SLOTS.set(engine.pool.cached_slots)
        metrics.PREFIX_CACHE_BYTES.set_function(lambda: engine.pool.cached_rows * engine.pool.bytes_per_row)
        metrics.PREFIX_CACHE_EVICTIONS.set_function(lambda: engine.pool.evictions)
        metrics.WAITING.set_function(lambda: len(engine.waiting) + len(self._inbox))
        metrics.ACTIVE.set_function(lambda: len(engine.running))
        metrics.SPECULATING.set_function(lambda: float(engine.policy.speculating))
        metrics.DRAFTING_PAUSED.set_function(engine.policy.paused)
        self.served = metrics.ServedModel(model_name or "unnamed", MAX_CHAIN)
        self.served.prefix_caching = engine.prefix_caching
        pool = engine.pool
        self.served.gauges(running=lambda: len(engine.running), waiting=self.waiting,
                           kv_usage=lambda: 1.0 - pool.free_slots / pool.slots if pool.slots else 0.0)
        self._session_pauses = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join(timeout_s)

    @property
    def forward_threads(self) -> int:
        """The torch thread count the engine's thread read back in itself last (0 before it ran):
        what its forwards run on, card_target_engine_threads."""
        return self._threads_now

    @property
    def alive(self) -> bool:
        return self.died is None and not self._stopping

    def waiting(self) -> int:
        """Generations submitted and not yet admitted to a KV slot."""
        return len(self._inbox) + len(self.engine.waiting)

    def submit(self, gen: Generation, sink: Callable[[Event], None],
               on_admit: Callable[[], None] | None = None) -> None:
        """Queue ``gen``; each of its events is handed to ``sink`` on the engine's thread (it must
        not block), and ``on_admit`` once it has a KV slot or has ended. Unavailable: the loop
        stopped or died; ResourceExhausted: ``max_waiting`` generations wait already."""
        with self._cv:
            if self.died is not None:
                raise Unavailable(f"card-target's engine stopped ({self.died!r}); retry another replica")
            if self._stopping:
                raise Unavailable("card-target is shutting down; retry against another replica")
            # those a free slot takes at the next iteration do not wait
            room = None if self.max_waiting is None else self.max_waiting + self.engine.pool.free_slots
            if room is not None and self.waiting() >= room:
                raise ResourceExhausted(f"{self.waiting()} requests wait for a KV slot already "
                                        f"(--max-waiting {self.max_waiting}); retry later")
            self._sinks[gen] = sink
            self._tracks[gen] = metrics.Track(time.perf_counter())
            if on_admit is not None:
                self._on_admit[gen] = on_admit
            self._inbox.append(gen)
            self._cv.notify()

    def cancel(self, gen: Generation) -> None:
        with self._cv:
            if gen in self._sinks:
                self._cancels.append(gen)
                self._cv.notify()

    def admitted(self, gen: Generation) -> bool:
        return gen.slot is not None or gen.result is not None

    # ---- the engine's thread -----------------------------------------------------------------
    def _run(self) -> None:
        name_os_thread(self._thread.name)  # its OpenMP workers, started by it, take the name too
        try:
            self._loop()
        except BaseException as exc:  # a bug: nothing must wait for this thread any more
            log.critical("the engine's thread died; every request ends and health is NOT_SERVING",
                         exc_info=exc)
            with self._cv:
                self.died = exc
                sinks, self._sinks = self._sinks, {}
                self._inbox, self._cancels, self._on_admit, self._tracks = [], [], {}, {}
            metrics.ENGINE_ALIVE.set(0)
            error = Unavailable("card-target's engine stopped; retry against another replica")
            for gen, sink in sinks.items():
                try:
                    sink(Event(gen, done=True, error=error))
                except Exception:
                    log.exception("delivering a generation's end failed")
            if self.on_death is not None:
                self.on_death(exc)

    def _loop(self) -> None:
        torch.set_num_threads(self.threads)  # per thread: this one runs every forward
        self._observe_threads()
        self.governor = self._governor()
        log.info("the engine's thread runs its forwards on %s%d torch thread(s)",
                 "at most " if self.governor else "", self._threads_now)
        governor = self.governor
        engine = self.engine
        while True:
            with self._cv:
                while not (self._inbox or self._cancels or self._stopping or not engine.idle):
                    self._cv.wait()
                if self._stopping:
                    break
                inbox, self._inbox = self._inbox, []
                cancels, self._cancels = self._cancels, []
            for gen in inbox:
                engine.add(gen)
            self._deliver_all([engine.cancel(gen) for gen in cancels if gen.result is None])
            if governor is not None:
                governor.before_iteration(prefill=engine.prefill_pending)
            self._observe_threads()
            try:
                events = engine.step()
                if governor is not None:
                    governor.after_iteration()
            except Exception as exc:  # the forward itself failed: every generation in it ends
                log.exception("target forward failed")
                events = [engine.cancel(gen) for gen in list(engine.running)]
                for event in events:
                    event.error = exc
            if events or engine.running:
                metrics.BATCH_SIZE.observe(len(engine.running) + sum(e.done for e in events))
            if (times := engine.last) is not None:
                engine.last = None
                metrics.ITERATION.labels("plan").observe(times.plan)
                metrics.ITERATION.labels("forward").observe(times.forward)
                metrics.ITERATION.labels("commit").observe(times.commit)
            if (pauses := engine.policy.session_pauses) != self._session_pauses:
                metrics.SESSION_PAUSES.inc(pauses - self._session_pauses)
                self._session_pauses = pauses
            self._deliver_all(events)
            self._admitted()
        with self._cv:
            inbox, self._inbox = self._inbox, []
        # shutdown: nothing is left half-open
        self._deliver_all([engine.cancel(gen) for gen in [*engine.running, *engine.waiting, *inbox]])

    def _governor(self) -> ShapeGovernors | None:
        """On a CPU with more than one thread and adaptive threads on: the governor of this thread's
        count, checking before each decoder layer too (None where /proc does not tell)."""
        if not self.adaptive_threads or self.threads < 2 or self.engine.pool.device.type != "cpu":
            return None
        cores = ProcCores.open()
        if cores is None:
            log.info("adaptive threads unavailable here (no /proc): the forwards keep %d", self.threads)
            return None
        governor = ShapeGovernors(self.threads, cores,
                                  on_change=lambda d: metrics.ENGINE_THREAD_CHANGES.labels(d).inc())
        governor.attach(decoder_layers(self.engine.model))
        return governor

    def _observe_threads(self) -> None:
        """Publish the torch thread count this thread's next forward runs on (read here: another
        thread's torch.get_num_threads() says nothing about this one's)."""
        threads = torch.get_num_threads()
        if threads != self._threads_now:
            self._threads_now = threads
            metrics.ENGINE_THREADS.set(threads)

    def _admitted(self) -> None:
        """Tell the fronts waiting on admission which of their generations got a slot (or ended)."""
        if not self._on_admit:
            return
        with self._cv:
            ready = [(g, cb) for g, cb in self._on_admit.items() if self.admitted(g)]
            for gen, _ in ready:
                del self._on_admit[gen]
        for _, callback in ready:
            try:
                callback()
            except Exception:
                log.exception("an admission callback failed")

    def _deliver_all(self, events: list[Event]) -> None:
        """Hand one iteration's events to their fronts, counted first (a client that has its
        answer finds it in the metrics); the iteration's commits share one time."""
        now = time.perf_counter()
        handoffs = []
        with self._cv:
            for event in events:
                gen = event.generation
                if event.done:
                    sink, track = self._sinks.pop(gen, None), self._tracks.pop(gen, None)
                    callback = self._on_admit.pop(gen, None)
                else:
                    sink, track, callback = self._sinks.get(gen), self._tracks.get(gen), None
                handoffs.append((event, sink, track, callback))
        try:
            for event, _, track, _ in handoffs:
                if track is not None:
                    self.served.observe(track, event, now)
            self.served.flush()
        except Exception:  # a metric must never stop the engine
            log.exception("observing generations' metrics failed")
        batches: dict[asyncio.AbstractEventLoop, list[tuple[Callable[[Event], None], Event]]] = {}
        for event, sink, _, callback in handoffs:
            if callback is not None:  # before the event: a loop runs its callbacks in order
                try:
                    callback()
                except Exception:
                    log.exception("an admission callback failed")
            if sink is None:
                continue
            if isinstance(sink, LoopSink):
                batches.setdefault(sink.aio, []).append((sink.put, event))
                continue
            try:
                sink(event)
            except Exception:  # a front that cannot take its event must not stop the engine
                log.exception("delivering a generation's event failed")
        for aio, items in batches.items():
            try:
                aio.call_soon_threadsafe(_put_all, items)
            except Exception:  # its loop closed (shutdown): nobody reads these streams any more
                log.exception("delivering %d event(s) to an event loop failed", len(items))
