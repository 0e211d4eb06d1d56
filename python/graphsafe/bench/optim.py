"""The `optim` suite: one whole optimizer.step(), graphsafe vs torch.optim, as % of copy bandwidth.

Three groups of measurements, each one record per method:
- compare: AdamW and SGD (momentum 0.9) at 4M, 64M and 256M elements, fp32 and bf16 params, in one tensor and
  in 200, graphsafe next to torch.optim's fused implementation (its foreach one where fused does not run, and
  labelled so); on CUDA a row bound by the host is measured in HOST_BOUND_ROUNDS rounds, its methods in
  alternating order, and each method reports the median of its rounds (the host's speed drifts within a run);
- algorithms: all nine graphsafe algorithms at 64M fp32 elements in one tensor;
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
from dataclasses import dataclass
from functools import lru_cache

import torch

import graphsafe.optim

from .harness import BenchContext, Suite, Target, register_suite
from .report import first_line, fmt_bool, fmt_bytes, fmt_float, fmt_ms, markdown_table
from .timing import Timing, gbps, host_us_per_call, input_set_count, time_function

MIB_ELEMENTS = 2**20
FULL_TOTALS = (4 * MIB_ELEMENTS, 64 * MIB_ELEMENTS, 256 * MIB_ELEMENTS)
HEADLINE_TOTAL = 64 * MIB_ELEMENTS
QUICK_DIVISOR = 1024
TENSOR_COUNTS = (1, 200)
DTYPES = (torch.float32, torch.bfloat16)
COMPARED = ("AdamW", "SGD")
ALGORITHMS = ("Adam", "AdamW", "SGD", "RMSprop", "Adagrad", "Lion", "LAMB", "LARS", "AdEMAMix")
TWO_PASS = ("LAMB", "LARS")
# Same arguments for graphsafe and torch; the other algorithms run with their class defaults.
OPTIONS = {"AdamW": dict(lr=1e-3, weight_decay=1e-2), "SGD": dict(lr=1e-3, momentum=0.9)}
TARGET_PCT_COPY_BW = 90.0
TARGET_MS = 0.50
# 8-bit states (issue 4): AdamW at 64M parameters, fp32 and bf16.
TARGET_8BIT_MS = {torch.float32: 0.37, torch.bfloat16: 0.25}
TARGET_8BIT_PCT_COPY_BW = 70.0
GRAPH_WARMUP_STEPS = 3  # eager steps on a side stream before capture, as torch.cuda.graph's docs ask
GRAPH_CHECK_REPLAYS = 2  # replays compared bitwise with the same number of eager steps
# graphsafe in the compare group: its default fp32 states, and on half-precision rows also bf16 states
# (state_bits=16), the storage torch keeps a half parameter's states in; the ≤ torch target compares that one.
SAME_STORAGE_METHOD = "graphsafe-bf16"
# graphsafe's methods and their state_bits (None: the case's own).
GRAPHSAFE_METHODS = {"graphsafe": None, SAME_STORAGE_METHOD: 16}
HOST_TOTAL = 4 * MIB_ELEMENTS
# A compare row whose host time is at least this share of its device time for some method is bound by the host,
# whose speed drifts by up to 2x within a run on the GPU machine: its methods are measured in HOST_BOUND_ROUNDS
# rounds in alternating order (CUDA only; on the CPU every row is host time). Five: with three, one lease's rounds
# of a row still swung from 0.37 to 0.74 ms, and a median of three was one slow round from a wrong verdict.
HOST_BOUND_SHARE = 0.8
HOST_BOUND_ROUNDS = 5
HOST_RUNS, HOST_CALLS = 7, 200  # timing.host_us_per_call
BYTES_FORMULA = (
    "numel × (3 × param bytes + 2 × Σ state bytes): param and grad read, param written, each state read and written"
)


@dataclass(frozen=True)
class OptimCase:
    group: str  # compare, algorithms or graph
    algorithm: str  # a graphsafe.optim class name (and its torch.optim namesake in the compare group)
    total: int  # elements over all tensors
    dtype: torch.dtype
    tensors: int
    state_bits: int = 32  # graphsafe's states (torch's are always its own)

    @property
    def label(self) -> str:
        eight = " 8-bit" if self.state_bits == 8 else ""
        return f"{self.algorithm}{eight} {fmt_count(self.total)} {dtype_short(self.dtype)} ×{self.tensors}"

    def sizes(self) -> list[int]:
        """`tensors` sizes summing to `total`, as equal as possible (the first ones one element larger)."""
        count = min(self.tensors, self.total)
        base, extra = divmod(self.total, count)
        return [base + (1 if i < extra else 0) for i in range(count)]


def fmt_count(elements: int) -> str:
    for suffix, scale in (("M", 2**20), ("K", 2**10)):
        if elements % scale == 0:
            return f"{elements // scale}{suffix}"
    return str(elements)


def dtype_short(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.uint8: "8-bit"}.get(dtype, str(dtype))


def _divisor(quick: bool) -> int:
    return QUICK_DIVISOR if quick else 1


def compare_cases(quick: bool) -> list[OptimCase]:
    return [
        OptimCase("compare", algorithm, total // _divisor(quick), dtype, tensors)
        for algorithm in COMPARED
        for total in FULL_TOTALS
        for dtype in DTYPES
        for tensors in TENSOR_COUNTS
    ]


def algorithm_cases(quick: bool) -> list[OptimCase]:
    return [OptimCase("algorithms", a, HEADLINE_TOTAL // _divisor(quick), torch.float32, 1) for a in ALGORITHMS]


def eight_bit_cases(quick: bool) -> list[OptimCase]:
    """All nine algorithms with 8-bit states at 64M fp32, and AdamW at 64M bf16."""
    total = HEADLINE_TOTAL // _divisor(quick)
    cases = [OptimCase("8bit", a, total, torch.float32, 1, state_bits=8) for a in ALGORITHMS]
    return cases + [OptimCase("8bit", "AdamW", total, torch.bfloat16, 1, state_bits=8)]


def graph_cases(quick: bool) -> list[OptimCase]:
    return [OptimCase("graph", "AdamW", HEADLINE_TOTAL // _divisor(quick), torch.float32, n) for n in TENSOR_COUNTS]


def host_cases(quick: bool) -> list[OptimCase]:
    return [OptimCase("host", a, HOST_TOTAL // _divisor(quick), torch.float32, n) for a in COMPARED for n in TENSOR_COUNTS]


def headline_case(quick: bool) -> OptimCase:
    return OptimCase("compare", "AdamW", HEADLINE_TOTAL // _divisor(quick), torch.float32, 1)


# ---- building optimizers ----


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
    return getattr(graphsafe.optim, algorithm)(params, **OPTIONS.get(algorithm, {}), state_bits=state_bits)


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


def _describe_states(optimizer: torch.optim.Optimizer) -> tuple[list[str], str]:
    states = state_tensors(optimizer, _params(optimizer)[0])
    dtypes = sorted({dtype_short(s.dtype) for s in states.values()})
    return list(states), "/".join(dtypes) or "-"


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
        names, state_dtype = _describe_states(optimizer)
        timing, host_ms = time_steps(lambda opt: opt.step(), input_sets, ctx)
        record |= _timing_fields(ctx, timing, host_ms, moved)
        record |= {"bytes_per_element": round(moved / case.total, 3), "states": names, "state_dtype": state_dtype,
                   "input_sets": len(input_sets)}
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


def host_bound(records: list[dict]) -> bool:
    return any("ms_median" in r and r["host_ms"] >= HOST_BOUND_SHARE * r["ms_median"] for r in records)


def measure_compare_case(ctx: BenchContext, case: OptimCase, rounds_wanted: int | None = None) -> list[dict]:
    """One compare row: each method once, and on CUDA, where the row is bound by the host, in
    HOST_BOUND_ROUNDS - 1 more rounds of alternating order (combine_rounds); speed-ups against torch's result.
    rounds_wanted: that many rounds whatever the row (tools/time_compare_rounds.py)."""
    methods = compare_methods(case)
    rounds = [[measure_method(ctx, case, m) for m in methods]]
    if rounds_wanted is None:
        rounds_wanted = HOST_BOUND_ROUNDS if ctx.device.type == "cuda" and host_bound(rounds[0]) else 1
    for r in range(1, rounds_wanted):
        order = methods[::-1] if r % 2 else methods
        by_method = {m: measure_method(ctx, case, m) for m in order}
        rounds.append([by_method[m] for m in methods])
    records = [combine_rounds([round_[i] for round_ in rounds], ctx) for i in range(len(methods))]
    torch_ms = records[0].get("ms_median")
    for record in records[1:]:
        if torch_ms is not None and "ms_median" in record:
            record["speedup_vs_torch"] = round(torch_ms / record["ms_median"], 3)
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

    for case in compare_cases(ctx.quick):
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


def _index(records: list[dict]) -> dict[tuple[str, str, str], dict]:
    return {(r["group"], r["case"], r["method"]): r for r in records if r.get("record") == "measurement"}


def evaluate_targets(records: list[dict], ctx: BenchContext) -> list[Target]:
    found = _index(records)
    head = headline_case(ctx.quick)
    ours = found.get(("compare", head.label, "graphsafe"), {})
    targets = [
        _absolute_target(f"{head.label}: graphsafe ≥ {TARGET_PCT_COPY_BW:.0f}% of copy BW", ours, "pct_copy_bw",
                         TARGET_PCT_COPY_BW, higher_is_better=True, unit="%", ctx=ctx),
        _absolute_target(f"{head.label}: graphsafe median ≤ {TARGET_MS:.2f} ms", ours, "ms_median", TARGET_MS,
                         higher_is_better=False, unit=" ms", ctx=ctx),
    ]
    for case in compare_cases(ctx.quick):  # the same state storage as torch's: fp32, or bf16 for bf16 parameters
        method = "graphsafe" if case.dtype == torch.float32 else SAME_STORAGE_METHOD
        targets.append(_relative_target(case, found.get(("compare", case.label, method), {}),
                                        found.get(("compare", case.label, "torch"), {}), ctx))
    for case in eight_bit_cases(ctx.quick):
        if case.algorithm != "AdamW":
            continue
        eight = found.get(("8bit", case.label, "graphsafe"), {})
        limit = TARGET_8BIT_MS[case.dtype]
        targets.append(_absolute_target(f"{case.label}: median ≤ {limit:.2f} ms", eight, "ms_median", limit,
                                        higher_is_better=False, unit=" ms", ctx=ctx))
        if case.dtype == torch.float32:
            targets.append(_absolute_target(f"{case.label}: ≥ {TARGET_8BIT_PCT_COPY_BW:.0f}% of copy BW", eight,
                                            "pct_copy_bw", TARGET_8BIT_PCT_COPY_BW, higher_is_better=True,
                                            unit="%", ctx=ctx))
    return targets


def _absolute_target(description, ours, key, limit, *, higher_is_better, unit, ctx) -> Target:
    threshold = f"{'≥' if higher_is_better else '≤'} {limit:g}{unit}"
    if key not in ours:
        return Target("optim", description, "ERROR", threshold=threshold, note=ours.get("error", "missing"))
    value = f"{ours[key]:.3f}{unit}" if unit == " ms" else f"{ours[key]:.1f}{unit}"
    if ctx.quick:
        return Target("optim", description, "SKIP", value, threshold, "target is for full sizes")
    met = ours[key] >= limit if higher_is_better else ours[key] <= limit
    note = "" if ctx.device.type == "cuda" else "target is for an H200"
    return Target("optim", description, "PASS" if met else "MISS", value, threshold, note)


def _relative_target(case: OptimCase, ours: dict, theirs: dict, ctx: BenchContext) -> Target:
    impl = theirs.get("impl", "fused")
    states = "fp32" if case.dtype == torch.float32 else "bf16"
    description = f"{case.label}: graphsafe ({states} states) ≤ torch {impl}"
    if "ms_median" not in ours or "ms_median" not in theirs:
        note = ours.get("error") or theirs.get("error") or "missing"
        return Target("optim", description, "ERROR", note=note)
    value = f"{ours['ms_median']:.3f} vs {theirs['ms_median']:.3f} ms"
    status = "PASS" if ours["ms_median"] <= theirs["ms_median"] else "MISS"
    return Target("optim", description, status, value, f"≤ torch {impl}", "quick sizes" if ctx.quick else "")


def _method_name(record: dict) -> str:
    return "graphsafe" if record["method"] in GRAPHSAFE_METHODS else f"torch {record['impl']}"


def _timing_cells(record: dict | None) -> list[str]:
    if not record or "ms_median" not in record:
        return ["-"] * 5
    return [fmt_ms(record["ms_median"]), fmt_ms(record["ms_min"]), fmt_ms(record["host_ms"]),
            fmt_float(record["gbps"]), fmt_float(record["pct_copy_bw"])]


def render(records: list[dict], ctx: BenchContext) -> str:
    found = _index(records)
    errors = [f"- {r['group']} {r['case']} {_method_name(r)}: {r['error']}" for r in found.values() if "error" in r]
    parts = [f"## optimizer step: graphsafe vs torch.optim ({ctx.describe_device()})", _compare_table(found, ctx),
             "### all nine graphsafe algorithms", _algorithms_table(found, ctx, algorithm_cases(ctx.quick)),
             "### 8-bit states (state_bits=8, block_size=256; absmax not counted in B/elem)",
             _algorithms_table(found, ctx, eight_bit_cases(ctx.quick)),
             "### graphsafe AdamW step captured in a CUDA graph", _graph_table(found, ctx),
             f"### host time of an eager step (µs per step, best of {HOST_RUNS} runs of {HOST_CALLS} steps)",
             _host_table(found, ctx), _legend(records, ctx)]
    if errors:
        parts.append("Errors:\n" + "\n".join(errors))
    return "\n\n".join(parts)


def _compare_table(found: dict, ctx: BenchContext) -> str:
    headers = ("case", "method", "state dtype", "B/elem", "ms median", "ms min", "host ms", "GB/s", "% copy BW",
               "× vs torch")
    rows = []
    for case in compare_cases(ctx.quick):
        for method in ("graphsafe", SAME_STORAGE_METHOD, "torch"):
            r = found.get(("compare", case.label, method))
            if r is None:
                continue
            speedup = f"{r['speedup_vs_torch']:.2f}" if "speedup_vs_torch" in r else "-"
            rows.append((case.label, _method_name(r), r.get("state_dtype", "-"),
                         fmt_float(r.get("bytes_per_element"), 0), *_timing_cells(r), speedup))
    return markdown_table(headers, rows, (False, False, False) + (True,) * 7)


def _algorithms_table(found: dict, ctx: BenchContext, cases: list[OptimCase]) -> str:
    headers = ("algorithm", "states", "B/elem", "ms median", "ms min", "host ms", "GB/s", "% copy BW (roofline)",
               "note")
    rows = []
    for case in cases:
        r = found.get((case.group, case.label, "graphsafe"))
        if r is None:
            continue
        note = "2 passes; bytes of 1" if case.algorithm in TWO_PASS else ""
        options = OPTIONS.get(case.algorithm)
        if options:
            note = ", ".join(f"{k}={v:g}" for k, v in options.items()) + (f"; {note}" if note else "")
        rows.append((case.label, ", ".join(r.get("states", [])) or "-", fmt_float(r.get("bytes_per_element"), 0),
                     *_timing_cells(r), note))
    return markdown_table(headers, rows, (False, False) + (True,) * 6 + (False,))


def _graph_table(found: dict, ctx: BenchContext) -> str:
    headers = ("case", "eager ms", "replay ms", "eager host ms", "replay host ms", "replay % copy BW",
               "replay = eager bitwise")
    rows = []
    for case in graph_cases(ctx.quick):
        r = found.get(("graph", case.label, "graphsafe"), {})
        eager = found.get(("compare", case.label, "graphsafe"), {})
        if "skipped" in r:
            rows.append((case.label, fmt_ms(eager.get("ms_median")), f"n/a ({ctx.device.type})", "-", "-", "-", "-"))
            continue
        rows.append((case.label, fmt_ms(eager.get("ms_median")), fmt_ms(r.get("ms_median")),
                     fmt_ms(eager.get("host_ms")), fmt_ms(r.get("host_ms")), fmt_float(r.get("pct_copy_bw")),
                     fmt_bool(r.get("replay_equals_eager"))))
    return markdown_table(headers, rows, (False,) + (True,) * 5 + (False,))


def _host_table(found: dict, ctx: BenchContext) -> str:
    headers = ("case", "graphsafe µs", "torch µs", "torch impl", "× vs torch")
    rows = []
    for case in host_cases(ctx.quick):
        ours, theirs = found.get(("host", case.label, "graphsafe"), {}), found.get(("host", case.label, "torch"), {})
        a, b = ours.get("host_us_per_step"), theirs.get("host_us_per_step")
        rows.append((case.label, fmt_float(a), fmt_float(b), theirs.get("impl", "-"),
                     f"{b / a:.2f}" if a and b else "-"))
    return markdown_table(headers, rows, (False, True, True, False, True))


def _legend(records: list[dict], ctx: BenchContext) -> str:
    fallbacks = sorted({(r["algorithm"], r["dtype"], r["fused_unavailable"])
                        for r in records if "fused_unavailable" in r})
    timer = "CUDA events, the host queueing steps ahead" if ctx.device.type == "cuda" else "time.perf_counter"
    lines = [
        "What is timed: one whole optimizer.step() (bookkeeping, state and step-counter updates, every launch), "
        f"{timer}. Gradients ~ N(0,1) are set once; each optimizer steps once before the timer's warm-up, so its "
        "state exists; the same parameters are then stepped again and again. n tensors: sizes summing to the "
        "total, split equally, each its own allocation.",
        f"Min bytes = {BYTES_FORMULA}, with the states each method actually holds: graphsafe's default "
        "(state_bits=32) keeps fp32 states for every param dtype, torch keeps them in the param dtype (so bf16 "
        "AdamW: graphsafe 22 B/elem, torch 14); on bf16 rows graphsafe also runs with state_bits=16 (bf16 states, "
        "state dtype bf16), the storage torch uses, and the ≤ torch target compares that row. LAMB and LARS read the tensors twice (norms, then update); they are charged one pass, the "
        "roofline. GB/s = min bytes / median; % copy BW against the copy above (100% = the step at copy speed).",
        "host ms: median wall time of the step() call on the host; on CUDA, where it approaches ms median the "
        "step is bound by the host, not by the device. × vs torch = torch's median / graphsafe's (> 1: faster). "
        f"On CUDA a row where some method's host ms is at least {HOST_BOUND_SHARE:.0%} of its ms median is "
        f"measured in {HOST_BOUND_ROUNDS} rounds, the methods' order alternating, and each method's ms median is "
        "the median of its rounds' (the host's speed drifts within a run; the JSON records keep the rounds).",
        "Hyperparameters: AdamW lr=1e-3 weight_decay=1e-2, SGD lr=1e-3 momentum=0.9 (both libraries); other "
        "algorithms: graphsafe's defaults. skip_zeros off.",
        f"CUDA graph: {GRAPH_WARMUP_STEPS} eager steps on a side stream, one step captured, replayed; the first "
        f"{GRAPH_CHECK_REPLAYS} replays are compared bitwise (params, states, step) with the same number of eager "
        "steps from the same start. eager ms: the compare row of the same case.",
        f"Host time: one optimizer stepped {HOST_CALLS} times in a row, {HOST_RUNS} runs, the fastest run per step "
        "(the device synchronised between runs; torch's and graphsafe's runs alternate); × vs torch = torch's / graphsafe's (> 1: faster).",
    ]
    if ctx.quick:
        lines.append(f"Quick sizes: element counts of the full cases divided by {QUICK_DIVISOR}; "
                     f"full sizes total {', '.join(fmt_count(t) for t in FULL_TOTALS)} "
                     f"(fp32 AdamW at {fmt_count(FULL_TOTALS[-1])} moves {fmt_bytes(FULL_TOTALS[-1] * 28)} a step).")
    for algorithm, dtype, reason in fallbacks:
        lines.append(f"torch {algorithm} {dtype}: fused=True does not run here ({reason}); foreach=True is timed.")
    return "\n".join(lines)


SUITE = register_suite(
    Suite(
        name="optim",
        description="optimizer step: graphsafe vs torch.optim fused (AdamW, SGD), nine algorithms, CUDA graph replay",
        run=run_suite,
        targets=evaluate_targets,
        render=render,
    )
)
