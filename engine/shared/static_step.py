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
    output    the logits of every row [bucket, vocab] and their argmax [bucket], on the device; the
              host reads the argmax (one small tensor) and the logits rows it needs

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

import torch

from card.engine.shared.exact_attention import KV_BLOCK
from card.engine.shared.hf import CausalLM

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
    """One session's decoding rows: ``tokens`` written at rows (= positions) ``start...`` of
    ``slot``."""

    slot: int
    start: int
    tokens: Sequence[int]


@dataclass(frozen=True)
class StepOutput:
    """What a step leaves on the device: ``logits`` [live rows, vocab], ``picks`` [live rows]
    (their argmax). Views into the step's output, valid until the next step."""

    logits: torch.Tensor
    picks: torch.Tensor


class StaticBatch:
    """The buffers one static step reads, and its attention. Handed to every decoder layer as
    ``past_key_values`` (``update`` writes the rows' keys and values by index) and as
    ``card_batch`` (card.engine.shared.kv_pool dispatches attention to ``attend``)."""

    static = True

    def __init__(self, pool: Any, max_rows: int) -> None:
        dev = pool.device
        self.pool = pool
        self.max_rows = max_rows
        self.tokens = torch.zeros(max_rows, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(max_rows, dtype=torch.int64, device=dev)
        pool.zero_scratch()
        self.slots = torch.full((max_rows,), pool.scratch, dtype=torch.int64, device=dev)
        # host staging: one copy per step; pinned where the device is a GPU (an async copy)
        pin = dev.type == "cuda"
        self._host = torch.zeros(3, max_rows, dtype=torch.int64, pin_memory=pin)
        self.rows = 0  # the bucket of the step being run (set by StaticStep)
        self.blocks = 1
        # the Triton decoding attention (StaticStep's ``attention``), or None: the block tree
        self.kernel: Callable[..., torch.Tensor] | None = None

    def fill(self, sessions: Sequence[DecodeRows], bucket: int) -> int:
        """Write the sessions' rows, then ghosts up to ``bucket``, into the buffers; returns the
        live row count."""
        host = self._host
        n = 0
        for s in sessions:
            k = len(s.tokens)
            host[0, n:n + k] = torch.as_tensor(s.tokens, dtype=torch.int64)
            host[1, n:n + k] = torch.arange(s.start, s.start + k)
            host[2, n:n + k] = s.slot
            n += k
        host[0, n:bucket] = 0  # ghosts: token 0 at position 0 of the scratch slot
        host[1, n:bucket] = 0
        host[2, n:bucket] = self.pool.scratch
        staged = host[:, :bucket].to(self.tokens.device, non_blocking=True)
        self.tokens[:bucket].copy_(staged[0])
        self.positions[:bucket].copy_(staged[1])
        self.slots[:bucket].copy_(staged[2])
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
    position must be written and every key row read must be finite (0 * NaN is NaN)."""
    heads, R, dim = query.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    real = min(blocks, keys.shape[2] // KV_BLOCK)
    k = keys[:, :, :real * KV_BLOCK].index_select(0, slots).view(R, kv_heads, real, KV_BLOCK, dim)
    v = values[:, :, :real * KV_BLOCK].index_select(0, slots).view(R, kv_heads, real, KV_BLOCK, dim)
    # heads h = kv * group + g (transformers' repeat_kv order): the group rides in M
    q = query.transpose(0, 1).reshape(R, kv_heads, 1, group, dim)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scaling  # [R, kvh, real, group, 64]
    cols = torch.arange(real * KV_BLOCK, device=keys.device).view(1, 1, real, 1, KV_BLOCK)
    scores = scores.masked_fill(cols > positions.view(R, 1, 1, 1, 1), float("-inf"))
    m = scores.amax(dim=-1)  # [R, kvh, real, group]; -inf for a block the row does not reach
    p = torch.exp(scores - _finite(m)[..., None])
    lsum = p.sum(dim=-1)
    acc = torch.matmul(p.to(v.dtype), v).float()  # [R, kvh, real, group, dim]
    if real < blocks:  # the blocks past the pool: masked, the neutral element of the combine
        pad = blocks - real
        m = torch.cat([m, m.new_full((R, kv_heads, pad, group), float("-inf"))], dim=2)
        lsum = torch.cat([lsum, lsum.new_zeros(R, kv_heads, pad, group)], dim=2)
        acc = torch.cat([acc, acc.new_zeros(R, kv_heads, pad, group, dim)], dim=2)
    n = blocks
    while n > 1:  # the fixed tree: block pairs (0,1), (2,3), ... then their pairs
        n //= 2
        m2 = m.view(R, kv_heads, n, 2, group)
        l2 = lsum.view(R, kv_heads, n, 2, group)
        a2 = acc.view(R, kv_heads, n, 2, group, dim)
        m = torch.maximum(m2[:, :, :, 0], m2[:, :, :, 1])
        base = _finite(m)
        w0 = torch.exp(m2[:, :, :, 0] - base)
        w1 = torch.exp(m2[:, :, :, 1] - base)
        lsum = l2[:, :, :, 0] * w0 + l2[:, :, :, 1] * w1
        acc = a2[:, :, :, 0] * w0[..., None] + a2[:, :, :, 1] * w1[..., None]
    out = acc[:, :, 0] / lsum[:, :, 0, :, None]  # [R, kvh, group, dim]
    return out.to(query.dtype).reshape(R, heads, dim)


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


def _finite(m: torch.Tensor) -> torch.Tensor:
    """A block maximum to subtract: -inf (nothing visible) becomes 0, so exp(-inf - 0) = 0."""
    return torch.where(torch.isinf(m), torch.zeros_like(m), m)


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
        hidden = layer(hidden, position_ids=positions, past_key_values=batch, position_embeddings=rotary,
                       card_batch=batch)
    logits = model.lm_head(inner.norm(hidden))[0]
    return logits, torch.argmax(logits, dim=-1)


class StaticStep:
    """Runs decoding steps of ``pool``'s sessions at static shapes (the module docstring).

    mode:
        static    the static step run eagerly (no compiler): what the others replay
        compiled  ``torch.compile(fullgraph=True, dynamic=False)``, one graph per (bucket, span)
        graphs    CUDA graphs, one per (bucket, span), captured the first time a shape runs
                  (``warm`` captures the shapes a configuration reaches at start-up)
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
        self.batch = StaticBatch(pool, self.buckets[-1])
        self.attention = _attention_for(attention, pool.device, pool.keys[0].shape[-1])
        if self.attention == "triton":
            from card.engine.shared.triton_attention import decode_attention

            self.batch.kernel = decode_attention
        self.max_blocks = _pow2(pool.keys[0].shape[2] // KV_BLOCK)
        self._fn: Callable[[CausalLM, StaticBatch], tuple[torch.Tensor, torch.Tensor]] = decode_forward
        if mode == "compiled":
            _allow_shapes(len(self.buckets) * (self.max_blocks.bit_length()))
            self._fn = torch.compile(decode_forward, fullgraph=True, dynamic=False)
        self._graphs: dict[tuple[int, int], tuple[Any, torch.Tensor, torch.Tensor]] = {}

    @property
    def max_rows(self) -> int:
        return self.buckets[-1]

    @torch.inference_mode()
    def run(self, sessions: Sequence[DecodeRows], bucket: int | None = None) -> StepOutput:
        """One step over ``sessions``' rows (in order): their logits and argmax, rows in order.
        ``bucket``: a larger one than the rows need (the probe, the tests)."""
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
            logits, picks = self._replay(bucket, blocks)
        else:
            logits, picks = self._fn(self.model, self.batch)
        return StepOutput(logits[:live], picks[:live])

    def _replay(self, bucket: int, blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        key = (bucket, blocks)
        if key not in self._graphs:
            self._graphs[key] = self._capture()
        graph, logits, picks = self._graphs[key]
        graph.replay()
        return logits, picks

    def _capture(self) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """Capture the step at the batch's current shape (its buffers already filled: the warm-up
        runs write only rows the step writes anyway, and ghosts' scratch row)."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up: lazy initialisations happen outside the capture
                decode_forward(self.model, self.batch)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: a draft worker on the same GPU keeps launching from its own thread while
        # a shape is captured mid-serving ("global" would make its calls fail the capture)
        with torch.cuda.graph(graph, pool=self._mempool(), capture_error_mode="thread_local"):
            logits, picks = decode_forward(self.model, self.batch)
        return graph, logits, picks

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
        """Whether every live row's logits are the same bits at every bucket, beside other
        sessions and ghosts, as the same row decoded alone (bucket 1, its earlier rows written
        by earlier steps); None if so, else what differed. Uses free slots of the pool and
        leaves them free."""
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
                alone = [self.run([DecodeRows(slots[0], p + j, tokens[j:j + 1])]).logits[0].clone()
                         for j in range(len(tokens))]
                for bucket in self.buckets:
                    chain = min(bucket, len(tokens))
                    sessions = [DecodeRows(slots[0], p, tokens[:chain])]
                    if bucket > chain and len(slots) > 1:  # a neighbour further on: a longer span
                        other = min(room - 1, p + 3 * KV_BLOCK)
                        sessions.append(DecodeRows(slots[1], other, tokens[:1]))
                    out = self.run(sessions, bucket)
                    for j in range(chain):
                        if not torch.equal(out.logits[j], alone[j]):
                            return f"row {j} of a {chain}-row chain at position {p + j} in bucket {bucket}"
        finally:
            for slot in slots:
                self.pool.release(slot)
        return None


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
