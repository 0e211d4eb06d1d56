"""The `cpu` suite: graphsafe's CPU backend side by side with PyTorch's CPU kernels (issue 22's cases).

- optimizer steps: AdamW, SGD (momentum 0.9) and Adagrad over 4M and 16M fp32 parameters in one tensor and 4M in
  200 tensors; torch.optim's `fused=True` CPU step, graphsafe with 32-bit states and with 8-bit states;
- embedding backward: graphsafe.ops.embedding_backward, aten.embedding_dense_backward and
  zeros(V, D).index_add_(0, idx, grad) on three cases.

Times are host-clock medians of whole calls (the CPU backend runs on the calling thread and OpenMP's threads).
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
from .timing import time_function

QUICK_DIVISOR = 64
OPTIMIZERS = {"AdamW": dict(lr=1e-3, weight_decay=1e-2), "SGD": dict(lr=1e-3, momentum=0.9),
              "Adagrad": dict(lr=1e-2)}
OPTIMIZER_METHODS = ("torch fused", "graphsafe 32-bit", "graphsafe 8-bit")
EMBEDDING_METHODS = ("graphsafe", "aten", "index_add")
EIGHT_BIT_LIMIT = 2.0  # the 8-bit step's time at most this many times the 32-bit step's


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


def _measure(ctx: BenchContext, record: dict, fn) -> dict:
    try:
        timing = time_function(fn, [()], ctx.device, ctx.timer)
        record.update(ms_median=timing.ms_median, ms_min=timing.ms_min, repeats=timing.repeats)
    except (RuntimeError, ValueError, MemoryError) as error:
        record["error"] = first_line(error)
    ctx.emit(record)
    return record


def run(ctx: BenchContext) -> list[dict]:
    if ctx.device.type != "cpu":
        return []  # (a CPU suite: `graphsafe bench --suite cpu --device cpu`)
    records = []
    for case in optimizer_cases(ctx.quick):
        for method in OPTIMIZER_METHODS:
            generator = torch.Generator().manual_seed(ctx.seed)
            record = dict(record="measurement", suite="cpu", kind="optimizer", case=case.name, method=method,
                          algorithm=case.algorithm, total=case.total, tensors=case.tensors)
            records.append(_measure(ctx, record, _optimizer_step(method, case, generator)))
    for case in embedding_cases(ctx.quick):
        indices, grad = case.indices(ctx.seed), case.grad(torch.Generator().manual_seed(ctx.seed))
        for method in EMBEDDING_METHODS:
            record = dict(record="measurement", suite="cpu", kind="embedding", case=case.name, method=method,
                          **case.fields())
            records.append(_measure(ctx, record, _embedding_backward(method, case, grad, indices)))
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
    return markdown_table(["case", "method", "ms median", "ms min", "x vs torch fused / aten", "error"], rows)


register_suite(Suite("cpu", "the CPU backend: optimizer steps and embedding backward vs PyTorch's CPU kernels", run,
                     targets, render))
