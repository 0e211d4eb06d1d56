"""Timing and copy bandwidth: CUDA events on the GPU, time.perf_counter on the CPU.

Every timed call is one call of `fn(*input_set)`; input sets rotate so that, on CUDA, a case whose inputs fit
in L2 does not measure cache hits (see `input_set_count`).
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

_FALLBACK_L2_BYTES = 60 * 1024 * 1024  # H200's L2; used when the device does not report its own
_MAX_INPUT_SETS = 64
_COPY_BYTES_CUDA = 2 * 1024**3
_COPY_BYTES_CUDA_FALLBACK = 512 * 1024**2
_COPY_BYTES_CPU = 256 * 1024**2


@dataclass(frozen=True)
class TimerConfig:
    warmup: int
    repeats: int


@dataclass(frozen=True)
class Timing:
    ms_median: float
    ms_min: float
    repeats: int


@dataclass(frozen=True)
class CopyBandwidth:
    gbps: float
    bytes_moved: int  # read + written, per copy
    ms_median: float


def default_timer_config(device: torch.device, quick: bool, repeats: int | None = None) -> TimerConfig:
    """CUDA: 30 repeats (20 quick) after 5 warm-up calls; CPU: 10 quick (3 full, the calls are long) after 2."""
    if device.type == "cuda":
        return TimerConfig(warmup=5, repeats=repeats or (20 if quick else 30))
    return TimerConfig(warmup=2, repeats=repeats or (10 if quick else 3))


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def l2_cache_bytes(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    reported = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)
    return int(reported) or _FALLBACK_L2_BYTES


def input_set_count(device: torch.device, bytes_per_set: int) -> int:
    """How many copies of the inputs to rotate through so that each is out of L2 when it comes round again."""
    l2 = l2_cache_bytes(device)
    if l2 == 0 or bytes_per_set >= 2 * l2:
        return 1
    return min(_MAX_INPUT_SETS, math.ceil(2 * l2 / max(bytes_per_set, 1)))


def time_function(
    fn: Callable[..., object], input_sets: Sequence[tuple], device: torch.device, config: TimerConfig
) -> Timing:
    if device.type == "cuda":
        samples = _time_cuda(fn, input_sets, config)
    else:
        samples = _time_host(fn, input_sets, config)
    return Timing(ms_median=statistics.median(samples), ms_min=min(samples), repeats=len(samples))


def _time_cuda(fn: Callable[..., object], input_sets: Sequence[tuple], config: TimerConfig) -> list[float]:
    for i in range(config.warmup):
        fn(*input_sets[i % len(input_sets)])
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(config.repeats)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(config.repeats)]
    # Launch every repeat before synchronising: the host runs ahead, so the events time the device work. The
    # events are recorded on the stream fetched once: Event.record() without one builds the current Stream object
    # at each call, host time of the harness's own that can exceed a small call's device time, and then the events
    # time the harness (docs/benchmarks.md, "How the harness's events are recorded").
    stream = torch.cuda.current_stream()
    for i in range(config.repeats):
        args = input_sets[i % len(input_sets)]
        starts[i].record(stream)
        fn(*args)
        ends[i].record(stream)
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in zip(starts, ends)]


def _time_host(fn: Callable[..., object], input_sets: Sequence[tuple], config: TimerConfig) -> list[float]:
    for i in range(config.warmup):
        fn(*input_sets[i % len(input_sets)])
    samples = []
    for i in range(config.repeats):
        args = input_sets[i % len(input_sets)]
        begin = time.perf_counter()
        fn(*args)
        samples.append((time.perf_counter() - begin) * 1e3)
    return samples


def time_in_turn(fns: Sequence[Callable[[], object]], config: TimerConfig) -> list[Timing]:
    """Host-clock timings of several calls timed in turn: each round calls every fn once, the first one of a round
    moving on by one each round. Methods compared side by side on a shared host (the CPU suite) then see the same
    drift of the machine, and each call finds the caches as the others leave them, as a training step finds them
    after the forward and backward passes; timing one method's repeats in a row lets slow minutes of the host fall
    on one method only."""
    for _ in range(config.warmup):
        for fn in fns:
            fn()
    samples: list[list[float]] = [[] for _ in fns]
    for round_ in range(config.repeats):
        for k in range(len(fns)):
            i = (round_ + k) % len(fns)
            begin = time.perf_counter()
            fns[i]()
            samples[i].append((time.perf_counter() - begin) * 1e3)
    return [Timing(ms_median=statistics.median(s), ms_min=min(s), repeats=len(s)) for s in samples]


def host_us_per_call(fn: Callable[[], object], device: torch.device, calls: int = 200, runs: int = 7) -> float:
    """The host time of one call of fn, in µs: the fastest of `runs` runs of `calls` calls in a row, the device
    synchronised between runs (not inside one: with fewer launches than a CUDA stream queues, the host never
    waits for the GPU)."""
    best = float("inf")
    for _ in range(runs):
        synchronize(device)
        begin = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, time.perf_counter() - begin)
    synchronize(device)
    return best / calls * 1e6


def measure_copy_bandwidth(device: torch.device, config: TimerConfig) -> CopyBandwidth:
    """Median bandwidth of one large dst.copy_(src) on `device`, counting bytes read plus bytes written."""
    sizes = (_COPY_BYTES_CUDA, _COPY_BYTES_CUDA_FALLBACK) if device.type == "cuda" else (_COPY_BYTES_CPU,)
    for attempt, size in enumerate(sizes, start=1):
        try:
            ms = _time_copy(device, size, config)
        except torch.OutOfMemoryError:
            if attempt == len(sizes):
                raise
            continue
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()  # hand the buffers back before the suites allocate theirs
        return CopyBandwidth(gbps=gbps(2 * size, ms), bytes_moved=2 * size, ms_median=ms)
    raise AssertionError("unreachable")


def _time_copy(device: torch.device, size: int, config: TimerConfig) -> float:
    src = torch.ones(size, dtype=torch.uint8, device=device)  # written, so first-touch page faults are not timed
    dst = torch.zeros_like(src)
    copy_config = TimerConfig(warmup=config.warmup + 1, repeats=max(config.repeats, 5))
    return time_function(lambda: dst.copy_(src), [()], device, copy_config).ms_median


def gbps(bytes_moved: int, ms: float) -> float:
    return bytes_moved / (ms * 1e-3) / 1e9 if ms > 0 else float("inf")
