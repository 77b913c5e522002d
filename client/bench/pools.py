"""KV pools the lab's measurements start from (client.bench.costs, client.bench.default_draft):
a prefilled prompt, and a layer of siblings laid out as a draft tree lays them."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from card.engine.shared.kv_pool import KVPool, Segment, forward


def prefilled(model: torch.nn.Module, tokens: Sequence[int], room: int) -> KVPool:
    """A pool of one slot holding ``tokens`` with ``room`` rows after them (tools, benchmarks)."""
    pool = KVPool(model, slots=1, max_len=len(tokens) + max(room, 1))
    no_rows = torch.empty(0, dtype=torch.int64)
    forward(model, pool, [Segment(0, 0, len(tokens))], torch.tensor(list(tokens)), no_rows)
    return pool


def siblings(n: int, k: int) -> Segment:
    """``k`` children of the last of ``n`` committed tokens, as a draft tree layer lays them out
    (slot 0): rows n..n+k-1, all at position n, each seeing the prefix and itself."""
    visible = torch.cat([torch.ones(k, n, dtype=torch.bool), torch.eye(k, dtype=torch.bool)], dim=1)
    return Segment(0, n, k, positions=torch.full((k,), n), visible=visible)
