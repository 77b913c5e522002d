"""Prometheus metrics of the target service (served on --metrics-port)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

GENERATIONS = Counter("card_target_generations_total", "Finished generations",
                      ["mode", "finish_reason"])
REFUSED = Counter("card_target_refused_total", "Generate calls refused", ["code"])
TOKENS = Counter("card_target_tokens_total", "Generated tokens")
ACTIVE = Gauge("card_target_active_generations", "Generations in the engine's batch now")
WAITING = Gauge("card_target_waiting_generations", "Generations waiting for a free KV slot")
KV_SLOTS = Gauge("card_target_kv_slots", "KV cache slots (most generations in one forward)")
KV_SLOTS_FREE = Gauge("card_target_kv_slots_free", "KV cache slots free now")
BATCH_SIZE = Histogram("card_target_batch_size", "Generations in each engine iteration",
                       buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64))
STEP_RTT = Histogram("card_target_step_rtt_seconds", "Step round trip to the cache service",
                     buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5))
STEP_FAILURES = Counter("card_target_step_failures_total", "Step calls that failed", ["code"])
RESYNCS = Counter("card_target_session_resyncs_total", "Sessions re-opened after a failed Step or open")
DEGRADED = Counter("card_target_degraded_generations_total",
                   "Card generations decoded without a draft because the cache refused their session")
TOKENS_PER_S = Histogram("card_target_tokens_per_second", "Throughput of each generation",
                         buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000))
ITERATION = Histogram("card_target_iteration_seconds",
                      "Engine iteration time by phase: plan (sources' steps, chain cut), forward (the "
                      "model), commit (sampling, stops, detokenizing); all but forward is host cost",
                      ["phase"], buckets=(0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25,
                                          0.5, 1.0))
CACHE_BREAKER = Gauge("card_target_cache_breaker_state",
                      "The circuit breaker over the cache: 0 closed (sessions open), 1 open (none opened "
                      "until the cool-down ends), 2 half-open (one probe under way)")
CLOSES_DROPPED = Counter("card_target_session_closes_dropped_total",
                         "CloseSession calls not sent because too many calls to the cache were under way "
                         "(the cache's idle timeout ends those sessions)")
CATCH_UPS = Counter("card_target_session_catch_ups_total",
                    "Sessions that opened after their generation committed more tokens; their first Step "
                    "tells them the tokens since")
DRAFTER_SWITCHES = Counter("card_target_drafter_switches_total",
                           "card-auto sessions switched to a drafter (model-free: the cache's lookup alone, "
                           "its worker paused; neural: its worker)", ["drafter"])
ENGINE_ALIVE = Gauge("card_target_engine_alive", "1 while the engine's thread runs, 0 once it died")
ENGINE_THREADS = Gauge("card_target_engine_threads",
                       "torch intra-op threads the engine's thread runs its forwards on, read in that "
                       "thread (torch's count is per thread: --threads, or torch's default)")
# vLLM's spec-decode counters, by the same names' meaning: drafted tokens verified, and kept
DRAFT_TOKENS = Counter("card_target_spec_decode_draft_tokens_total", "Drafted tokens the target verified")
ACCEPTED_DRAFT_TOKENS = Counter("card_target_spec_decode_accepted_tokens_total",
                                "Drafted tokens the target kept (verify loose: its kept mismatches included)")
LOOSE_KEPT = Counter("card_target_loose_kept_tokens_total",
                     "Drafted tokens kept by verify loose that plain decoding would not have chosen (lossy)")
REJECTION_FALLBACKS = Counter("card_target_rejection_fallbacks_total",
                              "verify rejection chains that came without a usable draft distribution and "
                              "were verified exactly (a cache that does not draw chains)")
# the drafting policy (card.engine.target.drafting_policy)
SPECULATING = Gauge("card_target_speculating",
                    "1 while the engine speculates, 0 while every draft is paused (plain decoding pays more)")
SPECULATION_DECISIONS = Counter("card_target_speculation_decisions_total",
                                "Switches of the engine's regime: to spec or plain, why (probe, won, lost, "
                                "unmeasured)", ["regime", "why"])
SPECULATION_RATE = Gauge("card_target_speculation_rate_tokens_per_second",
                         "Committed tokens per second of each regime at the latest probe's batch sizes",
                         ["regime"])
DRAFTING_PAUSED = Gauge("card_target_drafting_paused_generations",
                        "Generations in the batch whose drafting is paused now (engine-wide or their own)")
SESSION_PAUSES = Counter("card_target_drafting_session_pauses_total",
                         "Generations whose own drafting was paused: chains rejected or never verified")
