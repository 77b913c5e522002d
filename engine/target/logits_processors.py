"""A request's logits processors: what it asks to be done to the target's logits before a token
is picked (``min_tokens``, ``logit_bias``, ``repetition_penalty``, ``presence_penalty``,
``frequency_penalty``), with vLLM's semantics and in vLLM's order (vLLM v1's ``Sampler``,
vllm/v1/sample/sampler.py, and its built-in processors, vllm/v1/sample/logits_processor/builtin.py):

    1. min_tokens          EOS and the stop token ids get -inf while fewer than ``min_tokens``
                           output tokens precede the row
    2. logit_bias          each listed token's bias is added
    3. repetition_penalty  tokens of the prompt or the output: a positive logit is divided by it,
                           a negative one multiplied
    4. frequency_penalty   times the token's count in the output, subtracted; then
       presence_penalty    subtracted once for a token the output holds
    5. the grammar         tokens the request's constraint does not allow get -inf
                           (engine.target.grammar: its state follows the row's context too)
    -- a greedy request takes the argmax here
    6. temperature, min_p (relative to the likeliest token's probability), top-k, top-p:
       engine.shared.sampling.filtered_probs

Exact under speculation: the target judges a chain ``[next, *chain]`` row by row, and row j must
be what plain decoding computes after committing ``chain[:j]``: its penalty context is the
committed output plus ``chain[:j]`` and its output count (min_tokens) is the committed one plus j.
``ProcessedRows`` gives exactly that, and ``TargetState`` (engine.target.verify) reads every row it
judges, draws from or reports a logprob of through it, in plain decoding (a chain of none) and in
verification alike. Each processed logit is computed on the CPU in float64 by the same elementwise
operations on the same inputs whatever the batch, the chain length or the order of the tokens in
the context, so it is the same bits in both modes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from card.engine.shared.config import SamplingParams
from card.engine.target.grammar import GrammarState


class LogitsProcessors:
    """One generation's processors and the context they read: the prompt's tokens and the output
    committed so far (``commit``). ``active``: any processor changes the logits (otherwise rows
    pass through untouched, on the device where they are)."""

    def __init__(self, params: SamplingParams, prompt_ids: Sequence[int],
                 ending_ids: Iterable[int] = (), grammar: GrammarState | None = None) -> None:
        self.params = params
        self.grammar = grammar  # the request's constraint, compiled (None: unconstrained)
        self.active = params.adjusts_logits
        self.outputs = 0  # output tokens committed
        self.version = 0  # bumped by every commit: rows computed before it are stale after it
        self._ending = torch.tensor(sorted(set(ending_ids)), dtype=torch.int64)
        self._bias_ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.int64)
        self._bias = torch.tensor([b for _, b in params.logit_bias], dtype=torch.float64)
        self._penalized = (params.repetition_penalty != 1.0 or params.presence_penalty != 0.0
                           or params.frequency_penalty != 0.0)
        # the penalty context: every token seen (prompt or output) once, in the order first seen,
        # and how often the output holds each; sparse, so a row costs what its context holds
        self._index: dict[int, int] = {}
        self._ids: list[int] = []
        self._counts: list[int] = []
        self._cached: tuple[torch.Tensor, torch.Tensor] | None = None
        if self._penalized:
            for token in prompt_ids:
                self._see(token, output=False)

    def commit(self, tokens: Sequence[int]) -> None:
        """Output tokens the target committed (its next token included)."""
        self.outputs += len(tokens)
        self.version += 1
        if self.grammar is not None:
            self.grammar.commit(tokens)
        if self._penalized:
            for token in tokens:
                self._see(token, output=True)

    def rows(self, logits: torch.Tensor, chain: Sequence[int] = ()) -> ProcessedRows:
        """The rows of a verification of ``[next, *chain]`` (logits [1 + len(chain), V]; plain
        decoding: one row and no chain), each processed as plain decoding would process it."""
        return ProcessedRows(self, logits, chain)

    def process(self, row: torch.Tensor, prefix: Sequence[int]) -> torch.Tensor:
        """``row`` [V] processed in the context committed output + ``prefix``: a new float64
        tensor on the CPU (the engine's logits are never written)."""
        p = self.params
        x = row.detach().to("cpu", torch.float64, copy=True)
        vocab = x.shape[-1]
        if p.min_tokens and self.outputs + len(prefix) < p.min_tokens:
            ending = self._ending[self._ending < vocab]  # a tokenizer may list ids past the model's
            x[ending] = float("-inf")
        if p.logit_bias:
            x[self._bias_ids] += self._bias  # ids are unique and checked against the vocabulary
        if self._penalized:
            ids, counts = self._context(prefix)
            values = x[ids]
            if p.repetition_penalty != 1.0:
                r = p.repetition_penalty
                values = torch.where(values > 0, values / r, values * r)
            # OpenAI's definition (and vLLM's): the count's multiple, then the presence, subtracted
            if p.frequency_penalty != 0.0:
                values = values - p.frequency_penalty * counts
            if p.presence_penalty != 0.0:
                values = values - p.presence_penalty * (counts > 0).to(torch.float64)
            x[ids] = values
        if self.grammar is not None:
            allowed = self.grammar.mask(prefix)
            n = min(vocab, allowed.numel())
            x[:n].masked_fill_(~allowed[:n], float("-inf"))
            x[n:] = float("-inf")  # ids past the tokenizer's are no grammar's
            if not bool(torch.isfinite(x).any()):  # min_tokens held back the only ending left:
                ending = self._ending[(self._ending < n)]  # the grammar's end wins
                ending = ending[allowed[ending]]
                x[ending] = row.detach().to("cpu", torch.float64)[ending]
        return x

    # ---- the penalty context -----------------------------------------------------------------
    def _see(self, token: int, output: bool) -> None:
        i = self._index.get(token)
        if i is None:
            i = self._index[token] = len(self._ids)
            self._ids.append(token)
            self._counts.append(0)
            self._cached = None
        if output:
            self._counts[i] += 1
            self._cached = None

    def _context(self, prefix: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(token ids [S], their output counts [S] float64) over the prompt, the committed output
        and ``prefix`` (which counts as output): each id once."""
        if self._cached is None:
            self._cached = (torch.tensor(self._ids, dtype=torch.int64),
                            torch.tensor(self._counts, dtype=torch.float64))
        ids, counts = self._cached
        if not prefix:
            return ids, counts
        extra: dict[int, int] = {}  # prefix tokens not seen yet -> their index past ``ids``
        added: dict[int, int] = {}  # index -> occurrences in the prefix
        for token in prefix:
            i = self._index.get(token)
            if i is None:
                i = extra.setdefault(token, len(self._ids) + len(extra))
            added[i] = added.get(i, 0) + 1
        if extra:
            ids = torch.cat([ids, torch.tensor(list(extra), dtype=torch.int64)])
            counts = torch.cat([counts, torch.zeros(len(extra), dtype=torch.float64)])
        else:
            counts = counts.clone()
        where = torch.tensor(list(added), dtype=torch.int64)
        counts[where] += torch.tensor(list(added.values()), dtype=torch.float64)
        return ids, counts


class ProcessedRows:
    """The rows of one verification (or one plain decoding step), processed on demand: row j in
    the context committed output + ``chain[:j]``. Without active processors a row is the logits'
    own (on the device), as before any processor existed."""

    def __init__(self, processors: LogitsProcessors, logits: torch.Tensor, chain: Sequence[int]) -> None:
        self.processors = processors
        self.raw = logits
        self.chain = chain
        self._version = processors.version
        self._done: dict[int, torch.Tensor] = {}
        self._host: torch.Tensor | None = None  # the rows on the CPU, where they were elsewhere

    def __len__(self) -> int:
        return int(self.raw.shape[0])

    @property
    def active(self) -> bool:
        return self.processors.active

    def row(self, j: int) -> torch.Tensor:
        """Row j [V]: processed (float64, CPU) where processors are active, else the logits'."""
        if not self.processors.active:
            return self.raw[j]
        row = self._done.get(j)
        if row is None:
            # a row read after the target committed more would see the wrong context
            assert self._version == self.processors.version, "processed rows read after a commit"
            row = self._done[j] = self.processors.process(self._on_host()[j], self.chain[:j])
        return row

    def _on_host(self) -> torch.Tensor:
        """The rows on the CPU: rows on an accelerator come over in one copy (one synchronisation
        for the step, not one per row), in their own dtype (float64 is exact from any of them)."""
        if self.raw.device.type == "cpu":
            return self.raw
        if self._host is None:
            self._host = self.raw.detach().to("cpu")
        return self._host

    def head(self, n: int) -> torch.Tensor:
        """The first ``n`` rows [n, V]."""
        if not self.processors.active:
            return self.raw[:n]
        return torch.stack([self.row(j) for j in range(n)]) if n else self.raw[:0].to("cpu", torch.float64)
