"""A linear layer written as a reduction that inductor compiles into its own C++ loop (no BLAS):
its GB/s over SmolLM2-135M's decoder linears (30 layers x fused qkv, o, gate_up, down; cold, the
weights cycle), and whether row r of M rows is bitwise row r alone, at 1 and 2 threads.

    .venv/bin/python docs/measurements/gemv/inductor_reduction.py THREADS ORDER

ORDER mn: out[m, n] = sum_k x[m, k] w[n, k] computed row-major over (m, n), so each row re-reads
W; nm: computed over (n, m), so each weight row is read once for all M rows.
"""
import sys
import time

import torch

torch.manual_seed(0)
threads, order = int(sys.argv[1]), sys.argv[2]
torch.set_num_threads(threads)


def lin_mn(x, w):  # [M, K] x [N, K] -> [M, N]
    return (x[:, None, :] * w[None, :, :]).sum(-1)


def lin_nm(x, w):
    return (w[:, None, :] * x[None, :, :]).sum(-1).t()


c = torch.compile(lin_mn if order == "mn" else lin_nm, dynamic=True)
shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
L = 30
ws = [torch.randn(o, i) for _ in range(L) for (o, i) in shapes]
nbytes = sum(w.numel() * 4 for w in ws)
t = time.perf_counter()
with torch.no_grad():
    for M in (1, 2, 8):
        for (o, i) in shapes:
            c(torch.randn(M, i), torch.randn(o, i))
print(f"threads {threads}, order {order}: compile {time.perf_counter() - t:.1f}s")
with torch.no_grad():
    for M in (1, 2, 4, 8):
        xs = {i: torch.randn(M, i) for (_, i) in shapes}
        best = 1e9
        for _ in range(5):
            t = time.perf_counter()
            for w in ws:
                c(xs[w.shape[1]], w)
            best = min(best, time.perf_counter() - t)
        print(f"M={M}: {best * 1e3:.1f} ms {nbytes / best / 1e9:.1f} GB/s")
    ok = True
    for w in ws[:4]:
        x = torch.randn(8, w.shape[1])
        full = c(x, w)
        for M in (1, 2, 3, 5, 8):
            ok &= torch.equal(c(x[:M], w), full[:M])
        ok &= torch.equal(c(x[3:4], w), full[3:4])
        torch.set_num_threads(1 if threads > 1 else 2)
        ok &= torch.equal(c(x, w), full)
        torch.set_num_threads(threads)
    print("row r of M rows == row r alone, and across thread counts:", ok)
