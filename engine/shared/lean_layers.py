"""A decoder layer's forward as a short list of tensor ops: the same ops, in the same order, as
transformers' layer, without the Python around them.

Why: on a CPU a decoding step of a small model is a few milliseconds of arithmetic and thousands
of Python calls. Through transformers each layer goes through ``nn.Module.__call__`` about fifteen
times, a kwarg-deprecation decorator, a gradient-checkpointing wrapper, the attention-interface
lookup, config attribute reads and the sibling-slice bookkeeping of the fused projections
(card.engine.loading.fused_linear), each a few microseconds: ~2-3 ms of a 21 ms SmolLM2 step
(docs/performance.md, "The lean layer"). Here a layer is (gpt-fast's shape of it):

    h = input_norm(x); q, k, v = split(qkv(h)); [q_norm, k_norm]; rotary(q, k) (one op on [q | k])
    cache.update(k, v); a = attention(q, k, v); x = x + o_proj(a)
    h = post_norm(x); g, u = split(gate_up(h)); x = x + down(act(g) * u)

Exactness: every op is the one transformers runs on the same values (the norms' and the linears'
own ``forward``, the rotary formula ``q * cos + rotate_half(q) * sin``, the residual adds), so the
bits are the same; only the Python between them goes. The fused projections are read as column
views of their one product instead of contiguous copies: the values are the same and every op
after them is elementwise or copies them; for the same reason q and k, neighbouring columns of the
fused product, take their rotary embedding as one tensor (half the ops; ~5% of a SmolLM2 step).
That is checked, not assumed: ``lean_layers`` runs the first layer both ways on a few rows
(``_same_bits``) and keeps transformers' layers where a bit differs, or where the layer is not of a
known kind (``KNOWN``).

A decoder layer's own hooks (the thread governor's pre-hooks, card.engine.shared.thread_governor)
run before and after it as ``nn.Module.__call__`` would run them.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch

from card.engine.loading.fused_linear import FusedLinears, SiblingSlice
from card.engine.shared.hf import CACHE_KEYWORD, CausalLM

log = logging.getLogger(__name__)

# decoder layers whose forward is the Llama layer's (Qwen3: plus a per-head RMSNorm of q and k
# before the rotary embedding); anything else keeps transformers' forward
KNOWN = frozenset({"LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer"})

Linear = Callable[[torch.Tensor], torch.Tensor]
Attention = Callable[..., tuple[torch.Tensor, Any]]


def _call(module: Any) -> Linear:
    """``module``'s own ``forward``: its arithmetic without ``nn.Module.__call__``'s dispatch (no
    hooks are registered on a layer's parts; the decoder layer's own run in ``LeanLayer``)."""
    return module.forward


def _projections(parent: Any, names: tuple[str, ...]) -> tuple[Linear, tuple[int, ...]] | None:
    """One call computing ``names``' outputs side by side, and their widths: the fused layer where
    ``names`` are the slices of one (fuse_siblings lays them out in this order); None where they
    are separate layers."""
    slices = [getattr(parent, n) for n in names]
    group = getattr(slices[0], "group", None)
    if not isinstance(group, FusedLinears) or not all(
            isinstance(s, SiblingSlice) and s.group is group for s in slices):
        return None
    return _call(group.linear), group.widths


class LeanLayer:
    """One decoder layer's forward (module docstring); ``layer`` keeps its parameters."""

    def __init__(self, layer: Any, attention: Attention) -> None:  # a transformers decoder layer
        attn, mlp = layer.self_attn, layer.mlp
        self.layer = layer
        self.attn = attn
        self.attention = attention
        self.layer_idx: int = attn.layer_idx
        self.head_dim: int = attn.head_dim
        self.scaling: float = attn.scaling
        self.input_norm = _call(layer.input_layernorm)
        self.post_norm = _call(layer.post_attention_layernorm)
        self.q_norm = _call(attn.q_norm) if hasattr(attn, "q_norm") else None
        self.k_norm = _call(attn.k_norm) if hasattr(attn, "k_norm") else None
        self.qkv = _projections(attn, ("q_proj", "k_proj", "v_proj"))
        self.q_proj, self.k_proj, self.v_proj = (_call(attn.q_proj), _call(attn.k_proj), _call(attn.v_proj))
        self.o_proj = _call(attn.o_proj)
        self.gate_up = _projections(mlp, ("gate_proj", "up_proj"))
        self.gate_proj, self.up_proj = _call(mlp.gate_proj), _call(mlp.up_proj)
        self.down_proj = _call(mlp.down_proj)
        self.act = mlp.act_fn

    def __call__(self, hidden: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], cache: Any,
                 **attention_kwargs: Any) -> torch.Tensor:
        layer = self.layer
        for hook in layer._forward_pre_hooks.values():  # the thread governor's checkpoints
            changed = hook(layer, (hidden,))
            if changed is not None:  # nn.Module's rule: a pre-hook may replace the input
                hidden = changed[0] if isinstance(changed, tuple) else changed
        out = self._layer(hidden, rotary, cache, attention_kwargs)
        for post in layer._forward_hooks.values():
            changed = post(layer, (hidden,), out)
            if changed is not None:
                out = changed
        return out

    def _layer(self, hidden: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], cache: Any,
               attention_kwargs: dict[str, Any]) -> torch.Tensor:
        h = self.input_norm(hidden)
        shape = (*hidden.shape[:-1], -1, self.head_dim)
        cos, sin = rotary
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        if self.qkv is not None and self.q_norm is None:
            # q and k are neighbouring columns of the fused product: their rotary embedding as one
            # tensor (elementwise, so every element's bits are the separate ops'), half the ops
            fused, (wq, wk, _) = self.qkv
            out = fused(h)
            qk = out[..., :wq + wk].view(shape).transpose(1, 2)
            qk = qk * cos + _rotate_half(qk) * sin
            heads = wq // self.head_dim
            q, k = qk[:, :heads], qk[:, heads:]
            v = out[..., wq + wk:].view(shape).transpose(1, 2)
        else:
            if self.qkv is not None:
                fused, (wq, wk, _) = self.qkv
                out = fused(h)
                q, k, v = out[..., :wq], out[..., wq:wq + wk], out[..., wq + wk:]
            else:
                q, k, v = self.q_proj(h), self.k_proj(h), self.v_proj(h)
            q, k, v = q.view(shape), k.view(shape), v.view(shape)
            if self.q_norm is not None and self.k_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
        k, v = cache.update(k, v, self.layer_idx)
        attended, _ = self.attention(self.attn, q, k, v, None, scaling=self.scaling, **attention_kwargs)
        hidden = hidden + self.o_proj(attended.reshape(*hidden.shape[:-1], -1).contiguous())
        h = self.post_norm(hidden)
        if self.gate_up is not None:
            fused, (wg, _) = self.gate_up
            out = fused(h)
            g, u = out[..., :wg], out[..., wg:]
        else:
            g, u = self.gate_proj(h), self.up_proj(h)
        return hidden + self.down_proj(self.act(g) * u)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


# per model: its lean layers, or None where transformers' layers run (weak: they leave with it)
_PLANS: weakref.WeakKeyDictionary[CausalLM, list[LeanLayer] | None] = weakref.WeakKeyDictionary()


def lean_layers(model: CausalLM, attention: Attention) -> list[LeanLayer] | None:
    """``model``'s decoder layers as ``LeanLayer``s where that gives transformers' bits, else None
    (decided once per model: the first call checks, later ones reuse the answer). ``attention``
    is the attention function registered for the model (card.engine.shared.kv_pool)."""
    if model in _PLANS:
        return _PLANS[model]
    inner = model.model
    layers = list(inner.layers[: model.config.num_hidden_layers])
    plan: list[LeanLayer] | None = None
    kinds = {type(layer).__name__ for layer in layers}
    if not kinds <= KNOWN:
        log.info("decoder layers through transformers: %s is not a known layer kind",
                 ", ".join(sorted(kinds)))
    else:
        try:
            candidate = [LeanLayer(layer, attention) for layer in layers]
        except AttributeError as exc:  # a known kind with another layout (a newer transformers)
            log.info("decoder layers through transformers: %s", exc)
        else:
            try:
                same = _same_bits(model, candidate[0], attention)
            except Exception as exc:  # the lean forward cannot run this layout (a newer transformers)
                log.warning("decoder layers through transformers: the lean layer failed its check: %r", exc)
            else:
                if same:
                    plan = candidate
                else:
                    log.warning("decoder layers through transformers: the lean layer's bits differ")
    _PLANS[model] = plan
    return plan


class _ProbeCache:
    """A stand-in KV cache and attention for ``_same_bits``: records what the layer writes and
    attends causally over it with SDPA (any function of the inputs would do: both forwards get the
    same one)."""

    static = True  # card.engine.shared.kv_pool._slot_attention: ask ``attend``

    def __init__(self) -> None:
        self.written: list[torch.Tensor] = []

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *_: object,
               **__: object) -> tuple[torch.Tensor, torch.Tensor]:
        self.written += [key.clone(), value.clone()]
        return key, value

    def attend(self, layer: int, query: torch.Tensor, scale: float) -> torch.Tensor:
        key, value = self.written[-2], self.written[-1]
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, is_causal=True, scale=scale, enable_gqa=query.shape[1] != key.shape[1])
        return out.transpose(1, 2)  # [1, T, heads, dim], as the slot attention returns it


@torch.inference_mode()
def _same_bits(model: CausalLM, lean: LeanLayer, attention: Attention) -> bool:
    """Whether ``lean`` gives its layer's output and keys and values bit for bit as transformers'
    forward does, on 1 and 5 rows of random hidden states."""
    inner = model.model
    param = next(lean.layer.parameters())
    gen = torch.Generator().manual_seed(0)
    for rows in (1, 5):
        hidden = torch.randn(1, rows, model.config.hidden_size, generator=gen).to(param.device, param.dtype)
        positions = torch.arange(3, 3 + rows, device=param.device)[None]
        rotary = inner.rotary_emb(hidden, positions)
        theirs, ours = _ProbeCache(), _ProbeCache()
        expected = lean.layer(hidden, position_ids=positions, position_embeddings=rotary,
                              card_batch=theirs, **{CACHE_KEYWORD: theirs})
        got = lean(hidden, rotary, ours, card_batch=ours)
        if not (torch.equal(expected, got) and len(theirs.written) == len(ours.written)
                and all(torch.equal(a, b) for a, b in zip(theirs.written, ours.written, strict=True))):
            return False
    return True
