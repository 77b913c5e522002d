"""Prometheus metrics of the target service (served on --metrics-port, and on the HTTP API's
/metrics). The list, with vLLM's names beside ours: docs/services.md ("Metrics")."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client import Counter, Gauge, Histogram

if TYPE_CHECKING:  # the engine's types, for annotations only: this module stays light to import
    from card.engine.shared.stats import GenerationStats
    from card.engine.target.generation import GenerationResult
    from card.engine.target.scheduler import Event

GENERATIONS = Counter("card_target_generations_total", "Finished generations",
                      ["mode", "finish_reason"])
REFUSED = Counter("card_target_refused_total", "Generate calls refused", ["code"])
TOKENS = Counter("card_target_tokens_total", "Generated tokens")
ACTIVE = Gauge("card_target_active_generations", "Generations in the engine's batch now")
WAITING = Gauge("card_target_waiting_generations", "Generations waiting for a free KV slot")
KV_SLOTS = Gauge("card_target_kv_slots", "KV cache slots (most generations in one forward)")
KV_SLOTS_FREE = Gauge("card_target_kv_slots_free", "KV cache slots free now")
# prefix caching beyond the live slots (kv_pool.KVPool.cached_slots, --prefix-cache-gb)
KV_CACHED_SLOTS = Gauge("card_target_kv_cached_slots",
                        "KV cache slots that hold finished sequences only, for prefix caching")
PREFIX_CACHE_BYTES = Gauge("card_target_prefix_cache_kept_bytes",
                           "Bytes of keys and values free KV slots keep for later prompts (rows written)")
PREFIX_CACHE_EVICTIONS = Gauge("card_target_prefix_cache_evictions",
                               "Free KV slots whose rows were given back to bound the prefix cache's "
                               "memory, since start (a counter)")
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
ENGINE_THREAD_CHANGES = Counter("card_target_engine_thread_changes_total",
                               "Times the engine's forwards dropped to fewer torch threads (other threads "
                               "held cores) or climbed back (idle cores): --adaptive-threads",
                               ["direction"])
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


# ---- vLLM's shape ---------------------------------------------------------------------------
# The request-level series of vllm/v1/metrics/loggers.py and vllm/v1/spec_decode/metrics.py, by
# the same names under our prefix (``vllm:x`` is ``card_target_x``) and with the same
# ``model_name`` label, so that a dashboard or benchmark that reads vLLM's (AIPerf's server
# metrics, Grafana boards) reads card-target's by swapping the prefix. One label value per process
# (the served model name, ``ServedModel``): bounded. Observed on the engine's thread
# (card.target_service.engine_loop) from each generation's events, whatever its front.
MODEL = ["model_name"]
# vLLM's buckets; the latencies also get finer first buckets (a queue is often empty, and a GPU's
# inter-token gap is a few milliseconds, both below vLLM's first bound)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
               1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0,
                   20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = tuple(m * 10**e for e in range(7) for m in (1, 2, 5))  # vLLM's 1-2-5, to 5M

TTFT = Histogram("card_target_time_to_first_token_seconds",
                 "Time to first token: submitted to the engine until its first token is committed", MODEL,
                 buckets=TTFT_BUCKETS)
ITL = Histogram("card_target_inter_token_latency_seconds",
                "Time between a generation's consecutive commits (one per forward; a verified chain "
                "commits several tokens at once, as in vLLM)", MODEL, buckets=ITL_BUCKETS)
TPOT = Histogram("card_target_request_time_per_output_token_seconds",
                 "Each finished generation's decode time over its tokens after the first", MODEL,
                 buckets=ITL_BUCKETS)
E2E = Histogram("card_target_e2e_request_latency_seconds",
                "Finished generations: submitted to the engine until their last event", MODEL,
                buckets=REQUEST_BUCKETS)
QUEUE_TIME = Histogram("card_target_request_queue_time_seconds",
                       "Finished generations: time waiting for a KV slot", MODEL, buckets=REQUEST_BUCKETS)
PREFILL_TIME = Histogram("card_target_request_prefill_time_seconds",
                         "Finished generations: KV slot until first token", MODEL, buckets=REQUEST_BUCKETS)
DECODE_TIME = Histogram("card_target_request_decode_time_seconds",
                        "Finished generations: first token until last token", MODEL, buckets=REQUEST_BUCKETS)
INFERENCE_TIME = Histogram("card_target_request_inference_time_seconds",
                           "Finished generations: KV slot until last token", MODEL, buckets=REQUEST_BUCKETS)
REQUEST_PROMPT_TOKENS = Histogram("card_target_request_prompt_tokens",
                                  "Prompt tokens of each finished generation", MODEL, buckets=TOKEN_BUCKETS)
REQUEST_GENERATION_TOKENS = Histogram("card_target_request_generation_tokens",
                                      "Tokens each finished generation returned", MODEL,
                                      buckets=TOKEN_BUCKETS)
PROMPT_TOKENS = Counter("card_target_prompt_tokens", "Prompt tokens prefilled (counted at each first token)",
                        MODEL)
# vLLM's prefix-cache counters (vllm:prefix_cache_queries / _hits), in tokens, counted at each
# first token: hit rate = rate(hits) / rate(queries). Queries count every prompt token the cache
# was asked about (none with --no-enable-prefix-caching).
PREFIX_QUERIES = Counter("card_target_prefix_cache_queries",
                         "Prompt tokens looked up in the prefix cache (counted at each first token)", MODEL)
PREFIX_HITS = Counter("card_target_prefix_cache_hits",
                      "Of them, tokens whose keys and values the prefix cache held (not prefilled)", MODEL)
GENERATION_TOKENS = Counter("card_target_generation_tokens",
                            "Tokens returned to clients, counted as they are committed", MODEL)
REQUEST_SUCCESS = Counter("card_target_request_success",
                          "Generations that finished (stop: EOS or a stop string; length: the budget or the "
                          "context window)", [*MODEL, "finished_reason"])
RUNNING = Gauge("card_target_num_requests_running", "Generations in the engine's batch now", MODEL)
WAITING_REQUESTS = Gauge("card_target_num_requests_waiting", "Generations waiting for a free KV slot", MODEL)
KV_USAGE = Gauge("card_target_kv_cache_usage_perc",
                 "KV cache in use, a fraction (0-1, as vLLM's): slots held by generations over all slots",
                 MODEL)
# vLLM's spec-decode counters. A draft is one verification of a drafted chain; its accepted
# tokens are the drafted ones the target kept (verify loose: its kept mismatches included), per
# position (0: the chain's first token). Acceptance rate: rate(num_accepted_tokens) /
# rate(num_draft_tokens); mean acceptance length: 1 + rate(num_accepted_tokens) / rate(num_drafts).
SPEC_DRAFTS = Counter("card_target_spec_decode_num_drafts", "Drafted chains the target verified", MODEL)
SPEC_DRAFT_TOKENS = Counter("card_target_spec_decode_num_draft_tokens", "Drafted tokens the target verified",
                            MODEL)
SPEC_ACCEPTED_TOKENS = Counter("card_target_spec_decode_num_accepted_tokens",
                               "Drafted tokens the target kept (verify loose: its kept mismatches included)",
                               MODEL)
SPEC_ACCEPTED_PER_POS = Counter("card_target_spec_decode_num_accepted_tokens_per_pos",
                                "Drafted tokens kept at each chain position (0: the first; at most "
                                "MAX_CHAIN positions)", [*MODEL, "position"])

# HTTP requests of the OpenAI-compatible front (card.target_service.http_metrics), by route
# template (never the raw path: a client's URL is not a label), method and status
HTTP_REQUESTS = Counter("card_target_http_requests",
                        "HTTP requests answered, by route template, method and status",
                        ["handler", "method", "status"])
HTTP_DURATION = Histogram("card_target_http_request_duration_seconds",
                          "HTTP request duration until the response's last byte (a stream: its end)",
                          ["handler", "method"], buckets=REQUEST_BUCKETS)
FINISHED_REASON = {"eos": "stop", "stop": "stop", "length": "length"}  # vLLM's finished_reason values


@dataclass
class Track:
    """One generation seen by ``ServedModel``: when it was submitted, committed its first and its
    latest tokens (time.perf_counter()), and how much of its spec-decode stats is counted."""

    submitted: float
    first: float = 0.0
    last: float = 0.0
    drafted: int = 0
    accepted: int = 0
    histogram: list[int] = field(default_factory=list)


class ServedModel:
    """The vLLM-shaped series of one served model name, bound once (no label lookup per token),
    fed by the engine loop on its thread: ``observe`` each event of an iteration with its
    generation's ``Track``, then ``flush`` once. Counters are summed in plain ints until the flush
    (a few increments per iteration, not several per generation: this runs on the engine's
    critical path); histograms take each value as it comes. ``positions``: the most chain
    positions (card.engine.shared.config.MAX_CHAIN), the bound of the per-position label."""

    def __init__(self, model_name: str, positions: int) -> None:
        self.name = model_name
        self.positions = positions
        self.ttft, self.itl = TTFT.labels(model_name), ITL.labels(model_name)
        self.tpot = TPOT.labels(model_name)
        self.e2e, self.queue = E2E.labels(model_name), QUEUE_TIME.labels(model_name)
        self.prefill, self.decode = PREFILL_TIME.labels(model_name), DECODE_TIME.labels(model_name)
        self.inference = INFERENCE_TIME.labels(model_name)
        self.request_prompt = REQUEST_PROMPT_TOKENS.labels(model_name)
        self.request_generation = REQUEST_GENERATION_TOKENS.labels(model_name)
        self.prompt_tokens = PROMPT_TOKENS.labels(model_name)
        self.generation_tokens = GENERATION_TOKENS.labels(model_name)
        self.prefix_queries = PREFIX_QUERIES.labels(model_name)
        self.prefix_hits = PREFIX_HITS.labels(model_name)
        self.prefix_caching = True  # whether a prompt's tokens count as queries (the server says)
        self.drafts, self.draft_tokens = SPEC_DRAFTS.labels(model_name), SPEC_DRAFT_TOKENS.labels(model_name)
        self.accepted = SPEC_ACCEPTED_TOKENS.labels(model_name)
        self._per_pos: dict[int, Counter] = {}  # made at first use: positions a chain reached
        # summed since the last flush: prompt, generation, drafts, drafted, accepted; per position
        self._sums = [0, 0, 0, 0, 0]
        self._prefix = [0, 0]  # prefix cache: tokens queried, hit, since the last flush
        self._pos = [0] * positions

    def gauges(self, running: Callable[[], float], waiting: Callable[[], float],
               kv_usage: Callable[[], float]) -> None:
        """The scheduler's state, read at each scrape."""
        RUNNING.labels(self.name).set_function(running)
        WAITING_REQUESTS.labels(self.name).set_function(waiting)
        KV_USAGE.labels(self.name).set_function(kv_usage)

    def observe(self, track: Track, event: Event, now: float) -> None:
        """One event of ``track``'s generation, committed at ``now``: a chunk's first token (TTFT,
        its prompt's tokens) or later tokens (the gap since the last), the drafts verified since
        the last event, and, for a generation that finished (not cancelled, not failed), its
        request-level histograms."""
        gen, chunk, sums = event.generation, event.chunk, self._sums
        if chunk is not None:
            if not track.first:
                track.first = track.last = now
                self.ttft.observe(now - track.submitted)
                sums[0] += len(gen.request.prompt_ids)
                if self.prefix_caching:
                    self._prefix[0] += len(gen.request.prompt_ids)
                    self._prefix[1] += gen.stats.cached_tokens
            elif chunk.token_ids:
                self.itl.observe(now - track.last)
                track.last = now
            sums[1] += len(chunk.token_ids)
        stats = gen.stats
        if stats.draft_tokens != track.drafted:
            self._count_drafts(track, stats)
        result = gen.result
        if (event.done and event.error is None and result is not None
                and result.finish_reason in FINISHED_REASON):
            self._finished(track, result, gen.opened_at, now)

    def flush(self) -> None:
        """Add what ``observe`` summed to the counters."""
        sums, pos = self._sums, self._pos
        for counter, n in zip((self.prompt_tokens, self.generation_tokens, self.drafts, self.draft_tokens,
                               self.accepted), sums, strict=True):
            if n:
                counter.inc(n)
        for p, n in enumerate(pos):
            if not n:
                break  # a chain that kept position p kept every one before it
            self._position(p).inc(n)
            pos[p] = 0
        self._sums = [0, 0, 0, 0, 0]
        for counter, n in zip((self.prefix_queries, self.prefix_hits), self._prefix, strict=True):
            if n:
                counter.inc(n)
        self._prefix = [0, 0]

    def _count_drafts(self, track: Track, stats: GenerationStats) -> None:
        """The verifications since the last event: each added 1 to the stats' histogram at the
        number of drafted tokens it kept (and drafted at least one token)."""
        seen, pos = track.histogram, self._pos
        drafts = 0
        for kept, count in enumerate(stats.acceptance_histogram):
            new = count - (seen[kept] if kept < len(seen) else 0)
            if new:
                drafts += new
                for p in range(min(kept, self.positions)):
                    pos[p] += new
        sums = self._sums
        sums[2] += drafts
        sums[3] += stats.draft_tokens - track.drafted
        sums[4] += stats.accepted_draft_tokens - track.accepted
        track.drafted, track.accepted = stats.draft_tokens, stats.accepted_draft_tokens
        track.histogram = list(stats.acceptance_histogram)

    def _position(self, pos: int) -> Counter:
        counter = self._per_pos.get(pos)
        if counter is None:
            counter = self._per_pos[pos] = SPEC_ACCEPTED_PER_POS.labels(self.name, str(pos))
        return counter

    def _finished(self, track: Track, result: GenerationResult, admitted: float, now: float) -> None:
        """vLLM's request intervals: queued (submitted to admitted to a KV slot), prefill
        (admitted to first token), decode (first to last token), inference (admitted to last
        token), end to end (submitted to its end)."""
        first, last = track.first or now, track.last or now
        admitted = min(max(admitted or track.submitted, track.submitted), first)
        self.e2e.observe(now - track.submitted)
        self.queue.observe(admitted - track.submitted)
        self.prefill.observe(first - admitted)
        self.decode.observe(last - first)
        self.inference.observe(last - admitted)
        tokens = len(result.token_ids)
        if tokens > 1:
            self.tpot.observe((last - first) / (tokens - 1))
        self.request_prompt.observe(result.stats.prompt_tokens)
        self.request_generation.observe(tokens)
        REQUEST_SUCCESS.labels(self.name, FINISHED_REASON[result.finish_reason]).inc()
