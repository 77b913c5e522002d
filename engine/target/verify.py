"""The target's side of one generation: the committed sequence and the acceptance rule.

Committed sequence = prompt + every token the target emitted; it has one owner per process, this
object. The KV cache (card.engine.shared.kv_pool, filled by the engine's batched forwards) covers every
committed token but the last one (the *next token*), which rides at the head of the next
verification: a step forwards ``[next_token, *chain]`` at positions ``len(committed) - 1 ...``.

The acceptance rule is the request's ``VerifyPolicy``:

    exact   keep the longest prefix of the chain where each token is the target's own (argmax, or
            the seeded draw at that position): the tokens are plain decoding's
    loose   FLy: a mismatch at j is kept too when the target's top-3 entropy there is at least
            the threshold and the target's own tokens at j+1 .. j+W-1 (which it computed after
            the drafted token at j) all match the chain; a mismatch among the chain's last W
            tokens cannot be judged and ends the prefix, as in the paper's code
    rejection  speculative sampling on a drawn chain (its Proposal q): x_j is kept when
            c_j * q(x_j) < p(x_j), c_j the coin at its position (stream 1); at the first
            rejection the token is drawn from max(0, p - q) with the position's own uniform
            (stream 0), after a whole chain from p as plain decoding draws it. Greedy requests,
            chains that were not drawn and proposals that do not hold up (another process
            sent them) are verified exactly, which is lossless whatever the chain.
            With a floor f on q (VerifyPolicy.q_floor; card-target's --rejection-q-floor) the
            draft's claims are bounded: see ``TargetState._rejection``

Either way the target's own token after the kept prefix is committed too, so every step commits
``accepted + 1`` tokens, and logprobs (when asked) are read off the same rows.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from card.engine.shared.config import SamplingParams, Verify, VerifyPolicy
from card.engine.shared.sampling import draw, filtered_probs, position_uniform, select_token
from card.engine.shared.tree import Proposal
from card.engine.target.grammar import GrammarState
from card.engine.target.logits_processors import LogitsProcessors, ProcessedRows

# vLLM's floor for a token the distribution gives no mass (JSON has no -inf): a loose request can
# keep a drafted token outside its top-k / top-p
LOGPROB_FLOOR = -9999.0


@dataclass(frozen=True)
class TokenLogprob:
    """A committed token's log-probability and the ``top`` likeliest tokens there (id,
    log-probability), best first, under the logits the token was chosen from: the request's
    logits processors applied (penalties, logit_bias, min_tokens; engine.target.logits_processors),
    like vLLM's ``--logprobs-mode processed_logprobs``. Greedy requests: at temperature 1 (the
    model's own distribution when no processor is set); sampled ones: the distribution the token
    was drawn from (temperature, min-p, top-k, top-p applied: a token outside them is never an
    alternative, and a kept one, which only loose can keep, reads LOGPROB_FLOOR)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int], sampling: SamplingParams,
                   top: int) -> list[TokenLogprob]:
    """Logprobs of ``tokens`` [n] under the rows ``logits`` [n, V] that chose them."""
    rows = logits.detach().to("cpu", torch.float64)
    if sampling.greedy:
        logp = torch.log_softmax(rows, dim=-1)
    else:
        logp = torch.log(torch.stack([filtered_probs(row, sampling) for row in rows]))
    picked = logp.gather(1, torch.tensor(list(tokens), dtype=torch.int64).view(-1, 1)).view(-1)
    chosen: list[float] = picked.clamp(min=LOGPROB_FLOOR).tolist()
    if not top:
        return [TokenLogprob(t, lp) for t, lp in zip(tokens, chosen, strict=True)]
    values, ids = torch.topk(logp, min(top, logp.shape[-1]), dim=-1)
    out = []
    for t, lp, vs, ix in zip(tokens, chosen, values.tolist(), ids.tolist(), strict=True):
        alternatives = tuple((i, v) for i, v in zip(ix, vs, strict=True) if v != float("-inf"))
        out.append(TokenLogprob(t, lp, alternatives))
    return out


def proposal_holds(chain: Sequence[int], proposal: Proposal, vocab_size: int) -> bool:
    """A proposal the rejection rule can divide by: a row per chain token, probabilities finite,
    in [0, 1] and summing to 1, tokens in [0, vocab_size) (-1 pads, with probability 0), and each
    token drawn from its row (q(x) > 0). Another process sent it: a token past the vocabulary
    would fail the step's indexing, not just skew it."""
    if len(proposal) != len(chain) or proposal.tokens.shape != proposal.probs.shape:
        return False
    q = proposal.probs.to(torch.float64)
    if not bool((torch.isfinite(q) & (q >= 0) & (q <= 1)).all()):
        return False
    t = proposal.tokens
    if not bool((((t >= 0) & (t < vocab_size)) | ((t == -1) & (q == 0))).all()):
        return False
    if not bool(((q.sum(dim=-1) - 1).abs() < 1e-6).all()):
        return False
    x = torch.tensor(list(chain), dtype=torch.int64).view(-1, 1)
    return bool((((proposal.tokens == x) & (q > 0)).any(dim=-1)).all())


def residual(p: torch.Tensor, tokens: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """max(0, p - q) [V] for p [V] and a sparse q (``tokens``, ``q`` [w]); draw() normalises it.
    After a rejection p(x) < q(x) or some of q was floored, so some mass is left; should rounding
    leave none, p itself."""
    left = p.clone().index_add_(0, tokens, -q.to(p.dtype)).clamp_(min=0)
    return left if float(left.sum()) > 0 else p


def top3_entropy(logits: torch.Tensor) -> list[float]:
    """FLy's gate: -sum p log p over the three likeliest tokens of each row of ``logits`` [k, V]
    (the model's own distribution, not renormalised)."""
    top = torch.topk(torch.log_softmax(logits.detach().to("cpu", torch.float64), dim=-1), 3, dim=-1).values
    return (-(top.exp() * top).sum(dim=-1)).tolist()


@dataclass(frozen=True)
class RowPicks:
    """What a static step computed on the device for one session's rows (card.engine.shared.
    static_step): ``tokens``, each row's own token: its argmax, or (``drawn``) its draw with the
    request's seeded sampling params; ``accepted``: the chain tokens the exact rule keeps."""

    tokens: Sequence[int]
    drawn: bool = False
    accepted: int | None = None


class TargetState:
    """``verify``: the acceptance rule; ``logprobs``: None, or report each committed token's
    logprob with that many alternatives (``take_logprobs``); ``ending_ids``: the tokens that end
    the generation (EOS, the stop token ids), which ``min_tokens`` holds back.

    Every row the rules read goes through the request's logits processors first
    (engine.target.logits_processors: ``ProcessedRows``), in plain decoding and in verification
    alike; with none active the rows are the model's logits, untouched."""

    def __init__(self, prompt_ids: Sequence[int], sampling: SamplingParams,
                 verify: VerifyPolicy | None = None, logprobs: int | None = None,
                 ending_ids: Iterable[int] = (), grammar: GrammarState | None = None) -> None:
        self.sampling = sampling
        self.verify = verify or VerifyPolicy()
        self.logprobs = logprobs
        self.committed: list[int] = list(prompt_ids)
        self.processors = LogitsProcessors(sampling, prompt_ids, ending_ids, grammar)
        self.forwards = 0
        self.loose_kept = 0  # drafted tokens kept that were not the target's own (loose only)
        self.fallbacks = 0  # rejection: chains verified exactly for want of a usable proposal
        self._logprobs: list[TokenLogprob] = []
        self._picked: RowPicks | None = None  # what the current step's device chose, if anything
        # the rejection rule's coins and draws: keyed by the seed (reproducible), or, where the
        # server says so, by a key drawn for this request that no draft can know or guess
        self._coin_key = secrets.randbits(64) if self.verify.secret_coins else sampling.seed

    def first(self, logits: torch.Tensor) -> int:
        """Commit the first new token from the prompt's last logits [V]; returns it."""
        rows = self.processors.rows(logits.view(1, -1))
        token = select_token(rows.row(0), len(self.committed), self.sampling)
        self._commit(rows, [token])
        return token

    def device_sampling(self, chain: int, proposal: Proposal | None) -> SamplingParams | None:
        """The params a static step should draw this step's rows with on the device (a chain of
        ``chain`` tokens, drawn with ``proposal``), or None where it has nothing to draw: a greedy
        request (its argmax comes anyway), logits processors (the device sees the model's logits,
        not the processed ones), or the rejection rule (its coins and residual draws stay here).
        Exact and loose rules take the device's draws (``accept``)."""
        if self.sampling.greedy or self.processors.active:
            return None
        if self.verify.mode is Verify.REJECTION and chain and proposal is not None:
            return None
        return self.sampling

    def accept(self, chain: Sequence[int], logits: torch.Tensor,
               proposal: Proposal | None = None, picks: RowPicks | None = None) -> tuple[int, int]:
        """Judge ``chain`` given the logits [1 + len(chain), V] of ``[next_token, *chain]`` (and,
        drawn, the distributions its tokens were drawn from; ``picks``: what a static step chose
        on the device for these rows, of the model's logits: unused where processors change them,
        and its draws only by a sampled request, its argmax only by a greedy one); returns
        (accepted count, new next token)."""
        self._picked = None if self.processors.active else picks
        rows = self.processors.rows(logits, chain)
        if self.verify.mode is Verify.LOOSE and len(chain) > self.verify.window:
            accepted, token = self._loose(chain, rows)
        elif self.verify.mode is Verify.REJECTION and not self.sampling.greedy and chain:
            if proposal is not None and proposal_holds(chain, proposal, logits.shape[-1]):
                accepted, token = self._rejection(chain, rows, proposal)
            else:  # exact is lossless whatever the chain; the stats say it happened
                self.fallbacks += 1
                accepted, token = self._exact(chain, rows)
        else:  # loose never judges a mismatch among a chain's last W tokens: this is exact too
            accepted, token = self._exact(chain, rows)
        self._commit(rows, [*chain[:accepted], token])
        return accepted, token

    def take_logprobs(self) -> list[TokenLogprob]:
        """The logprobs of the tokens committed since the last call (empty unless asked for)."""
        out, self._logprobs = self._logprobs, []
        return out

    # ---- rules -------------------------------------------------------------------------------
    def _exact(self, chain: Sequence[int], rows: ProcessedRows) -> tuple[int, int]:
        start = len(self.committed) - 1  # position of the next token
        own = self._own(rows)
        if own is not None:  # the device's tokens, and its count where it judged the chain
            assert self._picked is not None
            accepted = self._picked.accepted
            if accepted is None:
                accepted = 0
                while accepted < len(chain) and own[accepted] == chain[accepted]:
                    accepted += 1
            return accepted, own[accepted]
        if self.sampling.greedy and not rows.active:  # every row's argmax in one read
            picks = self._argmax(rows.raw)
            accepted = 0
            while accepted < len(chain) and picks[accepted] == chain[accepted]:
                accepted += 1
            return accepted, picks[accepted]
        accepted = 0  # row by row: a row after the first mismatch is never processed nor drawn
        while True:
            token = select_token(rows.row(accepted), start + 1 + accepted, self.sampling)
            if accepted < len(chain) and token == chain[accepted]:
                accepted += 1
                continue
            return accepted, token

    def _rejection(self, chain: Sequence[int], rows: ProcessedRows, proposal: Proposal) -> tuple[int, int]:
        """Speculative sampling with a floor f on the claimed q (``verify.q_floor``; 0: the
        classic rule). At position j, with row q and drawn x, let m be the row's mass below f:

        - q(x) < f: x is not kept; the token is drawn from p itself;
        - else x is kept with probability (1 - m) * min(1, p(x) / q(x));
        - after a rejection the token is drawn from norm(max(0, p - q')), q' = q with its
          entries below f zeroed.

        Honest (x ~ q): a token is kept with probability (1 - m) min(q', p), the rejections'
        residual holds (1 - m) max(0, p - q') and the floored draws m p: p in all, exactly.
        Lying (q and x chosen at will, the coins unknown): the keep path gives y at most
        p(y) / q(x) <= p(y) / f, and the residual path at most p(y) / q(x) too (its mass is at
        least m + (q(x) - p(x))+, and a rejection's probability at most that over q(x)); so no
        token comes out with more than 2 p(y) / f (plus p(y) where the draft lets a plain draw
        happen instead), and one the target's filters exclude never does. p is the processed
        distribution (the request's logits processors, then its filters)."""
        start = len(self.committed) - 1  # position of the next token
        key, floor = self._coin_key, self.verify.q_floor
        for j, token in enumerate(chain):
            position = start + 1 + j
            p = filtered_probs(rows.row(j), self.sampling)  # [V] float64
            support = proposal.tokens[j] >= 0
            toks, q = proposal.tokens[j][support], proposal.probs[j][support]
            q_x = float(q[toks == token].sum())
            u = position_uniform(key, position)
            if q_x < floor:  # a claim the floor does not take: the target draws its own token
                return j, draw(p, u)
            low = q < floor
            held = float(q[low].sum())  # m
            # keep x with probability (1 - m) min(1, p(x) / q(x)): the coin c is uniform on [0, 1)
            if position_uniform(key, position, stream=1) * q_x < (1.0 - held) * min(float(p[token]), q_x):
                continue
            return j, draw(residual(p, toks, q.masked_fill(low, 0.0)), u)
        return len(chain), select_token(rows.row(len(chain)), start + 1 + len(chain), self.sampling)

    def _loose(self, chain: Sequence[int], rows: ProcessedRows) -> tuple[int, int]:
        k, window = len(chain), self.verify.window
        picks = self._picks(rows)  # the target's own token after each drafted prefix
        match = [picks[j] == chain[j] for j in range(k)]
        kept = list(match)
        if not all(match[:k - window]):
            entropy, threshold = top3_entropy(rows.head(k - window)), self.verify.entropy_threshold
            for j in range(k - window):
                if not match[j] and entropy[j] >= threshold and all(match[j + 1:j + window]):
                    kept[j] = True
            if rows.active:  # never a token a processor forbids (min_tokens holding EOS back)
                for j in range(k - window):
                    if kept[j] and not match[j] and float(rows.row(j)[chain[j]]) == float("-inf"):
                        kept[j] = False
        accepted = next((j for j in range(k) if not kept[j]), k)
        self.loose_kept += sum(1 for j in range(accepted) if not match[j])
        return accepted, picks[accepted]

    def _own(self, rows: ProcessedRows) -> list[int] | None:
        """Each row's own token as the device chose it (``RowPicks``), where that is the token
        this request would choose here: no processor active, and argmax for a greedy request, its
        seeded draw for a sampled one; else None."""
        picked = self._picked
        if picked is None or rows.active or len(picked.tokens) != len(rows):
            return None
        if picked.drawn == self.sampling.greedy:
            return None
        return list(picked.tokens)

    def _argmax(self, logits: torch.Tensor) -> list[int]:
        return torch.argmax(logits, dim=-1).tolist()

    def _picks(self, rows: ProcessedRows) -> list[int]:
        own = self._own(rows)
        if own is not None:
            return own
        if self.sampling.greedy and not rows.active:
            return self._argmax(rows.raw)
        start = len(self.committed) - 1
        return [select_token(rows.row(j), start + 1 + j, self.sampling) for j in range(len(rows))]

    def _commit(self, rows: ProcessedRows, tokens: list[int]) -> None:
        """Commit ``tokens`` (read off ``rows``' first rows): their logprobs first, while the rows'
        context still holds, then the committed sequence and the processors' context."""
        if self.logprobs is not None:
            self._logprobs += token_logprobs(rows.head(len(tokens)), tokens, self.sampling, self.logprobs)
        self.committed.extend(tokens)
        self.processors.commit(tokens)
