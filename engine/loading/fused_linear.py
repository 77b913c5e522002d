"""Sibling linears that read the same input run as one packed matrix product.

Why: on a CPU a decoding step is ~7 linears a layer, each a oneDNN call with a fixed cost
(~20 us) on a small matrix (SmolLM2: k and v are 192 x 576). The attention's q, k and v
projections, and the MLP's gate and up projections, read the same hidden state: their weights
concatenated are one larger matrix that streams better and costs one call (a layer: 4 calls
instead of 7; SmolLM2-135M fp32, 1-8 rows, two threads: the five projections 8-20% faster).

Exactness: each output column of the fused product must be bitwise the column of its own layer,
for every row count, or the model's logits would change. That holds when the kernel's reduction
for one output does not depend on the matrix's other columns; it is checked, not assumed: each
distinct group shape is run fused and apart at 1-64 rows and thread counts (``_same_bits``), and
kept apart where any bit differs.

How the model still calls ``q_proj(x)``, ``k_proj(x)``, ``v_proj(x)``: each becomes a
``SiblingSlice`` of one ``FusedLinears`` registered beside them (``qkv_proj``, ``gate_up_proj``).
The first sibling called with ``x`` runs the fused layer and keeps the output for this thread;
a sibling called with the very same tensor takes its columns from it; the last sibling drops it
(so no output outlives its layer). A sibling called with another input, in another order or
from another thread computes the fused product afresh: slower, never different.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from card.engine.loading.cpu_linear import PackedLinear
from card.engine.shared.torch_threads import probe_counts

# attribute names of linears that read one input, and the name their fused layer takes
SIBLINGS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("q_proj", "k_proj", "v_proj"), "qkv_proj"),
    (("gate_proj", "up_proj"), "gate_up_proj"),
)
# row counts the fused layer is compared at: one (run as two), chains, the 8-row batch hint's
# edge, and a prefill chunk's worth
CHECK_ROWS = (1, 2, 3, 8, 9, 33, 64)


class FusedLinears(torch.nn.Module):
    """One packed layer computing several siblings' outputs side by side; ``linear`` may be wrapped
    (card.engine.loading.invariant's RowChunks or FixedTiles) like any packed layer."""

    def __init__(self, linear: torch.nn.Module, widths: tuple[int, ...]) -> None:
        super().__init__()
        self.linear = linear
        self.widths = widths
        self._local = threading.local()  # this thread's (input, output) until its last sibling reads
        self.held: tuple[torch.Tensor, torch.Tensor] | None = None  # the same while dynamo traces

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)

    def columns(self, x: torch.Tensor, start: int, stop: int, last: bool) -> torch.Tensor:
        """Columns ``start:stop`` of the fused output for ``x``, contiguous (the layout the
        sibling's own layer gave)."""
        # traced, the same rule on a plain attribute (dynamo follows it at trace time: the graph
        # calls the fused op once); run, on this thread's own
        holder = self if torch.compiler.is_compiling() else self._local
        held = getattr(holder, "held", None)
        if held is not None and held[0] is x:
            out = held[1]
        else:
            out = self.linear(x)
            holder.held = (x, out)
        if last:
            holder.held = None
        return out[..., start:stop].contiguous()

    def extra_repr(self) -> str:
        return f"widths={self.widths}"


class SiblingSlice(torch.nn.Module):
    """What ``q_proj`` (or a sibling) becomes: its columns of the group's fused output."""

    group: FusedLinears

    def __init__(self, group: FusedLinears, start: int, stop: int, last: bool, in_features: int) -> None:
        super().__init__()
        object.__setattr__(self, "group", group)  # not a child: the group is registered once, beside
        self.start, self.stop, self.last = start, stop, last
        self.in_features, self.out_features = in_features, stop - start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.columns(x, self.start, self.stop, self.last)

    def extra_repr(self) -> str:
        return f"columns {self.start}:{self.stop} of the fused layer beside"


def fuse_siblings(model: torch.nn.Module, pack: Callable[[torch.nn.Linear], PackedLinear]) -> int:
    """Replace each group of ``SIBLINGS`` that are plain ``nn.Linear`` children of one module, with
    one input width, dtype and device and all or none biased, by a packed fused layer and slices
    of it, wherever the fused bits equal the separate ones; returns how many groups were fused.
    ``pack`` packs one linear (how ``pack_linears`` would)."""
    verdicts: dict[tuple, bool] = {}  # one check per group shape: a kernel's path depends on shapes
    fused = 0
    for parent in list(model.modules()):
        for names, fused_name in SIBLINGS:
            layers = [getattr(parent, n, None) for n in names]
            if not _fusable(parent, layers, fused_name):
                continue
            linears: list[torch.nn.Linear] = layers  # type: ignore[assignment]
            whole = _concatenated(linears)
            packed = pack(whole)
            key = (linears[0].in_features, tuple(lin.out_features for lin in linears),
                   linears[0].weight.dtype, linears[0].bias is not None)
            if key not in verdicts:
                verdicts[key] = _same_bits(packed, [pack(lin) for lin in linears])
            if not verdicts[key]:
                continue
            widths = tuple(lin.out_features for lin in linears)
            group = FusedLinears(packed, widths)
            setattr(parent, fused_name, group)
            start = 0
            for i, (name, width) in enumerate(zip(names, widths, strict=True)):
                setattr(parent, name, SiblingSlice(group, start, start + width, i == len(names) - 1,
                                                   linears[0].in_features))
                start += width
            fused += 1
    return fused


def _fusable(parent: torch.nn.Module, layers: list, fused_name: str) -> bool:
    if hasattr(parent, fused_name) or not all(type(lin) is torch.nn.Linear for lin in layers):
        return False
    first = layers[0]
    return all(lin.in_features == first.in_features and lin.weight.dtype == first.weight.dtype
               and lin.weight.device == first.weight.device
               and (lin.bias is None) == (first.bias is None) for lin in layers)


def _concatenated(linears: list[torch.nn.Linear]) -> torch.nn.Linear:
    first = linears[0]
    whole = torch.nn.Linear(first.in_features, sum(lin.out_features for lin in linears),
                            bias=first.bias is not None, device="meta")
    weight = torch.cat([lin.weight.detach() for lin in linears])
    whole.weight = torch.nn.Parameter(weight, requires_grad=False)
    if first.bias is not None:
        bias = torch.cat([lin.bias.detach() for lin in linears if lin.bias is not None])
        whole.bias = torch.nn.Parameter(bias, requires_grad=False)
    return whole


@torch.inference_mode()
def _same_bits(whole: torch.nn.Module, parts: list[torch.nn.Module]) -> bool:
    """Whether ``whole`` gives, column block by block, the bits of ``parts`` at every CHECK_ROWS
    count, with every thread count a forward may run on."""
    first = parts[0]
    dtype = first.dtype if isinstance(first, PackedLinear) else next(first.parameters()).dtype
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(max(CHECK_ROWS), int(first.in_features), generator=gen).to(dtype)  # type: ignore[arg-type]
    threads = torch.get_num_threads()
    try:
        for count in probe_counts():
            torch.set_num_threads(count)
            for m in CHECK_ROWS:
                if not torch.equal(whole(x[:m]), torch.cat([part(x[:m]) for part in parts], dim=-1)):
                    return False
    finally:
        torch.set_num_threads(threads)
    return True
