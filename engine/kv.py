"""KV-cache surgery and forwards with explicit positions, for transformers 5.x DynamicCache.

Keys and values are [batch=1, heads, seq, head_dim] per layer; "slot" below is an index on seq.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache


def new_cache() -> DynamicCache:
    return DynamicCache()


def kv_length(cache: DynamicCache) -> int:
    return int(cache.get_seq_length())


def kv_select(cache: DynamicCache, slots: torch.Tensor) -> None:
    """Keep only the given sequence slots, in the given order."""
    for layer in cache.layers:
        if getattr(layer, "is_initialized", False) and layer.keys is not None and layer.keys.numel():
            idx = slots.to(layer.keys.device)
            layer.keys = layer.keys.index_select(-2, idx)
            layer.values = layer.values.index_select(-2, idx)


def kv_crop(cache: DynamicCache, length: int) -> None:
    """Drop every slot at or after ``length``."""
    extra = kv_length(cache) - length
    if extra > 0:
        cache.crop(-extra)


def tree_mask(
    n_prefix: int, visible: torch.Tensor, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Additive 4-D attention mask [1, 1, Q, n_prefix + S] for a tree forward.

    Every query sees the whole committed prefix; ``visible`` [Q, S] (bool) says which tree slots
    (ancestors and itself) each query sees.
    """
    q = visible.shape[0]
    mask = torch.full((q, n_prefix + visible.shape[1]), torch.finfo(dtype).min, dtype=dtype, device=device)
    mask[:, :n_prefix] = 0
    mask[:, n_prefix:].masked_fill_(visible.to(device), 0)
    return mask[None, None]


@torch.inference_mode()
def forward(
    model: torch.nn.Module,
    cache: DynamicCache,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run ``tokens`` [Q] at ``positions`` [Q] on top of ``cache`` (which grows by Q); logits [Q, V].

    Without ``mask`` the forward is causal over cache + tokens.
    """
    device = model.device
    out = model(
        input_ids=tokens.to(device)[None],
        position_ids=positions.to(device)[None],
        attention_mask=mask,
        past_key_values=cache,
        use_cache=True,
    )
    return out.logits[0]
