"""Draft pools on the cache's side: the weights that split unnamed sessions between pools (a
canary), and each pool's acceptance as this replica's sessions measured it.

A pool is every registered worker that says the same ``pool`` (card-draft --pool); requests name
pools, so a pool's workers can be scaled, drained and replaced while the name stays.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

from card.cache_service import metrics
from card.common.drafts import parse_pool_weights


class PoolRouter:
    """Which pool an unnamed session goes to, among those with a worker that has room.

    Smooth weighted round robin (nginx's): every pick adds each eligible pool's weight to its
    credit and takes the pool with the most, which then pays the eligible weights' sum. Over any
    run of picks the split follows the weights within one session, with no randomness to make a
    small canary's share drift. Pools the weights omit take sessions only when no weighted pool
    has room; without weights every pool is eligible alike (the least-loaded worker wins)."""

    def __init__(self, weights: Iterable[tuple[str, float]] = ()) -> None:
        self.weights: dict[str, float] = dict(weights)
        self._credit: dict[str, float] = {}

    def set(self, weights: Iterable[tuple[str, float]]) -> None:
        """New weights (parse_pool_weights' checks first); the round robin starts over."""
        text = ",".join(f"{pool}={weight!r}" for pool, weight in weights)
        self.weights, self._credit = dict(parse_pool_weights(text)), {}

    def weight(self, pool: str) -> float:
        if not self.weights:
            return 1.0
        return self.weights.get(pool, 0.0)

    def choose(self, eligible: Iterable[str]) -> Collection[str]:
        """The pools to take the least-loaded worker from (the caller holds the Assignments' lock)."""
        pools = set(eligible)
        if not self.weights or len(pools) <= 1:
            return pools
        weighted = {p: self.weights[p] for p in pools if self.weights.get(p, 0.0) > 0}
        if not weighted:
            return pools
        for pool, weight in weighted.items():
            self._credit[pool] = self._credit.get(pool, 0.0) + weight
        best = max(sorted(weighted), key=lambda p: self._credit[p])
        self._credit[best] -= sum(weighted.values())
        return {best}


@dataclass
class PoolCounters:
    """What the target made of one pool's chains (Steps whose previous chain its worker grew)."""

    steps: int = 0
    chains: int = 0  # steps that verified a non-empty chain
    chain_tokens: int = 0
    accepted_tokens: int = 0
    committed_tokens: int = 0
    hits: int = 0  # hits and secondary hits: the target's token was in the tree
    busy_s: float = 0.0  # time since each step's previous one (the pace the target kept)


class PoolStats:
    """Per-pool counters of this replica, live (running sessions included), with their metrics."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pools: dict[str, PoolCounters] = {}
        self._series: dict[str, tuple] = {}  # each pool's metric children, looked up once (Step's path)

    def record(self, pool: str, chain_tokens: int, accepted: int, hit: bool, busy_s: float) -> None:
        """One Step of a session whose previous chain (``chain_tokens`` long) ``pool`` grew."""
        pool = metrics.POOL_LABEL(pool)  # bounded: pools past the cap count together (metrics.OTHER)
        with self._lock:
            c = self._pools.setdefault(pool, PoolCounters())
            c.steps += 1
            c.chains += chain_tokens > 0
            c.chain_tokens += chain_tokens
            c.accepted_tokens += accepted
            c.committed_tokens += accepted + 1
            c.hits += hit
            c.busy_s += busy_s
            series = self._series.get(pool)
            if series is None:
                series = self._series[pool] = tuple(m.labels(pool) for m in (
                    metrics.POOL_STEPS, metrics.POOL_CHAIN_TOKENS, metrics.POOL_ACCEPTED,
                    metrics.POOL_COMMITTED, metrics.POOL_HITS, metrics.POOL_BUSY))
        steps, offered, kept, committed, hits, busy = series
        steps.inc()
        offered.inc(chain_tokens)
        kept.inc(accepted)
        committed.inc(accepted + 1)
        if hit:
            hits.inc()
        busy.inc(busy_s)

    def names(self) -> list[str]:
        with self._lock:
            return list(self._pools)

    def snapshot(self) -> Mapping[str, PoolCounters]:
        with self._lock:
            return {p: PoolCounters(**vars(c)) for p, c in self._pools.items()}
