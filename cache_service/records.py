"""Finished-session records, off every RPC path: their bounded summary and the thread that writes them.

A finished record is a summary of the generation, never its per-forward lists: counts, means and
percentiles, and a histogram of accepted lengths whose buckets are capped (``HIST_CAP``). Its size
does not grow with the number of target forwards, so ``session_ttl_s`` alone bounds what the
records hold in Redis (about one record per session of the last TTL).

CloseSession builds the record and hands it to the cache's ``RecordWriter``: a bounded queue and
one thread, which writes what is queued in batches (one Redis transaction each, totals summed). The
caller never waits for Redis. While Redis is unreachable (down, stopped, restarting) the batch in
hand is retried with backoff and the rest wait in the queue, so an outage shorter than the queue
(``MAX_PENDING`` records: at 10 sessions/s, ~7 minutes) loses nothing; when the queue is full a
record is dropped and counted (``card_cache_records_dropped_total``). A write Redis refuses for
memory (``maxmemory`` under ``noeviction``) is not retried: those records are counted
(``card_cache_records_failed_total{reason="out_of_memory"}``), without a log line per record:
the monitor reports the store's state on its health name with one line naming the reason.

A retried batch is written once: a transaction whose reply was lost (a timeout) may have landed,
so before a retry the writer reads the first record's key, which only that transaction writes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from card.cache_service import metrics
from card.cache_service.store import MetadataStore, StoreFull
from card.engine.shared.errors import Unavailable
from card.engine.shared.stats import GenerationStats

log = logging.getLogger(__name__)

HIST_CAP = 32  # accepted lengths of HIST_CAP or more share the last bucket, "32+"
MAX_PENDING = 4096  # finished records queued for the store; more are dropped (and counted)
BATCH = 128  # records per Redis transaction
RETRY_S = (0.25, 2.0)  # first and longest wait before writing a batch again to an unreachable store

Fields = dict[str, str | int | float]


def _quantile(ordered: Sequence[float], q: float) -> float:
    """Nearest-rank quantile of an ascending, non-empty sequence."""
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def accepted_length_hist(lengths: Sequence[int]) -> dict[str, int]:
    """How many target forwards committed each length (tokens per forward), ascending; lengths
    of ``HIST_CAP`` or more count as ``"32+"``: at most ``HIST_CAP + 1`` buckets."""
    counts: dict[int, int] = {}
    for n in lengths:
        b = min(max(int(n), 0), HIST_CAP)
        counts[b] = counts.get(b, 0) + 1
    return {(f"{b}+" if b == HIST_CAP else str(b)): counts[b] for b in sorted(counts)}


def stats_fields(stats: GenerationStats) -> Fields:
    """The target's generation stats as bounded record fields (no per-forward list)."""
    lengths = list(stats.accepted_lengths)
    rtt = sorted(float(x) for x in stats.step_rtt_ms)
    fields: Fields = {
        "mode": stats.mode, "prompt_tokens": stats.prompt_tokens, "new_tokens": stats.new_tokens,
        "wall_s": round(stats.wall_s, 6), "prefill_s": round(stats.prefill_s, 6),
        "target_forwards": stats.target_forwards, "tokens_per_s": round(stats.tokens_per_s, 3),
        "mean_accepted_length": round(stats.mean_accepted_length, 4),
        "target_hits": stats.hits, "target_secondary_hits": stats.secondary_hits,
        "target_misses": stats.misses, "hit_rate": round(stats.hit_rate, 4),
        "target_idle_s": round(stats.target_idle_s, 6), "exact": int(stats.exact),
        "accepted_length_count": len(lengths),
        "accepted_length_mean": round(sum(lengths) / len(lengths), 4) if lengths else 0.0,
        "accepted_length_max": max(lengths, default=0),
        "accepted_length_hist": json.dumps(accepted_length_hist(lengths), separators=(",", ":")),
        "step_rtt_count": len(rtt),
    }
    if rtt:
        fields.update(step_rtt_mean_ms=round(sum(rtt) / len(rtt), 3),
                      step_rtt_p50_ms=round(_quantile(rtt, 0.5), 3),
                      step_rtt_p99_ms=round(_quantile(rtt, 0.99), 3), step_rtt_max_ms=round(rtt[-1], 3))
    return fields


@dataclass(frozen=True)
class FinishedRecord:
    """One session's final record (its live fields included) and what it adds to the totals."""

    session_id: str
    fields: Fields
    totals: dict[str, float]
    ttl_s: float
    # the session's record lock; the session is closed before the record is submitted, so once the
    # writer has taken it (a barrier) no live-record write of the monitor's can land after this one
    guard: threading.Lock | None = field(default=None, compare=False)


class RecordWriter:
    """A bounded queue of finished records and the one thread that writes them to the store.

    ``submit`` never blocks; ``stop`` writes what is queued within its timeout (shutdown)."""

    def __init__(self, store: MetadataStore, max_pending: int = MAX_PENDING) -> None:
        self.store = store
        self._queue: queue.Queue[FinishedRecord] = queue.Queue(max_pending)
        self._idle = threading.Condition()
        self._pending = 0  # submitted, not yet written or given up
        self._stop = threading.Event()
        self._abandon = threading.Event()
        self._thread: threading.Thread | None = None
        self.written = self.failed = self.dropped = 0
        metrics.RECORDS_PENDING.set_function(self._queue.qsize)

    @property
    def pending(self) -> int:
        """Records submitted and neither written nor given up yet (queued, or in hand)."""
        return self._pending

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="cache-records", daemon=True)
            self._thread.start()

    def submit(self, record: FinishedRecord) -> bool:
        """Queue ``record``; False when the queue is full (the record is dropped and counted)."""
        with self._idle:
            try:
                self._queue.put_nowait(record)
            except queue.Full:
                self.dropped += 1
                dropped = self.dropped
            else:
                self._pending += 1
                return True
        metrics.RECORDS_DROPPED.inc()
        if dropped == 1 or dropped % 1000 == 0:  # one line, not one per record
            log.warning("finished-session record of %s dropped: %d records queued for the store %s "
                        "(%d dropped so far, card_cache_records_dropped_total)", record.session_id,
                        self._queue.maxsize, self.store.url, dropped,
                        extra={"session_id": record.session_id})
        return False

    def flush(self, timeout_s: float) -> bool:
        """Wait until every submitted record is written or given up; False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._idle:
            while self._pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def stop(self, timeout_s: float = 5.0) -> None:
        """Write what is queued (for at most ``timeout_s``), then end the thread; what is left is
        dropped and counted."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                self._abandon.set()
                log.warning("%d finished-session record(s) not written at shutdown: the store %s is slow "
                            "or down (counted in card_cache_records_dropped_total)", self._pending,
                            self.store.url)
            self._thread = None

    def _run(self) -> None:
        held: list[FinishedRecord] = []  # a batch the store could not take yet
        delay = RETRY_S[0]
        while True:
            retry = bool(held)
            if held:
                batch, held = held, []
            else:
                try:
                    batch = [self._queue.get(timeout=0.1)]
                except queue.Empty:
                    if self._stop.is_set():
                        return
                    continue
                with contextlib.suppress(queue.Empty):
                    while len(batch) < BATCH:
                        batch.append(self._queue.get_nowait())
            if self._abandon.is_set():
                self.dropped += len(batch)
                metrics.RECORDS_DROPPED.inc(len(batch))
            elif not self._write(batch, retry):
                held = batch  # the store is unreachable: this batch again, after a wait
                self._abandon.wait(delay)
                delay = min(2 * delay, RETRY_S[1])
                continue
            delay = RETRY_S[0]
            with self._idle:
                self._pending -= len(batch)
                self._idle.notify_all()

    def _write(self, batch: list[FinishedRecord], retry: bool = False) -> bool:
        """Write ``batch`` (``retry``: again); False when the store is unreachable (the batch is to
        be tried again), True when it is written or given up (counted either way)."""
        totals: dict[str, float] = {}
        for record in batch:
            if record.guard is not None:
                with record.guard:  # a live-record write in flight lands first (see FinishedRecord)
                    pass
            for name, value in record.totals.items():
                totals[name] = totals.get(name, 0.0) + value
        try:
            if retry and self.store.finished_session(batch[0].session_id):
                pass  # an earlier try landed, its reply did not: written once is enough
            else:
                self.store.write_finished([(r.session_id, r.fields, r.ttl_s) for r in batch], totals)
        except StoreFull as exc:  # the monitor's probe reports it (health, one line); count it here
            self._failed("out_of_memory", batch, exc)
        except Unavailable as exc:  # unreachable (or refusing our password): kept, tried again
            log.debug("%d finished-session record(s) wait for the store: %s", len(batch), exc)
            return False
        except Exception:  # a bug: the thread must outlive it
            self._failed("error", batch, None)
            log.exception("%d finished-session record(s) not written", len(batch))
        else:
            self.written += len(batch)
            metrics.RECORDS_WRITTEN.inc(len(batch))
        return True

    def _failed(self, reason: str, batch: list[FinishedRecord], exc: BaseException | None) -> None:
        self.failed += len(batch)
        metrics.RECORDS_FAILED.labels(reason).inc(len(batch))
        if exc is not None:  # no warning per record: the monitor's one line says why
            log.debug("%d finished-session record(s) not written: %s", len(batch), exc)
