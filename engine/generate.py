"""The target loop, the same for every mode: step the chain source, verify, commit, stream.

    prefill -> next token t0
    loop:   chain = source.step(Correction(epoch, accepted, t_next))   # one query, never waits
            accepted, t_next = target.verify(chain)                    # one forward
            stream accepted + [t_next], stopping at EOS / stop string / budget
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from engine.chain_source import ChainSource
from engine.config import GenerationRequest
from engine.errors import InvalidArgument
from engine.stats import GenerationStats
from engine.stopping import OutputTracker
from engine.target import TargetState
from engine.tree import Correction, Outcome


@dataclass(frozen=True)
class Chunk:
    """Tokens committed by one target forward (after stop handling) and the text they released."""

    token_ids: tuple[int, ...]
    text: str


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str
    stats: GenerationStats

    def to_dict(self) -> dict:
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "stats": self.stats.to_dict(),
        }


def check_prompt(prompt_ids: Sequence[int], context_window: int, model_name: str) -> None:
    if not prompt_ids:
        raise InvalidArgument("the prompt is empty")
    if len(prompt_ids) >= context_window:
        raise InvalidArgument(
            f"the prompt has {len(prompt_ids)} tokens but the context window of {model_name} "
            f"is {context_window} tokens (room is needed for at least one new token)"
        )


class Generation:
    """One generation. Iterate it for streamed chunks; ``result`` is set once iteration ends."""

    def __init__(
        self,
        model: torch.nn.Module,
        request: GenerationRequest,
        source: ChainSource,
        *,
        eos_ids: frozenset[int],
        decode: Callable[[list[int]], str],
        context_window: int,
        mode: str,
        model_name: str = "the target model",
    ) -> None:
        check_prompt(request.prompt_ids, context_window, model_name)
        self.model = model
        self.request = request
        self.source = source
        self.context_window = context_window
        self.tracker = OutputTracker(request.stop, eos_ids, decode)
        self.stats = GenerationStats(mode=mode, prompt_tokens=len(request.prompt_ids))
        self.result: GenerationResult | None = None

    def __iter__(self) -> Iterator[Chunk]:
        stats, tracker = self.stats, self.tracker
        t0 = time.perf_counter()
        target = TargetState(self.model, self.request.prompt_ids, self.request.sampling)
        # the committed sequence has one owner, the target state; the source may read it
        self.source.open(target.committed)
        try:
            token = target.prefill()
            stats.prefill_s = time.perf_counter() - t0
            stats.accepted_lengths.append(1)
            kept, text = tracker.feed([token])
            yield Chunk(tuple(kept), text)
            epoch, accepted, accepted_ids = 0, (), ()
            while not tracker.done:
                if len(target.committed) >= self.context_window:
                    tracker.finish_reason = "length"
                    break
                correction = Correction(epoch, accepted, accepted_ids, token)
                t_step = time.perf_counter()
                step = self.source.step(correction)
                stats.target_idle_s += time.perf_counter() - t_step
                self._count(step.outcome)
                chain = step.chain
                epoch = chain.epoch
                # no point verifying past the token budget or the context window
                room = min(
                    self.request.stop.max_new_tokens - len(tracker.token_ids),
                    self.context_window - len(target.committed),
                ) - 1
                tokens = chain.tokens[: max(room, 0)]
                n, token = target.verify(tokens)
                accepted, accepted_ids = tokens[:n], chain.node_ids[:n]
                stats.accepted_lengths.append(n + 1)
                kept, text = tracker.feed([*accepted, token])
                yield Chunk(tuple(kept), text)
        finally:
            # target-side stats first: a remote source records them with the cache when it closes
            stats.wall_s = time.perf_counter() - t0
            stats.new_tokens = len(tracker.token_ids)
            stats.target_forwards = target.forwards
            src = self.source.close(stats)
            stats.draft_forwards = src.draft_forwards
            stats.draft_idle_s = src.draft_idle_s
            stats.step_rtt_ms = src.step_rtt_ms
            self.result = GenerationResult(
                tracker.text, list(tracker.token_ids), tracker.finish_reason or "aborted", stats
            )

    def _count(self, outcome: Outcome | None) -> None:
        if outcome is Outcome.HIT:
            self.stats.hits += 1
        elif outcome is Outcome.SECONDARY_HIT:
            self.stats.secondary_hits += 1
        elif outcome is Outcome.MISS:
            self.stats.misses += 1

    def run(self) -> GenerationResult:
        for _ in self:
            pass
        assert self.result is not None
        return self.result
