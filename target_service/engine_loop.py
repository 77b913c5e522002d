"""The thread that owns the target model: it runs card.engine.target.scheduler.TargetEngine iterations while
there is work, and sleeps when there is none.

Fronts (gRPC and HTTP threads) never touch the model: ``submit`` queues a generation with the
sink its events go to (a queue's ``put``, or a hand-off to an asyncio loop); ``cancel`` asks for it
to end (applied between iterations, so a cancelled
request stops within one forward and gives back its KV slot, its cache session and its draft
session at once).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import torch

from card.engine.target.generation import Generation
from card.engine.target.scheduler import Event, TargetEngine
from card.target_service import metrics

log = logging.getLogger(__name__)


class EngineLoop:
    def __init__(self, engine: TargetEngine, threads: int | None = None) -> None:
        self.engine = engine
        self.threads = threads
        self._cv = threading.Condition()
        self._inbox: list[Generation] = []
        self._cancels: list[Generation] = []
        self._sinks: dict[Generation, Callable[[Event], None]] = {}
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="target-engine", daemon=True)
        metrics.KV_SLOTS.set(engine.pool.slots)
        metrics.KV_SLOTS_FREE.set_function(lambda: engine.pool.free_slots)
        metrics.WAITING.set_function(lambda: len(engine.waiting) + len(self._inbox))
        metrics.ACTIVE.set_function(lambda: len(engine.running))

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join(timeout_s)

    def submit(self, gen: Generation, sink: Callable[[Event], None]) -> None:
        """Queue ``gen``; each of its events is handed to ``sink`` on the engine's thread (it must
        not block)."""
        with self._cv:
            self._sinks[gen] = sink
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
        if self.threads:
            torch.set_num_threads(self.threads)  # per thread: this one runs every forward
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
            for gen in cancels:
                if gen.result is None:
                    self._deliver(engine.cancel(gen))
            try:
                events = engine.step()
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
            for event in events:
                self._deliver(event)
        for gen in [*engine.running, *engine.waiting]:  # shutdown: nothing is left half-open
            self._deliver(engine.cancel(gen))

    def _deliver(self, event: Event) -> None:
        with self._cv:
            sink = self._sinks.get(event.generation)
            if event.done:
                self._sinks.pop(event.generation, None)
        if sink is not None:
            try:
                sink(event)
            except Exception:  # a front that cannot take its event must not stop the engine
                log.exception("delivering a generation's event failed")
