"""The `sparse` suite: one embedding table's whole update (gradient + optimizer step) from a batch of indices.

- torch dense: aten.embedding_dense_backward, then torch.optim.AdamW(fused=True) over the whole table (what a
  model with torch.nn.Embedding does);
- graphsafe dense: graphsafe.ops.embedding_backward, then graphsafe AdamW with skip_zeros over the whole table;
- graphsafe sparse (32- and 8-bit states): graphsafe.ops.embedding_backward_sparse, then graphsafe.optim.sparse_step,
  which touches only the batch's rows (8-bit: the quantisation blocks they share).

Times are CUDA-event medians of whole updates launched back to back; "replay" rows replay the sparse update captured
in a CUDA graph (as compile_step runs a step), so they show the device time without the host's. "bitwise = dense" says whether one sparse
update from a fresh table equals graphsafe's dense skip_zeros update bitwise (parameter and every state).
"""

from __future__ import annotations

import torch

import graphsafe.ops
import graphsafe.optim

from .harness import BenchContext, Suite, Target, register_suite
from .indices import TableCase
from .report import first_line, fmt_bool, fmt_ms, markdown_table
from .timing import synchronize, time_function

METHODS = ("torch dense", "graphsafe dense", "graphsafe sparse 32-bit", "graphsafe sparse 8-bit",
           "graphsafe sparse 32-bit replay", "graphsafe sparse 8-bit replay")
LR = 1e-3
SPEEDUP_TARGET = 20.0


def cases(ctx: BenchContext) -> list[TableCase]:
    if ctx.quick:
        return [TableCase("recsys-zipf (quick)", 65536, 32, torch.float32, 8192, True),
                TableCase("llm-vocab (quick)", 8192, 64, torch.bfloat16, 1024, False)]
    return [TableCase("recsys-zipf", 4 * 1024 * 1024, 128, torch.float32, 262144, True),
            TableCase("llm-vocab", 128256, 4096, torch.bfloat16, 16384, False)]


def _update(method: str, weight: torch.nn.Parameter, indices: torch.Tensor, grad: torch.Tensor):
    """The update function of a method over its own table (its optimizer made here)."""
    v = weight.shape[0]
    if method == "torch dense":
        opt = torch.optim.AdamW([weight], lr=LR, fused=weight.device.type == "cuda")

        def update():
            weight.grad = torch.ops.aten.embedding_dense_backward(grad, indices, v, -1, False)
            opt.step()
        return update, opt
    bits = 8 if "8-bit" in method else 32
    opt = graphsafe.optim.AdamW([weight], lr=LR, skip_zeros=True, state_bits=bits, min_8bit_size=0)
    if method == "graphsafe dense":
        def update():
            weight.grad = graphsafe.ops.embedding_backward(grad, indices, v)
            opt.step()
        return update, opt

    def update():
        rows, row_grads, count = graphsafe.ops.embedding_backward_sparse(grad, indices, v)
        graphsafe.optim.sparse_step(opt, weight, rows, row_grads, count)
    if not method.endswith("replay"):
        return update, opt
    update()  # the states exist before the capture
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        update()  # warm-up off the default stream, as torch's capture needs
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        update()
    return graph.replay, opt


def _sparse_equals_dense(case: TableCase, start: torch.Tensor, indices: torch.Tensor, grad: torch.Tensor) -> bool:
    tables = [torch.nn.Parameter(start.clone()) for _ in range(2)]
    (dense, dense_opt), (sparse, sparse_opt) = (_update(m, t, indices, grad) for m, t in
                                                zip(("graphsafe dense", "graphsafe sparse 32-bit"), tables))
    dense()
    sparse()
    a, b = dense_opt.state[tables[0]], sparse_opt.state[tables[1]]
    return torch.equal(tables[0], tables[1]) and all(torch.equal(a[k], b[k]) for k in a)


def run(ctx: BenchContext) -> list[dict]:
    records = []
    for case in cases(ctx):
        gen = torch.Generator().manual_seed(ctx.seed)
        indices = case.indices(ctx.seed).to(ctx.device)
        grad = case.grad(gen).to(ctx.device)
        start = (torch.randn((case.num_weights, case.dim), generator=gen) * 0.1).to(case.dtype).to(ctx.device)
        distinct = int(torch.unique(indices).numel())
        equal = _sparse_equals_dense(case, start, indices, grad)
        for method in METHODS:
            if method.endswith("replay") and ctx.device.type != "cuda":
                continue
            record = dict(record="measurement", suite="sparse", case=case.name, method=method, **case.fields(),
                          distinct_rows=distinct, sparse_equals_dense=equal)
            try:
                weight = torch.nn.Parameter(start.clone())
                update, opt = _update(method, weight, indices, grad)
                timing = time_function(update, [()], ctx.device, ctx.timer)
                record.update(ms_median=timing.ms_median, ms_min=timing.ms_min, repeats=timing.repeats)
                del weight, update, opt
            except (RuntimeError, ValueError, torch.OutOfMemoryError) as error:
                record["error"] = first_line(error)
            synchronize(ctx.device)
            if ctx.device.type == "cuda":
                torch.cuda.empty_cache()
            ctx.emit(record)
            records.append(record)
    return records


def _speedups(records: list[dict]) -> dict[tuple[str, str], float]:
    base = {r["case"]: r.get("ms_median") for r in records if r["method"] == "torch dense"}
    return {(r["case"], r["method"]): base[r["case"]] / r["ms_median"]
            for r in records if r.get("ms_median") and base.get(r["case"])}


def targets(records: list[dict], ctx: BenchContext) -> list[Target]:
    out = []
    speedups = _speedups(records)
    for method in ("graphsafe sparse 32-bit", "graphsafe sparse 8-bit", "graphsafe sparse 32-bit replay",
                   "graphsafe sparse 8-bit replay"):
        case = cases(ctx)[0].name
        x = speedups.get((case, method))
        description = f"{case}: {method} vs torch dense (backward + fused AdamW)"
        if ctx.device.type != "cuda" or ctx.quick:
            out.append(Target("sparse", description, "SKIP", note="measured on CUDA at full size"))
        elif x is None:
            out.append(Target("sparse", description, "ERROR", note="not measured"))
        else:
            out.append(Target("sparse", description, "PASS" if x >= SPEEDUP_TARGET else "MISS", f"{x:.1f}x",
                              f">= {SPEEDUP_TARGET:.0f}x"))
    return out


def render(records: list[dict], ctx: BenchContext) -> str:
    speedups = _speedups(records)
    rows = [[r["case"], r["method"], f"{r['distinct_rows']}/{r['num_weights']}", fmt_ms(r.get("ms_median")),
             fmt_ms(r.get("ms_min")), f"{speedups[(r['case'], r['method'])]:.2f}" if (r["case"], r["method"]) in speedups
             else "-", fmt_bool(r["sparse_equals_dense"]), r.get("error", "")] for r in records]
    return markdown_table(["case", "method", "rows touched", "ms median", "ms min", "x vs torch dense",
                           "sparse bitwise = dense", "error"], rows)


register_suite(Suite("sparse", "an embedding table's gradient + AdamW step: dense vs row-sparse", run, targets,
                     render))
