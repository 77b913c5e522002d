"""The target's decoding step at static shapes: every decoding row of an iteration in one flat
batch padded to a bucket, run from preallocated buffers, so that it can be compiled
(``torch.compile``) or captured (CUDA graphs) once per shape and replayed.

    rows      each session's ``[t_next, *chain]``, flattened; padded with *ghost rows* up to the
              next of ROW_BUCKETS. A ghost writes its key and value to row 0 of the pool's scratch
              slot (never a session's) and its logits are ignored
    buffers   tokens, positions, slots [max rows], written by index before each step (one
              host-to-device copy); the step reads ``buffer[:bucket]``, views whose addresses never
              change, which is what a captured graph needs
    span      every row attends over the same number of key blocks, ``blocks`` (a power of two,
              enough for the furthest row of the step), its own columns past its position masked
    output    the logits of every row [bucket, vocab], each row's own token [bucket] (its argmax, or
              for a row sampled on the device its seeded draw) and each session's count of chain
              tokens accepted under the exact rule, on the device; the host reads the tokens and
              counts as one small tensor ([2, bucket], ``StepOutput.read``) and only the logits
              rows a request needs on the host (logprobs, logits processors, loose or rejection)

Seeded sampling on the device: a row sampled with a request's (temperature, top-k, top-p, min-p,
seed) gets its position-keyed uniform from the host (``position_uniforms``, the numbers the host
path draws with) and the same float64 filtering and inverse-CDF draw the host runs
(card.engine.shared.sampling: ``filter_rows``, ``draw_rows``; the host's ``filtered_probs`` is
their one-row case), for every row of the step at once; the acceptance (row j of a session kept
iff its own token at j-1 is chain[j] and every earlier row's was) is ``exact_accepted``
(card.engine.target.verify). Which filters run is fixed per step on the host (``FilterShape``):
one graph per (bucket, span, filters).

Exactness: a row's logits must not depend on the bucket, on the rows beside it or on the span the
step chose for the furthest row. Linears, norms and the LM head are row-wise (made invariant per
device by card.engine.loading.invariant). Attention is computed per 64-key block (every block's
matmul has one shape whatever the step) and the blocks are combined by a fixed binary tree over
the power-of-two span: the blocks a longer span adds sit in right subtrees that are entirely
masked, and combining with a masked subtree multiplies by exp(0) = 1 and adds 0, which is exact
in floating point. So a row's attention equals the one the longest span would give, bit for bit,
by construction (tests/engine/test_static_step.py checks it, with a ghost row whose write is not
redirected as the negative control). What construction cannot promise (a batched matmul whose
result for one matrix depends on how many ride with it, a reduction kernel chosen by the number
of outputs) ``StaticStep.probe`` checks at start-up on the model itself, at every bucket; where it
fails the engine keeps its eager step (card.engine.shared.kv_pool.forward).

Prefill chunks are not decoding rows: they stay on the eager forward.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from card.engine.shared.config import SamplingParams
from card.engine.shared.exact_attention import KV_BLOCK, block_tree, read_blocks
from card.engine.shared.hf import CACHE_KEYWORD, CausalLM
from card.engine.shared.sampling import (
    FilterShape,
    RowBuffers,
    RowFilters,
    draw_rows,
    exact_accepted,
    filter_rows,
    position_uniforms,
)

log = logging.getLogger(__name__)

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# decoding attention of the static step: triton (one kernel per layer, card.engine.shared.triton_attention),
# blocks (the block tree in torch ops, any device), auto (triton on CUDA where Triton imports)
ATTENTIONS = ("auto", "triton", "blocks")
STEP_MODES = ("eager", "static", "compiled", "graphs", "auto")


def row_bucket(rows: int, buckets: Sequence[int] = ROW_BUCKETS) -> int:
    """The smallest bucket holding ``rows`` rows."""
    for b in buckets:
        if b >= rows:
            return b
    raise ValueError(f"{rows} decoding rows exceed the largest bucket ({buckets[-1]})")


def row_buckets(max_rows: int) -> tuple[int, ...]:
    """The buckets a step of at most ``max_rows`` rows can reach."""
    reach = [b for b in ROW_BUCKETS if b < max_rows]
    return (*reach, row_bucket(max_rows))


def span_blocks(position: int, max_blocks: int) -> int:
    """Key blocks a step whose furthest row sits at ``position`` attends over: a power of two,
    at most ``max_blocks`` (the pool's blocks rounded up to a power of two)."""
    need = position // KV_BLOCK + 1
    blocks = 1
    while blocks < need:
        blocks *= 2
    return min(blocks, max_blocks)


def _pow2(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


@dataclass(frozen=True)
class DecodeRows:
    """One session's decoding rows: ``tokens`` (``[t_next, *chain]``) written at rows (=
    positions) ``start...`` of ``slot``; ``sampling``: draw each row's token on the device with
    these params (row j with the uniform of position ``start + 1 + j``, the position its token
    takes), None (or greedy): its argmax."""

    slot: int
    start: int
    tokens: Sequence[int]
    sampling: SamplingParams | None = None


@dataclass(frozen=True)
class StepOutput:
    """What a step leaves on the device: ``logits`` [live rows, vocab]; ``picks`` [live rows], each
    row's own token (argmax, or its seeded draw); ``accepted`` [live rows], at each session's
    first row the chain tokens the exact rule accepts (0 elsewhere). Views into the step's output,
    valid until the next step."""

    logits: torch.Tensor
    picks: torch.Tensor
    accepted: torch.Tensor
    selected: torch.Tensor  # [2, live]: picks and accepted, one tensor for one read

    def read(self) -> tuple[list[int], list[int]]:
        """``picks`` and ``accepted`` on the host: the step's one device-to-host read."""
        picks, accepted = self.selected.tolist()
        return picks, accepted


class StaticBatch:
    """The buffers one static step reads, and its attention. Handed to every decoder layer as its
    KV cache (hf.CACHE_KEYWORD; ``update`` writes the rows' keys and values by index) and as
    ``card_batch`` (card.engine.shared.kv_pool dispatches attention to ``attend``)."""

    static = True

    def __init__(self, pool: Any, max_rows: int, vocab: int) -> None:
        dev = pool.device
        self.pool = pool
        self.vocab = vocab
        self.max_rows = max_rows
        self.tokens = torch.zeros(max_rows, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(max_rows, dtype=torch.int64, device=dev)
        pool.zero_scratch()
        self.slots = torch.full((max_rows,), pool.scratch, dtype=torch.int64, device=dev)
        # the selection's inputs (select_rows): each row's next input token in its session (-1 at
        # a session's last row and at ghosts), its session's first row, whether it is drawn, its
        # filters and uniform
        self.following = torch.full((max_rows,), -1, dtype=torch.int64, device=dev)
        self.first = torch.arange(max_rows, dtype=torch.int64, device=dev)
        self.top_k = torch.zeros(max_rows, dtype=torch.int64, device=dev)
        self.sampled = torch.zeros(max_rows, dtype=torch.bool, device=dev)
        self.temperature = torch.ones(max_rows, dtype=torch.float64, device=dev)
        self.top_p = torch.ones(max_rows, dtype=torch.float64, device=dev)
        self.min_p = torch.zeros(max_rows, dtype=torch.float64, device=dev)
        self.uniforms = torch.zeros(max_rows, dtype=torch.float64, device=dev)
        # host staging: two copies per step; pinned where the device is a GPU (an async copy)
        pin = dev.type == "cuda"
        self._host = torch.zeros(7, max_rows, dtype=torch.int64, pin_memory=pin)
        self._host_f = torch.zeros(4, max_rows, dtype=torch.float64, pin_memory=pin)
        self.rows = 0  # the bucket of the step being run (set by StaticStep)
        self.blocks = 1
        self.filters: FilterShape | None = None  # the step's device sampling (None: argmax only)
        self.work: RowBuffers | None = None  # its workspaces, made by the first step that samples
        # the Triton decoding attention (StaticStep's ``attention``), or None: the block tree
        self.kernel: Callable[..., torch.Tensor] | None = None

    def fill(self, sessions: Sequence[DecodeRows], bucket: int) -> int:
        """Write the sessions' rows, then ghosts up to ``bucket``, into the buffers, and set
        ``filters``; returns the live row count."""
        host, hf = self._host, self._host_f
        n = 0
        drawn: list[SamplingParams | None] = []
        for s in sessions:
            k = len(s.tokens)
            tokens = torch.as_tensor(s.tokens, dtype=torch.int64)
            host[0, n:n + k] = tokens
            host[1, n:n + k] = torch.arange(s.start, s.start + k)
            host[2, n:n + k] = s.slot
            host[3, n:n + k - 1] = tokens[1:]  # row j is judged against chain[j] = tokens[j + 1]
            host[3, n + k - 1] = -1
            host[4, n:n + k] = n
            sampling = s.sampling if s.sampling is not None and not s.sampling.greedy else None
            drawn.append(sampling)
            host[5, n:n + k] = 0
            host[6, n:n + k] = sampling is not None
            if sampling is not None:
                hf[3, n:n + k] = torch.from_numpy(position_uniforms(
                    sampling.seed, np.arange(s.start + 1, s.start + 1 + k, dtype=np.int64)))
            n += k
        host[0, n:bucket] = 0  # ghosts: token 0 at position 0 of the scratch slot, judged on nothing
        host[1, n:bucket] = 0
        host[2, n:bucket] = self.pool.scratch
        host[3, n:bucket] = -1
        host[4, n:bucket] = torch.arange(n, bucket)
        host[5:7, n:bucket] = 0
        self.filters = None
        if any(d is not None for d in drawn):  # per session, then each session's value on its rows
            filters = RowFilters.of(drawn, self.vocab)
            counts = torch.tensor([len(x.tokens) for x in sessions])
            host[5, :n] = filters.top_k.repeat_interleave(counts)
            for i, values in enumerate((filters.temperature, filters.top_p, filters.min_p)):
                hf[i, :n] = values.repeat_interleave(counts)
            hf[:, n:bucket] = torch.tensor([[1.0], [1.0], [0.0], [0.0]], dtype=torch.float64)
            self.filters = filters.shape
            if self.work is None:
                self.work = RowBuffers(self.max_rows, self.vocab, self.tokens.device)
            floats = hf[:, :bucket].to(self.tokens.device, non_blocking=True)
            for buffer, row in zip((self.temperature, self.top_p, self.min_p, self.uniforms), floats,
                                   strict=True):
                buffer[:bucket].copy_(row)
        staged = host[:, :bucket].to(self.tokens.device, non_blocking=True)
        for buffer, row in zip((self.tokens, self.positions, self.slots, self.following, self.first,
                                self.top_k), staged, strict=False):
            buffer[:bucket].copy_(row)
        self.sampled[:bucket].copy_(staged[6] != 0)
        return n

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, cache_kwargs: object = None,
               **_: object) -> tuple[torch.Tensor, torch.Tensor]:
        # key, value: [1, kv_heads, rows, head_dim] -> (slot_r, :, position_r); target rows sit
        # at their positions. Ghosts all write row 0 of the scratch slot.
        b = self.rows
        slots, rows = self.slots[:b], self.positions[:b]
        rows = torch.where(slots == self.pool.scratch, torch.zeros_like(rows), rows)
        self.pool.keys[layer_idx][slots, :, rows] = key[0].transpose(0, 1)
        self.pool.values[layer_idx][slots, :, rows] = value[0].transpose(0, 1)
        return key, value

    def attend(self, layer: int, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """``query`` [1, heads, rows, dim] -> [1, rows, heads, dim]: each row over its slot's keys,
        causal by position: one Triton kernel (card.engine.shared.triton_attention) or the block
        tree over ``blocks`` key blocks (the module docstring)."""
        keys, values = self.pool.keys[layer], self.pool.values[layer]
        slots, positions = self.slots[:self.rows], self.positions[:self.rows]
        if self.kernel is not None:
            return self.kernel(query[0], keys, values, slots, positions, scaling)[None]
        return block_attention(query[0], keys, values, slots, positions, self.blocks, scaling)[None]


def block_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor,
                    positions: torch.Tensor, blocks: int, scaling: float) -> torch.Tensor:
    """Attention of ``query`` [heads, R, dim] (row r of slot ``slots[r]`` at ``positions[r]``)
    over the first ``blocks`` KV_BLOCKs of its slot in ``keys``/``values`` [slots, kv_heads, L,
    dim]; returns [R, heads, dim]. Blocks past L count as masked. Keys at or before a row's
    position must be written and every key row read must be finite (0 * NaN is NaN). The block
    tree itself: card.engine.shared.exact_attention.block_tree."""
    R = query.shape[1]
    real = read_blocks(keys, blocks)
    cols = torch.arange(real * KV_BLOCK, device=keys.device).view(1, 1, real, 1, KV_BLOCK)
    return block_tree(query, keys, values, slots, cols > positions.view(R, 1, 1, 1, 1), blocks, scaling)


def _attention_for(attention: str, device: torch.device, head_dim: int) -> str:
    if attention != "auto":
        return attention
    if device.type != "cuda" or head_dim & (head_dim - 1):
        return "blocks"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "blocks"
    return "triton"


def decode_forward(model: CausalLM, batch: StaticBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """The static step's whole computation on ``batch``'s buffers (``batch.rows`` rows):
    logits [rows, vocab] and their argmax [rows]. Pure in its shapes: what a compiler or a CUDA
    graph captures."""
    inner = model.model
    b = batch.rows
    tokens = batch.tokens[:b][None]
    positions = batch.positions[:b][None]
    hidden = inner.embed_tokens(tokens)
    rotary = inner.rotary_emb(hidden, positions)
    for layer in inner.layers[: model.config.num_hidden_layers]:
        hidden = layer(hidden, position_ids=positions, position_embeddings=rotary, card_batch=batch,
                       **{CACHE_KEYWORD: batch})
    logits = model.lm_head(inner.norm(hidden))[0]
    return logits, torch.argmax(logits, dim=-1)


def select_rows(logits: torch.Tensor, picks: torch.Tensor, batch: StaticBatch) -> torch.Tensor:
    """Each row's own token and each session's accepted count, [2, rows] int64 (``StepOutput``),
    from the step's ``logits`` [rows, V] and their argmax ``picks``: rows the batch samples get
    their seeded draw (``batch.filters`` says which filters run; None: no row is drawn). Static
    shapes, no host read: captured with the forward."""
    b = batch.rows
    if batch.filters is not None:
        probs = filter_rows(logits, batch.temperature[:b], batch.top_k[:b], batch.top_p[:b], batch.min_p[:b],
                            batch.filters, batch.work)
        picks = torch.where(batch.sampled[:b], draw_rows(probs, batch.uniforms[:b], batch.work), picks)
    return torch.stack([picks, exact_accepted(picks, batch.following[:b], batch.first[:b])])


def step_forward(model: CausalLM, batch: StaticBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward and the selection: logits [rows, V] and ``select_rows``' [2, rows]."""
    logits, picks = decode_forward(model, batch)
    return logits, select_rows(logits, picks, batch)


class StaticStep:
    """Runs decoding steps of ``pool``'s sessions at static shapes (the module docstring).

    mode:
        static    the static step run eagerly (no compiler): what the others replay
        compiled  ``torch.compile(fullgraph=True, dynamic=False)``, one graph per (bucket, span)
        graphs    CUDA graphs, one per (bucket, span, filters), captured the first time a shape
                  runs (``warm`` captures the greedy shapes a configuration reaches at start-up)

    The selection (``select_rows``: argmax, device sampling, acceptance) is captured with the
    forward in ``graphs``; ``compiled`` runs it eagerly after the compiled forward: inductor would
    fuse and reorder the float64 softmax and sums, and the draws must be the host path's bits.
    """

    def __init__(self, model: CausalLM, pool: Any, max_rows: int, mode: str = "static",
                 attention: str = "auto") -> None:
        if mode not in ("static", "compiled", "graphs"):
            raise ValueError(f"unknown static step mode {mode!r}")
        if attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {', '.join(ATTENTIONS)}, got {attention!r}")
        if mode == "graphs" and pool.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.model = model
        self.pool = pool
        self.mode = mode
        self.buckets = row_buckets(max_rows)
        self.batch = StaticBatch(pool, self.buckets[-1], model.config.vocab_size)
        self.attention = _attention_for(attention, pool.device, pool.keys[0].shape[-1])
        if self.attention == "triton":
            from card.engine.shared.triton_attention import decode_attention

            self.batch.kernel = decode_attention
        self.max_blocks = _pow2(pool.keys[0].shape[2] // KV_BLOCK)
        self._fn: Callable[[CausalLM, StaticBatch], tuple[torch.Tensor, torch.Tensor]] = decode_forward
        if mode == "compiled":
            _allow_shapes(len(self.buckets) * (self.max_blocks.bit_length()))
            self._fn = torch.compile(decode_forward, fullgraph=True, dynamic=False)
        self._graphs: dict[tuple[int, int, FilterShape | None], tuple[Any, torch.Tensor, torch.Tensor]] = {}

    @property
    def max_rows(self) -> int:
        return self.buckets[-1]

    @torch.inference_mode()
    def run(self, sessions: Sequence[DecodeRows], bucket: int | None = None) -> StepOutput:
        """One step over ``sessions``' rows (in order): their logits, own tokens (argmax, or the
        seeded draw of a row whose session asks for it) and each session's accepted count, rows in
        order. ``bucket``: a larger one than the rows need (the probe, the tests)."""
        rows = sum(len(s.tokens) for s in sessions)
        bucket = max(row_bucket(rows, self.buckets), bucket or 1)
        furthest = max(s.start + len(s.tokens) - 1 for s in sessions)
        # the Triton kernel walks each row's own blocks: one shape (one graph) per bucket
        blocks = span_blocks(furthest, self.max_blocks) if self.attention == "blocks" else 1
        for s in sessions:  # key rows the span reads must be finite (card.engine.shared.kv_pool)
            end = s.start + len(s.tokens)
            self.pool.ready(s.slot, end, min(blocks * KV_BLOCK, self.pool.keys[0].shape[2]))
        live = self.batch.fill(sessions, bucket)
        self.batch.rows, self.batch.blocks = bucket, blocks
        if self.mode == "graphs":
            logits, selected = self._replay(bucket, blocks)
        else:
            logits, picks = self._fn(self.model, self.batch)
            selected = select_rows(logits, picks, self.batch)
        selected = selected[:, :live]
        return StepOutput(logits[:live], selected[0], selected[1], selected)

    def _replay(self, bucket: int, blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        key = (bucket, blocks, self.batch.filters)
        if key not in self._graphs:
            self._graphs[key] = self._capture()
        graph, logits, selected = self._graphs[key]
        graph.replay()
        return logits, selected

    def _capture(self) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """Capture the step at the batch's current shape (its buffers already filled: the warm-up
        runs write only rows the step writes anyway, and ghosts' scratch row)."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up: lazy initialisations happen outside the capture
                step_forward(self.model, self.batch)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: a draft worker on the same GPU keeps launching from its own thread while
        # a shape is captured mid-serving ("global" would make its calls fail the capture)
        with torch.cuda.graph(graph, pool=self._mempool(), capture_error_mode="thread_local"):
            logits, selected = step_forward(self.model, self.batch)
        return graph, logits, selected

    def _mempool(self) -> Any:
        if not hasattr(self, "_pool_handle"):
            self._pool_handle = torch.cuda.graph_pool_handle()
        return self._pool_handle

    def warm(self, max_position: int | None = None) -> int:
        """Run (compile or capture) every (bucket, span) shape up to ``max_position`` (None: the
        pool's rows) on the scratch slot; returns how many shapes."""
        last = (self.pool.keys[0].shape[2] - 1) if max_position is None else max_position
        spans = (sorted({span_blocks(p, self.max_blocks) for p in range(0, last + 1, KV_BLOCK)})
                 if self.attention == "blocks" else [1])  # the Triton kernel: one shape per bucket
        for blocks in spans:
            for bucket in self.buckets:
                self._run_scratch(bucket, blocks)
        return len(spans) * len(self.buckets)

    @torch.inference_mode()
    def _run_scratch(self, bucket: int, blocks: int) -> None:
        self.batch.fill([], bucket)  # all ghosts
        self.batch.rows, self.batch.blocks = bucket, blocks
        if self.mode == "graphs":
            self._replay(bucket, blocks)
        else:
            self._fn(self.model, self.batch)

    @torch.inference_mode()
    def probe(self, positions: Sequence[int] = (3, 70, 200)) -> str | None:
        """Whether every live row's logits, and its seeded draw on the device, are the same bits at
        every bucket, beside other sessions (a greedy one) and ghosts, as the same row decoded
        alone (bucket 1, its earlier rows written by earlier steps); None if so, else what
        differed. Uses free slots of the pool and leaves them free."""
        room = self.pool.keys[0].shape[2]
        positions = [p for p in positions if p + 8 < room] or [1]
        slots: list[int] = []
        try:
            for _ in range(2):
                slot = self.pool.acquire()
                if slot is None:
                    return None if slots else "no free slot to probe with"
                slots.append(slot)
                self.pool.ready(slot, 0, room)  # earlier rows: zeros, not whatever memory held
            gen = torch.Generator().manual_seed(0)
            vocab = self.model.config.vocab_size
            for p in positions:
                tokens = torch.randint(0, vocab, (8,), generator=gen).tolist()
                # plain decoding: one row per step, in order (each row's earlier rows written)
                runs = [self.run([DecodeRows(slots[0], p + j, tokens[j:j + 1], PROBE_SAMPLING)])
                        for j in range(len(tokens))]
                alone = [(r.logits[0].clone(), int(r.picks[0])) for r in runs]
                for bucket in self.buckets:
                    chain = min(bucket, len(tokens))
                    sessions = [DecodeRows(slots[0], p, tokens[:chain], PROBE_SAMPLING)]
                    if bucket > chain and len(slots) > 1:  # a neighbour further on: a longer span
                        other = min(room - 1, p + 3 * KV_BLOCK)
                        sessions.append(DecodeRows(slots[1], other, tokens[:1]))
                    out = self.run(sessions, bucket)
                    picks = out.picks.tolist()
                    for j in range(chain):
                        if not torch.equal(out.logits[j], alone[j][0]):
                            return f"row {j} of a {chain}-row chain at position {p + j} in bucket {bucket}"
                        if picks[j] != alone[j][1]:
                            return (f"the seeded draw of row {j} of a {chain}-row chain at position {p + j} "
                                    f"in bucket {bucket}")
        finally:
            for slot in slots:
                self.pool.release(slot)
        return None


# the probe's sampled rows: every filter on, so each of the device's sampling ops is checked
PROBE_SAMPLING = SamplingParams(temperature=1.0, top_k=40, top_p=0.9, min_p=0.01, seed=1)


def _allow_shapes(count: int) -> None:
    """Let dynamo keep one graph per (bucket, span) of the compiled step (its default keeps 8)."""
    import torch._dynamo

    config = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(config, name) and getattr(config, name) < count:
            setattr(config, name, count)


ROWS_PER_SLOT = 16  # a session's decoding rows the buckets are sized for: [t_next, *chain of <= 15]


def static_step_for(model: CausalLM, pool: Any, mode: str, check: bool = True) -> StaticStep | None:
    """The engine's static step for ``--decode-step`` ``mode``, or None (the eager forward).

    eager     None
    static    the static step, run eagerly
    compiled  the static step through torch.compile
    graphs    the static step as CUDA graphs (CUDA only)
    auto      graphs on CUDA; eager on the CPU, where neither the static step nor inductor pays
              yet (docs/performance.md has the figures)

    The step is probed at start-up (``StaticStep.probe``: every row alone and batched, at every
    bucket, bitwise); where the probe fails the engine keeps the eager forward. Either way one log
    line says which, and why. The probe's verdict is kept on the model (one per mode).
    ``check=False`` (an engine whose outputs are marked inexact, --exact off) skips the probe."""
    if mode not in STEP_MODES:
        raise ValueError(f"decode step must be one of {', '.join(STEP_MODES)}, got {mode!r}")
    if mode == "auto":
        mode = "graphs" if pool.device.type == "cuda" else "eager"
    if mode == "eager":
        return None
    if pool.slots > ROW_BUCKETS[-1]:  # one row each would overflow the largest bucket
        log.warning("decode step: eager; %d KV slots exceed the static step's %d rows", pool.slots,
                    ROW_BUCKETS[-1])
        return None
    step = StaticStep(model, pool, min(ROW_BUCKETS[-1], pool.slots * ROWS_PER_SLOT), mode)
    if not check:
        return step
    verdicts: dict[str, str | None] = model.__dict__.setdefault("_card_static_probe", {})
    if mode not in verdicts:
        try:
            verdicts[mode] = step.probe()
        except Exception as exc:  # a compiler or a capture that fails here: the eager forward serves
            log.exception("the %s static step failed at start-up", mode)
            verdicts[mode] = f"it failed: {type(exc).__name__}: {exc}"
        if verdicts[mode] is None:
            log.info("decode step: %s at static shapes, buckets %s, %s attention (probe passed on %s)",
                     mode, ",".join(map(str, step.buckets)), step.attention, pool.device)
        else:
            log.warning("decode step: eager; the %s static step is not invariant on %s (%s)", mode,
                        pool.device, verdicts[mode])
    return step if verdicts[mode] is None else None
