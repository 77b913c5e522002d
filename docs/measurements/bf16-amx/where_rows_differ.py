"""For each linear shape of SmolLM2-135M, packed by oneDNN: at which row counts M a row differs from
the same row alone, and at which counts it equals the first row of an 8-row forward (2 and 1 threads)."""
import torch
from card.engine.loading.cpu_linear import PackedLinear
torch.manual_seed(0)
for threads in (2,1):
  torch.set_num_threads(threads)
  for dt in (torch.bfloat16, torch.float32):
    for (i,o) in ((576,576),(576,192),(576,1536),(1536,576),(576,49152)):
        p = PackedLinear(torch.nn.Linear(i,o,bias=False).to(dt))
        x = torch.randn(300, i).to(dt)
        with torch.inference_mode():
            ref = torch.cat([p(x[j:j+1]) for j in range(300)])
            bad = [m for m in list(range(1,41))+[64,100,128,200,256,300] if not torch.equal(p(x[:m]), ref[:m])]
            # compare with M=8 reference
            ref8 = torch.cat([p(x[j:j+8]) [ :1] for j in range(292)])
            same8 = [m for m in list(range(2,41))+[64,128,256] if torch.equal(p(x[:m])[:min(m,292)], ref8[:min(m,292)])]
        print(threads, dt, i, o, "differs from alone at M =", bad[:50], "| equals M=8-first-row at", same8[:60], flush=True)
