"""Token selection by the target: greedy, or seeded sampling keyed by committed position.

A position-keyed uniform (not a stateful generator) is what makes sampling exact across modes:
vanilla draws position t after t forwards, card may draw it inside a 6-token verification, and
both use the same number ``u(seed, t)``.
"""

from __future__ import annotations

import secrets

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
    engine.target.logits_processors).

    Greedy params (a temperature below SAMPLING_EPS) give the one-hot distribution on the argmax,
    the limit of the softmax as the temperature goes to 0: dividing by such a temperature would
    overflow the logits to inf and the softmax to NaN. min-p does not apply to them (nor in vLLM:
    it cannot change an argmax).
    """
    logits = logits.detach().to("cpu", torch.float64)
    if params.greedy:
        return torch.zeros_like(logits).index_fill_(0, torch.argmax(logits).view(1), 1.0)
    scaled = logits / params.temperature
    if params.min_p > 0.0:
        # vLLM's MinPLogitsProcessor: drop the tokens whose probability at this temperature is
        # below min_p times the likeliest one's (the likeliest always stays)
        probs = torch.softmax(scaled, dim=-1)
        scaled = scaled.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    if params.top_k and params.top_k < scaled.numel():
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        drop = torch.cumsum(sorted_p, 0) - sorted_p >= params.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
        probs = probs / probs.sum()
    return probs


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
