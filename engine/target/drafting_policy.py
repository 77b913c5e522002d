"""Does this generation draft now, and with what: one owner per engine, ``DraftingPolicy``.

The output never depends on any of this; only the speed does. Every rule is measured, never
modelled, and the engine applies the answer through each chain source's one verb,
``draft_with(kind | None)`` (card.engine.target.chain_source): None stops the draft (a remote
session's worker gets StopDraft, an in-process link is detached), a ``DraftKind`` (the model-free
lookup or the draft worker) drafts with it from the committed text.

    engine      the target's committed tokens per second over clean decode iterations (no
                prefill chunk in them), kept per batch size for each regime, SPEC (drafting on)
                and PLAIN (every generation's drafting off: the draft spends nothing). The regime
                in force holds for a number of iterations, then the other is probed: ``settle``
                iterations unmeasured (drafts restart from the text), then ``judge`` measured
                ones, compared with the held regime's rate at the same batch sizes. The winner
                holds again, twice as long when it won again (up to ``hold[1]``), from
                ``hold[0]`` when the decision changed. A probe that meets batch sizes the other
                regime never measured keeps its samples and the other regime is probed next.
    generation  while speculating, a generation whose drafting does not pay is paused for a
                number of its steps (16 at first, doubling per relapse up to 256; one back-off
                whatever the cause), then drafts again from the committed text. Causes:
                - acceptance (``speculation`` auto): its running acceptance is below
                  ``min_alpha``, or the measured-cost cut (card.engine.target.speculation)
                  verified none of its chains for ``unpaid_steps`` steps running;
                - pace (``pace_rule``, in process): a moving average of its useful steps (a
                  drafted token accepted, or the next token in the tree; judged after a step
                  that verified a chain) fell below ``useful_floor``, or drafting makes its own
                  steps slower per committed token than decoding alone (both timed with the
                  injected clock on its own steps; the alone pace comes from ``calibration``
                  plain steps that open a generation and from every pause).
    drafter     a generation whose source offers both drafters (``card-auto``) opens on the
                model-free lookup (it costs nothing), tries the worker for ``trial_steps``, then
                keeps whichever committed tokens faster; the loser is tried again after
                ``retry_steps[0]`` steps, twice as long per trial it loses again.

``speculation``: ``auto`` (the above), ``always`` (speculate throughout, no acceptance pause) or
``never`` (plain decoding with every draft stopped: the policy's own cost).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum

from card.engine.shared.errors import InvalidArgument
from card.engine.shared.tree import Outcome
from card.engine.target.chain_source import DraftKind
from card.engine.target.generation import Generation
from card.engine.target.speculation import Acceptance

SPECULATION_MODES = ("auto", "always", "never")
EMA = 0.2  # weight of the newest step in a generation's moving averages


class Regime(Enum):
    SPEC = "spec"
    PLAIN = "plain"


@dataclass(frozen=True)
class DraftingConfig:
    """The policy's settings (one owner: card-target's ``--speculation``, card-bench and the
    in-process runner build this)."""

    speculation: str = "auto"
    # a probe costs more than its iterations: drafts that resume restart from the whole text
    first_hold: int = 24  # speculating iterations before the first plain probe
    hold: tuple[int, int] = (32, 1024)  # iterations a decision holds: first, longest
    settle: tuple[int, int] = (1, 3)  # unmeasured iterations after a switch: to plain, to spec
    warm_cap: int = 16  # after a switch to spec: iterations waiting for the drafts' first chains, at most
    judge: int = 10  # measured iterations of a probe
    margin: float = 0.02  # speculation must beat plain by this fraction to hold
    min_alpha: float = 0.12  # a generation's running acceptance below this pauses its drafting
    unpaid_steps: int = 16  # steps running whose chains the cost cut verified none of
    session_pause: tuple[int, int] = (16, 256)  # a generation's pause, first and longest, in its steps
    pace_rule: bool = False  # in process: pause a draft that keeps missing or slows its generation
    calibration: int = 0  # pace rule: plain steps that open a generation drafting with the worker
    useful_floor: float = 0.15  # pace rule: pause below this share of useful steps
    useful_start: tuple[float, float] = (0.5, 0.3)  # its start: a new generation, after a pause
    judge_steps: int = 8  # pace rule: drafting steps of a (re)started draft before its pace is compared
    trial_steps: int = 8  # card-auto: steps each drafter is judged on
    retry_steps: tuple[int, int] = (32, 256)  # card-auto: steps before a loser is tried again

    def __post_init__(self) -> None:
        if self.speculation not in SPECULATION_MODES:
            raise InvalidArgument(f"speculation must be one of {', '.join(SPECULATION_MODES)}, "
                                  f"not {self.speculation!r}")
        if self.judge < 1 or self.first_hold < 0 or min(*self.hold, *self.session_pause) < 1:
            raise InvalidArgument("speculation control: judge, holds and pauses must be >= 1")
        if self.calibration < 0:
            raise InvalidArgument(f"calibration steps must be >= 0, got {self.calibration}")


@dataclass
class Rate:
    """A regime's moving averages of seconds and committed tokens per clean iteration at one
    batch size (running means for the first 8), and the iteration it was last measured at."""

    seconds: float = 0.0
    tokens: float = 0.0
    n: int = 0
    at: int = 0

    def add(self, seconds: float, tokens: int, at: int) -> None:
        self.n += 1
        w = max(1.0 / self.n, 0.125)
        self.seconds += w * (seconds - self.seconds)
        self.tokens += w * (tokens - self.tokens)
        self.at = at


@dataclass
class Pace:
    """Moving averages of seconds and tokens per step of one generation (running means for the
    first 5)."""

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
class Decision:
    """One switch of the engine's regime, for metrics and logs: ``why`` is ``probe`` (a regime
    is tried), ``won`` / ``lost`` (a probe's verdict) or ``unmeasured``; the rates compared, in
    tokens per second (0 when not compared)."""

    regime: Regime
    why: str
    spec_rate: float = 0.0
    plain_rate: float = 0.0


@dataclass
class Stepped:
    """What one decoding iteration did for one generation: chain tokens its source ``offered``,
    ``verified`` of them after the cost cut, tokens ``committed``, and ``outcome``: the tree's
    verdict on the correction its source applied at this step (None: no tree judged it)."""

    gen: Generation
    offered: int
    verified: int
    committed: int
    outcome: Outcome | None


@dataclass
class Drafting:
    """One generation's drafting, as the policy last decided it."""

    drafters: tuple[DraftKind, ...]  # what its source drafts with, its first the one it opens on
    current: DraftKind | None  # the drafter chosen (card-auto: by pace); None: it cannot draft
    told: DraftKind | None = None  # what its source drafts with now (None: no drafting)
    paused_left: int = 0  # its steps until it drafts again (0: drafting)
    next_pause: int = 0
    pauses: int = 0  # for cause
    unpaid: int = 0  # steps running whose offered chain the cost cut verified none of
    acceptance: Acceptance = field(default_factory=Acceptance)
    useful: float = 0.0
    alone: Pace = field(default_factory=Pace)
    paced: dict[DraftKind, Pace] = field(default_factory=lambda: {k: Pace() for k in DraftKind})
    last_at: float | None = None  # when its latest step ended (None: the next one is not timed)
    last_offered: int = 0  # chain tokens offered and accepted at its previous step
    last_accepted: int = 0
    switches: int = 0  # card-auto: drafters switched to
    trial_left: int = 0  # card-auto: steps until the next decision
    on_trial: bool = True
    retry: int = 0


class DraftingPolicy:
    """Owned by one TargetEngine (or, in process, shared by the engines a runner makes one after
    the other, so what it measured serves the next generation). ``on_decision`` is called at
    every switch of the regime, ``on_switch`` at every change of a generation's drafter
    (card-auto); ``clock`` times each generation's steps."""

    def __init__(self, config: DraftingConfig | None = None,
                 on_decision: Callable[[Decision], None] | None = None,
                 on_switch: Callable[[DraftKind], None] | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        c = self.config = config or DraftingConfig()
        self.on_decision = on_decision
        self.on_switch = on_switch
        self.clock = clock
        self.regime = Regime.PLAIN if c.speculation == "never" else Regime.SPEC
        self.iteration = 0
        self.switches = 0
        self.session_pauses = 0  # generations paused for cause
        self.rates: dict[Regime, dict[int, Rate]] = {r: {} for r in Regime}
        self.last: Decision | None = None
        self._gens: dict[Generation, Drafting] = {}
        self._left = c.first_hold  # iterations until the held regime is probed, or the probe's measured ones
        self._settle = 0
        self._probing = False
        self._probe: list[tuple[int, int, float]] = []  # (batch, tokens, seconds)
        self._warmed = False  # since speculation (re)started, the drafts have delivered chains
        self._cold = 0  # iterations waited for that
        self._hold = {r: c.hold[0] for r in Regime}

    # ---- what the engine asks ---------------------------------------------------------------
    @property
    def speculating(self) -> bool:
        return self.regime is Regime.SPEC

    def drafting(self, gen: Generation) -> Drafting | None:
        """``gen``'s drafting (None: it is not running)."""
        return self._gens.get(gen)

    def stopped(self, gen: Generation) -> bool:
        """Its source could draft and does not (a chain it offers is not verified)."""
        d = self._gens.get(gen)
        return d is not None and bool(d.drafters) and d.told is None

    def wanted(self, d: Drafting) -> DraftKind | None:
        """What a generation drafts with in the next iteration: why it does not is here."""
        return d.current if self.speculating and d.paused_left == 0 else None

    def alpha(self, gen: Generation) -> float:
        d = self._gens.get(gen)
        return (d.acceptance if d is not None else Acceptance()).alpha

    def paused(self) -> int:
        """Running generations that could draft and do not."""
        return sum(bool(d.drafters) and d.told is None for d in list(self._gens.values()))

    # ---- what the engine tells --------------------------------------------------------------
    def admit(self, gen: Generation) -> None:
        """A generation takes a KV slot: its source is told what it opens with."""
        drafters = tuple(gen.source.drafters or ())
        c = self.config
        d = Drafting(drafters, drafters[0] if drafters else None, useful=c.useful_start[0],
                     trial_left=c.trial_steps, retry=c.retry_steps[0], next_pause=c.session_pause[0])
        self._gens[gen] = d  # its acceptance serves the cost cut whatever its source
        if not drafters:
            return
        if c.pace_rule and d.current is DraftKind.WORKER:
            d.paused_left = c.calibration  # the alone pace first: the draft starts a few steps late
        gen.stats.speculation = c.speculation
        self._tell(gen, d, self.wanted(d), opening=True)

    def release(self, gen: Generation) -> None:
        self._gens.pop(gen, None)

    def steer(self, running: Iterable[Generation]) -> None:
        """Before an iteration: each source whose drafting the policy changed is told."""
        for gen in running:
            d = self._gens.get(gen)
            if d is not None and d.drafters and (want := self.wanted(d)) is not d.told:
                self._tell(gen, d, want)

    def _tell(self, gen: Generation, d: Drafting, kind: DraftKind | None, opening: bool = False) -> None:
        if kind is None:
            gen.stats.drafting_pauses += 1
        elif d.told is None and not opening:  # it drafts again: judged afresh
            d.acceptance = Acceptance()
            if self.config.pace_rule:
                d.useful = self.config.useful_start[1 if d.pauses else 0]
                d.paced[kind] = Pace()
        d.told = kind
        gen.source.draft_with(kind)

    def observe(self, steps: Sequence[Stepped], seconds: float, clean: bool) -> Decision | None:
        """One iteration's decoding steps, its ``seconds``; ``clean``: no prefill chunk rode
        along and nothing failed (only those measure the regime). Each generation's own rules
        first, then the engine's regime."""
        batch = tokens = drafters = offering = drafting = 0
        now = self.clock()
        for s in steps:
            batch += 1
            tokens += s.committed
            d = self._gens.get(s.gen)
            if d is None:
                continue
            d.acceptance.observe(s.verified, s.committed - 1)
            if not d.drafters:
                continue
            drafters += 1
            if d.told is None:
                s.gen.stats.drafting_paused_steps += 1
            else:
                drafting += 1
                offering += s.offered > 0
            self._step(s, d, now)
        return self.tick(batch if drafters else 0, tokens, seconds, clean, warm=2 * offering >= drafting)

    # ---- one generation -----------------------------------------------------------------------
    def _step(self, s: Stepped, d: Drafting, now: float) -> None:
        c = self.config
        if d.last_at is not None:  # its previous step's end to this one's: one step of its own
            (d.alone if d.told is None else d.paced[d.told]).add(now - d.last_at, s.committed)
        d.last_at = now
        judged_before, accepted_before = d.last_offered > 0, d.last_accepted
        d.last_offered, d.last_accepted = s.offered, s.committed - 1
        if d.told is None:
            if self.speculating and d.paused_left > 0:
                d.paused_left -= 1
            return
        if len(d.drafters) > 1:
            self._choose(d)
        pause = False
        if c.speculation == "auto" and self.speculating:
            if s.offered:  # a step without a chain says nothing about whether chains pay
                d.unpaid = 0 if s.verified else d.unpaid + 1
            pause = ((d.acceptance.chains >= 4 and d.acceptance.alpha < c.min_alpha)
                     or d.unpaid >= c.unpaid_steps)
        if c.pace_rule:
            if judged_before:  # a verdict on a chain the draft delivered
                useful = accepted_before > 0 or s.outcome is not Outcome.MISS
                d.useful += EMA * (float(useful) - d.useful)
            drafted = d.paced[d.told]
            slower = (drafted.steps >= c.judge_steps and d.alone.steps > 0
                      and drafted.s_per_token > d.alone.s_per_token)
            pause = pause or d.useful < c.useful_floor or slower
        if pause:
            d.paused_left = d.next_pause
            d.next_pause = min(2 * d.paused_left, c.session_pause[1])
            d.unpaid = 0
            d.pauses += 1
            self.session_pauses += 1

    def _choose(self, d: Drafting) -> None:
        """card-auto, after a step of the current drafter: keep it, or switch to the other."""
        c = self.config
        d.trial_left -= 1
        if d.trial_left > 0:
            return
        assert d.current is not None
        other = d.drafters[0] if d.current is d.drafters[1] else d.drafters[1]
        mine, theirs = d.paced[d.current], d.paced[other]
        if not d.on_trial or not theirs.steps:  # the keeper's time is up, or never tried
            self._switch(d, other, trial=True)
        elif theirs.s_per_token < mine.s_per_token:
            # the trial lost: back to the other, and a longer wait before the next try
            d.retry = min(2 * d.retry, c.retry_steps[1]) if d.switches > 1 else d.retry
            self._switch(d, other, trial=False)
        else:  # the trial won
            d.on_trial, d.trial_left, d.retry = False, d.retry, c.retry_steps[0]

    def _switch(self, d: Drafting, to: DraftKind, trial: bool) -> None:
        d.current, d.on_trial, d.switches = to, trial, d.switches + 1
        d.trial_left = self.config.trial_steps if trial else d.retry
        if trial:
            d.paced[to] = Pace()  # judged on fresh steps
        d.last_at = None  # the switch's own step is no drafter's
        if self.on_switch is not None:
            self.on_switch(to)

    # ---- the engine's regime ------------------------------------------------------------------
    def tick(self, batch: int, tokens: int, seconds: float, clean: bool, warm: bool = True
             ) -> Decision | None:
        """One iteration that decoded ``batch`` drafting-capable generations and committed
        ``tokens`` in ``seconds``; ``warm``: most drafting generations were offered a chain
        (drafts that restart from the text deliver nothing for a while: speculation is measured
        from when they do, or after ``warm_cap`` iterations). Returns the decision when the
        regime switches (the engine steers before the next iteration)."""
        self.iteration += 1
        if self.config.speculation != "auto" or batch == 0:
            return None
        if self._settle > 0:
            self._settle -= 1
            return None
        if self.speculating and not self._warmed:
            self._warmed = warm or self._cold >= self.config.warm_cap
            self._cold += 1
            if not self._warmed:
                return None
        if clean:
            self.rates[self.regime].setdefault(batch, Rate()).add(seconds, tokens, self.iteration)
            if self._probing:
                self._probe.append((batch, tokens, seconds))
        if clean or not self._probing:  # a probe counts measured iterations only
            self._left -= 1
        if self._left > 0:
            return None
        if not self._probing:
            return self._regime(self._other(), "probe", probing=True)
        return self._judge()

    def _other(self) -> Regime:
        return Regime.PLAIN if self.regime is Regime.SPEC else Regime.SPEC

    def _judge(self) -> Decision:
        """The probe is over: the probed regime against the held one, at the probe's batch sizes."""
        probed, held = self.regime, self._other()
        fresh = self.iteration - 4 * self.config.hold[1]
        table = self.rates[held]
        mine_tok = mine_s = theirs_tok = theirs_s = 0.0
        for batch, tokens, seconds in self._probe:
            rate = table.get(batch)
            if rate is None or rate.at < fresh:
                continue
            mine_tok, mine_s = mine_tok + tokens, mine_s + seconds
            theirs_tok, theirs_s = theirs_tok + rate.tokens, theirs_s + rate.seconds
        if mine_s <= 0 or theirs_s <= 0:  # the held regime never ran at these sizes: measure it now
            return self._regime(held, "unmeasured", probing=True)
        mine, theirs = mine_tok / mine_s, theirs_tok / theirs_s
        spec, plain = (mine, theirs) if probed is Regime.SPEC else (theirs, mine)
        winner = Regime.SPEC if spec > plain * (1.0 + self.config.margin) else Regime.PLAIN
        if winner is probed:  # the decision changes: both holds start over
            self._hold = {r: self.config.hold[0] for r in Regime}
            return self._regime(probed, "won", probing=False, spec=spec, plain=plain)
        # the held regime is confirmed: it holds twice as long before the next probe
        self._hold[held] = min(2 * self._hold[held], self.config.hold[1])
        return self._regime(held, "lost", probing=False, spec=spec, plain=plain)

    def _regime(self, regime: Regime, why: str, probing: bool, spec: float = 0.0,
                plain: float = 0.0) -> Decision:
        changed = regime is not self.regime
        self.regime = regime
        self._probing = probing
        self._probe = []
        self._left = self.config.judge if probing else self._hold[regime]
        if changed:
            self.switches += 1
            self._settle = self.config.settle[1 if regime is Regime.SPEC else 0]
            self._warmed, self._cold = False, 0
        decision = Decision(regime, why, spec, plain)
        self.last = decision
        if self.on_decision is not None:
            self.on_decision(decision)
        return decision

    def rate(self, regime: Regime, batch: int) -> float:
        """The measured tokens per second of ``regime`` at ``batch`` (0 when never measured)."""
        r = self.rates[regime].get(batch)
        return r.tokens / r.seconds if r is not None and r.seconds > 0 else 0.0
