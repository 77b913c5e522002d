"""The target engine: one loop owns the model; each iteration is one forward over every live
generation (continuous batching, nano-vllm's shape).

    admit    waiting generations take a free KV slot (engine.kv_pool.KVPool), in arrival order
    plan     each running generation gives its next input: a prefill chunk, or [t_next, *chain]
             after its chain source's step; steps first, then prefill chunks while the iteration
             has token budget (``max_batch_tokens``; the first input always goes)
    budget   each chain is cut to what pays at this iteration's measured cost (engine.speculation)
    forward  one flattened forward over all of them (engine.kv_pool.forward), timed
    commit   each generation absorbs its rows' logits and streams what it committed; finished
             ones close and give their slot back

Requests join and leave between iterations. A prompt is prefilled in chunks of ``prefill_chunk``
tokens, so a long prompt does not stall everyone else's decoding; the chunk size is fixed (not a
function of the load), so a generation's arithmetic is the same alone and in any batch.

One generation failing (its source raised, its input was bad) ends that generation only.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from engine.chain_source import step_all
from engine.generate import Chunk, Generation
from engine.kv_pool import PREFILL_CHUNK, KVPool, Segment, forward
from engine.speculation import CostModel, chain_lengths

log = logging.getLogger(__name__)



@dataclass
class Event:
    """What one iteration did for one generation: a chunk it committed (None while prefilling),
    and, when it ended, ``done`` (``error``: the exception that ended it early)."""

    generation: Generation
    chunk: Chunk | None = None
    done: bool = False
    error: BaseException | None = None


class TargetEngine:
    def __init__(self, model: torch.nn.Module, pool: KVPool, max_batch_tokens: int = 2048,
                 prefill_chunk: int = PREFILL_CHUNK, adaptive: bool = True) -> None:
        self.model = model
        self.pool = pool
        self.adaptive = adaptive  # cut chains by measured cost (engine.speculation)
        self.cost = CostModel()
        self.max_batch_tokens = max(max_batch_tokens, 1)
        self.prefill_chunk = prefill_chunk
        self.waiting: deque[Generation] = deque()
        self.running: list[Generation] = []
        self.forwards = 0

    @classmethod
    def alone(cls, model: torch.nn.Module, kv_len: int) -> TargetEngine:
        """An engine of one slot of ``kv_len`` rows: one generation run by itself."""
        return cls(model, KVPool(model, slots=1, max_len=max(kv_len, 2)))

    # ---- queue -------------------------------------------------------------------------------
    def add(self, gen: Generation) -> None:
        self.waiting.append(gen)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def cancel(self, gen: Generation) -> Event:
        """End ``gen`` now (its client went away): it leaves the queue or the batch, closes its
        source and gives its slot back. Between iterations only (the engine's thread)."""
        if gen in self.waiting:
            self.waiting.remove(gen)
        return self._finish(gen)

    # ---- one iteration -----------------------------------------------------------------------
    def step(self) -> list[Event]:
        events = self._admit()
        inputs: list[tuple[Generation, list[int], int, bool]] = []
        budget = self.max_batch_tokens
        # steps first (a token or a short chain each, all sources stepped together), then prefill
        # chunks while budget lasts
        decoding = [g for g in self.running if not g.prefilling]
        t_step = time.perf_counter()
        steps = step_all([g.source for g in decoding], [g.correction() for g in decoding])
        waited = time.perf_counter() - t_step
        for gen, step in zip(decoding, steps, strict=True):
            try:
                if isinstance(step, Exception):
                    raise step
                tokens, start, all_rows = gen.take_step(step, waited)
            except Exception as exc:  # its source failed: this generation ends, the batch goes on
                events.append(self._fail(gen, exc))
                continue
            inputs.append((gen, list(tokens), start, all_rows))
            budget -= len(tokens)
        for gen in [g for g in self.running if g.prefilling]:
            if inputs and budget < min(self.prefill_chunk, gen.prefill_left):
                continue
            tokens, start, all_rows = gen.next_input(self.prefill_chunk)
            inputs.append((gen, list(tokens), start, all_rows))
            budget -= len(tokens)
        if not inputs:
            return events
        if self.adaptive:
            inputs = self._budget(inputs)
        segments, rows, offset = [], [], 0
        for gen, tokens, start, all_rows in inputs:
            assert gen.slot is not None
            segments.append(Segment(gen.slot, start, len(tokens)))
            if all_rows:
                rows.append(torch.arange(offset, offset + len(tokens)))
            elif start + len(tokens) == len(gen.request.prompt_ids):  # the prompt's last chunk
                rows.append(torch.tensor([offset + len(tokens) - 1]))
            else:
                rows.append(torch.empty(0, dtype=torch.int64))
            offset += len(tokens)
        flat = torch.tensor([t for _, tokens, _, _ in inputs for t in tokens], dtype=torch.int64)
        t0 = time.perf_counter()
        logits = forward(self.model, self.pool, segments, flat, torch.cat(rows))
        self.cost.observe(flat.numel(), time.perf_counter() - t0)
        self.forwards += 1
        first = 0
        for (gen, _, _, _), own in zip(inputs, rows, strict=True):
            mine = logits[first:first + own.numel()]
            first += own.numel()
            try:
                chunk = gen.absorb(mine)
            except Exception as exc:
                events.append(self._fail(gen, exc))
                continue
            if gen.done:
                event = self._finish(gen)
                event.chunk = chunk
                events.append(event)
            elif chunk is not None:
                events.append(Event(gen, chunk))
        return events

    def _budget(self, inputs: list[tuple[Generation, list[int], int, bool]]
                ) -> list[tuple[Generation, list[int], int, bool]]:
        """Cut each step's chain to what pays at this iteration's measured cost."""
        steps = [k for k, (_, _, _, all_rows) in enumerate(inputs) if all_rows]
        fixed = sum(len(tokens) for _, tokens, _, all_rows in inputs if not all_rows) + len(steps)
        lengths = chain_lengths([len(inputs[k][1]) - 1 for k in steps],
                                [inputs[k][0].acceptance.alpha for k in steps], fixed, self.cost.fit())
        for k, length in zip(steps, lengths, strict=True):
            gen, tokens, start, _ = inputs[k]
            if length < len(tokens) - 1:
                inputs[k] = (gen, gen.trim_chain(length), start, True)
        return inputs

    def _admit(self) -> list[Event]:
        events = []
        while self.waiting and self.pool.free_slots:
            gen = self.waiting.popleft()
            if gen.kv_len > self.pool.max_len:  # the servicer sizes context windows; a guard
                events.append(self._fail(gen, ValueError(
                    f"generation needs {gen.kv_len} KV rows, the cache holds {self.pool.max_len}")))
                continue
            gen.slot = self.pool.acquire()
            self.running.append(gen)
            try:
                gen.open()
            except Exception as exc:
                events.append(self._fail(gen, exc))
        return events

    def _fail(self, gen: Generation, exc: BaseException) -> Event:
        log.warning("generation ended by an error: %s", exc)
        event = self._finish(gen)
        event.error = exc
        return event

    def _finish(self, gen: Generation) -> Event:
        if gen in self.running:
            self.running.remove(gen)
        if gen.slot is not None:
            self.pool.release(gen.slot)
            gen.slot = None
        try:
            gen.close()
        except Exception:  # closing the source is best effort; the output stands
            log.exception("closing a generation's chain source failed")
        return Event(gen, done=True)

    # ---- one generation, here and now --------------------------------------------------------
    def stream(self, gen: Generation) -> Iterator[Chunk]:
        """Run ``gen`` to its end, yielding its chunks; an error it met is raised; a consumer that
        stops early cancels it."""
        self.add(gen)
        try:
            while True:
                for event in self.step():
                    if event.generation is not gen:
                        continue
                    if event.chunk is not None:
                        yield event.chunk
                    if event.error is not None:
                        raise event.error
                    if event.done:
                        return
        finally:
            if gen.result is None:
                self.cancel(gen)
