"""Prometheus metrics of the cache service (one set per process)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from prometheus_client import Counter, Gauge, Histogram

# Label values that callers choose (pool names come from each draft's registration) are capped: a
# series costs memory in this process and in every scrape, and a draft that registers under a new
# pool name each time would grow them without bound. Past MAX_POOL_LABELS distinct pools, the
# rest are counted together under OTHER, which no pool can be named (card.common.drafts.POOL_NAME).
MAX_POOL_LABELS = 64
OTHER = "(other)"
LABELS_FOLDED = Counter("card_cache_metric_labels_folded",
                        "Observations whose label value (a pool name) was counted under "
                        f"'{OTHER}' because the label already had its most distinct values", ["label"])


class LabelCap:
    """The first ``limit`` distinct values of one label keep their name; later ones fold into
    OTHER (and are counted in LABELS_FOLDED). Thread-safe; its lock is a leaf."""

    def __init__(self, label: str, limit: int) -> None:
        self.label = label
        self.limit = limit
        self._kept: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, value: str) -> str:
        with self._lock:
            if value in self._kept or (len(self._kept) < self.limit and value != OTHER):
                self._kept.add(value)
                return value
        LABELS_FOLDED.labels(self.label).inc()
        return OTHER


POOL_LABEL = LabelCap("pool", MAX_POOL_LABELS)

SESSIONS_OPEN = Gauge("card_cache_sessions_open", "Sessions currently open")
STEPS = Counter("card_cache_steps", "Step calls answered (corrections applied)")
STEP_BATCHES = Counter("card_cache_step_batches",
                       "StepBatch calls (one per target iteration with several sessions)")
STEP_ERRORS = Counter("card_cache_step_errors", "Steps of a StepBatch that failed with an unforeseen error "
                      "(a bug): that session's step fails INTERNAL, the batch's others are answered")
STEP_LATENCY = Histogram(
    "card_cache_step_latency_seconds", "Time to apply a correction and pick the next chain",
    buckets=(5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0),
)
OUTCOMES = Counter("card_cache_outcomes", "Verdicts on the target's next token", ["outcome"])
LOOKUP_CHAINS = Counter("card_cache_lookup_chains", "Chains answered by the session's own text (model-free "
                        "lookup) because its tree held nothing")
TURN_AFFINITY = Counter("card_cache_turn_affinity",
                        "Sessions whose prompt extends an earlier session's text, by where they went: "
                        "kept (the worker that drafted the earlier turn) or moved (another: that one "
                        "gone, full, refused or too busy)", ["outcome"])
DRAFT_PAUSES = Counter("card_cache_draft_pauses", "Sessions whose drafting the target's speculation "
                       "controller paused (the worker stopped) or resumed", ["action"])
LAYERS = Counter("card_cache_layers_received", "Draft layers received (applied or dropped)")
LAYERS_MALFORMED = Counter("card_cache_layers_malformed",
                           "Draft layers dropped because they could not be decoded (a draft bug)")
TREE_DROPPED = Counter("card_cache_tree_entries_dropped",
                       "Tree entries of draft layers dropped past a bound (card.engine.shared.tree): kind "
                       "node or secondary; why session (a session's tree is full), worker (the trees of "
                       "the worker's sessions are) or width (a parent's tier-B entries would pass the "
                       "q-row width)",
                       ["kind", "why"])
DRAFTS = Gauge("card_cache_drafts_registered", "Draft workers registered")
REDIS_UP = Gauge("card_cache_redis_up", "1 when the metadata store answers and takes writes")
REDIS_OUT_OF_MEMORY = Gauge("card_cache_redis_out_of_memory",
                            "1 while Redis answers but refuses writes for memory (maxmemory, noeviction)")
RECORDS_WRITTEN = Counter("card_cache_records_written", "Finished-session records written to the store")
RECORDS_FAILED = Counter("card_cache_records_failed",
                         "Finished-session records the store refused (down, out of memory)", ["reason"])
RECORDS_DROPPED = Counter("card_cache_records_dropped",
                          "Finished-session records dropped unwritten: the writer's queue was full")
RECORDS_PENDING = Gauge("card_cache_records_pending", "Finished-session records queued for the store")
RECORDS_EVICTED = Counter("card_cache_records_evicted",
                          "Finished-session records the in-process store (memory://) let go before their TTL "
                          "to stay within its bound")
DRAFT_RECORDS_FAILED = Counter("card_cache_draft_records_failed",
                               "Monitor rounds whose write of the draft records the store refused",
                               ["reason"])

# Draft pools (card.cache_service.pools): acceptance of each pool's chains, as this replica's
# sessions measured it, so that two pools serving one target can be compared (a canary)
POOL_STEPS = Counter("card_cache_pool_steps", "Target steps after a chain of the pool's", ["pool"])
POOL_CHAIN_TOKENS = Counter("card_cache_pool_chain_tokens", "Drafted tokens the pool's chains offered",
                            ["pool"])
POOL_ACCEPTED = Counter("card_cache_pool_accepted_tokens", "Drafted tokens of the pool's chains accepted",
                        ["pool"])
POOL_COMMITTED = Counter("card_cache_pool_committed_tokens",
                         "Tokens committed by the steps that verified the pool's chains", ["pool"])
POOL_HITS = Counter("card_cache_pool_hits", "Steps whose next token the pool's tree held", ["pool"])
POOL_BUSY = Counter("card_cache_pool_busy_seconds",
                    "Time between those steps and their sessions' previous ones (committed/busy: tokens/s)",
                    ["pool"])
POOL_WORKERS = Gauge("card_cache_pool_workers", "Registered workers of the pool", ["pool", "state"])
POOL_SESSIONS = Gauge("card_cache_pool_sessions", "Sessions the pool's workers serve now", ["pool"])
POOL_WEIGHT = Gauge("card_cache_pool_weight", "The pool's share of unnamed sessions (--pool-weights)",
                    ["pool"])


def set_pools(pools: dict[str, list[Any]], weight: Callable[[str], float]) -> None:
    """The pool gauges from the registry's pools (Assignments.pools), stale pools removed; pools
    past the label cap are summed under OTHER (their weight too)."""
    for gauge in (POOL_WORKERS, POOL_SESSIONS, POOL_WEIGHT):
        gauge.clear()
    workers_by: dict[tuple[str, str], int] = {}
    sessions_by: dict[str, int] = {}
    weight_by: dict[str, float] = {}
    for pool, workers in pools.items():
        label = POOL_LABEL(pool)
        for state in ("serving", "draining"):
            n = sum((w.draining == (state == "draining")) for w in workers)
            workers_by[label, state] = workers_by.get((label, state), 0) + n
        sessions_by[label] = sessions_by.get(label, 0) + sum(len(w.sessions) for w in workers)
        weight_by[label] = weight_by.get(label, 0.0) + weight(pool)
    for (label, state), n in workers_by.items():
        POOL_WORKERS.labels(label, state).set(n)
    for label, n in sessions_by.items():
        POOL_SESSIONS.labels(label).set(n)
    for label, w in weight_by.items():
        POOL_WEIGHT.labels(label).set(w)
