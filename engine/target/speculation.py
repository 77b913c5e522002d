"""How many drafted tokens each generation verifies in an iteration, decided from measured cost.

Verifying drafted tokens takes compute the other generations in the batch could use. Each
iteration the engine cuts the chains so that the iteration's expected tokens per second is
highest (a chain cut never changes the output, only how fast it comes):

    cost   a forward of R rows takes  t(R) = a + b*R  seconds, fitted by least squares over the
           engine's own recent forwards (``CostModel``): measured, never assumed
    gain   generation i accepts each drafted token with probability alpha_i, its own running
           acceptance (``Acceptance``), so its j-th drafted token commits with alpha_i**j
    rule   start every chain at 0 rows; give one more row to the generation whose next row
           gains most (alpha_i**(k_i+1)) while that gain beats what the row costs: adding a row
           raises E/T (expected tokens over time) exactly when gain > b * E / T

Alone on a CPU a row costs a few percent of a forward and any useful draft keeps its chain;
with eight generations in the batch the same row costs what a whole token is worth to the
others, and only the draft's likeliest tokens are verified. vLLM's dynamic speculation guessed
this rule instead of measuring it (vllm#49548); here both sides of the inequality are measured.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence


class CostModel:
    """t(rows) = a + b * rows over the last ``window`` forwards."""

    def __init__(self, window: int = 64) -> None:
        self.samples: deque[tuple[int, float]] = deque(maxlen=window)

    def observe(self, rows: int, seconds: float) -> None:
        self.samples.append((rows, seconds))

    def fit(self) -> tuple[float, float] | None:
        """(a, b) in seconds, or None while the forwards seen do not vary in size."""
        n = len(self.samples)
        if n < 4:
            return None
        mean_r = sum(r for r, _ in self.samples) / n
        mean_t = sum(t for _, t in self.samples) / n
        var = sum((r - mean_r) ** 2 for r, _ in self.samples)
        if var == 0:
            return None
        b = sum((r - mean_r) * (t - mean_t) for r, t in self.samples) / var
        b = max(b, 0.0)
        return max(mean_t - b * mean_r, 0.0), b


class Acceptance:
    """A generation's chance of accepting a drafted token: successes / trials of a geometric
    run (each verified chain is accepted tokens, then one rejection unless it was taken whole),
    with recent chains weighing more and a prior of one each."""

    DECAY = 0.9

    def __init__(self) -> None:
        self.accepted = 1.0
        self.rejected = 1.0
        self.chains = 0  # verified chains observed

    @property
    def alpha(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def observe(self, offered: int, accepted: int) -> None:
        if offered == 0:  # nothing was asked of the draft: nothing learned
            return
        self.chains += 1
        self.accepted = self.accepted * self.DECAY + accepted
        self.rejected = self.rejected * self.DECAY + (1.0 if accepted < offered else 0.0)


def chain_lengths(available: Sequence[int], alphas: Sequence[float], fixed_rows: int,
                  cost: tuple[float, float] | None) -> list[int]:
    """Drafted tokens to verify per generation: ``available`` [i] offered, acceptance
    ``alphas`` [i]; ``fixed_rows``: rows the iteration has anyway (next tokens, prefill chunks)."""
    if cost is None:  # not measured yet: verify what the draft offers
        return list(available)
    a, b = cost
    lengths = [0] * len(available)
    expected = float(len(available))  # every generation commits its next token
    seconds = a + b * fixed_rows
    heap = [(-alphas[i], i) for i in range(len(available)) if available[i] > 0 and alphas[i] > 0]
    heapq.heapify(heap)
    while heap:
        neg_gain, i = heapq.heappop(heap)
        gain = -neg_gain
        if seconds > 0 and gain * seconds <= b * expected:
            break
        lengths[i] += 1
        expected += gain
        seconds += b
        if lengths[i] < available[i]:
            heapq.heappush(heap, (-(gain * alphas[i]), i))
    return lengths
