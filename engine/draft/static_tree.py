"""The draft's tree-growth forward at static shapes: every tree row of a round (each session's
frontier, and a cascade's n-gram rows) in one flat batch padded to a bucket, run from preallocated
buffers, so that it can be captured as CUDA graphs once per shape and replayed (the target's
static step, card.engine.shared.static_step, whose buckets, scratch slot, buffers and forward
this reuses).

    rows      the round's tree segments (``Segment.visible`` set), flattened, padded with ghost
              rows up to the next of ROW_BUCKETS. A ghost is token 0 at position 0, written to
              row 0 of the pool's scratch slot and seeing only that row; its logits are ignored
    buffers   tokens, positions, slots, KV rows [max rows] and visibility [max rows, span keys],
              written before each step from host staging; the step reads ``buffer[:bucket]``
    span      every row attends over ``blocks`` KV_BLOCKs (a power of two holding the round's
              furthest row), by the block tree with each row's own mask
              (card.engine.shared.exact_attention.tree_attention)

A tree row sits at a KV row in expansion order (after its session's committed rows), not at its
position: so unlike the target's rows, the KV row and the rotary position are two buffers.

Exactness: a row's logits equal the eager tree forward's (kv_pool.forward, which attends tree
segments with the same block tree) bit for bit, at every bucket: the block tree's result for a row
does not depend on the span or the rows beside it (masked right subtrees combine exactly), and
linears, norms and the LM head are row-wise (made invariant by card.engine.loading.invariant).
tests/engine/test_draft_static_step.py checks it, with a ghost whose write is not redirected as
the negative control. Prefill chunks stay on the eager forward.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from card.engine.shared.exact_attention import KV_BLOCK, pow2_blocks, tree_attention
from card.engine.shared.hf import CausalLM
from card.engine.shared.kv_pool import KVPool, Segment
from card.engine.shared.static_step import (
    ROW_BUCKETS,
    StaticBatch,
    _pow2,
    decode_forward,
    row_bucket,
    row_buckets,
)

log = logging.getLogger(__name__)

DRAFT_STEP_MODES = ("eager", "static", "graphs", "auto")


class TreeBatch(StaticBatch):
    """The target's static batch, plus what a tree row needs: its KV row (``kv_rows``, apart from
    its position) and its mask (``visible`` [max rows, max span keys])."""

    def __init__(self, pool: KVPool, max_rows: int, vocab: int) -> None:
        super().__init__(pool, max_rows, vocab)
        dev = pool.device
        self.max_blocks = _pow2(pool.keys[0].shape[2] // KV_BLOCK)
        self.kv_rows = torch.zeros(max_rows, dtype=torch.int64, device=dev)
        self.visible = torch.zeros(max_rows, self.max_blocks * KV_BLOCK, dtype=torch.bool, device=dev)
        pin = dev.type == "cuda"
        self._tree_host = torch.zeros(4, max_rows, dtype=torch.int64, pin_memory=pin)
        self._seen_host = torch.zeros(max_rows, self.max_blocks * KV_BLOCK, dtype=torch.bool, pin_memory=pin)

    def fill_tree(self, segments: Sequence[Segment], tokens: torch.Tensor, bucket: int, blocks: int) -> int:
        """Write the segments' rows (``tokens`` [sum of lengths], in order), then ghosts up to
        ``bucket``; returns the live row count."""
        host, seen = self._tree_host, self._seen_host
        width = blocks * KV_BLOCK
        n = 0
        seen[:bucket, :width] = False
        for s in segments:
            k = s.length
            assert s.visible is not None and s.positions is not None
            host[1, n:n + k] = s.positions
            host[2, n:n + k] = s.slot
            host[3, n:n + k] = torch.arange(s.start, s.end)
            seen[n:n + k, :s.end] = s.visible
            n += k
        host[0, :n] = tokens
        host[0:4, n:bucket] = 0  # ghosts: token 0 at position 0, row 0 of the scratch slot
        host[2, n:bucket] = self.pool.scratch
        seen[n:bucket, 0] = True  # a ghost sees its own row (finite), so its softmax is too
        staged = host[:, :bucket].to(self.tokens.device, non_blocking=True)
        for buffer, row in zip((self.tokens, self.positions, self.slots, self.kv_rows), staged, strict=True):
            buffer[:bucket].copy_(row)
        self.visible[:bucket, :width].copy_(seen[:bucket, :width], non_blocking=True)
        self.rows, self.blocks = bucket, blocks
        return n

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, cache_kwargs: object = None,
               **_: object) -> tuple[torch.Tensor, torch.Tensor]:
        b = self.rows
        slots, rows = self.slots[:b], self.kv_rows[:b]
        self.pool.keys[layer_idx][slots, :, rows] = key[0].transpose(0, 1)
        self.pool.values[layer_idx][slots, :, rows] = value[0].transpose(0, 1)
        return key, value

    def attend(self, layer: int, query: torch.Tensor, scaling: float) -> torch.Tensor:
        b, width = self.rows, self.blocks * KV_BLOCK
        return tree_attention(query[0], self.pool.keys[layer], self.pool.values[layer], self.slots[:b],
                              self.visible[:b, :width], self.blocks, scaling)[None]


class TreeStep:
    """Runs the tree rows of draft rounds at static shapes (the module docstring).

    mode:
        static  the static step run eagerly (no capture)
        graphs  CUDA graphs, one per (bucket, span), captured the first time a shape runs
    """

    def __init__(self, model: CausalLM, pool: KVPool, max_rows: int, mode: str = "static") -> None:
        if mode not in ("static", "graphs"):
            raise ValueError(f"unknown static draft step mode {mode!r}")
        if mode == "graphs" and pool.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.model = model
        self.pool = pool
        pool.tree_blocks = True  # the eager rounds beside the step attend tree rows as it does
        self.mode = mode
        self.buckets = row_buckets(max_rows)
        self.batch = TreeBatch(pool, self.buckets[-1], model.config.vocab_size)
        self._graphs: dict[tuple[int, int], tuple[Any, torch.Tensor]] = {}
        self.failed: str | None = None  # why the step stopped serving (the eager forward took over)

    @property
    def max_rows(self) -> int:
        return self.buckets[-1]

    def fits(self, segments: Sequence[Segment]) -> bool:
        """Whether a round's tree ``segments`` go through this step (else the eager forward): they
        fit the largest bucket, and the step has not failed (a capture that raised)."""
        return self.failed is None and sum(s.length for s in segments) <= self.max_rows

    @torch.inference_mode()
    def run(self, segments: Sequence[Segment], tokens: torch.Tensor,
            bucket: int | None = None) -> torch.Tensor:
        """The logits [rows, vocab] of the tree ``segments``' rows (``tokens``, in order);
        ``bucket``: a larger one than the rows need (the tests). A view, valid until the next run."""
        rows = sum(s.length for s in segments)
        bucket = max(row_bucket(rows, self.buckets), bucket or 1)
        blocks = min(pow2_blocks(max(s.end for s in segments)), self.batch.max_blocks)
        held = self.pool.keys[0].shape[2]
        for s in segments:
            self.pool.written(s.slot, s.start, s.end)
            self.pool.ready(s.slot, s.end, min(blocks * KV_BLOCK, held))  # span rows read masked: finite
        live = self.batch.fill_tree(segments, tokens, bucket, blocks)
        if self.mode == "graphs":
            logits = self._replay(bucket, blocks)
        else:
            logits, _ = decode_forward(self.model, self.batch)
        return logits[:live]

    def _replay(self, bucket: int, blocks: int) -> torch.Tensor:
        key = (bucket, blocks)
        if key not in self._graphs:
            self._graphs[key] = self._capture()
        graph, logits = self._graphs[key]
        graph.replay()
        return logits

    def _capture(self) -> tuple[Any, torch.Tensor]:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # lazy initialisations outside the capture
                decode_forward(self.model, self.batch)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if not hasattr(self, "_pool_handle"):
            self._pool_handle = torch.cuda.graph_pool_handle()
        # thread_local: a target on the same GPU keeps launching from its own thread
        with torch.cuda.graph(graph, pool=self._pool_handle, capture_error_mode="thread_local"):
            logits, _ = decode_forward(self.model, self.batch)
        return graph, logits


def tree_step_for(model: CausalLM | None, pool: KVPool | None, mode: str,
                  rows_per_session: int) -> TreeStep | None:
    """The draft worker's static tree step for ``--decode-step`` ``mode``, or None (the eager
    forward): eager -> None; static; graphs (CUDA only); auto -> graphs on CUDA, eager on the CPU
    (where the static step does not pay, docs/performance.md). One log line says which."""
    if mode not in DRAFT_STEP_MODES:
        raise ValueError(f"decode step must be one of {', '.join(DRAFT_STEP_MODES)}, got {mode!r}")
    if model is None or pool is None:
        return None  # model-free: no forward
    if mode == "auto":
        mode = "graphs" if pool.device.type == "cuda" else "eager"
    if mode == "eager":
        log.info("draft step: eager tree forward")
        return None
    max_rows = min(ROW_BUCKETS[-1], pool.slots * rows_per_session)
    step = TreeStep(model, pool, max_rows, mode)  # graphs without CUDA: refused (ValueError)
    log.info("draft step: %s at static shapes, buckets %s", mode, ",".join(map(str, step.buckets)))
    return step
