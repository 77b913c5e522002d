"""How many torch threads a CPU forward runs on, chosen from what the cores are doing right now.

A spinning OpenMP team wants its cores to itself. On the 2-core box (SmolLM2-135M, plain decoding
in process) two threads decode 1.3x faster than one on idle cores, and 30x slower beside one other
busy thread (0.5 against 15.6 tok/s at 1 in flight; a niced spinner in another session, as
AIPerf's timing loop is, or a draft worker's forwards): each barrier of the forward waits for the
worker that shares its core with the other thread, a scheduler slice at a time. A fixed
``--threads`` must pick one of the two; the governor picks per iteration, and within a forward:

- **Contention, seen directly.** A team thread's run-queue delay (``/proc/self/task/TID/schedstat``,
  field 2: time it was runnable but not running) over a window of the forward. When one member
  waited more than ``down_share`` of ``down_windows`` windows in a row (``check``: before each
  decoder layer, and after the iteration), the count drops a rung at once, mid-forward included,
  so a collapse costs a few layers, not a forward. One window is not enough: a request arriving
  (its chat template, tokenizing, a load generator's wake-up) preempts a team thread for a few
  ms once, and through the services such bursts dropped the count on idle cores every few
  seconds, the hold doubling each time, so plain decoding ran on one thread most of the time (2
  of 14 s on two, 2026-11-28); a neighbour that really holds a core shows in every window. Nor are
  two: at 8 in flight the service's own threads (each token streamed, the client reading it) take
  the second core for bursts of up to four windows once per iteration, and two threads still
  decode faster beside them (84-86 tokens/s on two fixed threads against 73 after the drop to one
  that two windows made, 2026-11-29); five windows in a row (100 ms) is what only a neighbour
  that holds the core fills.
  Counts do not change results: every count of the ladder is one the load-time invariance
  probes checked (``card.engine.shared.torch_threads.probe_counts``).
- **Idle cores, sampled.** Before an iteration: the machine's runnable tasks (``/proc/loadavg``'s
  fourth field) less this thread and its own spinning workers. When the next rung's cores have
  been idle at ``up_samples`` iterations in a row, and the hold since the last drop has passed,
  the count climbs a rung. A drop soon after a climb doubles the hold (up to ``hold_max_s``), so a
  neighbour that comes and goes costs a bounded share of the time.

Linux only (``/proc``); elsewhere ``ProcCores.open`` gives None and the count stays fixed.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from card.engine.shared.torch_threads import thread_ladder

log = logging.getLogger(__name__)


class CoreSignals(Protocol):
    """What the governor reads about the cores; ``ProcCores`` reads it from /proc."""

    cpus: int

    def team_delays_ns(self) -> dict[int, int]:
        """Each team thread's cumulative run-queue delay, by thread id (the engine's thread and its
        workers)."""
        ...

    def others_running(self) -> int:
        """Runnable threads on the machine now, besides this thread and its spinning workers."""
        ...

    def refresh(self) -> None:
        """Find the team's threads again (OpenMP starts workers when a larger count first runs)."""
        ...


class ProcCores:
    """``CoreSignals`` of the calling thread's team, read from /proc with ``pread`` on descriptors
    kept open (about 2 us a read). The team is the calling thread plus the threads bearing its OS
    name: OpenMP workers inherit the name of the thread that starts them
    (card.engine.shared.torch_threads.name_os_thread)."""

    def __init__(self, tid: int, name: str, cpus: int) -> None:
        self.tid = tid
        self.name = name
        self.cpus = cpus
        self._loadavg = os.open("/proc/loadavg", os.O_RDONLY)
        self._team: dict[int, tuple[int, int]] = {}  # tid -> (schedstat fd, stat fd)
        self.refresh()

    @classmethod
    def open(cls) -> ProcCores | None:
        """For the calling thread, or None where /proc does not say what is needed."""
        if not sys.platform.startswith("linux"):
            return None
        tid = threading.get_native_id()
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            cores = cls(tid, name, len(os.sched_getaffinity(0)))
            cores.team_delays_ns()
            cores.others_running()
        except (OSError, ValueError, IndexError):
            return None
        return cores

    def refresh(self) -> None:
        team = {self.tid}
        for entry in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{entry}/comm") as f:
                    if f.read().strip() == self.name:
                        team.add(int(entry))
            except OSError:
                continue  # a thread that ended while we looked
        for tid in [t for t in self._team if t not in team]:
            self._close(tid)
        for tid in team - self._team.keys():
            fds: list[int] = []
            try:
                for leaf in ("schedstat", "stat"):
                    fds.append(os.open(f"/proc/self/task/{tid}/{leaf}", os.O_RDONLY))
            except OSError:  # the thread ended between the listing and the opening
                for fd in fds:
                    os.close(fd)
                continue
            self._team[tid] = (fds[0], fds[1])

    def team_delays_ns(self) -> dict[int, int]:
        delays = {}
        for tid, (schedstat, _) in list(self._team.items()):
            try:
                delays[tid] = int(os.pread(schedstat, 128, 0).split()[1])
            except OSError:  # the worker ended: OpenMP shrank its pool
                self._close(tid)
        return delays

    def others_running(self) -> int:
        running = int(os.pread(self._loadavg, 128, 0).split()[3].split(b"/")[0])
        spinning = 0
        for tid, (_, stat) in list(self._team.items()):
            if tid == self.tid:
                continue
            try:
                raw = os.pread(stat, 512, 0)
            except OSError:
                self._close(tid)
                continue
            state = raw.rindex(b")") + 2  # the field after the name, which may hold spaces
            spinning += raw[state:state + 1] == b"R"
        return max(0, running - 1 - spinning)

    def close(self) -> None:
        for tid in list(self._team):
            self._close(tid)
        os.close(self._loadavg)

    def _close(self, tid: int) -> None:
        for fd in self._team.pop(tid, ()):
            os.close(fd)


@dataclass(frozen=True)
class GovernorSettings:
    # a team thread that waited for a core this share of a window means another thread holds it
    down_share: float = 0.25
    # windows shorter than this are folded into the next: one preemption by a serving thread in a
    # 20 ms window is not contention (a collapsed forward waits tens of ms per layer)
    min_window_s: float = 0.02
    down_windows: int = 5  # windows in a row over ``down_share`` before a drop (a burst is one)
    up_samples: int = 3  # iterations in a row that must see the next rung's cores idle
    hold_s: float = 0.5  # no climb this long after a drop; doubled by each drop soon after a climb
    hold_max_s: float = 30.0
    settle_s: float = 10.0  # a climb that held this long resets the hold
    refresh_every: int = 256  # iterations between looks for the team's threads


class ThreadGovernor:
    """The count the calling thread's next forward runs on, between 1 and ``most`` (ladder rungs
    only). Use on the one thread that runs the forwards: ``before_iteration`` sets its torch
    count, ``check`` (before each decoder layer: ``attach``) and ``after_iteration`` watch it."""

    def __init__(self, most: int, cores: CoreSignals, settings: GovernorSettings = GovernorSettings(),
                 clock: Callable[[], float] = time.monotonic,
                 set_threads: Callable[[int], None] = torch.set_num_threads,
                 on_change: Callable[[str], object] | None = None) -> None:
        self.ladder = thread_ladder(most)
        self.cores = cores
        self.settings = settings
        self.clock = clock
        self.set_threads = set_threads
        self.on_change = on_change  # called with "down" or "up" (a metric)
        self.count = self.ladder[-1]
        self.drops = 0
        self.climbs = 0
        self._idle_samples = 0
        self._hold = settings.hold_s
        self._hold_until = 0.0
        self._climbed_at: float | None = None
        self._iterations = 0
        self._strikes = 0  # windows in a row over down_share
        self._last_check = clock()
        self._mark_t = clock()
        self._mark = cores.team_delays_ns()
        self._thread = threading.get_ident()
        self.set_threads(self.count)

    def before_iteration(self) -> None:
        s = self.settings
        self._iterations += 1
        if self._iterations % s.refresh_every == 0:
            self.cores.refresh()
        now = self.clock()
        if now - self._last_check > 5 * s.min_window_s:  # windows in a row, not across an idle gap
            self._strikes = 0
        if self._climbed_at is not None and now - self._climbed_at > s.settle_s:
            self._climbed_at, self._hold = None, s.hold_s
        rung = self.ladder.index(self.count)
        if rung + 1 < len(self.ladder) and now >= self._hold_until:
            upper = self.ladder[rung + 1]
            idle = self.cores.cpus - self.cores.others_running()
            self._idle_samples = self._idle_samples + 1 if idle >= upper else 0
            if self._idle_samples >= s.up_samples:
                self._idle_samples = 0
                self.climbs += 1
                self._climbed_at = now
                self._set(upper, "up")
                self.cores.refresh()  # the new workers start at the next parallel region
        self._mark_t, self._mark = now, self.cores.team_delays_ns()

    def check(self) -> None:
        """Drop a rung if a team thread waited for a core too long since the last window."""
        if self.count == 1:
            return
        now = self.clock()
        wall = now - self._mark_t
        if wall < self.settings.min_window_s:
            return
        delays = self.cores.team_delays_ns()
        before, self._mark_t, self._mark = self._mark, now, delays
        # a thread that joined the team during the window has no mark: it starts its own from here
        waited = max((d - before[t] for t, d in delays.items() if t in before), default=0) / 1e9
        self._last_check = now
        s = self.settings
        self._strikes = self._strikes + 1 if waited > s.down_share * wall else 0
        if self._strikes < s.down_windows:
            return
        self._strikes = 0
        if self._climbed_at is not None and now - self._climbed_at < s.settle_s:
            self._hold = min(self._hold * 2, s.hold_max_s)  # the cores it climbed into were not free
        self._climbed_at = None
        self._hold_until = now + self._hold
        self._idle_samples = 0
        self.drops += 1
        self._set(self.ladder[self.ladder.index(self.count) - 1], "down")

    def after_iteration(self) -> None:
        self.check()

    def attach(self, layers: torch.nn.ModuleList) -> Callable[[], None]:
        """``check`` before each of ``layers`` (a model's decoder layers); returns the detacher."""
        return _before_layers(layers, self._thread, self.check)

    def _set(self, count: int, direction: str) -> None:
        log.debug("forwards now on %d thread(s) (drops %d, climbs %d)", count, self.drops, self.climbs)
        self.count = count
        self.set_threads(count)
        if self.on_change is not None:
            self.on_change(direction)


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """A transformers causal LM's decoder layers (``model.model.layers``), the governor's checkpoints
    inside a forward; none for a model without them (the governor then checks between iterations)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    return layers if isinstance(layers, torch.nn.ModuleList) else torch.nn.ModuleList()


class ShapeGovernors:
    """A governor for iterations that prefill a prompt chunk and one for the rest (decoding rows),
    over the same team: contention costs them differently. Beside a draft worker growing trees (it
    runs whenever a session does), a decoding forward's ~15 small parallel regions a layer collapse
    on two threads (1-50 ms a layer against ~2 ms on one, card-target's log, 2026-11-29), while a
    prefill chunk's large ones still run faster on two. With one governor, the drop a decoding
    step earned kept the next prompts' prefills on one thread too (the draft never leaves the
    cores idle for a climb): 512-token first tokens through the trio 1.41-1.56 s against
    1.06-1.17 s on two threads. Each keeps its own count, windows and holds; beside a neighbour
    that holds a core (a spinner), the prefill governor drops too, by the same rule."""

    def __init__(self, most: int, cores: CoreSignals, settings: GovernorSettings = GovernorSettings(),
                 clock: Callable[[], float] = time.monotonic,
                 set_threads: Callable[[int], None] = torch.set_num_threads,
                 on_change: Callable[[str], object] | None = None) -> None:
        self.set_threads = set_threads
        self.decode = ThreadGovernor(most, cores, settings, clock, set_threads, on_change)
        self.prefill = ThreadGovernor(most, cores, settings, clock, set_threads, on_change)
        self.active = self.decode
        self._applied = self.decode.count
        self._thread = threading.get_ident()

    @property
    def count(self) -> int:
        return self.active.count

    @property
    def drops(self) -> int:
        return self.decode.drops + self.prefill.drops

    def before_iteration(self, prefill: bool) -> None:
        """``prefill``: the iteration computes a prompt chunk (the engine plans it)."""
        self.active = self.prefill if prefill else self.decode
        if self.active.count != self._applied:  # the other governor's count is in force
            self.set_threads(self.active.count)
        self.active.before_iteration()
        self._applied = self.active.count

    def after_iteration(self) -> None:
        self.active.after_iteration()
        self._applied = self.active.count

    def attach(self, layers: torch.nn.ModuleList) -> Callable[[], None]:
        """The active governor's ``check`` before each of ``layers``; returns the detacher."""
        return _before_layers(layers, self._thread, self._check)

    def _check(self) -> None:
        self.active.check()
        self._applied = self.active.count


def _before_layers(layers: torch.nn.ModuleList, thread: int, check: Callable[[], None]) -> Callable[[], None]:
    """``check`` before each of ``layers``, on ``thread`` only (not a draft forwarding the same
    model object); returns the detacher."""
    def hook(*_: object) -> None:
        if threading.get_ident() == thread:
            check()

    handles = [layer.register_forward_pre_hook(hook) for layer in layers]

    def detach() -> None:
        for handle in handles:
            handle.remove()
    return detach
