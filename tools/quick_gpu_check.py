"""Development check for a GPU machine: CUDA vs CPU bitwise on a few cases, and rough timings of the
issue's three benchmark cases. The real benchmark is `graphsafe bench`; the real tests are in tests/."""
import time
import torch
import graphsafe

torch.manual_seed(0)
dev = "cuda"

def check(V, D, N, dtype, idx_dtype=torch.int64, pad=-1, scale=False, hot=None):
    if hot:
        rows = torch.randperm(V)[:hot]
        idx = rows[torch.randint(0, hot, (N,))]
    else:
        idx = torch.randint(0, V, (N,))
    idx = idx.to(idx_dtype)
    g = torch.randn(N, D).to(dtype)
    cpu = graphsafe.ops.embedding_backward(g, idx, V, pad, scale)
    gpu = graphsafe.ops.embedding_backward(g.to(dev), idx.to(dev), V, pad, scale).cpu()
    ok = torch.equal(cpu, gpu)
    print(f"V={V} D={D} N={N} {dtype} {idx_dtype} pad={pad} scale={scale} hot={hot}: bitwise {'OK' if ok else 'MISMATCH'}"
          + ("" if ok else f" maxdiff={(cpu.double()-gpu.double()).abs().max().item()}"))
    return ok

allok = True
for dtype in [torch.float32, torch.float16, torch.bfloat16, torch.float64]:
    for (V, D, N, hot) in [(1000, 64, 5000, None), (300, 7, 20000, 5), (50, 4096, 3000, 3), (100000, 128, 100000, None)]:
        for pad, scale in [(-1, False), (2, True)]:
            allok &= check(V, D, N, dtype, torch.int32 if D == 7 else torch.int64, pad, scale, hot)
print("ALL BITWISE OK" if allok else "SOME MISMATCH")

def bench(fn, reps=30):
    for _ in range(3): fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); fn(); e.record(); e.synchronize(); ts.append(s.elapsed_time(e))
    ts.sort(); return ts[len(ts)//2]

src = torch.empty(2**30, dtype=torch.uint8, device=dev); dst = torch.empty_like(src)
t = bench(lambda: dst.copy_(src)); copy_bw = 2 * 2**30 / t / 1e6
print(f"copy bw {copy_bw:.0f} GB/s")
del src, dst
def zipf(V, N, s=1.05):
    p = 1.0 / torch.arange(1, V + 1, dtype=torch.float64, device=dev) ** s
    ranks = torch.multinomial(p.float(), N, replacement=True)
    return torch.randperm(V, device=dev)[ranks]
cases = [
    ("V=128256 D=4096 bf16 uniform", 128256, 4096, torch.bfloat16, torch.randint(0, 128256, (16384,), device=dev)),
    ("V=4M D=128 fp32 zipf", 4_000_000, 128, torch.float32, zipf(4_000_000, 262144)),
    ("V=1M D=64 fp16 hot1000", 1_000_000, 64, torch.float16, torch.randperm(1_000_000, device=dev)[:1000][torch.randint(0, 1000, (524288,), device=dev)]),
]
for name, V, D, dt, idx in cases:
    g = torch.randn(idx.numel(), D, device=dev, dtype=dt)
    nbytes = V * D * g.element_size() + g.numel() * g.element_size() + idx.numel() * 8
    res = {}
    res["graphsafe"] = bench(lambda: torch.ops.graphsafe.embedding_backward(g, idx, V, -1, False))
    res["aten"] = bench(lambda: torch.ops.aten.embedding_dense_backward(g, idx, V, -1, False))
    res["index_add"] = bench(lambda: torch.zeros(V, D, dtype=dt, device=dev).index_add_(0, idx, g))
    res["zeros_only"] = bench(lambda: torch.zeros(V, D, dtype=dt, device=dev))
    print(name, "maxcount", torch.bincount(idx).max().item(), " ".join(f"{k}={v:.3f}ms({nbytes/v/1e6/copy_bw*100:.0f}%)" for k, v in res.items()))
