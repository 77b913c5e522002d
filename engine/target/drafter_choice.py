"""Which of two drafters serves a generation, by measured pace (``card-auto``).

    model-free  n-gram chains from the text itself: no forward, no cores, wins outright where the
                output repeats its input (code edits, summaries, follow-ups)
    neural      the draft model (or a cascade): costs a forward per layer, wins where the text is new

A generation opens on the model-free drafter (it costs nothing), tries the neural one for
``TRIAL_STEPS``, then keeps whichever committed tokens faster: seconds per committed token over its
latest steps (``Pace``, the target's own steps from one to the next, so the draft's share of
shared cores counts against it). The loser is tried again after ``RETRY_STEPS[0]`` steps, twice as
long per trial it loses again (up to ``RETRY_STEPS[1]``). The output never depends on any of this.

Who uses it: in process, ``PolicyCard`` (card.engine.inprocess.sources) switches between an inline
model-free drafter and a draft worker; through the services, ``RemoteCard`` (mode ``card-auto``)
switches the cache session between its model-free lookup alone (the worker paused) and its worker.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

EMA = 0.2  # weight of the newest step in the moving averages
TRIAL_STEPS = 8  # steps each drafter is judged on
RETRY_STEPS = (32, 256)  # steps before a losing drafter is tried again: first, longest

MODEL_FREE, NEURAL = "model-free", "neural"


@dataclass
class Pace:
    """Moving averages of seconds and tokens per target step (running means for the first 5)."""

    seconds: float = 0.0
    tokens: float = 0.0
    steps: int = 0

    def add(self, seconds: float, tokens: int) -> None:
        self.steps += 1
        w = max(1.0 / self.steps, EMA)
        self.seconds += w * (seconds - self.seconds)
        self.tokens += w * (tokens - self.tokens)

    @property
    def s_per_token(self) -> float:
        return self.seconds / self.tokens if self.tokens > 0 else math.inf


@dataclass
class DrafterChoice:
    """One generation's choice. ``step(tokens)`` after each target step of the current drafter
    (``tokens`` committed by it); it returns the drafter to switch to before the next step, or
    None. ``untimed()``: this step is no drafter's (drafting paused by the engine), it is not timed."""

    clock: Callable[[], float] = time.perf_counter
    current: str = MODEL_FREE
    pace: dict[str, Pace] = field(default_factory=lambda: {MODEL_FREE: Pace(), NEURAL: Pace()})
    switches: int = 0
    _left: int = TRIAL_STEPS  # steps until the next decision
    _trial: bool = True  # the current drafter is on trial (a decision follows)
    _retry: int = RETRY_STEPS[0]
    _last: float | None = None

    def untimed(self) -> None:
        self._last = None

    def step(self, tokens: int) -> str | None:
        now = self.clock()
        if self._last is not None:
            self.pace[self.current].add(now - self._last, tokens)
        self._last = now
        self._left -= 1
        if self._left > 0:
            return None
        other = NEURAL if self.current == MODEL_FREE else MODEL_FREE
        if not self._trial or not self.pace[other].steps:  # the keeper's time is up, or never tried
            return self._switch(other, trial=True)
        if self.pace[other].s_per_token < self.pace[self.current].s_per_token:
            # the trial lost: back to the other, and a longer wait before the next try
            self._retry = min(2 * self._retry, RETRY_STEPS[1]) if self.switches > 1 else self._retry
            return self._switch(other, trial=False)
        self._trial, self._left, self._retry = False, self._retry, RETRY_STEPS[0]  # the trial won
        return None

    def _switch(self, to: str, trial: bool) -> str:
        self.current, self._trial, self.switches = to, trial, self.switches + 1
        self._left = TRIAL_STEPS if trial else self._retry
        if trial:
            self.pace[to] = Pace()  # judged on fresh steps
        self._last = None  # the switch's own step is not timed
        return to
