"""Linear layers with oneDNN-prepacked weights, for models decoding on the CPU.

Why: a CARD verification forwards ``1 + len(chain)`` tokens at once. With PyTorch's default CPU
path (MKL sgemm) a forward of 2-8 rows costs 2-3x a one-row forward on the 2-core AMD EPYC
box of docs/performance.md, because small-M sgemm repacks the weight on every call. oneDNN's
matmul on a weight reordered once into its blocked layout costs 1.2-2x one row instead, and on
two threads even a one-row forward is faster (254 vs 360 ms per token for Qwen2.5-Coder-1.5B).

Exactness: the packed kernel is batch-invariant and thread-invariant: row ``i`` of a forward of
``M`` rows is bitwise equal to the forward of row ``i`` alone, with 1 or N threads. MKL's path is
not (rows differ by ~1e-4 between M=1 and M=7). So with packed weights the target's logits for a
token do not depend on how many chain tokens rode along, which is what makes greedy card == vanilla
hold on real fp32 models by construction of the linear layers (attention is still computed per
forward shape).

The packed weight replaces the dense one (an opaque mkldnn tensor of the same size): no extra
memory, except for an output projection tied to the input embeddings, whose dense copy the
embedding keeps. Packed models cannot be saved; pack after loading, as ``engine.loading.models`` does.
"""

from __future__ import annotations

import torch

# oneDNN reorders for a batch-size hint; 8 covers 1 + the longest CPU chain and measured best
# among {none, 1, 8} for 4- and 7-row forwards without slowing 1-row forwards on two threads.
_BATCH_HINT = 8
_PACKABLE = (torch.float32,)


class PackedLinear(torch.nn.Module):
    """``y = x @ W.T + b`` with W held in oneDNN's blocked layout (inference only)."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, _BATCH_HINT)  # opaque [out, in]
        # a copy: the checkpoint may be memory-mapped, and a view would keep the whole file resident
        self.bias = None if linear.bias is None else linear.bias.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN-packed"


def can_pack(model: torch.nn.Module) -> bool:
    """Whether ``pack_linears`` applies: fp32 weights on the CPU and a torch built with oneDNN."""
    if not torch.backends.mkldnn.is_available():
        return False
    weights = [m.weight for m in model.modules() if type(m) is torch.nn.Linear]
    return bool(weights) and all(w.device.type == "cpu" and w.dtype in _PACKABLE for w in weights)


def pack_linears(model: torch.nn.Module) -> int:
    """Replace every ``nn.Linear`` of ``model`` by a ``PackedLinear`` in place; returns how many.

    Layers are packed one at a time so the peak memory is the model plus one layer.
    """
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                setattr(parent, name, PackedLinear(child))
                count += 1
    return count

