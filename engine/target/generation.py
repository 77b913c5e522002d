"""One generation as a passive record; the target engine (engine.target.scheduler) drives it.

    open     the chain source opens at the prompt
    prefill  next_input: a chunk of the prompt        absorb: nothing, or (last chunk) token t0
    decode   next_input: chain = source.step(Correction(epoch, accepted, t_next))   # never waits
                         -> [t_next, *chain]           absorb: accepted, t_next = target.accept(chain)
             stream accepted + [t_next], stopping at EOS / stop string / budget / context window
    close    the source closes, given the generation's stats; ``result`` is set

Every mode and every entry point runs this: alone (engine.target.scheduler.run_alone: an engine
of one slot) or beside others in card-target's engine, one forward per iteration for all of them.
The record holds no model: the engine that owns the model feeds it its logits.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from card.engine.shared.config import MAX_CHAIN, GenerationRequest, SamplingParams
from card.engine.shared.errors import InvalidArgument
from card.engine.shared.stats import GenerationStats
from card.engine.shared.tree import NO_NODE, Correction, Outcome, Proposal
from card.engine.target.chain_source import ChainSource, StepResult
from card.engine.target.grammar import GrammarCompiler
from card.engine.target.stopping import OutputTracker
from card.engine.target.verify import RowPicks, TargetState, TokenLogprob


@dataclass(frozen=True)
class Chunk:
    """Tokens committed by one target forward (after stop handling) and the text they released;
    ``logprobs``: one per token when the request asked for them."""

    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str
    stats: GenerationStats
    logprobs: list[TokenLogprob] = field(default_factory=list)

    def to_dict(self) -> dict:
        out = {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "stats": self.stats.to_dict(),
        }
        if self.logprobs:
            out["logprobs"] = [{"token": lp.token, "logprob": lp.logprob, "top": [list(t) for t in lp.top]}
                               for lp in self.logprobs]
        return out


def check_prompt(prompt_ids: Sequence[int], context_window: int, model_name: str) -> None:
    if not prompt_ids:
        raise InvalidArgument("the prompt is empty")
    if len(prompt_ids) >= context_window:
        raise InvalidArgument(
            f"the prompt has {len(prompt_ids)} tokens but the context window of {model_name} "
            f"is {context_window} tokens (room is needed for at least one new token)"
        )


class Generation:
    """One generation; ``result`` is set once it ends. An engine drives it through ``open /
    next_input (prefill) or correction + take_step (decode) / absorb / close``. ``vocab_size``:
    the target's (a chain token outside it is cut; 0: no check). ``grammars``: the model's
    grammar compiler, needed by a request with a constraint; ``grammar_drafts``: where the grammar
    forces the next tokens, verify those (a chain no model drafted) instead of a source's chain
    that leaves them (engine.target.grammar; off for plain decoding, which verifies no chain)."""

    def __init__(
        self,
        request: GenerationRequest,
        source: ChainSource,
        *,
        eos_ids: frozenset[int],
        decode: Callable[[list[int]], str],
        context_window: int,
        mode: str,
        model_name: str = "the target model",
        vocab_size: int = 0,
        grammars: GrammarCompiler | None = None,
        grammar_drafts: bool = True,
    ) -> None:
        check_prompt(request.prompt_ids, context_window, model_name)
        self.request = request
        self.source = source
        self.context_window = context_window
        self.tracker = OutputTracker(request.stop, eos_ids, decode)
        self.stats = GenerationStats(mode=mode, prompt_tokens=len(request.prompt_ids),
                                     verify=request.verify.effective(request.sampling).value)
        if vocab_size and any(t >= vocab_size for t, _ in request.sampling.logit_bias):
            raise InvalidArgument(f"logit_bias names a token id outside the vocabulary [0, {vocab_size})")
        constraint = request.sampling.constraint
        if constraint is not None and grammars is None:
            raise InvalidArgument("this target cannot constrain its output "
                                  "(no grammar compiler for its tokenizer)")
        grammar = grammars.state(constraint) if constraint is not None and grammars is not None else None
        self.grammar_drafts = grammar_drafts and grammar is not None
        self.grammar_drafted = 0  # chain tokens the grammar forced (no model drafted them)
        # min_tokens holds back every token that would end the generation
        self.target = TargetState(request.prompt_ids, request.sampling, request.verify, request.logprobs,
                                  ending_ids={*eos_ids, *request.stop.stop_token_ids}, grammar=grammar)
        self.logprobs: list[TokenLogprob] = []  # of the tokens streamed so far, when asked for
        self._vocab = vocab_size or 2**62
        self.result: GenerationResult | None = None
        self.slot: int | None = None  # the engine's KV slot while it runs
        self._t0 = 0.0
        self._prefilled = 0  # prompt tokens whose keys and values are in the KV cache
        self._pending: Sequence[int] = ()  # the prefill chunk or chain in flight
        self._pending_ids: Sequence[int] = ()
        self._pending_q: Proposal | None = None  # a drawn chain's distributions (rejection)
        self._epoch = 0
        self._accepted: tuple[int, ...] = ()
        self._accepted_ids: tuple[int, ...] = ()

    @property
    def kv_len(self) -> int:
        return self.kv_rows(self.request, self.context_window)

    @staticmethod
    def kv_rows(request: GenerationRequest, context_window: int) -> int:
        """KV rows a generation can ever write: prompt + budget, within the context window."""
        return min(context_window, len(request.prompt_ids) + request.stop.max_new_tokens)

    @property
    def done(self) -> bool:
        return self.tracker.done

    @property
    def opened_at(self) -> float:
        """When its source opened, on time.perf_counter()'s clock (0.0 before): in an engine, its
        admission to a KV slot (card-target's queue-time metric)."""
        return self._t0

    @property
    def prefill_left(self) -> int:
        """Prompt tokens not yet in the KV cache."""
        return len(self.request.prompt_ids) - self._prefilled

    @property
    def settled_rows(self) -> int:
        """Rows of its slot that hold the final keys and values of its committed tokens: the
        prompt prefilled so far, then every committed token but the next one."""
        return self._prefilled if self.prefilling else len(self.target.committed) - 1

    @property
    def prefilling(self) -> bool:
        return self.prefill_left > 0

    # ---- driven by the engine ----------------------------------------------------------------
    def open(self) -> None:
        """Open the chain source (idempotent: a server may open it before the engine admits the
        generation, so that a remote session's round trip is not on the engine's loop)."""
        if self._t0:
            return
        self._t0 = time.perf_counter()
        # the committed sequence has one owner, the target state; the source may read it
        self.source.open(self.target.committed)

    def reuse(self, cached: int) -> None:
        """The first ``cached`` prompt tokens' keys and values are in the slot already (a cached
        prefix, card.engine.shared.prefix_cache): prefill starts after them. Before any input."""
        if not 0 <= cached < len(self.request.prompt_ids) or self._prefilled:
            raise ValueError(f"cannot reuse {cached} rows of a {len(self.request.prompt_ids)}-token prompt "
                             f"with {self._prefilled} prefilled")
        self._prefilled = cached
        self.stats.cached_tokens = cached

    def adopt(self, rows: int) -> None:
        """The next ``rows`` prompt rows' keys and values were copied into its slot (another
        prompt in the batch computed them, card.engine.target.scheduler): prefill goes on after
        them. At least one prompt token is always left to prefill."""
        if not 0 < rows < self.prefill_left:
            raise ValueError(f"cannot adopt {rows} rows with {self.prefill_left} prompt tokens left")
        self._prefilled += rows
        self.stats.cached_tokens += rows

    def next_input(self, prefill_chunk: int) -> tuple[Sequence[int], int]:
        """While prefilling: the next chunk of the prompt and the position of its first token."""
        n = min(prefill_chunk, self.prefill_left)
        self._pending = self.target.committed[self._prefilled:self._prefilled + n]
        return self._pending, self._prefilled

    def correction(self) -> Correction:
        """What the target verified last, for the source's next step (decoding only)."""
        return Correction(self._epoch, self._accepted, self._accepted_ids, self.target.committed[-1])

    def take_step(self, step: StepResult, waited_s: float) -> tuple[Sequence[int], int]:
        """The input of a decoding forward, ``[t_next, *chain]`` and the position of ``t_next``,
        given the source's answer to ``correction()``: the chain within the token budget, the
        context window and the vocabulary (the engine may cut it further, ``trim_chain``)."""
        committed = self.target.committed
        token = committed[-1]
        self.stats.target_idle_s += waited_s
        self._count(step.outcome)
        chain = step.chain
        self._epoch = chain.epoch
        # no point verifying past the token budget or the context window, and never past MAX_CHAIN
        # whatever a source hands out (a remote cache is another process)
        room = min(
            self.request.stop.max_new_tokens - len(self.tracker.token_ids),
            self.context_window - len(committed),
            MAX_CHAIN + 1,
        ) - 1
        tokens = chain.tokens[: max(room, 0)]
        # a chain comes from another process: a token outside the vocabulary (a broken or hostile
        # draft) would fail the whole batch's forward, so the chain stops before it
        bad = next((i for i, t in enumerate(tokens) if not 0 <= t < self._vocab), None)
        self._pending = tokens if bad is None else tokens[:bad]
        self._pending_ids = chain.node_ids[: len(self._pending)]
        # a drawn chain cut by length is still a draw (no token was kept or cut by its value); one
        # cut at a bad token is not, and is verified exactly (lossless whatever the chain)
        drawn = chain.proposal is not None and bad is None
        self._pending_q = chain.proposal.head(len(self._pending)) if drawn and chain.proposal else None
        if self.target.processors.grammar is not None:
            self._follow_grammar(max(room, 0))
        return [token, *self._pending], len(committed) - 1

    def _follow_grammar(self, room: int) -> None:
        """Cut the pending chain where it leaves the grammar (its next token would get -inf in
        its row: no rule keeps it); with grammar drafts, verify the tokens the grammar forces
        where the chain does not begin with them, and continue a chain (not a drawn one: its
        proposal covers its own tokens) with the tokens the grammar forces after it. Either way
        exact: the rows the target judges are plain decoding's rows, only which chain it judges
        changes."""
        grammar = self.target.processors.grammar
        assert grammar is not None
        keep = grammar.valid_prefix(self._pending)
        if keep < len(self._pending):
            self.trim_chain(keep)
        if not self.grammar_drafts:
            return
        forced = grammar.forced(room)
        if forced and list(self._pending[:len(forced)]) != forced:
            self._pending, self._pending_ids, self._pending_q = forced, (NO_NODE,) * len(forced), None
            self.grammar_drafted += len(forced)
        if self._pending_q is None and self._pending:
            more = grammar.forced(room - len(self._pending), after=self._pending)
            if more:
                self._pending = [*self._pending, *more]
                self._pending_ids = (*self._pending_ids, *(NO_NODE,) * len(more))
                self.grammar_drafted += len(more)

    def trim_chain(self, length: int) -> list[int]:
        """Verify only the chain's first ``length`` tokens (the engine's speculation budget; the
        output of an exact request never depends on it; a loose one's can, as which mismatches
        loose may judge depends on the chain's length); the step's new input."""
        self._pending = self._pending[:length]
        self._pending_ids = self._pending_ids[:length]
        if self._pending_q is not None:
            self._pending_q = self._pending_q.head(length)
        return [self.target.committed[-1], *self._pending]

    def device_sampling(self) -> SamplingParams | None:
        """The params a static step draws this step's rows with on the device, or None (its
        argmax only): ``TargetState.device_sampling`` for the chain in flight."""
        return self.target.device_sampling(len(self._pending), self._pending_q)

    def absorb(self, logits: torch.Tensor, picks: RowPicks | None = None) -> Chunk | None:
        """Take this generation's logits of the forward (all rows of a step; the last row of a
        prompt's last chunk; none of an earlier chunk), and what a static step chose for its rows
        on the device (``RowPicks``); the chunk it commits, if any."""
        self.target.forwards += 1
        if self.prefilling:
            self._prefilled += len(self._pending)
            if self.prefilling:
                return None
            token = self.target.first(logits[-1])
            self.stats.prefill_s = time.perf_counter() - self._t0
            return self._commit([token], 1)
        n, token = self.target.accept(self._pending, logits, self._pending_q, picks)
        self.stats.observe_step(len(self._pending), n)
        self._accepted, self._accepted_ids = tuple(self._pending[:n]), tuple(self._pending_ids[:n])
        return self._commit([*self._accepted, token], n + 1)

    def _commit(self, tokens: list[int], accepted_length: int) -> Chunk:
        self.stats.accepted_lengths.append(accepted_length)
        kept, text = self.tracker.feed(tokens)
        if not self.tracker.done and len(self.target.committed) >= self.context_window:
            text += self.tracker.finish("length")  # what was held back is streamed too
        logprobs = tuple(self.target.take_logprobs()[:len(kept)])  # a stop cuts both alike
        self.logprobs += logprobs
        return Chunk(tuple(kept), text, logprobs)

    def close(self) -> GenerationResult:
        """End the generation (finished, failed or cancelled: ``aborted``); idempotent."""
        if self.result is not None:
            return self.result
        stats, tracker = self.stats, self.tracker
        # target-side stats first: a remote source records them with the cache when it closes
        stats.wall_s = time.perf_counter() - self._t0 if self._t0 else 0.0
        stats.new_tokens = len(tracker.token_ids)
        stats.target_forwards = self.target.forwards
        stats.loose_kept = self.target.loose_kept
        stats.rejection_fallbacks = self.target.fallbacks
        try:
            src = self.source.close(stats)
            stats.draft_forwards = src.draft_forwards
            stats.draft_idle_s = src.draft_idle_s
            stats.step_rtt_ms = src.step_rtt_ms
        finally:
            self.result = GenerationResult(
                tracker.text, list(tracker.token_ids), tracker.finish_reason or "aborted", stats,
                self.logprobs,
            )
        return self.result

    def _count(self, outcome: Outcome | None) -> None:
        if outcome is Outcome.HIT:
            self.stats.hits += 1
        elif outcome is Outcome.SECONDARY_HIT:
            self.stats.secondary_hits += 1
        elif outcome is Outcome.MISS:
            self.stats.misses += 1
