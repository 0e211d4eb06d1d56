"""The `optim` suite: one whole optimizer.step(), graphsafe vs torch.optim, as % of copy bandwidth.

Six groups of measurements, each one record per method:
- compare: AdamW and SGD (momentum 0.9) at 4M, 64M and 256M elements, fp32 and bf16 params, in one tensor and
  in 200, graphsafe next to torch.optim's fused implementation (its foreach one where fused does not run, and
  labelled so); on CUDA a row bound by the host is measured in HOST_BOUND_ROUNDS rounds, its methods in
  alternating order, and each method reports the median of its rounds (the host's speed drifts within a run);
- algorithms: every graphsafe algorithm at 64M fp32 elements in one tensor (8bit: those that take 8-bit states);
- state_bits: AdamW and Lion at 16M fp32 elements in one tensor and in 200, graphsafe with 32-bit and with 8-bit
  states on the same parameters, measured as the compare rows are but on CUDA always in HOST_BOUND_ROUNDS rounds
  (the ×200 steps are bound by the host); the 8-bit record's speedup_vs_32bit is the 32-bit median / its own;
- graph: graphsafe AdamW at 64M fp32 captured in a CUDA graph and replayed (host overhead gone), checked
  bitwise against the same steps taken eagerly (CUDA only);
- host: the host time of an eager step alone, AdamW and SGD at 4M fp32 in one tensor and in 200, graphsafe
  next to torch's fused step: best of HOST_RUNS runs of HOST_CALLS steps (a steadier number than the host ms
  of single timed calls, which vary by up to 2x between runs when the step is bound by the host).

Gradients are set once (N(0,1): no element is zero, so skip_zeros would change nothing; it stays off), every
optimizer steps once before the timer's own warm-up (its state exists), and the timed calls step the same
parameters again and again. Each method is charged its own minimum bytes: params and grads read once,
params written once, every state tensor it actually holds read and written once (torch keeps bf16 states
for bf16 params, graphsafe fp32), one pass for LAMB and LARS although they make two.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections import Counter
from functools import lru_cache

import torch

import graphsafe.optim

from .harness import BenchContext, Suite, register_suite
from .optim_cases import (EIGHT_BIT_METHOD, GRAPH_CHECK_REPLAYS, GRAPH_WARMUP_STEPS, GRAPHSAFE_METHODS,
                          HOST_BOUND_ROUNDS, HOST_BOUND_SHARE, HOST_CALLS, HOST_RUNS, OPTIONS, SAME_STORAGE_METHOD,
                          STATE_BITS_GROUP, TWO_PASS, OptimCase, algorithm_cases, compare_cases, dtype_short,
                          eight_bit_cases, graph_cases, host_cases, state_bits_cases)
from .optim_report import evaluate_targets, plot, render
from .report import first_line
from .timing import Timing, gbps, host_us_per_call, input_set_count, time_function


def make_params(case: OptimCase, device: torch.device, seed: int) -> list[torch.nn.Parameter]:
    """The case's parameters, each with its gradient already set; the same seed gives the same values."""
    generator = torch.Generator(device=device).manual_seed(seed)
    params = []
    for numel in case.sizes():
        p = torch.nn.Parameter(torch.randn(numel, dtype=case.dtype, device=device, generator=generator))
        p.grad = torch.randn(numel, dtype=case.dtype, device=device, generator=generator)
        params.append(p)
    return params


def graphsafe_optimizer(algorithm: str, params, state_bits: int = 32) -> torch.optim.Optimizer:
    optimizer = getattr(graphsafe.optim, algorithm)(params, **OPTIONS.get(algorithm, {}), state_bits=state_bits)
    if hasattr(optimizer, "train"):  # AdamWScheduleFree steps in train mode (it starts in eval mode)
        optimizer.train()
    return optimizer


def torch_optimizer(algorithm: str, params, impl: str) -> torch.optim.Optimizer:
    return getattr(torch.optim, algorithm)(params, **OPTIONS[algorithm], **{impl: True})


@lru_cache(maxsize=None)
def torch_impl(algorithm: str, dtype: torch.dtype, device: torch.device) -> tuple[str, str]:
    """("fused", "") when torch's fused step runs for this dtype and device, else ("foreach", why not)."""
    p = torch.nn.Parameter(torch.zeros(8, dtype=dtype, device=device))
    p.grad = torch.ones_like(p)
    try:
        torch_optimizer(algorithm, [p], "fused").step()
    except Exception as exc:  # noqa: BLE001 - any refusal means: use foreach, and say why
        return "foreach", first_line(exc)
    return "fused", ""


def new_optimizer(case: OptimCase, method: str, device: torch.device, seed: int) -> torch.optim.Optimizer:
    params = make_params(case, device, seed)
    if method in GRAPHSAFE_METHODS:
        return graphsafe_optimizer(case.algorithm, params, GRAPHSAFE_METHODS[method] or case.state_bits)
    return torch_optimizer(case.algorithm, params, torch_impl(case.algorithm, case.dtype, device)[0])


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def state_tensors(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> dict[str, torch.Tensor]:
    """The per-element states the optimizer holds for p (its step counter and other scalars left out)."""
    state = optimizer.state.get(p, {})
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and v.shape == p.shape and k != "step"}


def min_bytes(optimizer: torch.optim.Optimizer) -> int:
    """One step's minimum traffic: BYTES_FORMULA over every parameter, with the states actually held."""
    total = 0
    for p in _params(optimizer):
        states = state_tensors(optimizer, p).values()
        total += p.numel() * (3 * p.element_size() + 2 * sum(s.element_size() for s in states))
    return total


def _describe_states(optimizer: torch.optim.Optimizer) -> tuple[list[str], str, dict[str, int]]:
    """The first parameter's state names; the storage of the states over every parameter ("fp32", or e.g.
    "8-bit ×150, fp32 ×50" where tensors under min_8bit_size kept fp32 states with state_bits=8); the number of
    tensors per storage."""
    per_tensor = Counter()
    for p in _params(optimizer):
        per_tensor["/".join(sorted({dtype_short(s.dtype) for s in state_tensors(optimizer, p).values()})) or "-"] += 1
    names = list(state_tensors(optimizer, _params(optimizer)[0]))
    mixed = ", ".join(f"{storage} ×{n}" for storage, n in sorted(per_tensor.items()))
    return names, next(iter(per_tensor)) if len(per_tensor) == 1 else mixed, dict(per_tensor)


def _release(device: torch.device) -> None:
    if device.type == "cuda":
        gc.collect()  # a safety net: anything left in a reference cycle would keep gigabytes of state alive
        torch.cuda.empty_cache()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---- measuring ----


def build_input_sets(case: OptimCase, method: str, ctx: BenchContext) -> list[tuple[torch.optim.Optimizer]]:
    """One optimizer over the case's parameters, plus copies when one would stay in L2; each has stepped once."""
    first = new_optimizer(case, method, ctx.device, ctx.seed)
    first.step()
    sets = [(first,)]
    for i in range(1, input_set_count(ctx.device, min_bytes(first))):
        extra = new_optimizer(case, method, ctx.device, ctx.seed + i)
        extra.step()
        sets.append((extra,))
    _synchronize(ctx.device)
    return sets


def time_steps(call, input_sets: list[tuple], ctx: BenchContext) -> tuple[Timing, float]:
    """The timer's device (or host) time per call, and the median host time of launching one call."""
    host_seconds: list[float] = []

    def timed(*args):
        begin = time.perf_counter()
        call(*args)
        host_seconds.append(time.perf_counter() - begin)

    timing = time_function(timed, input_sets, ctx.device, ctx.timer)
    return timing, statistics.median(host_seconds[-timing.repeats:]) * 1e3


def _base_record(ctx: BenchContext, case: OptimCase, method: str, impl: str) -> dict:
    return {
        "record": "measurement",
        "suite": "optim",
        "group": case.group,
        "case": case.label,
        "algorithm": case.algorithm,
        "method": method,
        "impl": impl,
        "device": ctx.device.type,
        "dtype": dtype_short(case.dtype),
        "numel": case.total,
        "tensors": case.tensors,
        "options": OPTIONS.get(case.algorithm, "class defaults"),
        "passes": 2 if case.algorithm in TWO_PASS else 1,
        "quick": ctx.quick,
    }


def _timing_fields(ctx: BenchContext, timing: Timing, host_ms: float, moved: int) -> dict:
    bandwidth = gbps(moved, timing.ms_median)
    return {
        "ms_median": round(timing.ms_median, 5),
        "ms_min": round(timing.ms_min, 5),
        "host_ms": round(host_ms, 5),
        "repeats": timing.repeats,
        "bytes": moved,
        "gbps": round(bandwidth, 2),
        "pct_copy_bw": round(100 * bandwidth / ctx.copy_bw_gbps, 2),
    }


def _impl(ctx: BenchContext, case: OptimCase, method: str) -> tuple[str, str]:
    """The implementation a method runs, and why torch's is not its fused one ("" if it is)."""
    if method in GRAPHSAFE_METHODS:
        return "graphsafe", ""
    return torch_impl(case.algorithm, case.dtype, ctx.device)


def measure_method(ctx: BenchContext, case: OptimCase, method: str) -> dict:
    """Time case × method; a failure becomes the record's "error" so that the other methods still run."""
    impl, fallback_reason = _impl(ctx, case, method)
    record = _base_record(ctx, case, method, impl)
    if fallback_reason:
        record["fused_unavailable"] = fallback_reason
    input_sets: list[tuple] = []
    optimizer = None
    try:
        input_sets = build_input_sets(case, method, ctx)
        optimizer = input_sets[0][0]
        moved = min_bytes(optimizer)
        names, state_dtype, tensors_by_state_dtype = _describe_states(optimizer)
        timing, host_ms = time_steps(lambda opt: opt.step(), input_sets, ctx)
        record |= _timing_fields(ctx, timing, host_ms, moved)
        record |= {"bytes_per_element": round(moved / case.total, 3), "states": names, "state_dtype": state_dtype,
                   "tensors_by_state_dtype": tensors_by_state_dtype, "input_sets": len(input_sets)}
    except Exception as exc:  # one failing method must not hide the others' results
        record["error"] = first_line(exc)
    finally:
        input_sets = optimizer = None  # drop every reference before handing the memory back
        _release(ctx.device)
    return record


def _equal_steps(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> bool:
    """Parameters, per-element states and step counters all bitwise equal."""
    for p, q in zip(_params(a), _params(b)):
        if not torch.equal(p, q):
            return False
        sa, sb = a.state[p], b.state[q]
        if sa.keys() != sb.keys() or not all(torch.equal(sa[k], sb[k]) for k in sa):
            return False
    return True


def capture_step(optimizer: torch.optim.Optimizer) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(GRAPH_WARMUP_STEPS):
            optimizer.step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        optimizer.step()
    return graph


def measure_graph(ctx: BenchContext, case: OptimCase) -> dict:
    """graphsafe's step captured once and replayed; first GRAPH_CHECK_REPLAYS replays vs as many eager steps."""
    record = _base_record(ctx, case, "graphsafe", "graphsafe (CUDA graph replay)")
    if ctx.device.type != "cuda":
        return record | {"skipped": "CUDA graphs need a CUDA device"}
    captured = eager = graph = None
    stream = torch.cuda.current_stream()
    try:
        captured = graphsafe_optimizer(case.algorithm, make_params(case, ctx.device, ctx.seed))
        graph = capture_step(captured)
        for _ in range(GRAPH_CHECK_REPLAYS):
            graph.replay()
        eager = graphsafe_optimizer(case.algorithm, make_params(case, ctx.device, ctx.seed))
        for _ in range(GRAPH_WARMUP_STEPS + GRAPH_CHECK_REPLAYS):
            eager.step()
        record["replay_equals_eager"] = _equal_steps(captured, eager)
        eager = None
        _release(ctx.device)
        moved = min_bytes(captured)
        timing, host_ms = time_steps(graph.replay, [()], ctx)
        record |= _timing_fields(ctx, timing, host_ms, moved)
        record |= {"bytes_per_element": round(moved / case.total, 3), "input_sets": 1}
    except Exception as exc:  # a failed capture is a result too; leave the device usable for the rest
        record["error"] = first_line(exc)
        torch.cuda.set_stream(stream)  # torch.cuda.graph leaves its capture stream current when capture fails
        try:
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001 - the error is already recorded
            pass
    finally:
        del captured, eager, graph
        _release(ctx.device)
    return record


def measure_host(ctx: BenchContext, case: OptimCase) -> list[dict]:
    """The host time of one eager step, torch's and graphsafe's: the best of HOST_RUNS runs of HOST_CALLS step()
    calls, the device synchronised between runs (not inside one). The two methods' runs alternate, so that a
    slower spell of a shared host (the H200's varies by up to 2x between leases and within a run) falls on both."""
    methods = ("torch", "graphsafe")
    records, optimizers, best = {}, {}, {}
    for method in methods:
        records[method] = _base_record(ctx, case, method, _impl(ctx, case, method)[0])
        try:
            optimizers[method] = new_optimizer(case, method, ctx.device, ctx.seed)
            optimizers[method].step()
        except Exception as exc:  # one failing method must not hide the other's results
            records[method]["error"] = first_line(exc)
    try:
        for _ in range(HOST_RUNS):
            for method, optimizer in list(optimizers.items()):
                try:
                    us = host_us_per_call(optimizer.step, ctx.device, HOST_CALLS, runs=1)
                except Exception as exc:  # this method stops; the other goes on
                    records[method]["error"] = first_line(exc)
                    del optimizers[method]
                    continue
                best[method] = min(best.get(method, us), us)
    finally:
        optimizers.clear()
        _release(ctx.device)
    for method, us in best.items():
        if "error" not in records[method]:
            records[method] |= {"host_us_per_step": round(us, 2), "runs": HOST_RUNS, "calls": HOST_CALLS}
    return [records[method] for method in methods]


def compare_methods(case: OptimCase) -> list[str]:
    """torch, graphsafe, and on half-precision rows graphsafe with bf16 states."""
    return ["torch", "graphsafe"] + ([SAME_STORAGE_METHOD] if case.dtype != torch.float32 else [])


def row_methods(case: OptimCase) -> tuple[list[str], str]:
    """A row's methods, the first the one the others are held against, and the field of that ratio: a compare row
    against torch, a state_bits row's 8-bit states against 32-bit (the case's own state_bits)."""
    if case.group == STATE_BITS_GROUP:
        return ["graphsafe", EIGHT_BIT_METHOD], "speedup_vs_32bit"
    return compare_methods(case), "speedup_vs_torch"


def host_bound(records: list[dict]) -> bool:
    return any("ms_median" in r and r["host_ms"] >= HOST_BOUND_SHARE * r["ms_median"] for r in records)


def measure_compare_case(ctx: BenchContext, case: OptimCase, rounds_wanted: int | None = None) -> list[dict]:
    """One compare or state_bits row: each of its methods (row_methods) once, and on CUDA, where the row is bound by
    the host or is a state_bits row (its ×200 steps are, and the host's speed drifts within a run), in
    HOST_BOUND_ROUNDS - 1 more rounds of alternating order (combine_rounds); speed-ups against the first method's
    result. rounds_wanted: that many rounds whatever the row (tools/time_compare_rounds.py)."""
    methods, speedup_field = row_methods(case)
    rounds = [[measure_method(ctx, case, m) for m in methods]]
    if rounds_wanted is None:
        in_rounds = case.group == STATE_BITS_GROUP or host_bound(rounds[0])
        rounds_wanted = HOST_BOUND_ROUNDS if ctx.device.type == "cuda" and in_rounds else 1
    for r in range(1, rounds_wanted):
        order = methods[::-1] if r % 2 else methods
        by_method = {m: measure_method(ctx, case, m) for m in order}
        rounds.append([by_method[m] for m in methods])
    records = [combine_rounds([round_[i] for round_ in rounds], ctx) for i in range(len(methods))]
    base_ms = records[0].get("ms_median")
    for record in records[1:]:
        if base_ms is not None and "ms_median" in record:
            record[speedup_field] = round(base_ms / record["ms_median"], 3)
    return records


def combine_rounds(records: list[dict], ctx: BenchContext) -> dict:
    """A method's rounds as one record: the first round's, with the median of the rounds' ms medians (and
    bandwidth from it), the smallest ms min, the median host ms, and the rounds' ms medians ("rounds"). A round
    that failed makes the record that failure."""
    if len(records) == 1 or any("ms_median" not in r for r in records):
        return next((r for r in records if "ms_median" not in r), records[0])
    combined = dict(records[0])
    medians = [r["ms_median"] for r in records]
    ms = statistics.median(medians)
    bandwidth = gbps(combined["bytes"], ms)
    combined |= {"ms_median": round(ms, 5), "ms_min": min(r["ms_min"] for r in records),
                 "host_ms": round(statistics.median(r["host_ms"] for r in records), 5),
                 "gbps": round(bandwidth, 2), "pct_copy_bw": round(100 * bandwidth / ctx.copy_bw_gbps, 2),
                 "rounds": medians}
    return combined


def run_suite(ctx: BenchContext) -> list[dict]:
    records = []

    def emit(record: dict) -> dict:
        ctx.emit(record)
        records.append(record)
        return record

    for case in compare_cases(ctx.quick) + state_bits_cases(ctx.quick):
        for record in measure_compare_case(ctx, case):
            emit(record)
    for case in algorithm_cases(ctx.quick) + eight_bit_cases(ctx.quick):
        emit(measure_method(ctx, case, "graphsafe"))
    for case in graph_cases(ctx.quick):
        emit(measure_graph(ctx, case))
    for case in host_cases(ctx.quick):
        for record in measure_host(ctx, case):
            emit(record)
    return records


# ---- targets and report ----


SUITE = register_suite(
    Suite(
        name="optim",
        description=("optimizer step: graphsafe vs torch.optim fused (AdamW, SGD), every algorithm, 8-bit vs 32-bit "
                     "states, CUDA graph replay"),
        run=run_suite,
        targets=evaluate_targets,
        render=render,
        plot=plot,
    )
)
