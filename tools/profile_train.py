"""Where the GPU time of one `graphsafe train` step goes: torch.profiler over a few steps of the PyTorch loop and of
graphsafe's traced graph run eagerly (a captured replay hides its kernels from the profiler; its kernels are the
same). Prints the top kernels by total GPU time per step for each. A development tool, run on the GPU machine:

    python3 tools/profile_train.py [--matmul tf32|ieee] [--batch-size N] [--steps 5]
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from graphsafe.bench.train import step_for
from graphsafe.trainer.data import LMData
from graphsafe.trainer.run import default_config, matmul_precision


def steps_for(config, device):
    """The bench's PyTorch loop and graphsafe's traced graph run eagerly (bench/train.py), same seed and lr."""
    return {name: step_for(method, config, device)[0]
            for name, method in (("torch eager", "torch eager"), ("graphsafe graph, eager", "graphsafe eager"))}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--matmul", default="tf32")
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=14)
    args = parser.parse_args()
    device = torch.device("cuda")
    config = default_config("cuda", matmul=args.matmul, batch_size=args.batch_size)
    data = LMData(config.vocab, config.batch_size, config.seq_len, 0, device)
    batches = [next(data) for _ in range(args.steps)]
    with matmul_precision(config):
        for name, step in steps_for(config, device).items():
            for batch in batches[:3]:
                step(*batch)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for batch in batches:
                    step(*batch)
                torch.cuda.synchronize()
            events = prof.key_averages()
            kernels = [e for e in events if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
            kernels = kernels or [e for e in events if e.self_device_time_total > 0]
            total = sum(e.device_time_total for e in kernels) / args.steps / 1e3
            launches = sum(e.count for e in kernels) / args.steps
            print(f"\n## {name}: matmul {config.matmul}, batch {config.batch_size}: GPU kernel time {total:.3f} ms "
                  f"per step, {launches:.0f} kernels per step")
            for e in sorted(kernels, key=lambda e: -e.device_time_total)[: args.top]:
                print(f"{e.device_time_total / args.steps / 1e3:8.3f} ms {e.count / args.steps:5.0f}x  {e.key[:110]}")


if __name__ == "__main__":
    main()
