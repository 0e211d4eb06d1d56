"""The suite registry and the driver that `graphsafe bench` runs.

A suite is a name plus functions: `run` measures and emits one record per measurement (through `ctx.emit`, as it
goes), `targets` turns the records into PASS/MISS/SKIP verdicts, `render` draws the markdown table, and `plot`
(optional) draws a matplotlib figure from the records and the run's environment record (plots.py). Adding a
suite (e.g. `optim`) is one module that calls `register_suite` and one import line in `graphsafe/bench/__init__.py`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

import graphsafe

from . import plots
from .environment import device_name, environment_record
from .report import JsonLines, markdown_table
from .timing import CopyBandwidth, TimerConfig, default_timer_config, measure_copy_bandwidth


@dataclass
class BenchContext:
    device: torch.device
    quick: bool
    timer: TimerConfig
    copy_bandwidth: CopyBandwidth
    emit: Callable[[dict], None]
    seed: int = 0

    @property
    def copy_bw_gbps(self) -> float:
        return self.copy_bandwidth.gbps

    def describe_device(self) -> str:
        return f"{self.device.type} ({device_name(self.device)})"


@dataclass(frozen=True)
class Target:
    suite: str
    description: str
    status: str  # PASS, MISS, SKIP or ERROR
    value: str = ""
    threshold: str = ""
    note: str = ""

    def record(self) -> dict:
        return {"record": "target", **self.__dict__}


@dataclass(frozen=True)
class Suite:
    name: str
    description: str
    run: Callable[[BenchContext], list[dict]]
    targets: Callable[[list[dict], BenchContext], list[Target]] = lambda records, ctx: []
    render: Callable[[list[dict], BenchContext], str] = lambda records, ctx: ""
    plot: Callable[[list[dict], dict], object] | None = None  # (its records, the environment record) -> Figure


_SUITES: dict[str, Suite] = {}


def register_suite(suite: Suite) -> Suite:
    if suite.name in _SUITES:
        raise ValueError(f"benchmark suite {suite.name!r} is registered twice")
    _SUITES[suite.name] = suite
    return suite


def suites() -> dict[str, Suite]:
    return dict(_SUITES)


@dataclass
class BenchOptions:
    suites: list[str] = field(default_factory=list)  # empty: all
    device: str | None = None  # None: cuda when usable, else cpu
    quick: bool | None = None  # None: quick on cpu, full on cuda
    repeats: int | None = None
    json_out: str | None = None
    seed: int = 0
    plot_dir: str | None = None  # write each suite's picture there (plots.py)
    from_file: str | None = None  # with plot_dir: draw the records of this saved run instead of measuring


def cuda_usable() -> bool:
    return torch.cuda.is_available() and graphsafe.cuda_backend_built()


def resolve_device(requested: str | None) -> torch.device:
    """cuda (with its index) when asked for, or by default when usable; else cpu. Says why cuda cannot run."""
    device = torch.device(requested if requested is not None else ("cuda" if cuda_usable() else "cpu"))
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise SystemExit(f"graphsafe: unsupported device {requested!r} (use cuda or cpu)")
    if not torch.cuda.is_available():
        raise SystemExit("graphsafe: --device cuda asked for, but torch sees no CUDA device")
    if not graphsafe.cuda_backend_built():
        raise SystemExit("graphsafe: --device cuda asked for, but this graphsafe was built without CUDA")
    device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
    torch.cuda.set_device(device)
    return device


def run_bench(options: BenchOptions) -> int:
    """Run the chosen suites; JSON lines to stdout as measured, then one markdown report per suite, then (with
    plot_dir) their pictures. With from_file: only the pictures, from that saved run's records.
    A missing matplotlib raises plots.PlotUnavailable before anything is measured."""
    chosen = _choose_suites(options.suites)
    if options.plot_dir is not None:  # both checked now, not after a run of minutes
        plots.require_matplotlib()
        try:
            Path(options.plot_dir).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise SystemExit(f"graphsafe: cannot make the plot folder {options.plot_dir!r}: {exc.strerror}") from None
    if options.from_file is not None:
        _plot_saved_run(options.from_file, options.plot_dir, chosen, asked=bool(options.suites))
        return 0
    device = resolve_device(options.device)
    quick = (device.type == "cpu") if options.quick is None else options.quick
    timer = default_timer_config(device, quick, options.repeats)
    progress(f"measuring copy bandwidth on {device.type} ...")
    copy_bw = measure_copy_bandwidth(device, timer)
    out = JsonLines(path=options.json_out)
    try:
        environment = environment_record(device, copy_bw.gbps, copy_bw.bytes_moved, quick)
        out.emit(environment | {"suites": [suite.name for suite in chosen]})
        ctx = BenchContext(device, quick, timer, copy_bw, out.emit, options.seed)
        reports = [_run_suite(suite, ctx) for suite in chosen]
    finally:
        out.close()
    print()
    print(_header(ctx, environment))
    for report in reports:
        print()
        print(report)
    if options.plot_dir is not None:
        _write_plots(out.records, options.plot_dir, chosen)
    return 0


def _plot_saved_run(path: str, folder: str, chosen: list[Suite], asked: bool) -> None:
    """The pictures of a saved run's suites (those `asked` for, which it must hold; else all it holds)."""
    try:
        records = plots.read_records(path)
    except ValueError as exc:
        raise SystemExit(f"graphsafe: {exc}") from None
    held = {r.get("suite") for r in records if r.get("record") == "measurement"}
    missing = [suite.name for suite in chosen if suite.name not in held]
    if asked and missing:
        raise SystemExit(f"graphsafe: {path} has no measurements of suite(s) {', '.join(missing)}")
    chosen = [suite for suite in chosen if suite.name in held]
    if not any(suite.plot for suite in chosen):
        raise SystemExit(f"graphsafe: {path} has no measurements of a suite with a plot ({', '.join(_plotted())})")
    _write_plots(records, folder, chosen, path)


def _write_plots(records: list[dict], folder: str, chosen: list[Suite], source: str = "this run") -> None:
    try:
        written = plots.write_plots(records, Path(folder), chosen)
    except ValueError as exc:
        raise SystemExit(f"graphsafe: cannot plot {source}: {exc}") from None
    for path in written:
        progress(f"plot: {path}")
    without = [suite.name for suite in chosen if suite.plot is None]
    if without:  # not an error: `--plot` with every suite is the ordinary call
        progress(f"no plot for suite(s) {', '.join(without)} (plots exist for {', '.join(_plotted())})")


def _plotted() -> list[str]:
    return [name for name, suite in _SUITES.items() if suite.plot is not None]


def _choose_suites(names: list[str]) -> list[Suite]:
    registered = suites()
    if not names:
        return list(registered.values())
    unknown = [name for name in names if name not in registered]
    if unknown:
        raise SystemExit(f"graphsafe: unknown suite(s) {', '.join(unknown)}; known: {', '.join(registered)}")
    return [registered[name] for name in dict.fromkeys(names)]


def _run_suite(suite: Suite, ctx: BenchContext) -> str:
    progress(f"suite {suite.name}: {suite.description}")
    records = suite.run(ctx)
    targets = suite.targets(records, ctx)
    for target in targets:
        ctx.emit(target.record())
    parts = [suite.render(records, ctx)]
    if targets:
        parts.append(render_targets(targets))
    return "\n\n".join(part for part in parts if part)


def render_targets(targets: list[Target]) -> str:
    rows = [(t.description, t.value, t.threshold, t.status + (f" ({t.note})" if t.note else "")) for t in targets]
    return "Targets:\n\n" + markdown_table(("target", "value", "threshold", "result"), rows)


def _header(ctx: BenchContext, environment: dict) -> str:
    size = "quick sizes" if ctx.quick else "full sizes"
    return (
        f"# graphsafe bench — {ctx.describe_device()}, {size}\n\n"
        f"{environment['date']}, graphsafe {environment['graphsafe_version']} commit "
        f"{environment['graphsafe_commit']}, torch {environment['torch']}.\n"
        f"Copy bandwidth: {ctx.copy_bw_gbps:.1f} GB/s (dst.copy_(src) of "
        f"{ctx.copy_bandwidth.bytes_moved // 2 / 2**20:.0f} MiB, bytes read + written, median). "
        f"Times: median of {ctx.timer.repeats} repeats after "
        f"{ctx.timer.warmup} warm-up call(s), {'CUDA events' if ctx.device.type == 'cuda' else 'time.perf_counter'}."
    )


def progress(message: str) -> None:
    """A log line on stderr (stdout carries the JSON lines and the tables)."""
    print(f"[graphsafe bench] {message}", file=sys.stderr, flush=True)
