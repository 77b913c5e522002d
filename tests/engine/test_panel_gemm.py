"""The panel kernel (card.engine.loading.panel_gemm): built here with the system compiler, every
row the bits of that row alone at any row and thread count, its AVX-512 build the AVX2 build's
bits, and a model on it exact (many requests in flight on it: tests/engine/test_invariance.py,
test_many_in_flight_equal_alone)."""

from __future__ import annotations

import pytest
import torch

from card.engine.loading import c_kernels, panel_gemm
from card.engine.loading.cpu_linear import PackedLinear
from card.engine.loading.invariant import FixedTiles, RowChunks, make_exact, probe
from card.engine.loading.models import ModelConfig
from card.engine.shared.errors import InvalidArgument
from tests.engine.support import chain_logits_equal_steps
from tests.tiny_models import sharpened, tiny_model

VOCAB = 512
ROW_COUNTS = (1, 2, 3, 5, 6, 7, 8, 9, 13, 47, 48, 49, 97, 300)


def _rows_as_alone(linear, x: torch.Tensor) -> bool:
    """Whether every row of ``linear`` over the first m rows of ``x`` is that row's bits in the
    full product, for every count of ROW_COUNTS and on 1 and 2 threads."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        full = linear(x)
        for count in (1, 2):
            torch.set_num_threads(count)
            for m in ROW_COUNTS:
                if not torch.equal(linear(x[:m]), full[:m]):
                    return False
        return True
    finally:
        torch.set_num_threads(threads)


def test_the_kernel_builds_on_this_machine() -> None:
    """CI runs on x86-64 machines with AVX2 and a C compiler: the kernel must build and load there
    (a build that silently failed would leave ``auto`` on oneDNN and these tests meaningless)."""
    assert panel_gemm.supported()
    assert panel_gemm.available() is None


def test_a_clean_cache_builds_the_kernel_once(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """On a machine that has never built it (an empty cache), the first load compiles the C file;
    the next finds it by the source's hash and compiles nothing."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    built = c_kernels.build(panel_gemm.SOURCE)
    assert built.parent == tmp_path / "card" / "kernels" and built.stat().st_size > 0
    assert list(built.parent.iterdir()) == [built]  # no temporary file left beside it
    stamp = built.stat().st_mtime_ns
    assert c_kernels.build(panel_gemm.SOURCE) == built and built.stat().st_mtime_ns == stamp


def test_a_cache_it_cannot_write_gets_a_private_build(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """Where the cache folder cannot be made (here a file stands where it would go), the kernel
    is built in a private temporary folder instead: the model still loads on it."""
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "card").write_text("not a folder")
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    built = c_kernels.build(panel_gemm.SOURCE)
    assert built.exists() and not built.is_relative_to(cache)


@pytest.mark.parametrize(("out_features", "in_features", "bias"),
                         [(576, 576, False), (960, 576, True), (576, 1536, False), (100, 37, True),
                          (5, 3, False)])
def test_every_row_is_its_alone_bits_at_any_row_and_thread_count(out_features: int, in_features: int,
                                                                  bias: bool) -> None:
    torch.manual_seed(out_features + in_features)
    weight = torch.randn(out_features, in_features)
    b = torch.randn(out_features) if bias else None
    layer = panel_gemm.PanelWeight(weight, b)
    x = torch.randn(max(ROW_COUNTS), in_features)
    assert _rows_as_alone(layer, x)
    # and the product itself: within fp32 rounding of a float64 reference
    want = torch.nn.functional.linear(x.double(), weight.double(), None if b is None else b.double())
    assert torch.allclose(layer(x).double(), want, atol=1e-4 * in_features ** 0.5, rtol=1e-5)


def test_the_row_check_catches_a_kernel_whose_sum_order_follows_the_row_count() -> None:
    """Negative control for the check above: a product that sums the two halves of the inputs
    apart once more than 8 rows come (as a split-K kernel would) fails it."""
    torch.manual_seed(0)
    weight = torch.randn(256, 1536)

    def split_k(x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= 8:
            return x @ weight.T
        return x[:, :768] @ weight[:, :768].T + x[:, 768:] @ weight[:, 768:].T

    assert not _rows_as_alone(split_k, torch.randn(max(ROW_COUNTS), 1536))


def test_inputs_of_other_layouts_and_leading_dimensions() -> None:
    torch.manual_seed(1)
    weight = torch.randn(96, 64)
    layer = panel_gemm.PanelWeight(weight, None)
    x = torch.randn(2, 5, 128)[..., ::2]  # not contiguous, [2, 5, 64]
    out = layer(x)
    assert out.shape == (2, 5, 96)
    assert torch.equal(out, layer(x.contiguous().reshape(10, 64)).reshape(2, 5, 96))
    assert layer(torch.empty(0, 64)).shape == (0, 96)


def test_choose_depends_on_the_setting_and_dtype_only() -> None:
    assert panel_gemm.choose("onednn", torch.float32) == "onednn"
    assert panel_gemm.choose("panel", torch.float32) == "panel"
    assert panel_gemm.choose("panel", torch.bfloat16) == "onednn"  # the panel kernel is fp32 only
    auto = "panel" if panel_gemm.panel_pays() else "onednn"
    assert panel_gemm.choose("auto", torch.float32) == auto
    with pytest.raises(ValueError):
        panel_gemm.choose("mkl", torch.float32)
    with pytest.raises(InvalidArgument):
        ModelConfig(cpu_linear="mkl")


def test_without_a_compiler_auto_falls_back_to_onednn(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """A machine without a C compiler (or where the build fails) keeps oneDNN under ``auto`` and
    says why; asking for ``panel`` there is an error with the reason."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # nothing built yet
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    panel_gemm.build_of.cache_clear()
    try:
        assert panel_gemm.available() is not None
        assert panel_gemm.choose("auto", torch.float32) == "onednn"
        with pytest.raises(panel_gemm.Unavailable, match="no-such-cc"):
            panel_gemm.choose("panel", torch.float32)
    finally:
        panel_gemm.build_of.cache_clear()


# ---- a model on the panel kernel -----------------------------------------------------------------
def _model(kind: str = "llama", hidden: int = 256, exact: bool = True, sharp: bool = False,
           perturb: float = 0.0) -> torch.nn.Module:
    model = tiny_model(kind, vocab=VOCAB, hidden=hidden, layers=3, dtype=torch.float32, perturb=perturb)
    if sharp:
        sharpened(model)
    how = make_exact(model, exact=exact, cpu_linear="panel")
    assert how.startswith("panel-kernel linears"), how
    return model


def test_make_exact_on_the_panel_kernel_needs_no_tiles_or_chunks() -> None:
    model = _model(hidden=1536)
    linears = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert linears and all(m.kernel == "panel" for m in linears)
    assert not any(isinstance(m, FixedTiles | RowChunks) for m in model.modules())
    assert all(probe(m) for m in linears)


@pytest.mark.parametrize("hidden", [256, 1536])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_chain_logits_equal_plain_steps_on_the_panel_kernel(kind: str, hidden: int) -> None:
    assert chain_logits_equal_steps(_model(kind, hidden), exact=True)


@pytest.mark.parametrize(("capability", "vendor", "pays"),
                         [("AVX2", "AuthenticAMD", True), ("AVX2", "GenuineIntel", True),
                          ("AVX512", "GenuineIntel", True), ("AVX512", "AuthenticAMD", False),
                          ("AVX512", "", False), ("DEFAULT", "GenuineIntel", False)])
def test_auto_takes_the_panel_kernel_where_it_was_measured_faster(
        monkeypatch: pytest.MonkeyPatch, capability: str, vendor: str, pays: bool) -> None:
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setattr(panel_gemm, "_vendor", lambda: vendor)
    assert panel_gemm.panel_pays() is pays


def _product(lib, panels: torch.Tensor, x: torch.Tensor, n: int, bias: torch.Tensor | None,
             threads: int) -> torch.Tensor:
    out = torch.empty(x.shape[0], n)
    lib.card_panel_linear(x.data_ptr(), x.shape[0], x.shape[1], panels.data_ptr(), n,
                          None if bias is None else bias.data_ptr(), out.data_ptr(), threads)
    return out


@pytest.mark.skipif(not c_kernels.wide(), reason="the AVX-512 build runs on AVX-512 CPUs only")
@pytest.mark.parametrize(("out_features", "in_features", "bias"),
                         [(576, 576, False), (960, 576, True), (100, 37, True), (5, 3, False)])
def test_the_avx512_build_gives_the_avx2_builds_bits(out_features: int, in_features: int,
                                                     bias: bool) -> None:
    """The two builds differ in how many outputs advance together, never in an output's chain, so
    every row count (the eight-row and two-row kernels and their remainders) and thread count gives
    the same bits; and the build ``auto`` loads on this CPU is the AVX-512 one."""
    wide, narrow = panel_gemm.build_of(c_kernels.AVX512), panel_gemm.build_of(())
    assert panel_gemm.library() is wide
    torch.manual_seed(out_features * in_features)
    weight, b = torch.randn(out_features, in_features), torch.randn(out_features) if bias else None
    panels = torch.empty(narrow.card_panel_floats(out_features, in_features))
    narrow.card_panel_pack(weight.contiguous().data_ptr(), out_features, in_features, panels.data_ptr())
    x = torch.randn(max(ROW_COUNTS), in_features)
    for m in (*ROW_COUNTS, 16, 17, 24, 129):
        rows = torch.randn(m, in_features)
        for threads in (1, 2):
            assert torch.equal(_product(wide, panels, rows, out_features, b, threads),
                               _product(narrow, panels, rows, out_features, b, threads)), (m, threads)
    assert torch.equal(_product(wide, panels, x, out_features, b, 2),
                       _product(narrow, panels, x, out_features, b, 2))


@pytest.mark.skipif(not c_kernels.wide(), reason="the AVX-512 build runs on AVX-512 CPUs only")
def test_the_build_comparison_sees_another_order() -> None:
    """Negative control for the comparison above: the same product summed in another order
    (float64, rounded once) is not the kernel's bits, and the comparison says so."""
    wide = panel_gemm.build_of(c_kernels.AVX512)
    torch.manual_seed(3)
    weight, x = torch.randn(96, 576), torch.randn(9, 576)
    panels = torch.empty(wide.card_panel_floats(96, 576))
    wide.card_panel_pack(weight.data_ptr(), 96, 576, panels.data_ptr())
    other = (x.double() @ weight.double().T).float()
    assert not torch.equal(_product(wide, panels, x, 96, None, 2), other)
