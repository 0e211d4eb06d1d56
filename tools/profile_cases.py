"""Development: per-case eager vs graph-replay time of graphsafe's embedding backward (host overhead vs GPU)."""
import sys
import torch
import graphsafe  # noqa: F401

dev = "cuda"
torch.manual_seed(0)

def timed(fn, reps=30):
    for _ in range(3): fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); fn(); e.record(); e.synchronize(); ts.append(s.elapsed_time(e))
    ts.sort(); return ts[len(ts) // 2]

def zipf(V, N, s=1.05):
    p = 1.0 / torch.arange(1, V + 1, dtype=torch.float64, device=dev) ** s
    return torch.randperm(V, device=dev)[torch.multinomial(p.float(), N, replacement=True)]

cases = {
    "c1": (128256, 4096, torch.bfloat16, lambda: torch.randint(0, 128256, (16384,), device=dev)),
    "c2": (4_000_000, 128, torch.float32, lambda: zipf(4_000_000, 262144)),
    "c3": (1_000_000, 64, torch.float16, lambda: torch.randperm(1_000_000, device=dev)[:1000][torch.randint(0, 1000, (524288,), device=dev)]),
}
only = sys.argv[1:] or list(cases)
for name in only:
    V, D, dt, make = cases[name]
    idx = make(); g = torch.randn(idx.numel(), D, device=dev, dtype=dt)
    f = lambda: torch.ops.graphsafe.embedding_backward(g, idx, V, -1, False)
    eager = timed(f)
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3): f()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = f()
    replay = timed(graph.replay)
    zeros = timed(lambda: torch.zeros(V, D, dtype=dt, device=dev))
    print(f"{name}: eager {eager:.3f} ms, graph replay {replay:.3f} ms, zeros alone {zeros:.3f} ms", flush=True)
