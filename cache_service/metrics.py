"""Prometheus metrics of the cache service (one set per process)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

SESSIONS_OPEN = Gauge("card_cache_sessions_open", "Sessions currently open")
STEPS = Counter("card_cache_steps", "Step calls answered (corrections applied)")
STEP_BATCHES = Counter("card_cache_step_batches",
                       "StepBatch calls (one per target iteration with several sessions)")
STEP_LATENCY = Histogram(
    "card_cache_step_latency_seconds", "Time to apply a correction and pick the next chain",
    buckets=(5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0),
)
OUTCOMES = Counter("card_cache_outcomes", "Verdicts on the target's next token", ["outcome"])
LAYERS = Counter("card_cache_layers_received", "Draft layers received (applied or dropped)")
LAYERS_MALFORMED = Counter("card_cache_layers_malformed",
                           "Draft layers dropped because they could not be decoded (a draft bug)")
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
