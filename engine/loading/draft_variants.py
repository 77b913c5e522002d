"""Training-free drafts derived from the target itself.

A layer-truncated copy keeps the first N decoder layers, the final norm and the LM head
("self-speculative" drafting): the residual stream after N layers, read out through the target's
own head, already predicts the target's next token often, at N/L of the per-token cost, and the
tokenizer is the target's by construction. See docs/default-draft.md for the measurements that
chose the default draft.
"""

from __future__ import annotations

import torch

from card.engine.shared.errors import InvalidArgument
from card.engine.shared.hf import CausalLM


def decoder_layers(model: CausalLM) -> torch.nn.ModuleList:
    """The decoder-layer list of a transformers causal LM (Llama, Qwen2, Mistral, ... layouts)."""
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise InvalidArgument(
            f"cannot truncate {type(model).__name__}: it has no model.layers list of decoder layers"
        )
    return layers


def truncate_layers(model: CausalLM, n: int) -> torch.nn.Module:
    """Keep the first ``n`` decoder layers of ``model`` in place (final norm and head stay); returns it.

    The config is updated too, so caches and masks are built for ``n`` layers.
    """
    layers = decoder_layers(model)
    total = len(layers)
    if not 1 <= n <= total:
        raise InvalidArgument(f"layers must be in [1, {total}] for this model, got {n}")
    if n == total:
        return model
    model.model.layers = torch.nn.ModuleList(list(layers)[:n])
    for config in {id(c): c for c in (model.config, getattr(model.model, "config", None)) if c}.values():
        config.num_hidden_layers = n
        layer_types = getattr(config, "layer_types", None)
        if layer_types:  # per-layer attention kinds (sliding / full) must match the kept layers
            config.layer_types = list(layer_types)[:n]
    return model
