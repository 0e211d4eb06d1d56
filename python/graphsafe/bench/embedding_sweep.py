"""The token sweep of the `embedding` suite: graphsafe against zeros().index_add_ (and aten, eager) at N = 256 … 1M
tokens for two LLM vocabularies, launched eagerly and replayed from a CUDA graph.

Small N shows the fixed cost (launches, the zero fill of the whole table), large N the bandwidth: each point
carries its share of the memory floor, min bytes (EmbeddingCase.min_bytes) at the measured copy bandwidth.
Replayed rows replay one graph captured over one input set (its grad may stay in L2 at small N, for every
method alike); eager rows rotate input sets as the cases do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import graphsafe

from .._core_args import dtype_name
from .report import first_line, fmt_float, fmt_ms, markdown_table
from .timing import gbps, time_function

TOKENS = (256, 1024, 4096, 16384, 65536, 262144, 1048576)
QUICK_TOKENS = (256, 1024)
QUICK_V_DIVISOR, QUICK_D_DIVISOR = 64, 16
MODES = ("eager", "replayed")
METHODS = ("graphsafe", "index_add", "aten")
EAGER_ONLY = ("aten",)  # stock aten is not the capture-safe baseline; its eager time is context
FLOOR_TARGET_PCT = 80.0  # graphsafe at the largest N, eager, as % of the memory floor


@dataclass(frozen=True)
class SweepConfig:
    name: str
    num_weights: int
    dim: int
    dtype: torch.dtype


CONFIGS = (
    SweepConfig("vocab-32k", 32000, 1024, torch.bfloat16),
    SweepConfig("vocab-128k", 128256, 4096, torch.bfloat16),
)


def configs_for(quick: bool) -> tuple[SweepConfig, ...]:
    if not quick:
        return CONFIGS
    return tuple(SweepConfig(c.name, c.num_weights // QUICK_V_DIVISOR, c.dim // QUICK_D_DIVISOR, c.dtype)
                 for c in CONFIGS)


def tokens_for(quick: bool) -> tuple[int, ...]:
    return QUICK_TOKENS if quick else TOKENS


def _replayable(fn, args):
    """A captured call of fn(*args) (warmed up on a side stream, as torch's capture needs) and its replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(*args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*args)
    return graph, out


def _measure(ctx, case, method, mode, methods, input_sets) -> dict:
    fn = methods[method]

    def call(grad, indices):
        return fn(grad, indices, case.num_weights)

    if mode == "eager":
        timing = time_function(call, input_sets, ctx.device, ctx.timer)
        if method == "graphsafe":
            graphsafe.check_errors()
        return {"ms_median": timing.ms_median, "ms_min": timing.ms_min, "repeats": timing.repeats,
                "input_sets": len(input_sets)}
    graph, out = _replayable(call, input_sets[0])
    try:
        timing = time_function(graph.replay, [()], ctx.device, ctx.timer)
        if method == "graphsafe":
            eager = call(*input_sets[0])
            torch.cuda.synchronize()
            graphsafe.check_errors()
            bitwise = bool(torch.equal(eager.view(torch.int16 if eager.element_size() == 2 else torch.int32),
                                       out.view(torch.int16 if out.element_size() == 2 else torch.int32)))
        else:
            bitwise = None
    finally:
        del graph, out
    record = {"ms_median": timing.ms_median, "ms_min": timing.ms_min, "repeats": timing.repeats, "input_sets": 1}
    if bitwise is not None:
        record["replay_bitwise_equals_eager"] = bitwise
    return record


def run_sweep(ctx, make_case, make_input_sets, methods, release) -> list[dict]:
    """Every (config, N): index_add first, then aten, then graphsafe, eager then replayed; one record each, with
    graphsafe's speedup over index_add in the same mode."""
    records = []
    modes = MODES if ctx.device.type == "cuda" else ("eager",)
    for config in configs_for(ctx.quick):
        for tokens in tokens_for(ctx.quick):
            case = make_case(config, tokens)
            try:
                input_sets = make_input_sets(case, ctx.device, ctx.seed)
            except torch.OutOfMemoryError as exc:
                release(ctx.device)
                failed = _record(ctx, config, case, "graphsafe", "eager") | {"error": first_line(exc)}
                records.append(_emit(ctx, failed))
                continue
            baseline = {}
            for method in ("index_add", "aten", "graphsafe"):
                for mode in modes:
                    if mode == "replayed" and method in EAGER_ONLY:
                        continue
                    record = _record(ctx, config, case, method, mode)
                    try:
                        record |= _measure(ctx, case, method, mode, methods, input_sets)
                    except Exception as exc:  # one failing method must not hide the others' results
                        release(ctx.device)
                        records.append(_emit(ctx, record | {"error": first_line(exc)}))
                        continue
                    bandwidth = gbps(case.min_bytes(), record["ms_median"])
                    record |= {"bytes": case.min_bytes(), "gbps": round(bandwidth, 2),
                               "pct_copy_bw": round(100 * bandwidth / ctx.copy_bw_gbps, 2)}
                    record["ms_median"], record["ms_min"] = round(record["ms_median"], 5), round(record["ms_min"], 5)
                    if method == "index_add":
                        baseline[mode] = record["ms_median"]
                    elif mode in baseline:
                        record["speedup_vs_index_add"] = round(baseline[mode] / record["ms_median"], 3)
                    records.append(_emit(ctx, record))
            del input_sets
            release(ctx.device)
    return records


def _record(ctx, config: SweepConfig, case, method: str, mode: str) -> dict:
    return {"record": "measurement", "suite": "embedding", "part": "sweep", "case": f"sweep {config.name}",
            "case_name": config.name, "method": method, "mode": mode, "device": ctx.device.type,
            "dtype": dtype_name(config.dtype), "index_dtype": "int64", "V": config.num_weights, "D": config.dim,
            "N": case.num_indices, "distribution": "uniform", "quick": ctx.quick}


def _emit(ctx, record: dict) -> dict:
    ctx.emit(record)
    return record


def sweep_records(records: list[dict]) -> list[dict]:
    return [r for r in records if r.get("record") == "measurement" and r.get("part") == "sweep"]


def _index(records: list[dict]) -> dict[tuple, dict]:
    return {(r["case_name"], r["N"], r["method"], r["mode"]): r for r in sweep_records(records)}


def evaluate_sweep(records: list[dict], ctx, target_cls) -> list:
    """Per config and mode: graphsafe ≤ index_add at every N; per config: graphsafe eager at the largest N reaches
    FLOOR_TARGET_PCT of the memory floor."""
    found = _index(records)
    targets = []
    modes = MODES if ctx.device.type == "cuda" else ("eager",)
    tokens = tokens_for(ctx.quick)
    for config in configs_for(ctx.quick):
        for mode in modes:
            description = f"sweep {config.name} {mode}: graphsafe ≤ index_add at every N ({tokens[0]}…{tokens[-1]})"
            ratios, missing = [], []
            for n in tokens:
                ours = found.get((config.name, n, "graphsafe", mode), {})
                theirs = found.get((config.name, n, "index_add", mode), {})
                if "ms_median" in ours and "ms_median" in theirs:
                    ratios.append((theirs["ms_median"] / ours["ms_median"], n))
                else:
                    missing.append(n)
            if missing:
                targets.append(target_cls("embedding", description, "ERROR", note=f"missing N={missing}"))
                continue
            worst, at = min(ratios)
            misses = [n for ratio, n in ratios if ratio < 1.0]
            status = "PASS" if not misses else "MISS"
            note = ("quick sizes" if ctx.quick else "") + (f" slower at N={misses}" if misses else "")
            targets.append(target_cls("embedding", description, status, f"worst {worst:.2f}× at N={at}", "≥ 1.00×",
                                      note.strip()))
        ours = found.get((config.name, tokens[-1], "graphsafe", "eager"), {})
        description = (f"sweep {config.name}: graphsafe eager at N={tokens[-1]} ≥ {FLOOR_TARGET_PCT:g}% of the "
                       "memory floor")
        if "pct_copy_bw" not in ours:
            targets.append(target_cls("embedding", description, "ERROR", note=ours.get("error", "missing")))
        elif ctx.quick or ctx.device.type != "cuda":
            targets.append(target_cls("embedding", description, "SKIP", f"{ours['pct_copy_bw']:.1f}%",
                                      f"{FLOOR_TARGET_PCT:g}%", "target is for full sizes on an H200"))
        else:
            status = "PASS" if ours["pct_copy_bw"] >= FLOOR_TARGET_PCT else "MISS"
            targets.append(target_cls("embedding", description, status, f"{ours['pct_copy_bw']:.1f}%",
                                      f"{FLOOR_TARGET_PCT:g}%"))
    return targets


def render_sweep(records: list[dict], ctx) -> str:
    found = _index(records)
    if not found:
        return ""
    headers = ("config", "N", "graphsafe eager", "index_add eager", "× eager", "graphsafe replayed",
               "index_add replayed", "× replayed", "aten eager", "% floor (eager)", "% floor (replayed)")
    rows, errors = [], []
    for config in configs_for(ctx.quick):
        for n in tokens_for(ctx.quick):
            cell = {(m, mode): found.get((config.name, n, m, mode), {}) for m in METHODS for mode in MODES}
            for (m, mode), r in cell.items():
                if "error" in r:
                    errors.append(f"- {config.name} N={n} {m} {mode}: {r['error']}")
            gs_e, gs_r = cell[("graphsafe", "eager")], cell[("graphsafe", "replayed")]
            ia_e, ia_r = cell[("index_add", "eager")], cell[("index_add", "replayed")]
            rows.append((
                config.name, str(n), fmt_ms(gs_e.get("ms_median")), fmt_ms(ia_e.get("ms_median")),
                fmt_float(gs_e.get("speedup_vs_index_add"), 2), fmt_ms(gs_r.get("ms_median")),
                fmt_ms(ia_r.get("ms_median")), fmt_float(gs_r.get("speedup_vs_index_add"), 2),
                fmt_ms(cell[("aten", "eager")].get("ms_median")), fmt_float(gs_e.get("pct_copy_bw")),
                fmt_float(gs_r.get("pct_copy_bw")),
            ))
    legend = [f"{c.name}: V={c.num_weights} D={c.dim} {dtype_name(c.dtype)}, uniform int64 indices"
              for c in configs_for(ctx.quick)]
    legend.append("× = index_add's median / graphsafe's median in the same mode (> 1: graphsafe faster). % floor = "
                  "min bytes at the measured copy bandwidth / graphsafe's median. Replayed: one CUDA graph per point, "
                  "captured over one input set.")
    parts = [f"### embedding backward token sweep ({ctx.describe_device()})",
             markdown_table(headers, rows, (False,) + (True,) * 10), "\n".join(legend)]
    if errors:
        parts.append("Errors:\n" + "\n".join(errors))
    return "\n\n".join(parts)


SWEEP_STYLE = {("graphsafe", "eager"): ("o-", "tab:blue"), ("graphsafe", "replayed"): ("o--", "tab:blue"),
               ("index_add", "eager"): ("^-", "tab:green"), ("index_add", "replayed"): ("^--", "tab:green"),
               ("aten", "eager"): ("s-", "tab:orange")}


def plot_sweep(axes, records: list[dict], config_name: str, copy_gbps: float) -> None:
    """One config's medians against tokens (log-log), each method and mode a line, beside the memory floor."""
    mine = [r for r in records if r["case_name"] == config_name and isinstance(r.get("ms_median"), (int, float))]
    for (method, mode), (style, color) in SWEEP_STYLE.items():
        points = sorted((r["N"], r["ms_median"]) for r in mine if r["method"] == method and r["mode"] == mode)
        if points:
            axes.plot(*zip(*points), style, color=color, label=f"{method} {mode}")
    floor = sorted({(r["N"], r["bytes"] / (copy_gbps * 1e6)) for r in mine if "bytes" in r})
    if floor:
        axes.plot(*zip(*floor), "k:", label=f"memory floor ({copy_gbps:.4g} GB/s copy)")
    first = mine[0] if mine else {}
    axes.set_xscale("log")
    axes.set_yscale("log")
    axes.set_xlabel("tokens (indices) per backward", fontsize="small")
    axes.set_ylabel("ms (median)")
    axes.grid(True, which="major", alpha=0.3)
    axes.legend(loc="best", fontsize="x-small")
    axes.set_title(f"token sweep {config_name}: V={first.get('V')} D={first.get('D')} {first.get('dtype')}",
                   fontsize="small")
