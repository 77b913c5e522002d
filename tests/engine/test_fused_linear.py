"""Sibling linears fused into one packed product (card.engine.loading.fused_linear): the model's
bits do not change, a fused product that would change them is kept apart, and the shared output
is right whatever order, input or thread the siblings are called with."""

from __future__ import annotations

import copy
import threading

import pytest
import torch

from card.engine.loading.cpu_linear import PackedLinear, pack_linears
from card.engine.loading.fused_linear import FusedLinears, SiblingSlice, _same_bits, fuse_siblings
from card.engine.loading.invariant import make_exact
from tests.tiny_models import tiny_model

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch without oneDNN")


def packed(model: torch.nn.Module, fuse: bool) -> torch.nn.Module:
    model = copy.deepcopy(model)
    if fuse:
        fuse_siblings(model, PackedLinear)
    pack_linears(model)
    return model


@pytest.mark.parametrize("kind", ["llama", "qwen2"])  # qwen2: q, k and v carry biases
@torch.inference_mode()
def test_a_fused_model_gives_the_unfused_bits_at_every_row_count(kind: str) -> None:
    base = tiny_model(kind, layers=3, dtype=torch.float32)
    apart, fused = packed(base, fuse=False), packed(base, fuse=True)
    assert sum(isinstance(m, FusedLinears) for m in fused.modules()) == 6  # qkv and gate/up, 3 layers
    assert not any(isinstance(m, FusedLinears) for m in apart.modules())
    ids = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(0))
    for rows in (1, 2, 5, 40):
        assert torch.equal(fused(input_ids=ids[:, :rows]).logits, apart(input_ids=ids[:, :rows]).logits), rows


@torch.inference_mode()
def test_a_fused_product_whose_bits_differ_is_kept_apart() -> None:
    """Negative control of the check: a fused layer one ulp off in one column fails it, and
    fuse_siblings then leaves the siblings as they were (the model's outputs unchanged)."""
    torch.manual_seed(0)
    parts = [torch.nn.Linear(32, n, bias=False) for n in (32, 16, 16)]
    whole = torch.nn.Linear(32, 64, bias=False)
    whole.weight.copy_(torch.cat([p.weight for p in parts]))
    assert _same_bits(PackedLinear(whole), [PackedLinear(p) for p in parts])
    whole.weight[40, 3] = torch.nextafter(whole.weight[40, 3], torch.tensor(1.0))
    assert not _same_bits(PackedLinear(whole), [PackedLinear(p) for p in parts])

    base = tiny_model("llama", layers=2, hidden=32, dtype=torch.float32)
    model = copy.deepcopy(base)
    own = {id(m) for m in model.modules()}

    def off_by_an_ulp(linear: torch.nn.Linear) -> PackedLinear:
        if id(linear) not in own and linear.out_features == 64:  # the fused q/k/v (32 + 16 + 16)
            linear.weight[40, 3] = torch.nextafter(linear.weight[40, 3], torch.tensor(1.0))
        return PackedLinear(linear)

    assert fuse_siblings(model, off_by_an_ulp) == 2  # gate/up (2 x 64 columns = 128) only
    assert all(type(m.self_attn.q_proj) is torch.nn.Linear for m in model.model.layers)
    assert all(isinstance(m.mlp.gate_proj, SiblingSlice) for m in model.model.layers)
    pack_linears(model)
    ids = torch.randint(0, 97, (1, 9), generator=torch.Generator().manual_seed(1))
    assert torch.equal(model(input_ids=ids).logits, packed(base, fuse=False)(input_ids=ids).logits)


@torch.inference_mode()
def test_siblings_give_their_columns_whatever_order_input_or_thread() -> None:
    torch.manual_seed(0)
    parts = [torch.nn.Linear(24, n, bias=True) for n in (24, 8, 8)]
    holder = torch.nn.Module()
    for name, layer in zip(("q_proj", "k_proj", "v_proj"), parts, strict=True):
        setattr(holder, name, layer)
    want = [PackedLinear(p) for p in parts]
    assert fuse_siblings(holder, PackedLinear) == 1
    group: FusedLinears = holder.qkv_proj
    x, y = torch.randn(5, 24), torch.randn(3, 24)
    # the usual order: one fused call, dropped after the last sibling
    runs = []
    group.linear.register_forward_hook(lambda *_: runs.append(1))
    assert torch.equal(holder.q_proj(x), want[0](x)) and torch.equal(holder.k_proj(x), want[1](x))
    assert torch.equal(holder.v_proj(x), want[2](x))
    assert len(runs) == 1 and group._local.held is None
    # another input between siblings, another order: computed afresh, never another input's columns
    assert torch.equal(holder.q_proj(x), want[0](x))
    assert torch.equal(holder.k_proj(y), want[1](y))
    assert torch.equal(holder.v_proj(x), want[2](x))  # y's output was held: x is computed again
    assert torch.equal(holder.k_proj(x), want[1](x))  # v dropped what it held
    assert len(runs) == 5
    # two threads calling the siblings interleaved: each gets its own input's columns
    barrier, results = threading.Barrier(2), {}

    def worker(name: str, inp: torch.Tensor) -> None:
        with torch.inference_mode():
            q = holder.q_proj(inp)
            barrier.wait()  # both threads hold an output now
            results[name] = (q, holder.k_proj(inp), holder.v_proj(inp))

    threads = [threading.Thread(target=worker, args=(n, t)) for n, t in (("x", x), ("y", y))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for name, inp in (("x", x), ("y", y)):
        assert all(torch.equal(got, w(inp)) for got, w in zip(results[name], want, strict=True)), name


def test_make_exact_fuses_where_it_packs_and_says_so() -> None:
    model = tiny_model("qwen2", layers=2, dtype=torch.float32)
    how = make_exact(model, exact=True)
    assert "4 sibling groups fused" in how, how
    assert sum(isinstance(m, FusedLinears) for m in model.modules()) == 4
    model64 = tiny_model("qwen2", layers=2, dtype=torch.float64)  # not packed: not fused
    make_exact(model64, exact=True)
    assert not any(isinstance(m, FusedLinears) for m in model64.modules())
