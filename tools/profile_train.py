"""Where the GPU time of one training step of the bench's `train` suite goes: torch.profiler over a few steps of each
method (bench/train.py: the PyTorch loop, graphsafe's traced graph run eagerly, the captured replay, torch.compile).
Prints, per method, the GPU kernel time per step and the top kernels by total GPU time, then the kernels whose time
differs most between two methods (--compare A B). A development tool, run on the GPU machine:

    python3 tools/profile_train.py [--model lm|llama] [--methods "torch eager,graphsafe eager"] [--steps 5]
"""

from __future__ import annotations

import argparse
import gc
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from graphsafe.bench.harness import BenchContext
from graphsafe.bench.train import WORKLOADS, step_for
from graphsafe.trainer.data import LMData
from graphsafe.trainer.run import matmul_precision


def kernel_times(prof, steps: int) -> dict[str, tuple[float, float]]:
    """{kernel name: (ms per step, launches per step)} of the profiled steps."""
    events = prof.key_averages()
    kernels = [e for e in events if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
    kernels = kernels or [e for e in events if e.self_device_time_total > 0]
    return {e.key: (e.device_time_total / steps / 1e3, e.count / steps) for e in kernels}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=sorted(WORKLOADS), default="lm")
    parser.add_argument("--methods", default="torch eager,graphsafe eager,graphsafe captured")
    parser.add_argument("--compare", nargs=2, default=("torch eager", "graphsafe eager"))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=16)
    args = parser.parse_args()
    device = torch.device("cuda")
    ctx = BenchContext(device=device, quick=False, timer=None, copy_bandwidth=None, emit=print)
    workload = WORKLOADS[args.model](ctx)
    config = workload.config
    data = LMData(config.vocab, config.batch_size, config.seq_len, config.seed, device)
    batches = [next(data) for _ in range(args.steps)]
    print(workload.describe)
    profiles: dict[str, dict[str, tuple[float, float]]] = {}
    with matmul_precision(config):
        for method in args.methods.split(","):
            step, mode = step_for(method, workload, device)
            for batch in batches[:4]:
                step(*batch)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for batch in batches:
                    step(*batch)
                torch.cuda.synchronize()
            times = profiles[method] = kernel_times(prof, args.steps)
            total = sum(t for t, _ in times.values())
            launches = sum(n for _, n in times.values())
            print(f"\n## {method} ({mode()}): GPU kernel time {total:.3f} ms per step, {launches:.0f} kernels per step")
            for key, (t, n) in sorted(times.items(), key=lambda kv: -kv[1][0])[: args.top]:
                print(f"{t:8.3f} ms {n:5.0f}x  {key[:120]}")
            del step, mode
            gc.collect()
            torch.cuda.empty_cache()
    a, b = args.compare
    if a in profiles and b in profiles:
        diffs: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])
        for i, method in enumerate((a, b)):
            for key, (t, n) in profiles[method].items():
                diffs[key][i] += t
                diffs[key][2 + i] += n
        print(f"\n## kernels that differ most: {b} minus {a} (ms per step; launches per step)")
        for key, (ta, tb, na, nb) in sorted(diffs.items(), key=lambda kv: -abs(kv[1][1] - kv[1][0]))[: args.top]:
            print(f"{tb - ta:+8.3f} ms  ({ta:.3f} -> {tb:.3f}; {na:.0f} -> {nb:.0f}x)  {key[:110]}")


if __name__ == "__main__":
    main()
