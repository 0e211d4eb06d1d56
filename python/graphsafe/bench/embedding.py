"""The `embedding` suite: dense embedding backward, graphsafe vs aten vs the index_add workaround.

Each case runs the three methods side by side on the same inputs and reports time, bandwidth against the
minimum bytes an embedding backward must move, accuracy against a float64 reference, and whether two runs
are bitwise identical. The token sweep (embedding_sweep.py) follows the cases: two LLM vocabularies from 256 to
1M tokens, eager and replayed from a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

import graphsafe

from .._core_args import dtype_name
from . import embedding_sweep
from .harness import BenchContext, Suite, Target, register_suite
from .indices import ZIPF_EXPONENT, hot_row_indices, uniform_indices, zipf_indices
from .plots import measured, new_figure, nothing_measured, run_title
from .report import fmt_bool, fmt_bytes, fmt_error, fmt_float, fmt_ms, first_line, markdown_table
from .timing import gbps, input_set_count, time_function

BYTES_FORMULA = "V*D*elem (output written once) + N*D*elem (grad read once) + N*index_elem (indices read once)"
QUICK_DIVISOR = 64
INDEX_DTYPE = torch.int64


@dataclass(frozen=True)
class EmbeddingCase:
    number: int
    name: str
    num_weights: int
    dim: int
    dtype: torch.dtype
    num_indices: int
    distribution: str  # uniform, zipf or hot-rows
    hot_rows: int = 0
    target_ms: float | None = None  # graphsafe's median must not exceed this (full sizes only)

    def scaled(self, divisor: int) -> "EmbeddingCase":
        """V and N (and the hot-row count, so that tokens per hot row stay the same) divided by `divisor`."""
        return replace(
            self,
            num_weights=max(1, self.num_weights // divisor),
            num_indices=max(1, self.num_indices // divisor),
            hot_rows=max(1, self.hot_rows // divisor) if self.hot_rows else 0,
        )

    def min_bytes(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        index_elem = torch.empty((), dtype=INDEX_DTYPE).element_size()
        return self.num_weights * self.dim * elem + self.num_indices * self.dim * elem + self.num_indices * index_elem

    def describe_indices(self) -> str:
        if self.distribution == "zipf":
            return (
                f"N={self.num_indices} zipf indices (p ∝ 1/k^{ZIPF_EXPONENT} over ranks k, ranks on a random "
                "permutation of rows)"
            )
        if self.distribution == "hot-rows":
            return f"N={self.num_indices} indices uniform over {self.hot_rows} random hot rows"
        return f"N={self.num_indices} uniform indices"


FULL_CASES = (
    EmbeddingCase(1, "llm-vocab", 128256, 4096, torch.bfloat16, 16384, "uniform", target_ms=0.45),
    EmbeddingCase(2, "recsys-zipf", 4_000_000, 128, torch.float32, 262144, "zipf"),
    EmbeddingCase(3, "hot-rows", 1_000_000, 64, torch.float16, 524288, "hot-rows", hot_rows=1000),
)


def graphsafe_backward(grad, indices, num_weights, padding_idx=-1, scale_grad_by_freq=False):
    """The public name (the op's overload, as the README calls it); torch.ops.graphsafe.embedding_backward, the
    overload packet, first picks the overload, which costs host time an eager call at small N shows."""
    return graphsafe.ops.embedding_backward(grad, indices, num_weights, padding_idx, scale_grad_by_freq)


def aten_backward(grad, indices, num_weights, padding_idx=-1, scale_grad_by_freq=False):
    return torch.ops.aten.embedding_dense_backward(grad, indices, num_weights, padding_idx, scale_grad_by_freq)


def index_add_backward(grad, indices, num_weights, padding_idx=-1, scale_grad_by_freq=False):
    """The capture-safe workaround; it has no padding_idx or scale_grad_by_freq, so it ignores both."""
    out = torch.zeros(num_weights, grad.shape[-1], dtype=grad.dtype, device=grad.device)
    return out.index_add_(0, indices.reshape(-1), grad.reshape(-1, grad.shape[-1]))


METHODS = {"graphsafe": graphsafe_backward, "aten": aten_backward, "index_add": index_add_backward}
BASELINES = ("index_add", "aten")
MEASURE_ORDER = ("index_add", "aten", "graphsafe")  # baselines first: graphsafe's record then carries its speedups
DISPLAY_ORDER = ("graphsafe", "aten", "index_add")
PLOT_STYLE = {"graphsafe": ("o", "tab:blue"), "aten": ("s", "tab:orange"), "index_add": ("^", "tab:green")}


def cases_for(quick: bool) -> tuple[EmbeddingCase, ...]:
    return tuple(case.scaled(QUICK_DIVISOR) for case in FULL_CASES) if quick else FULL_CASES


def make_indices(case: EmbeddingCase, seed: int) -> torch.Tensor:
    seed = seed * 1000 + case.number
    if case.distribution == "zipf":
        return zipf_indices(case.num_weights, case.num_indices, seed)
    if case.distribution == "hot-rows":
        return hot_row_indices(case.num_weights, case.num_indices, case.hot_rows, seed)
    return uniform_indices(case.num_weights, case.num_indices, seed)


def make_input_sets(case: EmbeddingCase, device: torch.device, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (grad, indices) set, plus copies at other addresses when one set would stay in the L2 cache."""
    indices = make_indices(case, seed).to(device)
    generator = torch.Generator(device=device).manual_seed(seed * 1000 + case.number)
    grad = torch.randn(case.num_indices, case.dim, dtype=case.dtype, device=device, generator=generator)
    bytes_per_set = grad.numel() * grad.element_size() + indices.numel() * indices.element_size()
    sets = [(grad, indices)]
    sets += [(grad.clone(), indices.clone()) for _ in range(input_set_count(device, bytes_per_set) - 1)]
    return sets


def float64_reference(grad: torch.Tensor, indices: torch.Tensor, num_weights: int, padding_idx=-1, scale=False):
    return torch.ops.aten.embedding_dense_backward(grad.double(), indices, num_weights, padding_idx, scale)


def max_abs_error(result: torch.Tensor, reference: torch.Tensor, chunk_elements: int = 1 << 26) -> float:
    """max |result - reference| in float64, a block of rows at a time so that no full-size float64 copy is made."""
    rows = max(1, chunk_elements // max(1, reference.shape[-1]))
    worst = torch.zeros((), dtype=torch.float64, device=reference.device)
    for start in range(0, reference.shape[0], rows):
        block = (result[start : start + rows].double() - reference[start : start + rows]).abs().max()
        worst = torch.maximum(worst, block)
    return float(worst)


def _release(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _base_record(ctx: BenchContext, case: EmbeddingCase, method: str) -> dict:
    record = {
        "record": "measurement",
        "suite": "embedding",
        "case": case.number,
        "case_name": case.name,
        "method": method,
        "device": ctx.device.type,
        "dtype": dtype_name(case.dtype),
        "index_dtype": dtype_name(INDEX_DTYPE),
        "V": case.num_weights,
        "D": case.dim,
        "N": case.num_indices,
        "distribution": case.distribution,
        "quick": ctx.quick,
    }
    if case.distribution == "zipf":
        record["zipf_exponent"] = ZIPF_EXPONENT
    if case.hot_rows:
        record["hot_rows"] = case.hot_rows
    return record


def measure_method(ctx, case, method, input_sets, reference, baseline_ms: dict[str, float]) -> dict:
    """Accuracy and determinism on the first input set (two calls), then the timed calls; errors are recorded."""
    record = _base_record(ctx, case, method)
    backward = METHODS[method]

    def call(grad, indices):
        return backward(grad, indices, case.num_weights)

    try:
        first, second = call(*input_sets[0]), call(*input_sets[0])
        deterministic = bool(torch.equal(first, second))
        del second
        error = max_abs_error(first, reference)
        del first
        timing = time_function(call, input_sets, ctx.device, ctx.timer)
        if method == "graphsafe":
            graphsafe.check_errors()
    except Exception as exc:  # one failing method must not hide the others' results
        _release(ctx.device)
        return record | {"error": first_line(exc)}
    moved = case.min_bytes()
    bandwidth = gbps(moved, timing.ms_median)
    record |= {
        "ms_median": round(timing.ms_median, 5),
        "ms_min": round(timing.ms_min, 5),
        "repeats": timing.repeats,
        "input_sets": len(input_sets),
        "bytes": moved,
        "bytes_formula": BYTES_FORMULA,
        "gbps": round(bandwidth, 2),
        "pct_copy_bw": round(100 * bandwidth / ctx.copy_bw_gbps, 2),
        "max_abs_err": error,
        "deterministic": deterministic,
    }
    for baseline in BASELINES:
        if baseline != method and baseline in baseline_ms:
            record[f"speedup_vs_{baseline}"] = round(baseline_ms[baseline] / timing.ms_median, 3)
    return record


def run_case(ctx: BenchContext, case: EmbeddingCase) -> list[dict]:
    input_sets = make_input_sets(case, ctx.device, ctx.seed)
    grad, indices = input_sets[0]
    reference = float64_reference(grad, indices, case.num_weights)
    reference_absmax = float(reference.abs().max())
    records, baseline_ms = [], {}
    for method in MEASURE_ORDER:
        record = measure_method(ctx, case, method, input_sets, reference, baseline_ms)
        record["ref_absmax"] = reference_absmax
        if "ms_median" in record:
            baseline_ms[method] = record["ms_median"]
        ctx.emit(record)
        records.append(record)
    del input_sets, grad, indices, reference
    _release(ctx.device)
    return records


def run_suite(ctx: BenchContext) -> list[dict]:
    records = []
    for case in cases_for(ctx.quick):
        records += run_case(ctx, case)
    records += embedding_sweep.run_sweep(ctx, sweep_case, make_input_sets, METHODS, _release)
    return records


def sweep_case(config: embedding_sweep.SweepConfig, tokens: int) -> EmbeddingCase:
    """One point of the token sweep as a case (uniform indices), so that it shares the cases' inputs and min bytes."""
    number = 100 + [c.name for c in embedding_sweep.CONFIGS].index(config.name)
    return EmbeddingCase(number, config.name, config.num_weights, config.dim, config.dtype, tokens, "uniform")


def _by_case_and_method(records: list[dict]) -> dict[tuple[int, str], dict]:
    return {(r["case"], r["method"]): r for r in records if r.get("record") == "measurement" and "part" not in r}


def evaluate_targets(records: list[dict], ctx: BenchContext) -> list[Target]:
    found = _by_case_and_method(records)
    targets = []
    for case in cases_for(ctx.quick):
        ours, theirs = found.get((case.number, "graphsafe"), {}), found.get((case.number, "index_add"), {})
        label = f"case {case.number} {case.name}"
        if case.target_ms is not None:
            targets.append(_absolute_target(label, ours, case.target_ms, ctx))
        targets.append(_relative_target(label, ours, theirs, ctx))
    return targets + embedding_sweep.evaluate_sweep(records, ctx, Target)


def _absolute_target(label: str, ours: dict, limit_ms: float, ctx: BenchContext) -> Target:
    description = f"{label}: graphsafe median ≤ {limit_ms} ms"
    if "ms_median" not in ours:
        return Target("embedding", description, "ERROR", threshold=f"{limit_ms} ms", note=ours.get("error", "missing"))
    value = f"{ours['ms_median']:.3f} ms"
    if ctx.quick:
        return Target("embedding", description, "SKIP", value, f"{limit_ms} ms", "target is for full sizes")
    status = "PASS" if ours["ms_median"] <= limit_ms else "MISS"
    note = "" if ctx.device.type == "cuda" else "target is for an H200"
    return Target("embedding", description, status, value, f"{limit_ms} ms", note)


def _relative_target(label: str, ours: dict, theirs: dict, ctx: BenchContext) -> Target:
    description = f"{label}: graphsafe ≤ index_add"
    if "ms_median" not in ours or "ms_median" not in theirs:
        note = ours.get("error") or theirs.get("error") or "missing"
        return Target("embedding", description, "ERROR", note=note)
    value = f"{ours['ms_median']:.3f} ms vs {theirs['ms_median']:.3f} ms"
    status = "PASS" if ours["ms_median"] <= theirs["ms_median"] else "MISS"
    return Target("embedding", description, status, value, "≤ index_add", "quick sizes" if ctx.quick else "")


def render(records: list[dict], ctx: BenchContext) -> str:
    found = _by_case_and_method(records)
    headers = ("case", "method", "ms median", "ms min", "GB/s", "% copy BW", "× vs index_add", "× vs aten",
               "max abs err", "bitwise repeatable")
    rows, errors = [], []
    for case in cases_for(ctx.quick):
        for method in DISPLAY_ORDER:
            record = found.get((case.number, method))
            if record is None:
                continue
            if "error" in record:
                errors.append(f"- case {case.number} {method}: {record['error']}")
                rows.append((f"{case.number} {case.name}", method, "error", *["-"] * 7))
                continue
            rows.append((
                f"{case.number} {case.name}", method, fmt_ms(record["ms_median"]), fmt_ms(record["ms_min"]),
                fmt_float(record["gbps"]), fmt_float(record["pct_copy_bw"]),
                *(_speedup(found.get((case.number, base)), record) for base in BASELINES),
                fmt_error(record["max_abs_err"]), fmt_bool(record["deterministic"]),
            ))
    right = (False, False) + (True,) * 6 + (True, False)
    parts = [f"## embedding backward ({ctx.describe_device()})", markdown_table(headers, rows, right)]
    parts.append(_legend(ctx))
    if errors:
        parts.append("Errors:\n" + "\n".join(errors))
    sweep = embedding_sweep.render_sweep(records, ctx)
    if sweep:
        parts.append(sweep)
    return "\n\n".join(parts)


def _speedup(baseline: dict | None, record: dict) -> str:
    if not baseline or "ms_median" not in baseline:
        return "-"
    return f"{baseline['ms_median'] / record['ms_median']:.2f}"


def _legend(ctx: BenchContext) -> str:
    lines = ["Cases (int64 indices; grad ~ N(0,1) in the case's dtype; seed fixed):"]
    for case in cases_for(ctx.quick):
        lines.append(
            f"{case.number}. {case.name}: V={case.num_weights} D={case.dim} {dtype_name(case.dtype)}, "
            f"{case.describe_indices()}; min bytes {fmt_bytes(case.min_bytes())}"
        )
    lines.append("")
    lines.append(f"Min bytes = {BYTES_FORMULA}. GB/s = min bytes / median time; % copy BW against the copy above.")
    lines.append(
        "× vs X = X's median / this median (> 1: faster). max abs err: against aten on the float64 grad. "
        "bitwise repeatable: two calls on the same input give torch.equal results."
    )
    if ctx.quick:
        lines.append(f"Quick sizes: V, N and hot rows of the full cases divided by {QUICK_DIVISOR}.")
    return "\n".join(lines)


def plot(records: list[dict], environment: dict):
    """The cases' panel, then one panel per token-sweep config (embedding_sweep.plot_sweep) when the run has one."""
    sweep = [r for r in measured(records) if r.get("part") == "sweep"]
    configs = list(dict.fromkeys(r["case_name"] for r in sweep))
    figure = new_figure(8, 6 + 5 * len(configs))
    panels = figure.subplots(1 + len(configs), 1, squeeze=False)[:, 0]
    _plot_cases(panels[0], [r for r in records if r.get("part") != "sweep"], environment)
    for axes, name in zip(panels[1:], configs):
        embedding_sweep.plot_sweep(axes, sweep, name, environment["copy_bw_gbps"])
    return figure


def _plot_cases(axes, records: list[dict], environment: dict) -> None:
    """Each method's median time against the case's tokens (log-log), beside the case's memory floor: its min
    bytes at the measured copy bandwidth, the time no method can beat. The cases are different tables (V, D,
    dtype), so their points are not joined."""
    points = measured(records)
    if not points:
        nothing_measured(axes)
        return
    for method in DISPLAY_ORDER:
        mine = [r for r in points if r["method"] == method]
        marker, color = PLOT_STYLE[method]
        axes.scatter([r["N"] for r in mine], [r["ms_median"] for r in mine], marker=marker, s=50, zorder=3,
                     color=color, label=method)
    cases = list({r["case"]: r for r in points}.values())  # one record per case: its shape and min bytes
    tokens = [r["N"] for r in cases]
    copy_gbps = environment["copy_bw_gbps"]
    axes.hlines([r["bytes"] / (copy_gbps * 1e6) for r in cases], [n / 1.3 for n in tokens],
                [n * 1.3 for n in tokens], colors="black", zorder=2,
                label=f"memory floor (min bytes at the {copy_gbps:.4g} GB/s copy bandwidth)")
    axes.set_xscale("log")
    axes.set_yscale("log")
    axes.set_xticks(tokens, [f"{r['N']}\n{r['case_name']}" for r in cases], fontsize="small")
    axes.minorticks_off()
    shapes = "".join(f"\n{r['case_name']}: V={r['V']} D={r['D']} {r['dtype']}, {r['distribution']}" for r in cases)
    axes.set_xlabel(f"tokens (indices) per backward{shapes}", fontsize="small")
    axes.set_ylabel("ms (median)")
    axes.grid(True, which="major", alpha=0.3)
    axes.legend(loc="best", fontsize="small")
    axes.set_title(run_title(environment, "dense embedding backward"), fontsize="medium")


SUITE = register_suite(
    Suite(
        name="embedding",
        description="dense embedding backward: graphsafe vs aten embedding_dense_backward vs zeros().index_add_",
        run=run_suite,
        targets=evaluate_targets,
        render=render,
        plot=plot,
    )
)
