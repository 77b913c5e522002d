"""Whether speculation pays, engine-wide and per generation, decided from measured throughput.

Speculation is worth its compute only while the target, with it, commits tokens faster than it
would decoding plainly at the same load. Where draft and target share compute (this CPU, one GPU
holding both models) the draft's share shows up as slower target forwards; where acceptance is
low the verified rows cost more than they return. Both are measured here, never modelled:

    engine   the target's committed tokens per second over clean decode iterations (no prefill
             chunk in them), kept per batch size (decoding generations) for each regime, SPEC
             (drafting on) and PLAIN (every generation's drafting paused: the draft spends
             nothing). The regime in force holds for a number of iterations, then the other is
             probed: ``settle`` iterations unmeasured (a draft stops, or restarts from the text;
             speculation is measured once most drafts offer chains again), then ``judge``
             measured ones, compared with the held regime's rate at the same batch
             sizes. The winner holds again, twice as long when it won again (up to ``hold[1]``),
             from ``hold[0]`` when the decision changed. A probe that meets batch sizes the other
             regime never measured keeps its samples and the other regime is probed next.
    session  while speculating, a generation whose drafting does not pay is paused for a number
             of its steps (16 at first, doubling per relapse up to 256), then drafts again from the
             committed text: its chains were rejected (running acceptance below ``min_alpha``) or
             the engine's measured-cost cut (card.engine.target.speculation) verified none of them
             for ``unpaid_steps`` steps running. Fewer drafted sessions leave the draft's compute to
             the ones that pay.

Paused means the chain source stops its draft (``Pausable``: a remote session's worker gets
StopDraft, an in-process drafter is detached), not only that the target ignores the chains. The
output never depends on any of this; only the speed does. ``mode``: ``auto`` (the above),
``always`` (speculate throughout, the measured-cost cut only) or ``never`` (plain decoding with
every draft paused: the controller's own cost).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from card.engine.shared.errors import InvalidArgument

SPECULATION_MODES = ("auto", "always", "never")


class Regime(Enum):
    SPEC = "spec"
    PLAIN = "plain"


@dataclass(frozen=True)
class SpeculationControl:
    """The controller's settings (one owner: card-target's ``--speculation``, card-bench and
    the in-process runner build this)."""

    mode: str = "auto"
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

    def __post_init__(self) -> None:
        if self.mode not in SPECULATION_MODES:
            raise InvalidArgument(f"speculation must be one of {', '.join(SPECULATION_MODES)}, "
                                  f"not {self.mode!r}")
        if self.judge < 1 or self.first_hold < 0 or min(*self.hold, *self.session_pause) < 1:
            raise InvalidArgument("speculation control: judge, holds and pauses must be >= 1")


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
class SessionControl:
    """One generation's drafting: ``paused_left`` steps until it drafts again (0: drafting)."""

    paused_left: int = 0
    next_pause: int = 0
    unpaid: int = 0  # steps running whose offered chain the cost cut verified none of
    pauses: int = 0


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
class SpeculationController:
    """Owned by one TargetEngine (or, in process, shared by the engines a runner makes one after
    the other). ``on_decision`` is called at every switch of the regime."""

    config: SpeculationControl = field(default_factory=SpeculationControl)
    on_decision: Callable[[Decision], None] | None = None
    regime: Regime = Regime.SPEC
    iteration: int = 0
    switches: int = 0
    rates: dict[Regime, dict[int, Rate]] = field(default_factory=lambda: {r: {} for r in Regime})
    last: Decision | None = None
    _left: int = 0  # iterations until the held regime is probed, or the probe's measured ones
    _settle: int = 0
    _probing: bool = False
    _probe: list[tuple[int, int, float]] = field(default_factory=list)  # (batch, tokens, seconds)
    _warmed: bool = False  # since speculation (re)started, the drafts have delivered chains
    _cold: int = 0  # iterations waited for that
    _hold: dict[Regime, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        c = self.config
        if c.mode == "never":
            self.regime = Regime.PLAIN
        self._left = c.first_hold
        self._hold = {r: c.hold[0] for r in Regime}

    # ---- what the engine asks ---------------------------------------------------------------
    @property
    def speculating(self) -> bool:
        return self.regime is Regime.SPEC

    @property
    def enabled(self) -> bool:
        return self.config.mode == "auto"

    def drafting(self, ctl: SessionControl) -> bool:
        """Whether one generation drafts in this iteration."""
        return self.speculating and ctl.paused_left == 0

    # ---- what the engine tells --------------------------------------------------------------
    def session_step(self, ctl: SessionControl, offered: int, verified: int, alpha: float,
                     judged: bool) -> bool:
        """One decoding step of a drafting generation: ``offered`` chain tokens, ``verified`` of
        them after the cost cut, ``alpha`` its running acceptance, ``judged`` whether it has had
        chains enough to be judged. True: pause its drafting now."""
        c = self.config
        if c.mode != "auto" or not self.speculating:
            return False
        if offered:  # a step without a chain says nothing about whether chains pay
            ctl.unpaid = 0 if verified else ctl.unpaid + 1
        if not (judged and alpha < c.min_alpha) and ctl.unpaid < c.unpaid_steps:
            return False
        ctl.paused_left = ctl.next_pause or c.session_pause[0]
        ctl.next_pause = min(2 * ctl.paused_left, c.session_pause[1])
        ctl.unpaid = 0
        ctl.pauses += 1
        return True

    def session_paused_step(self, ctl: SessionControl) -> bool:
        """One step of a paused generation; True when its pause is over (it drafts again)."""
        if ctl.paused_left > 0:
            ctl.paused_left -= 1
        return ctl.paused_left == 0

    def observe(self, batch: int, tokens: int, seconds: float, clean: bool, warm: bool = True
                ) -> Decision | None:
        """One iteration that decoded ``batch`` generations and committed ``tokens`` in
        ``seconds``; ``clean``: no prefill chunk rode along (only those are measured); ``warm``:
        most drafting generations were offered a chain (drafts that restart from the text deliver
        nothing for a while: speculation is measured from when they do, or after ``warm_cap``
        iterations). Returns the decision when the regime switches (the engine pauses or resumes
        drafting before the next iteration)."""
        self.iteration += 1
        if self.config.mode != "auto" or batch == 0:
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
            return self._switch(self._other(), "probe", probing=True)
        return self._judge()

    # ---- decisions ----------------------------------------------------------------------------
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
            return self._switch(held, "unmeasured", probing=True)
        mine, theirs = mine_tok / mine_s, theirs_tok / theirs_s
        spec, plain = (mine, theirs) if probed is Regime.SPEC else (theirs, mine)
        winner = Regime.SPEC if spec > plain * (1.0 + self.config.margin) else Regime.PLAIN
        if winner is probed:  # the decision changes: both holds start over
            self._hold = {r: self.config.hold[0] for r in Regime}
            return self._switch(probed, "won", probing=False, spec=spec, plain=plain)
        # the held regime is confirmed: it holds twice as long before the next probe
        self._hold[held] = min(2 * self._hold[held], self.config.hold[1])
        return self._switch(held, "lost", probing=False, spec=spec, plain=plain)

    def _switch(self, regime: Regime, why: str, probing: bool, spec: float = 0.0,
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
