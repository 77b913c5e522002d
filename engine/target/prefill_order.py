"""Which prompts an iteration prefills, and in what order (the plan phase of
card.engine.target.scheduler).

A burst of prompts (eight chat turns arriving at once, the first turns of a benchmark's
conversations, an agent's parallel calls) used to be prefilled in arrival order, as many as the
token budget held: they all finished in the same iteration or two, so every first token came after
the whole burst's prefill. On one server the order that gives the least mean wait is shortest job
first, and one job at a time unless starting the next costs the others less than it saves itself:

    order    the prompts with the fewest tokens left to prefill first (ties: arrival order); a
             prompt passed over ``MAX_PASSED`` iterations goes before all of them from then on
             (arrival order among such), so a stream of short prompts never starves a long one
    group    with the engine's measured cost of a forward, t(R) = a + b R
             (card.engine.target.speculation.CostModel), prompt j joins the iteration's prompts
             while  b n_j (finishing + decoding) <= (a + b D) waiting : its n_j rows delay
             everyone whose token comes at the end of this forward (the prompts the iteration
             completes, the D decoding streams), and leaving it and the ``waiting`` prompts after
             it for the next forward costs each of them that forward's fixed part. Tiny prompts
             group (a dominates), long ones go one at a time, and beside many decoding streams
             one prompt at a time. Until the cost is measured: as many as the budget holds.

So the short prompts' first tokens come while the longer ones still prefill, and the longest's
about when it did in arrival order. Outputs do not change: a prompt's rows are the same bits in
whichever iteration, beside whichever rows, they are computed (docs/engine.md). ``arrival``
keeps arrival order and the token budget alone (vLLM's first-come-first-served).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar

PREFILL_ORDERS = ("shortest", "arrival")
MAX_PASSED = 8  # iterations a prompt may be passed over before it goes first


class Prompt(Protocol):  # a Generation, as far as ordering goes (hashed by identity)
    @property
    def prefill_left(self) -> int: ...


P = TypeVar("P", bound=Prompt)


class PrefillOrder:
    def __init__(self, order: str = "shortest", max_passed: int = MAX_PASSED) -> None:
        if order not in PREFILL_ORDERS:
            raise ValueError(f"prefill order must be one of {', '.join(PREFILL_ORDERS)}, got {order!r}")
        self.shortest = order == "shortest"
        self.max_passed = max_passed
        # each prefilling prompt -> iterations it was offered a chunk and not taken; rebuilt at
        # every plan from the prompts offered, so an ended one is dropped at the next
        self._passed: dict[Prompt, int] = {}

    def ordered(self, prompts: Sequence[P]) -> list[P]:
        """``prompts`` (in arrival order) in the order this iteration offers them chunks."""
        if not self.shortest:
            return list(prompts)
        aged = [p for p in prompts if self._passed.get(p, 0) >= self.max_passed]
        rest = [p for p in prompts if self._passed.get(p, 0) < self.max_passed]
        return aged + sorted(rest, key=lambda p: p.prefill_left)  # stable: ties in arrival order

    def joins(self, prompt: Prompt, rows: int, finishing: int, decoding: int, decoding_rows: int,
              waiting: int, cost: tuple[float, float] | None) -> bool:
        """Whether ``prompt``'s chunk of ``rows`` joins an iteration that already prefills some
        prompt (``finishing`` of them complete in it) beside ``decoding`` streams of
        ``decoding_rows`` rows; ``waiting``: the prompts it and those after it in the order are."""
        if not self.shortest or cost is None or self._passed.get(prompt, 0) >= self.max_passed:
            return True
        a, b = cost
        return b * rows * (finishing + decoding) <= (a + b * decoding_rows) * waiting

    def planned(self, offered: Sequence[Prompt], taken: Sequence[Prompt]) -> None:
        """After the plan: the ``offered`` prompts (every one still prefilling) not ``taken`` were
        passed over once more."""
        took = set(taken)
        self._passed = {p: self._passed.get(p, 0) + (p not in took) for p in offered}
