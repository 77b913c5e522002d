"""Linear layers with oneDNN-prepacked weights, for models decoding on the CPU (or, for fp32 on
AVX2 machines, the project's panel kernel: card.engine.loading.panel_gemm).

Why: a CARD verification forwards ``1 + len(chain)`` tokens at once. With PyTorch's default CPU
path (MKL sgemm) a forward of 2-8 rows costs 2-3x a one-row forward on the 2-core AMD EPYC
box of docs/performance.md, because small-M sgemm repacks the weight on every call. oneDNN's
matmul on a weight reordered once into its blocked layout costs 1.2-2x one row instead, and on
two threads even a one-row forward is faster (254 vs 360 ms per token for Qwen2.5-Coder-1.5B).

Exactness: the packed kernel is batch-invariant and thread-invariant for two rows or more: row
``i`` of a forward of ``M >= 2`` rows is bitwise equal to the same row in any other forward of two
or more rows, with 1 or N threads (fp32 and bf16, measured on AVX-512 with and without AVX512-BF16;
card.engine.loading.invariant probes it again at load). On AMX, bf16 matrices of 33 rows or more
take another kernel (measured on a Xeon with AMX-BF16): there the probe finds every count up to
32 invariant and the layer runs in chunks of at most 32 rows (invariant.RowChunks). One row alone
takes oneDNN's matrix-vector path, whose reduction order differs once ``in_features`` is large
(1536: every output differs in fp32 and bf16), so ``pad_single_row`` runs a lone row as two.
MKL's unpacked path is not invariant at all in fp32 (rows differ by ~1e-4 between M=1 and M=7).

The packed weight replaces the dense one (an opaque mkldnn tensor of the same size): no extra
memory, except for an output projection tied to the input embeddings, whose dense copy the
embedding keeps. Packed models cannot be saved; pack after loading, as ``card.engine.loading.models`` does.
"""

from __future__ import annotations

import itertools
import weakref

import torch

from card.engine.loading.panel_gemm import PanelWeight, choose

# oneDNN reorders for a batch-size hint; 8 covers 1 + the longest CPU chain and measured best
# among {none, 1, 8} for 4- and 7-row forwards without slowing 1-row forwards on two threads.
_BATCH_HINT = 8


def _packable_dtypes() -> tuple[torch.dtype, ...]:
    # bf16 through oneDNN needs AVX512-BF16 or AMX-BF16 (or an emulation oneDNN accepts): asked, not assumed
    bf16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return (torch.float32, torch.bfloat16) if bf16 else (torch.float32,)


# Packed layers by key, for the compiled step: the packed weight is an opaque oneDNN tensor that
# dynamo cannot trace, so a compiled forward calls ``card::packed_linear(x, key)`` instead, an op
# it treats as a black box (inductor fuses everything between the linears). Weak: a model's
# layers leave with the model.
_LAYERS: weakref.WeakValueDictionary[int, PackedLinear] = weakref.WeakValueDictionary()
_KEYS = itertools.count()


@torch.library.custom_op("card::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, key: int) -> torch.Tensor:
    """The packed layer ``key``'s forward on ``x``, as an op a compiler does not look into."""
    return _LAYERS[key].run(x)


@packed_linear.register_fake
def _packed_linear_shape(x: torch.Tensor, key: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], _LAYERS[key].out_features)


class PackedLinear(torch.nn.Module):
    """``y = x @ W.T + b`` with W held in oneDNN's blocked layout, or (``kernel="panel"``, fp32 on
    AVX2) in card.engine.loading.panel_gemm's panels (inference only)."""

    def __init__(self, linear: torch.nn.Linear, pad_single_row: bool = True, kernel: str = "onednn") -> None:
        super().__init__()
        self.pad_single_row = pad_single_row
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.kernel = kernel
        weight = linear.weight.detach()
        self.dtype = weight.dtype  # the packed tensor is opaque; the probe and logs read this
        self.panel: PanelWeight | None = None
        self.packed: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None
        if kernel == "panel":  # one kernel for every row count: a lone row needs no padding
            self.panel = PanelWeight(weight, linear.bias)
        else:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, _BATCH_HINT)  # opaque [out, in]
            # a copy: the checkpoint may be memory-mapped, and a view would keep the whole file resident
            self.bias = None if linear.bias is None else linear.bias.detach().clone()
        self.key = next(_KEYS)
        _LAYERS[self.key] = self

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        if torch.compiler.is_compiling():  # traced: an opaque op (the comment on ``_LAYERS``)
            return packed_linear(x, self.key)
        return self.run(x)

    def run(self, x: torch.Tensor) -> torch.Tensor:
        if self.panel is not None:
            return self.panel(x)
        if self.pad_single_row and x.numel() == self.in_features:
            # one row: run it as two (the matrix-matrix kernel every larger forward takes)
            pair = torch.ops.mkldnn._linear_pointwise(x.reshape(1, -1).expand(2, -1), self.packed, self.bias,
                                                      "none", [], "")
            return pair[:1].reshape(*x.shape[:-1], self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        how = "panel kernel" if self.panel is not None else "oneDNN-packed"
        return f"in_features={self.in_features}, out_features={self.out_features}, {how}"


def can_pack(model: torch.nn.Module) -> bool:
    """Whether ``pack_linears`` applies: fp32 (or bf16 where oneDNN runs it) weights on the CPU and
    a torch built with oneDNN."""
    if not torch.backends.mkldnn.is_available():
        return False
    weights = [m.weight for m in model.modules() if type(m) is torch.nn.Linear]
    packable = _packable_dtypes()
    return bool(weights) and all(w.device.type == "cpu" and w.dtype in packable for w in weights)


def pack_linears(model: torch.nn.Module, pad_single_row: bool = True, cpu_linear: str = "onednn") -> int:
    """Replace every ``nn.Linear`` of ``model`` by a ``PackedLinear`` in place, each with the kernel
    ``cpu_linear`` chooses for its dtype (panel_gemm.choose); returns how many.

    Layers are packed one at a time so the peak memory is the model plus one layer.
    """
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                kernel = choose(cpu_linear, child.weight.dtype)
                setattr(parent, name, PackedLinear(child, pad_single_row, kernel))
                count += 1
    return count

