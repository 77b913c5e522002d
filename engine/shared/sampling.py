"""Token selection by the target: greedy, or seeded sampling keyed by committed position; the
same arithmetic for every row of a step at once (``filter_rows``, ``draw_rows``) and the exact
acceptance rule on the device (``exact_accepted``). In engine/shared because the static step
(card.engine.shared.static_step) runs it inside its captured graph; only the target calls it.

A position-keyed uniform (not a stateful generator) is what makes sampling exact across modes:
vanilla draws position t after t forwards, card may draw it inside a 6-token verification, and
both use the same number ``u(seed, t)``.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from card.engine.shared.config import SamplingParams

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def position_uniform(seed: int, position: int, stream: int = 0) -> float:
    """A uniform number in [0, 1) that depends only on (seed, position) and ``stream``: stream 0
    draws tokens; rejection sampling's accept-or-reject coin at a position is stream 1, so the
    coin and the draw that follows a rejection are independent."""
    key = _splitmix64(seed) if not stream else _splitmix64(_splitmix64(seed) ^ _splitmix64(stream))
    bits = _splitmix64(key ^ (position & _MASK64))
    return (bits >> 11) * (1.0 / (1 << 53))


def private_seed() -> int:
    """A seed for what leaves the target: a rejection session's ``ChainDraw`` goes to the cache and
    its draft, which must not learn the request's seed (the target's coins are keyed by it, and
    every unseeded request has seed 0). Drawn per session from the OS's generator, so it tells a
    draft nothing, not even which requests share a seed; the draft only needs a generator that
    the target's coins do not depend on. Never used for the target's own draws: seeded card still
    draws what seeded vanilla draws."""
    return secrets.randbits(63)


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Softmax of ``logits`` [V] after temperature, min-p, top-k and top-p, in float64 on the CPU
    (vLLM's order; ``logits`` already went through the request's logits processors,
    engine.target.logits_processors): ``filter_rows`` on one row, the same ops the static step
    runs for every row of a step at once (card.engine.shared.static_step), so a token drawn here
    and one drawn there are the same bits.

    Greedy params (a temperature below SAMPLING_EPS) give the one-hot distribution on the argmax,
    the limit of the softmax as the temperature goes to 0: dividing by such a temperature would
    overflow the logits to inf and the softmax to NaN. min-p does not apply to them (nor in vLLM:
    it cannot change an argmax).
    """
    logits = logits.detach().to("cpu", torch.float64)
    if params.greedy:
        return torch.zeros_like(logits).index_fill_(0, torch.argmax(logits).view(1), 1.0)
    vocab = logits.numel()
    one = RowFilters.of([params], vocab)
    return filter_rows(logits[None], one.temperature, one.top_k, one.top_p, one.min_p, one.shape)[0]


@dataclass(frozen=True)
class FilterShape:
    """Which filters a batch of rows runs (known on the host before the step, so a compiled or
    captured step has one graph per shape): min-p, top-k up to ``top_k_cap`` (0: none; a power of
    two, at most the vocabulary), top-p. A row that does not use a filter the batch runs gets its
    neutral value (min_p 0, top_k 0, top_p 1), which changes none of its bits."""

    min_p: bool = False
    top_k_cap: int = 0
    top_p: bool = False


@dataclass(frozen=True)
class RowFilters:
    """Per-row filter parameters of a batch (host tensors [R]) and the batch's ``shape``."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    shape: FilterShape

    @staticmethod
    def of(params: Sequence[SamplingParams | None], vocab: int) -> RowFilters:
        """Rows sampled with ``params`` (None or greedy: a neutral row, temperature 1)."""
        sampled = [p if p is not None and not p.greedy else None for p in params]
        top_k = [p.top_k if p is not None and 0 < p.top_k < vocab else 0 for p in sampled]
        cap = 0
        if any(top_k):
            cap = 1
            while cap < max(top_k):
                cap *= 2
            cap = min(cap, vocab)
        return RowFilters(
            torch.tensor([p.temperature if p is not None else 1.0 for p in sampled], dtype=torch.float64),
            torch.tensor(top_k, dtype=torch.int64),
            torch.tensor([p.top_p if p is not None else 1.0 for p in sampled], dtype=torch.float64),
            torch.tensor([p.min_p if p is not None else 0.0 for p in sampled], dtype=torch.float64),
            FilterShape(any(p is not None and p.min_p > 0.0 for p in sampled), cap,
                        any(p is not None and p.top_p < 1.0 for p in sampled)),
        )


class RowBuffers:
    """Preallocated [rows, V] workspaces for ``filter_rows`` and ``draw_rows`` (the static step
    keeps one): every [R, V] intermediate is written into one of them (``out=``, in place), so a
    step allocates none. On the CPU that is most of the cost: a fresh tensor of a few MB is fresh
    pages from the OS, faulted in on first touch, several times per step; a CUDA graph needs fixed
    addresses anyway. The ops are the same ones, so the bits are."""

    def __init__(self, rows: int, vocab: int, device: torch.device) -> None:
        rows = max(rows, 2)  # a lone row's sum takes two (``_row_sums``)
        # empty, not zeros: every op writes what it reads first, and untouched pages cost nothing
        # (a step of 8 rows touches 8 rows of the largest bucket's)
        self.values = torch.empty(3, rows, vocab, dtype=torch.float64, device=device)
        self.index = torch.empty(rows, vocab, dtype=torch.int64, device=device)
        self.cols = torch.arange(vocab, device=device)

    def take(self, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.values[0, :rows], self.values[1, :rows], self.values[2, :rows], self.index[:rows]


def filter_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                min_p: torch.Tensor, shape: FilterShape, work: RowBuffers | None = None) -> torch.Tensor:
    """``filtered_probs`` of every row of ``logits`` [R, V] at once, on their device: float64
    [R, V] (a view into ``work`` where given: valid until its next use). ``temperature``,
    ``top_p``, ``min_p`` float64 [R], ``top_k`` int64 [R] (0 or >= V: none), ``shape`` which
    filters run at all. Every op works row by row in an order that does not depend on R (softmax,
    sort, cumsum over the last dim; ``_row_sums``): a row's probabilities are the same bits in a
    batch of one as in a batch of 256, which tests/engine/test_device_sampling.py checks."""
    rows = logits.shape[0]
    if work is None:
        a, c, d = (torch.empty(logits.shape, dtype=torch.float64, device=logits.device) for _ in range(3))
        order = torch.empty(logits.shape, dtype=torch.int64, device=logits.device)
    else:
        a, c, d, order = work.take(rows)
    scaled = a.copy_(logits).div_(temperature[:, None])  # float64, exactly the logits' values
    if shape.min_p:
        # vLLM's MinPLogitsProcessor: drop the tokens whose probability at this temperature is
        # below min_p times the likeliest one's (the likeliest always stays)
        probs = torch.softmax(scaled, dim=-1, out=c)
        scaled.masked_fill_(probs < min_p[:, None] * probs.amax(dim=-1, keepdim=True), float("-inf"))
    if shape.top_k_cap:
        # the k-th largest value of each row (a value, whichever algorithm selects it)
        top = torch.topk(scaled, shape.top_k_cap, dim=-1).values
        kth = top.gather(1, (top_k.clamp(1, shape.top_k_cap) - 1)[:, None])
        kth = kth.masked_fill((top_k <= 0)[:, None], float("-inf"))
        scaled.masked_fill_(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1, out=c)
    if shape.top_p:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True, out=(d, order))
        # keep the smallest prefix whose mass reaches top_p (always at least one token); a row
        # without top-p drops nothing and is divided by 1: its probabilities come back unchanged
        before = torch.cumsum(sorted_p, dim=-1, out=scaled).sub_(sorted_p)  # mass before each token
        on = (top_p < 1.0)[:, None]
        sorted_p.masked_fill_((before >= top_p[:, None]) & on, 0.0)
        kept = scaled.zero_().scatter_(1, order, sorted_p)
        sums = _row_sums(kept, None if work is None else work.values[1, :2])  # probs (c) is free now
        probs = kept.div_(torch.where(on, sums, torch.ones_like(top_p)[:, None]))
    return probs


def _row_sums(x: torch.Tensor, pair: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's sum, [R, 1], in an order that depends on neither R nor the thread count. On the
    CPU a sum over the last dim of two or more rows runs each row serially (its threads split the
    rows), while the sum of a single row longer than torch's grain (32768) splits the row itself
    across threads, so a lone row is summed beside a zero row (in ``pair`` [2, V], a free buffer,
    where given). On CUDA the reduction's launch shape depends on the number of rows; a cumsum's
    last element does not."""
    if x.device.type == "cuda":
        return torch.cumsum(x, dim=-1)[:, -1:]
    if x.shape[0] == 1:
        if pair is None:
            pair = torch.empty(2, x.shape[1], dtype=x.dtype, device=x.device)
        pair[0].copy_(x[0])
        pair[1].zero_()
        return pair.sum(dim=-1, keepdim=True)[:1]
    return x.sum(dim=-1, keepdim=True)


def draw_rows(probs: torch.Tensor, u: torch.Tensor, work: RowBuffers | None = None) -> torch.Tensor:
    """``draw`` for every row of ``probs`` [R, V] with its uniform ``u`` float64 [R]: [R] int64,
    on their device, the same index ``draw`` finds for each row. ``work``: ``filter_rows``'
    buffers (``probs`` may be one of its first two; the third and the index are used here)."""
    rows, vocab = probs.shape
    if work is None:
        cdf = torch.cumsum(probs, dim=-1)
        cols = torch.arange(vocab, device=probs.device)
        last = torch.empty(probs.shape, dtype=torch.int64, device=probs.device)
    else:
        _, _, d, last = work.take(rows)
        cdf, cols = torch.cumsum(probs, dim=-1, out=d), work.cols
    x = u[:, None] * cdf[:, -1:]
    idx = torch.searchsorted(cdf, x, right=True).clamp_(max=vocab - 1)  # [R, 1]
    # step back from a zero-probability token onto the last one with mass at or before it
    mass = (probs != 0) & (cols <= idx)
    return torch.where(mass, cols, torch.zeros_like(cols), out=last).amax(dim=-1)


def position_uniforms(seed: int, positions: np.ndarray) -> np.ndarray:
    """``position_uniform(seed, p)`` for every p of ``positions`` (int64 [n]) at once, stream 0:
    float64 [n], the same numbers (the same integer ops, and the same exact scaling)."""
    key = np.uint64(_splitmix64(seed))
    with np.errstate(over="ignore"):
        bits = _splitmix64_np(key ^ positions.astype(np.uint64))
    return (bits >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def _splitmix64_np(x: np.ndarray) -> np.ndarray:
    x = x + np.uint64(0x9E3779B97F4A7C15)  # uint64 arithmetic wraps: the & _MASK64 of _splitmix64
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def select_token(logits: torch.Tensor, position: int, params: SamplingParams) -> int:
    """The target's token at committed ``position`` given its logits [V] there."""
    if params.greedy:
        return int(torch.argmax(logits).item())
    return draw(filtered_probs(logits, params), position_uniform(params.seed, position))


def draw(probs: torch.Tensor, u: float) -> int:
    """The token at ``u`` in [0, 1) of the (not necessarily normalised) weights ``probs`` [V]:
    inverse CDF, so the same u gives the same token wherever the same weights are seen."""
    cdf = torch.cumsum(probs, 0)
    x = u * float(cdf[-1])
    idx = int(torch.searchsorted(cdf, torch.tensor([x], dtype=cdf.dtype), right=True).item())
    # searchsorted can land on a zero-probability tail token through rounding; step back onto mass
    idx = min(idx, probs.numel() - 1)
    while probs[idx] == 0 and idx > 0:
        idx -= 1
    return idx


def exact_accepted(picks: torch.Tensor, following: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """The exact rule for every session of a flat step at once, on the device: ``picks`` [R] each
    row's own token (argmax or seeded draw), ``following`` [R] the next input token of the row's
    session (its chain token there; -1 at a session's last row and at ghosts), ``first`` [R] the
    row where its session starts. Row j of a session is kept iff it and every row before it in
    the session picked the chain's next token; returns [R] int64 holding, at each session's first
    row, how many chain tokens it keeps (the same count ``TargetState._exact`` finds), 0 elsewhere.
    Integer ops only: exact on any device."""
    miss = (picks != following).to(torch.int64)
    misses = torch.cumsum(miss, 0)
    # misses in the session up to and including the row: the running count since its first row
    upto = misses - misses.gather(0, first) + miss.gather(0, first)
    return torch.zeros_like(picks).scatter_add_(0, first, (upto == 0).to(torch.int64))
