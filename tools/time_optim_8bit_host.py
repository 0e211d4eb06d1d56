"""Eager optimizer steps with 8-bit states against 32-bit states on the same parameters (issue 22: "an 8-bit step no
slower than the 32-bit step on the same parameters, at 1 and at 200 tensors"), where the step over many tensors is
bound by the host.

python3 tools/time_optim_8bit_host.py [--rounds 9] [--steps 50] [--numel 16777216] [--tensors 1,200]
                                      [--algorithms AdamW,Lion] [--min-8bit-size 4096] [--cpu]

For each algorithm, tensor count and state_bits (32, 8: same parameters, gradients and options; 8-bit with the
defaults min_8bit_size=4096, block_size=256: a tensor smaller than min_8bit_size keeps fp32 states), one optimizer; the cases then take turns, round after round, so that a
drift of the host's speed touches all alike. A round of a case: the device synchronised, `steps` eager steps issued
back to back between two CUDA events, the device synchronised again. Printed per case, the median over the rounds
(and the fastest round) of:
  wall    ms per step, from before the first step is issued until the device has finished the last;
  gpu     ms per step between the CUDA events (the stream's time: kernels, and gaps where it waited for the host);
  issue   µs per step the host took to issue the steps (perf_counter around the loop, no synchronisation in it:
          with at most a few hundred launches queued the host never waits for the GPU, so this is host time).
A step is host-bound when issue >= gpu; then wall follows issue. Also printed: the kernels one step launches
(counted once, under torch.profiler; "?" where it cannot count them). --cpu times CPU tensors (wall and issue only).

To compare two versions of the Python layer on the same build (e.g. before and after a commit that changes only
python/): check the other version out elsewhere (git worktree add /tmp/gs-old <commit>), copy the built extension
beside it (cp "$(python3 -c 'import graphsafe._C as c; print(c.__file__)')" /tmp/gs-old/python/graphsafe/), and run
this script once with PYTHONPATH=/tmp/gs-old/python and once without, or alternate the two a few times.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import graphsafe.optim as go

OPTIONS = {"AdamW": dict(lr=1e-3, weight_decay=1e-2), "Lion": dict(lr=1e-4, weight_decay=1e-2),
           "SGD": dict(lr=1e-3, momentum=0.9), "Adam": dict(lr=1e-3), "RMSprop": dict(lr=1e-3),
           "Adagrad": dict(lr=1e-2)}


def make_case(algorithm: str, numel: int, tensors: int, bits: int, device: torch.device,
              min_8bit_size: int) -> torch.optim.Optimizer:
    """An optimizer over `tensors` fp32 parameters of numel elements in all (the remainder in the last), each with a
    gradient, after two steps (its states made)."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    sizes = [numel // tensors] * tensors
    sizes[-1] += numel - sum(sizes)
    params = []
    for size in sizes:
        p = torch.nn.Parameter(torch.randn(size, generator=gen).to(device))
        p.grad = (torch.randn(size, generator=gen) * 1e-2).to(device)
        params.append(p)
    optimizer = getattr(go, algorithm)(params, state_bits=bits, min_8bit_size=min_8bit_size, **OPTIONS[algorithm])
    for _ in range(2):
        optimizer.step()
    return optimizer


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def one_round(optimizer: torch.optim.Optimizer, steps: int, device: torch.device) -> tuple[float, float, float]:
    """(wall ms, gpu ms, issue µs) per step over `steps` steps in a row."""
    step = optimizer.step
    cuda = device.type == "cuda"
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    synchronize(device)
    begin = time.perf_counter()
    if cuda:
        start.record()
    for _ in range(steps):
        step()
    issued = time.perf_counter()
    if cuda:
        end.record()
    synchronize(device)
    finished = time.perf_counter()
    gpu_ms = start.elapsed_time(end) / steps if cuda else float("nan")
    return (finished - begin) * 1e3 / steps, gpu_ms, (issued - begin) * 1e6 / steps


def kernels_per_step(optimizer: torch.optim.Optimizer, device: torch.device) -> str:
    """How many kernels one step launches, counted under torch.profiler ("?" if it cannot count them)."""
    if device.type != "cuda":
        return "-"
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            optimizer.step()
            torch.cuda.synchronize(device)
        return str(sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA))
    except Exception:  # (a count only: never a reason to stop the timing)
        return "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--numel", type=int, default=16 * 1024 * 1024)
    parser.add_argument("--tensors", default="1,200")
    parser.add_argument("--algorithms", default="AdamW,Lion")
    parser.add_argument("--min-8bit-size", type=int, default=4096)
    parser.add_argument("--cpu", action="store_true", help="CPU tensors (no CUDA events)")
    args = parser.parse_args()
    device = torch.device("cpu" if args.cpu or not torch.cuda.is_available() else "cuda")
    cases = {}
    for algorithm in args.algorithms.split(","):
        for tensors in map(int, args.tensors.split(",")):
            for bits in (32, 8):
                cases[(algorithm, tensors, bits)] = make_case(algorithm, args.numel, tensors, bits, device,
                                                             args.min_8bit_size)
    kernels = {key: kernels_per_step(optimizer, device) for key, optimizer in cases.items()}
    results: dict[tuple, list[tuple[float, float, float]]] = {key: [] for key in cases}
    for _ in range(args.rounds):
        for key, optimizer in cases.items():
            results[key].append(one_round(optimizer, args.steps, device))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"{name}; {args.numel} fp32 parameters; {args.rounds} interleaved rounds of {args.steps} eager steps; "
          "median per step (fastest round)")
    print(f"{'case':24s} {'bits':>4s} {'wall ms':>16s} {'gpu ms':>16s} {'issue us':>16s} {'kernels':>7s}")
    for (algorithm, tensors, bits), rounds in results.items():
        columns = []
        for i, scale in ((0, "{:7.3f}"), (1, "{:7.3f}"), (2, "{:7.1f}")):
            values = [r[i] for r in rounds]
            columns.append(f"{scale.format(statistics.median(values))} ({scale.format(min(values)).strip()})")
        print(f"{algorithm + ' x' + str(tensors):24s} {bits:4d} {columns[0]:>16s} {columns[1]:>16s} {columns[2]:>16s} "
              f"{kernels[(algorithm, tensors, bits)]:>7s}")


if __name__ == "__main__":
    main()
