"""SmolLM2-135M's decoder linears (random weights of its 30 layers' fused shapes), cold, at several
row counts: oneDNN's packed kernel against the panel kernel (card.engine.loading.panel_gemm),
alternating three times each, best of four passes; GB/s of weights read and GFLOP/s.

    .venv/bin/python docs/measurements/panel-gemm/linears.py [THREADS] [ROWS,ROWS,...]
"""

from __future__ import annotations

import sys
import time

import torch

from card.engine.loading import panel_gemm

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30  # qkv, o, gate+up, down


class Layer:
    def __init__(self, weight: torch.Tensor) -> None:
        self.panel = panel_gemm.PanelWeight(weight, None)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 8)

    def run_panel(self, x: torch.Tensor) -> torch.Tensor:
        return self.panel(x)

    def run_onednn(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.expand(2, -1) if x.shape[0] == 1 else x  # a lone row as two, as cpu_linear runs it
        return torch.ops.mkldnn._linear_pointwise(rows, self.packed, None, "none", [], "")[:x.shape[0]]


def main() -> None:
    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
    counts = [int(v) for v in sys.argv[2].split(",")] if len(sys.argv) > 2 else [1, 2, 4, 8, 16, 32, 256]
    torch.manual_seed(0)
    layers = [Layer(torch.randn(n, k) * 0.05) for n, k in SHAPES]
    nbytes = sum(n * k * 4 for n, k in SHAPES)
    for m in counts:
        xs = [torch.randn(m, k) for _, k in SHAPES[:4]]
        best: dict[str, float] = {}
        for name in ("onednn", "panel") * 3:
            for _ in range(4):
                t = time.perf_counter()
                for i, layer in enumerate(layers):
                    getattr(layer, f"run_{name}")(xs[i % 4])
                best[name] = min(time.perf_counter() - t, best.get(name, 1e9))
        d, p = best["onednn"], best["panel"]
        print(f"M={m:4d} onednn {d * 1e3:7.2f} ms {nbytes / d / 1e9:5.1f} GB/s | panel {p * 1e3:7.2f} ms "
              f"{nbytes / p / 1e9:5.1f} GB/s {2 * m * nbytes / 4 / p / 1e9:6.1f} GFLOP/s | "
              f"panel speed {d / p:.2f}x", flush=True)


if __name__ == "__main__":
    main()
