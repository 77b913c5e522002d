"""For each linear shape of SmolLM2-135M, packed by oneDNN: at which row counts M a row differs from
the same row alone, and at which counts it equals the first row of an 8-row forward (2 and 1 threads).

    .venv/bin/python docs/measurements/bf16-amx/where_rows_differ.py
"""

import torch

from card.engine.loading.cpu_linear import PackedLinear

SHAPES = ((576, 576), (576, 192), (576, 1536), (1536, 576), (576, 49152))
COUNTS = [*range(1, 41), 64, 100, 128, 200, 256, 300]

torch.manual_seed(0)
for threads in (2, 1):
    torch.set_num_threads(threads)
    for dtype in (torch.bfloat16, torch.float32):
        for width, out in SHAPES:
            layer = PackedLinear(torch.nn.Linear(width, out, bias=False).to(dtype))
            x = torch.randn(300, width).to(dtype)
            with torch.inference_mode():
                alone = torch.cat([layer(x[j:j + 1]) for j in range(300)])
                differs = [m for m in COUNTS if not torch.equal(layer(x[:m]), alone[:m])]
                first_of_8 = torch.cat([layer(x[j:j + 8])[:1] for j in range(292)])
                equal_8 = [m for m in COUNTS[1:] if torch.equal(layer(x[:m])[:292], first_of_8[:m])]
            print(threads, dtype, width, out, "differs from alone at M =", differs,
                  "| equals the first row of 8 at", equal_8, flush=True)
