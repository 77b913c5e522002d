"""The lean decoder layer (card.engine.shared.lean_layers): a forward through it writes the same keys
and values and gives the same logits, bit for bit, as transformers' layers, for every layer kind it
takes, packed or not, prompt rows, decoding rows, several sessions and a draft's tree rows; the
check that guards it fails where the bits differ; unknown layer kinds keep transformers' layers;
the thread governor's pre-hooks still run before each layer."""

from __future__ import annotations

import copy

import pytest
import torch

from card.engine.loading.invariant import make_exact
from card.engine.shared import lean_layers
from card.engine.shared.kv_pool import KVPool, Segment, _slot_attention, forward
from tests.tiny_models import tiny_model


def _plan(model: torch.nn.Module) -> list[lean_layers.LeanLayer] | None:
    lean_layers._PLANS.pop(model, None)
    return lean_layers.lean_layers(model, _slot_attention)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("exact", [False, True])
def test_lean_layers_give_transformers_bits(kind: str, dtype: torch.dtype, exact: bool) -> None:
    model = tiny_model(kind, layers=3, dtype=dtype)
    if exact:  # packed, fused q/k/v and gate/up where the CPU packs this dtype, probed tiles elsewhere
        make_exact(model)
    plan = _plan(model)
    assert plan is not None and len(plan) == 3
    if exact and dtype == torch.float32:  # fused q/k/v and gate/up: read as one product's columns
        assert plan[0].qkv is not None and plan[0].gate_up is not None
    theirs = _forwards_with(model, None)
    ours = _forwards_with(model, plan)
    assert len(theirs) == len(ours)
    for i, (x, y) in enumerate(zip(theirs, ours, strict=True)):
        assert torch.equal(x, y), i


def _forwards_with(model: torch.nn.Module, plan: list[lean_layers.LeanLayer] | None) -> list[torch.Tensor]:
    lean_layers._PLANS[model] = plan
    try:
        pool = KVPool(model, slots=3, max_len=128)
        gen = torch.Generator().manual_seed(3)
        a, b = torch.randint(0, 97, (70,), generator=gen), torch.randint(0, 97, (9,), generator=gen)
        outs = [forward(model, pool, [Segment(0, 0, 70, exact=True, prefill=True), Segment(1, 0, 9)],
                        torch.cat([a, b]), torch.tensor([69, 78]))]
        step = torch.randint(0, 97, (5,), generator=gen)
        outs.append(forward(model, pool, [Segment(0, 70, 1, exact=True), Segment(1, 9, 4, exact=True)], step,
                            torch.arange(5)))
        visible = torch.ones(3, 16, dtype=torch.bool).tril(diagonal=13)
        visible[2, 14] = False  # a sibling's row, not an ancestor's
        forward(model, pool, [Segment(2, 0, 13)], torch.arange(13), torch.empty(0, dtype=torch.int64))
        outs.append(forward(model, pool, [Segment(2, 13, 3, visible=visible)], torch.tensor([5, 6, 7]),
                            torch.arange(3)))
        written = [(0, 71), (1, 13), (2, 16)]  # (slot, rows): the rest of the pool is never written
        return outs + [t[slot, :, :rows].clone() for t in (*pool.keys, *pool.values)
                       for slot, rows in written]
    finally:
        lean_layers._PLANS.pop(model, None)


def test_the_check_refuses_a_lean_layer_whose_bits_differ(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: a lean layer whose rotary embedding is an ulp off (the rotation's cosine
    scaled by 1 + 2^-20) fails the check, and the model keeps transformers' layers."""
    model = tiny_model("llama", layers=2, dtype=torch.float32)
    assert _plan(model) is not None
    call = lean_layers.LeanLayer.__call__

    def off(self: lean_layers.LeanLayer, hidden: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor],
            cache: object, **kwargs: object) -> torch.Tensor:
        cos, sin = rotary
        return call(self, hidden, (cos * (1 + 2 ** -20), sin), cache, **kwargs)

    monkeypatch.setattr(lean_layers.LeanLayer, "__call__", off)
    assert _plan(model) is None


def test_a_lean_layer_that_fails_its_check_keeps_transformers_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    """A layout the lean forward cannot run (a newer transformers' shapes: here it raises) keeps
    transformers' layers, decided once, and the model decodes, rather than every forward failing."""
    model = tiny_model("llama", layers=2, dtype=torch.float32)

    def broken(self: lean_layers.LeanLayer, *args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError("shape mismatch")

    monkeypatch.setattr(lean_layers.LeanLayer, "__call__", broken)
    assert _plan(model) is None and model in lean_layers._PLANS
    pool = KVPool(model, slots=1, max_len=64)
    logits = forward(model, pool, [Segment(0, 0, 5)], torch.arange(5), torch.tensor([4]))
    assert logits.shape == (1, 97)
    lean_layers._PLANS.pop(model, None)


def test_an_unknown_layer_kind_keeps_transformers_layers() -> None:
    """A layer class the lean layer does not know (here a Llama layer under another name, as a
    fine-tune's remote code would ship it) runs through transformers, and gives the same logits."""
    model = tiny_model("llama", layers=2, dtype=torch.float32)
    other = copy.deepcopy(model)
    renamed = type("CustomDecoderLayer", (type(other.model.layers[0]),), {})
    for layer in other.model.layers:
        layer.__class__ = renamed
    assert _plan(model) is not None and _plan(other) is None
    outs = []
    for m in (model, other):
        pool = KVPool(m, slots=1, max_len=64)
        outs.append(forward(m, pool, [Segment(0, 0, 5)], torch.arange(5), torch.tensor([4])))
    assert torch.equal(outs[0], outs[1])


def test_the_layers_pre_hooks_run_before_each_layer() -> None:
    """The thread governor checks the cores before each decoder layer through a forward pre-hook
    (card.engine.shared.thread_governor): the lean path runs them too, once a layer, in order."""
    model = tiny_model("llama", layers=3, dtype=torch.float32)
    assert _plan(model) is not None
    seen: list[int] = []
    for i, layer in enumerate(model.model.layers):
        layer.register_forward_pre_hook(lambda *_, i=i: seen.append(i))
    pool = KVPool(model, slots=1, max_len=64)
    forward(model, pool, [Segment(0, 0, 4)], torch.arange(4), torch.tensor([3]))
    assert seen == [0, 1, 2]
    lean_layers._PLANS.pop(model, None)


def test_a_copy_of_a_model_gets_its_own_plan() -> None:
    """Plans are per model object: a deep copy (another draft variant of the same weights) checks
    and runs its own layers, never the original's."""
    model = tiny_model("llama", layers=2, dtype=torch.float32)
    twin = copy.deepcopy(model)
    plan, twin_plan = _plan(model), _plan(twin)
    assert plan is not None and twin_plan is not None
    assert plan[0].layer is model.model.layers[0] and twin_plan[0].layer is twin.model.layers[0]


def test_a_family_whose_model_forward_does_more_is_refused() -> None:
    """Gemma scales its embeddings by sqrt(hidden) in its model forward, which the engine's own
    forward (embedding, layers, norm, LM head) would skip: every token would be wrong. Refused at
    the edge instead, with the families that are supported."""
    from transformers import GemmaConfig, GemmaForCausalLM

    from card.engine.shared.errors import FailedPrecondition

    torch.manual_seed(0)
    config = GemmaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    model = GemmaForCausalLM(config).eval()
    with pytest.raises(FailedPrecondition, match=r"\(model_type 'gemma'\) is not a supported architecture"):
        KVPool(model, slots=1, max_len=64)
