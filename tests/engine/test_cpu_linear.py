"""oneDNN-prepacked Linear layers (card.engine.loading.cpu_linear): same numbers as nn.Linear, batch- and
thread-invariant, applied by load_model exactly where it should be, and exact end to end."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from card.engine.inprocess.sources import SyncDraft
from card.engine.loading.cpu_linear import PackedLinear, can_pack, pack_linears
from card.engine.loading.models import ModelConfig, load_model
from card.engine.shared.config import TreeParams
from card.engine.target.chain_source import NoDraft
from tests.engine.support import card_source, generate, prompt_cases
from tests.tiny_models import save_tiny_checkpoint, sharpened, tiny_model

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch without oneDNN")


def packed_layer(n_in: int, n_out: int, bias: bool, seed: int = 0) -> tuple[torch.nn.Linear, PackedLinear]:
    torch.manual_seed(seed)
    dense = torch.nn.Linear(n_in, n_out, bias=bias).eval()
    return dense, PackedLinear(dense)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 96), (7, 96), (2, 5, 96)])
@torch.inference_mode()
def test_packed_layer_computes_the_linear_map(bias: bool, shape: tuple[int, ...]) -> None:
    dense, packed = packed_layer(96, 200, bias)
    x = torch.randn(*shape)
    got = packed(x)
    assert got.shape == (*shape[:-1], 200)
    torch.testing.assert_close(got, F.linear(x, dense.weight, dense.bias), rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_packed_rows_do_not_depend_on_the_batch_or_the_threads() -> None:
    """The property that makes a verify of 1 + L tokens give the logits of L + 1 single steps."""
    _, packed = packed_layer(256, 512, bias=True, seed=1)
    x = torch.randn(8, 256)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        together = packed(x)
        alone = torch.cat([packed(x[i:i + 1]) for i in range(8)])
        torch.set_num_threads(2)
        two_threads = packed(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(together, alone)
    assert torch.equal(together, two_threads)


def test_only_fp32_cpu_models_are_packable() -> None:
    assert can_pack(tiny_model(dtype=torch.float32))
    assert not can_pack(tiny_model(dtype=torch.float64))
    assert not can_pack(torch.nn.Sequential(torch.nn.ReLU()))  # nothing to pack


@torch.inference_mode()
def test_a_packed_model_gives_the_same_logits() -> None:
    model = tiny_model("qwen2", dtype=torch.float32)
    ids = torch.tensor([[5, 17, 3, 88, 41, 9]])
    want = model(input_ids=ids).logits
    n_linear = sum(type(m) is torch.nn.Linear for m in model.modules())
    assert pack_linears(model) == n_linear
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    torch.testing.assert_close(model(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("config", "packed"), [
    ({}, True),
    ({"prepack": False}, False),
    ({"quantize": "int8"}, False),
    ({"dtype": "float64"}, False),
])
def test_load_model_prepacks_fp32_cpu_models_by_default(tmp_path, config: dict, packed: bool) -> None:
    folder = save_tiny_checkpoint(tmp_path / "tiny")
    loaded = load_model(ModelConfig(spec=str(folder), device="cpu", **config))
    assert any(isinstance(m, PackedLinear) for m in loaded.model.modules()) is packed


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_card_and_sd_equal_vanilla_on_packed_fp32_models(kind: str) -> None:
    """Greedy exactness with the CPU serving path: fp32 weights, packed target and draft."""
    target = pack_sharp(tiny_model(kind, seed=0, vocab=97, dtype=torch.float32))
    draft = pack_sharp(tiny_model(kind, seed=0, vocab=97, perturb=0.02, dtype=torch.float32))
    for prompt, budget in prompt_cases(6, seed=7, max_new=40):
        want = generate(target, NoDraft(), prompt, max_new_tokens=budget).tokens
        assert generate(target, SyncDraft(draft, gamma=3), prompt, max_new_tokens=budget).tokens == want
        with card_source(draft, TreeParams(width=2, branch=3, max_depth=6, max_chain=5)) as card:
            assert generate(target, card, prompt, max_new_tokens=budget).tokens == want


def pack_sharp(model: torch.nn.Module) -> torch.nn.Module:
    model = sharpened(model)
    pack_linears(model)
    return model


@torch.inference_mode()
def test_the_traced_op_runs_the_layer_and_its_registry_lets_layers_go() -> None:
    """``card::packed_linear`` (what a compiled step calls for a packed layer) gives the layer's
    own bits, and the key registry holds no layer alive: a dropped model's weights are freed."""
    import gc

    from card.engine.loading import cpu_linear

    _, layer = packed_layer(48, 24, bias=True)
    x = torch.randn(3, 48)
    assert torch.equal(torch.ops.card.packed_linear(x, layer.key), layer(x))
    key = layer.key
    assert cpu_linear._LAYERS[key] is layer
    del layer
    gc.collect()
    assert key not in cpu_linear._LAYERS
