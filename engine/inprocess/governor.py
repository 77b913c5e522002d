"""When in-process card drafts and when the target decodes alone (LocalCard's back-off).

A draft is worth the cores it holds only while the target, with it, commits tokens faster than
the target alone would. Two signals say it does not:

    useful  moving average of corrections that accepted drafted tokens or whose next token was
            in the tree (hit or secondary hit), counted once the draft session has delivered its
            first layer (before that it is prefilling and has offered nothing). A chain accepted
            to its tier-B end is a "miss" for the tree but the best a draft can do. Low: the
            draft is wrong for this text.
    pace    seconds per committed token, drafting vs alone, both measured on this generation's
            own target steps (from one ``step`` call to the next: the target's forward and the
            step's bookkeeping). The alone pace comes from a short calibration when the
            generation starts (the draft starts a few steps late) and from every pause, so it
            follows the context length and whatever else the machine is doing.

On either signal the draft session is stopped for a number of steps (16 at first, doubling per
failed probe up to 256), its cores lent to the target, then restarted and judged again on fresh
steps. A draft that helps is judged every step and never paused by the pace rule; one that only
breaks even costs a probe (8 steps) per pause. The output never depends on any of this.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from card.engine.shared.tree import Outcome
from card.engine.target.drafter_choice import Pace

EMA = 0.2  # weight of the newest step in the moving averages
BACKOFF_USEFUL = 0.15  # pause below this
USEFUL_START, USEFUL_PROBE = 0.5, 0.3  # 6 straight misses pause a new session, 4 a probe
JUDGE_STEPS = 8  # drafting steps of a (re)started session before its pace is compared
BACKOFF_STEPS = (16, 256)  # first and longest pause, in target steps; doubles per failed probe


@dataclass
class Governor:
    """Drafting on or off, step by step. ``calibration_steps = 0`` starts drafting at once and
    leaves the pace rule off until a ``useful`` pause has measured the alone pace; ``enabled =
    False`` drafts throughout (no calibration, no pause)."""

    calibration_steps: int = 4
    clock: Callable[[], float] = time.perf_counter
    enabled: bool = True
    drafting: bool = False
    backoffs: int = 0  # pauses for cause (not the calibration)
    useful: float = USEFUL_START
    alone: Pace = field(default_factory=Pace)
    with_draft: Pace = field(default_factory=Pace)
    _paused_left: int = 0
    _next_backoff: int = BACKOFF_STEPS[0]
    _last: float | None = None

    def open(self) -> bool:
        """A new generation; True when drafting starts now (else after the calibration)."""
        self.backoffs, self._next_backoff, self._last = 0, BACKOFF_STEPS[0], None
        self.alone, self.useful = Pace(), USEFUL_START
        self._paused_left = self.calibration_steps if self.enabled else 0
        self.drafting = not self._paused_left
        self.with_draft = Pace()
        return self.drafting

    def timed(self, tokens: int) -> None:
        """A step begins: the time since the last one committed ``tokens`` in the current mode.
        The first step after ``open`` is not timed (its interval holds the prefill)."""
        now = self.clock()
        if self._last is not None:
            (self.with_draft if self.drafting else self.alone).add(now - self._last, tokens)
        self._last = now

    def resume(self) -> bool:
        """While paused, once per step: True when the pause is over and drafting restarts."""
        self._paused_left -= 1
        if self._paused_left > 0:
            return False
        self.useful = USEFUL_START if self.backoffs == 0 else USEFUL_PROBE
        self.with_draft, self.drafting = Pace(), True
        return True

    def keep(self, outcome: Outcome, delivered: bool, accepted: int = 0) -> bool:
        """While drafting, once per step with the correction's verdict and how many drafted
        tokens it accepted: False means pause now."""
        if not self.enabled:
            return True
        if delivered:
            useful = accepted > 0 or outcome is not Outcome.MISS
            self.useful += EMA * (float(useful) - self.useful)
        slower = (self.with_draft.steps >= JUDGE_STEPS and self.alone.steps > 0
                  and self.with_draft.s_per_token > self.alone.s_per_token)
        if self.useful >= BACKOFF_USEFUL and not slower:
            return True
        self.backoffs += 1
        self._paused_left = self._next_backoff
        self._next_backoff = min(2 * self._next_backoff, BACKOFF_STEPS[1])
        self.drafting = False
        return False
