"""The `cpu` suite: graphsafe's CPU backend side by side with PyTorch's CPU kernels (issue 22's cases).

- optimizer steps: AdamW, SGD (momentum 0.9) and Adagrad over 4M and 16M fp32 parameters in one tensor and 4M in
  200 tensors; torch.optim's `fused=True` CPU step, graphsafe with 32-bit states and with 8-bit states;
- embedding backward: graphsafe.ops.embedding_backward, aten.embedding_dense_backward and
  zeros(V, D).index_add_(0, idx, grad) on three cases.

Times are host-clock medians of whole calls (the CPU backend runs on the calling thread and OpenMP's threads), the
methods of a case timed in turn, round by round (timing.time_in_turn), so that a slow stretch of a shared host falls
on all of them alike; at full size at least MIN_ROUNDS rounds, more with --repeats.
Targets: graphsafe's 32-bit step at least torch fused's speed on each optimizer row, its 8-bit step within 2x of its
32-bit step, and the embedding backward at least aten's speed; they apply to full sizes on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import graphsafe.ops
import graphsafe.optim

from .harness import BenchContext, Suite, Target, register_suite
from .indices import TableCase
from .optim_cases import fmt_count
from .report import first_line, fmt_ms, markdown_table
from .timing import TimerConfig, time_in_turn

QUICK_DIVISOR = 64
OPTIMIZERS = {"AdamW": dict(lr=1e-3, weight_decay=1e-2), "SGD": dict(lr=1e-3, momentum=0.9),
              "Adagrad": dict(lr=1e-2)}
OPTIMIZER_METHODS = ("torch fused", "graphsafe 32-bit", "graphsafe 8-bit")
EMBEDDING_METHODS = ("graphsafe", "aten", "index_add")
EIGHT_BIT_LIMIT = 2.0  # the 8-bit step's time at most this many times the 32-bit step's
MIN_ROUNDS = 31  # at full size: a shared host needs many rounds, and a round takes under a second here


@dataclass(frozen=True)
class OptimizerCase:
    algorithm: str
    total: int
    tensors: int

    @property
    def name(self) -> str:
        return f"{self.algorithm} {fmt_count(self.total)} ×{self.tensors}"


def optimizer_cases(quick: bool) -> list[OptimizerCase]:
    divisor = QUICK_DIVISOR if quick else 1
    return [OptimizerCase(a, total // divisor, n) for a in OPTIMIZERS
            for total, n in ((4 << 20, 1), (16 << 20, 1), (4 << 20, 200))]


def embedding_cases(quick: bool) -> list[TableCase]:
    divisor = QUICK_DIVISOR if quick else 1
    return [TableCase("llm-small", 32000 // divisor, 256, torch.float32, 8192 // divisor, False),
            TableCase("llm-vocab", 128256 // divisor, 1024, torch.bfloat16, 4096 // divisor, False),
            TableCase("recsys-zipf", (1 << 20) // divisor, 64, torch.float32, 262144 // divisor, True)]


def _optimizer_step(method: str, case: OptimizerCase, generator: torch.Generator):
    size = case.total // case.tensors
    params = [torch.nn.Parameter(torch.randn(size, generator=generator)) for _ in range(case.tensors)]
    for p in params:
        p.grad = torch.randn(size, generator=generator)
    options = OPTIMIZERS[case.algorithm]
    if method == "torch fused":
        optimizer = getattr(torch.optim, case.algorithm)(params, fused=True, **options)
    else:
        bits = 8 if method == "graphsafe 8-bit" else 32
        optimizer = getattr(graphsafe.optim, case.algorithm)(params, state_bits=bits, min_8bit_size=0, **options)
    return optimizer.step


def _embedding_backward(method: str, case: TableCase, grad: torch.Tensor, indices: torch.Tensor):
    v = case.num_weights
    if method == "graphsafe":
        return lambda: graphsafe.ops.embedding_backward(grad, indices, v)
    if method == "aten":
        return lambda: torch.ops.aten.embedding_dense_backward(grad, indices, v, -1, False)
    return lambda: torch.zeros((v, grad.shape[-1]), dtype=grad.dtype).index_add_(0, indices, grad)


def _measure_in_turn(ctx: BenchContext, records: list[dict], makers: list) -> list[dict]:
    """Times one case's methods in turn (timing.time_in_turn), at least MIN_ROUNDS rounds. `makers` build each
    method's call; a method whose making or first call fails gets its error in its record, the others are timed."""
    calls = []
    for record, make in zip(records, makers):
        try:
            call = make()
            call()
            calls.append((record, call))
        except (RuntimeError, ValueError, MemoryError) as error:
            record["error"] = first_line(error)
    config = TimerConfig(warmup=ctx.timer.warmup, repeats=max(ctx.timer.repeats, 1 if ctx.quick else MIN_ROUNDS))
    try:
        timings = time_in_turn([call for _, call in calls], config) if calls else []
        for (record, _), timing in zip(calls, timings):
            record.update(ms_median=timing.ms_median, ms_min=timing.ms_min, repeats=timing.repeats)
    except (RuntimeError, ValueError, MemoryError) as error:  # a later call failed: no method's time stands
        for record, _ in calls:
            record["error"] = first_line(error)
    for record in records:
        ctx.emit(record)
    return records


def run(ctx: BenchContext) -> list[dict]:
    if ctx.device.type != "cpu":
        return []  # (a CPU suite: `graphsafe bench --suite cpu --device cpu`)
    records = []
    for case in optimizer_cases(ctx.quick):
        case_records = [dict(record="measurement", suite="cpu", kind="optimizer", case=case.name, method=method,
                             algorithm=case.algorithm, total=case.total, tensors=case.tensors)
                        for method in OPTIMIZER_METHODS]
        makers = [lambda m=method: _optimizer_step(m, case, torch.Generator().manual_seed(ctx.seed))
                  for method in OPTIMIZER_METHODS]
        records += _measure_in_turn(ctx, case_records, makers)
    for case in embedding_cases(ctx.quick):
        indices, grad = case.indices(ctx.seed), case.grad(torch.Generator().manual_seed(ctx.seed))
        case_records = [dict(record="measurement", suite="cpu", kind="embedding", case=case.name, method=method,
                             **case.fields()) for method in EMBEDDING_METHODS]
        makers = [lambda m=method: _embedding_backward(m, case, grad, indices) for method in EMBEDDING_METHODS]
        records += _measure_in_turn(ctx, case_records, makers)
    return records


def _time(records: list[dict], case: str, method: str) -> float | None:
    return next((r.get("ms_median") for r in records if r["case"] == case and r["method"] == method), None)


def targets(records: list[dict], ctx: BenchContext) -> list[Target]:
    wanted = []  # (description, value, threshold text, passes)
    for case in optimizer_cases(ctx.quick):
        torch_ms, ms32, ms8 = (_time(records, case.name, m) for m in OPTIMIZER_METHODS)
        wanted.append((f"{case.name}: graphsafe 32-bit vs torch fused", torch_ms / ms32 if torch_ms and ms32 else None,
                       ">= 1.0x", lambda x: x >= 1.0))
        wanted.append((f"{case.name}: graphsafe 8-bit / 32-bit time", ms8 / ms32 if ms8 and ms32 else None,
                       f"<= {EIGHT_BIT_LIMIT:.0f}x", lambda x: x <= EIGHT_BIT_LIMIT))
    for case in embedding_cases(ctx.quick):
        ours, aten = _time(records, case.name, "graphsafe"), _time(records, case.name, "aten")
        wanted.append((f"{case.name} embedding backward: graphsafe vs aten", aten / ours if ours and aten else None,
                       ">= 1.0x", lambda x: x >= 1.0))
    out = []
    for description, value, threshold, passes in wanted:
        if ctx.device.type != "cpu" or ctx.quick:
            out.append(Target("cpu", description, "SKIP", note="measured on the CPU at full size"))
        elif value is None:
            out.append(Target("cpu", description, "ERROR", note="not measured"))
        else:
            out.append(Target("cpu", description, "PASS" if passes(value) else "MISS", f"{value:.2f}x", threshold))
    return out


def render(records: list[dict], ctx: BenchContext) -> str:
    if not records:
        return "The cpu suite runs on the CPU only (`--device cpu`)."
    rows = []
    for r in records:
        base = "torch fused" if r["kind"] == "optimizer" else "aten"
        base_ms = _time(records, r["case"], base)
        ratio = f"{base_ms / r['ms_median']:.2f}" if base_ms and r.get("ms_median") else "-"
        rows.append([r["case"], r["method"], fmt_ms(r.get("ms_median")), fmt_ms(r.get("ms_min")), ratio,
                     r.get("error", "")])
    rounds = max((r.get("repeats", 0) for r in records), default=0)
    return (f"The methods of each case timed in turn, {rounds} rounds (medians and minima per method).\n\n"
            + markdown_table(["case", "method", "ms median", "ms min", "x vs torch fused / aten", "error"], rows))


register_suite(Suite("cpu", "the CPU backend: optimizer steps and embedding backward vs PyTorch's CPU kernels", run,
                     targets, render))
