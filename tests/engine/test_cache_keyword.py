"""The keyword the engine hands a decoder layer its KV cache by (card.engine.shared.hf.CACHE_KEYWORD)
is the installed transformers' own. transformers 5.2x renamed the layers' ``past_key_values`` to
``cache`` and drops the old name in 5.40 (pyproject allows < 6): passed under the old name, a layer
would then swallow the cache in its ``**kwargs`` and attend without writing a key, so every forward
that runs transformers' layers (the static step, the lean layer's check, the fallback) would decode
wrong text. The layer must write through the keyword, without a deprecation warning."""

from __future__ import annotations

import warnings

import pytest
import torch

from card.engine.shared import hf
from card.engine.shared.kv_pool import KVPool, Segment, enable, forward
from card.engine.shared.lean_layers import _PLANS, _ProbeCache
from tests.tiny_models import tiny_model


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_a_layer_writes_its_keys_through_the_keyword_without_a_warning(kind: str) -> None:
    model = tiny_model(kind, layers=1, dtype=torch.float32)
    enable(model)
    layer = model.model.layers[0]
    hidden = torch.randn(1, 3, model.config.hidden_size)
    positions = torch.arange(3)[None]
    rotary = model.model.rotary_emb(hidden, positions)
    probe = _ProbeCache()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a deprecated keyword warns (FutureWarning) before it goes
        layer(hidden, position_ids=positions, position_embeddings=rotary, card_batch=probe,
              **{hf.CACHE_KEYWORD: probe})
    assert len(probe.written) == 2  # its keys and values, written through our cache
    if hf.CACHE_KEYWORD == "cache":  # control: the old name is the deprecated one here
        with warnings.catch_warnings(), pytest.raises(FutureWarning):
            warnings.simplefilter("error")
            layer(hidden, position_ids=positions, position_embeddings=rotary, card_batch=probe,
                  past_key_values=probe)


def test_the_keyword_follows_the_layers_signature() -> None:
    class Old(torch.nn.Module):
        def forward(self, hidden: torch.Tensor, past_key_values: object = None, **kwargs: object) -> None:
            pass

    class New(torch.nn.Module):
        def forward(self, hidden: torch.Tensor, cache: object = None, **kwargs: object) -> None:
            pass

    assert hf.cache_keyword(Old) == "past_key_values"
    assert hf.cache_keyword(New) == "cache"
    installed = hf.cache_keyword(type(tiny_model("qwen3", layers=1).model.layers[0]))
    assert installed == hf.CACHE_KEYWORD


def test_transformers_layers_decode_as_the_lean_layers_do() -> None:
    """The fallback (transformers' own layers, where the lean layer's check fails) writes the slot
    through the keyword: its logits equal the lean layers' bit for bit over a prompt and a step."""
    model = tiny_model("llama", layers=2, dtype=torch.float32)
    outs = []
    for plan in ("lean", None):
        _PLANS.pop(model, None)
        if plan is None:
            _PLANS[model] = None
        pool = KVPool(model, slots=1, max_len=64)
        first = forward(model, pool, [Segment(0, 0, 7, exact=True, prefill=True)], torch.arange(7),
                        torch.tensor([6]))
        step = forward(model, pool, [Segment(0, 7, 1, exact=True)], torch.tensor([3]), torch.tensor([0]))
        outs.append((first, step))
    _PLANS.pop(model, None)
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
