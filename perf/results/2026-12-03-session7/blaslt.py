import sys, torch, torch.nn.functional as F
sys.path.insert(0, "perf"); sys.path.insert(0, "python_models")
from bench_gemm import graph_time_us
torch.manual_seed(0)
for M in (128, 512):
  for name, n, k in (("qkv", 4096, 1024), ("o", 1024, 2048), ("gate_up", 6144, 1024), ("down", 1024, 3072)):
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5 for _ in range(28)]
    x = torch.randn(M, k, device="cuda", dtype=torch.bfloat16)
    r = torch.randn(M, n, device="cuda", dtype=torch.bfloat16)
    res = []
    for lib in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(lib)
        res.append(graph_time_us(lambda i: F.linear(x, ws[i]), 28))
        res.append(graph_time_us(lambda i: r.addmm_(x, ws[i].t()), 28))
    print(f"M={M} {name}: cublas {res[0]:.2f} (addmm_ {res[1]:.2f})  cublaslt {res[2]:.2f} (addmm_ {res[3]:.2f}) µs", flush=True)
torch.backends.cuda.preferred_blas_library("cublas")
