"""GB/s of the candidate CPU paths for a decoding linear layer over SmolLM2-135M's decoder linears
(30 layers x fused qkv, o, gate_up, down = 425 MB fp32; cold: the weights cycle, far beyond the L3):
our oneDNN-packed layer (a lone row run as two), MKL through F.linear, MKL one row at a time,
torch.mv one row at a time, at 1-8 rows; then a plain sum over the same bytes.

    .venv/bin/python docs/measurements/gemv/linear_paths.py THREADS
"""
import sys
import time

import torch
import torch.nn.functional as F

from card.engine.loading.cpu_linear import PackedLinear

torch.manual_seed(0)
threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
torch.set_num_threads(threads)
H, INTER, KV, L = 576, 1536, 192, 30
shapes = [(H + 2 * KV, H), (H, H), (2 * INTER, H), (H, INTER)]  # fused qkv, o, gate_up, down
layers = [torch.nn.Linear(i, o, bias=False) for _ in range(L) for (o, i) in shapes]
nbytes = sum(layer.weight.numel() * 4 for layer in layers)
packed = [PackedLinear(layer) for layer in layers]


def run(fn, M, reps=5):
    xs = {layer.in_features: torch.randn(M, layer.in_features) for layer in layers}
    best = 1e9
    for _ in range(reps):
        t = time.perf_counter()
        for k, layer in enumerate(layers):
            fn(k, xs[layer.in_features])
        best = min(best, time.perf_counter() - t)
    return best


paths = {
    "packed": lambda k, x: packed[k].run(x),
    "mkl_linear": lambda k, x: F.linear(x, layers[k].weight),
    "mkl_rows": lambda k, x: [F.linear(x[r:r + 1], layers[k].weight) for r in range(x.shape[0])],
    "mv_rows": lambda k, x: [torch.mv(layers[k].weight, x[r]) for r in range(x.shape[0])],
}
print(f"threads {threads}, {nbytes / 1e6:.0f} MB of linears")
with torch.no_grad():
    for M in (1, 2, 4, 8):
        row = []
        for name, fn in paths.items():
            s = run(fn, M)
            row.append(f"{name} {s * 1e3:6.1f} ms {nbytes / s / 1e9:5.1f} GB/s")
        print(f"M={M}: " + " | ".join(row))
    flat = torch.cat([layer.weight.flatten() for layer in layers])
    best = 1e9
    for _ in range(5):
        t = time.perf_counter()
        flat.sum()
        best = min(best, time.perf_counter() - t)
    print(f"sum over the same bytes: {best * 1e3:.1f} ms {nbytes / best / 1e9:.1f} GB/s")
