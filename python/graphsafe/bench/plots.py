"""Pictures of benchmark records (`graphsafe bench --plot DIR`) and the matplotlib they need.

matplotlib is an optional extra (`pip install 'graphsafe[plot]'`): it is imported only when a picture is asked
for, and its absence is a PlotUnavailable error that names the extra. A suite draws its picture from its
measurement records and the run's environment record alone (Suite.plot), so a saved JSON-lines file (`--json-out`)
draws the same picture later (`--from FILE`), e.g. on a machine that has matplotlib when the GPU machine has not.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

EXTRA = "plot"  # pyproject.toml's [project.optional-dependencies] entry that installs matplotlib
INSTALL_HINT = f"pip install 'graphsafe[{EXTRA}]' (or: pip install matplotlib)"
DPI = 100


class PlotUnavailable(ImportError):
    """matplotlib cannot be imported; the message says how to install it."""


def require_matplotlib() -> None:
    """Raise PlotUnavailable unless matplotlib imports (checked before a run, so a long run never ends in it)."""
    try:
        import matplotlib.figure  # noqa: F401
    except ImportError as exc:
        raise PlotUnavailable(f"plots need matplotlib, which is not installed: {INSTALL_HINT}") from exc


def new_figure(width: float, height: float):
    """A figure of its own (not pyplot's global state, and no display backend: it only saves files)."""
    require_matplotlib()
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=DPI, layout="constrained")


def save(figure, path: str | Path) -> str | Path:
    figure.savefig(path, dpi=DPI)
    return path


def nothing_measured(axes) -> None:
    """An empty panel that says so (every measurement of it failed, or the run did not make them)."""
    axes.text(0.5, 0.5, "nothing measured in this run", ha="center", transform=axes.transAxes)
    axes.set_axis_off()


def run_title(environment: dict, what: str) -> str:
    """`what` on the run's device, with the date, commit and sizes the environment record gives."""
    sizes = "quick sizes" if environment.get("quick") else "full sizes"
    return (f"{what}\n{environment.get('device_name', environment.get('device', '?'))}, {sizes}, "
            f"{str(environment.get('date', '?'))[:10]}, commit {environment.get('graphsafe_commit', '?')}")


def measured(records: Iterable[dict], key: str = "ms_median") -> list[dict]:
    """The measurement records that carry `key` as a number (errors, skipped rows and "inf" strings left out)."""
    return [r for r in records if r.get("record") == "measurement" and isinstance(r.get(key), (int, float))]


def write_plots(records: list[dict], folder: Path, chosen: list) -> list[Path]:
    """Each chosen suite's picture, `<folder>/<suite>.png`, from `records` (one run's JSON lines); suites without a
    picture, or without records here, draw none."""
    environment = next((r for r in records if r.get("record") == "environment"), None)
    if environment is None:
        raise ValueError("no environment record (the first of graphsafe bench's JSON lines)")
    written = []
    for suite in chosen:
        mine = [r for r in records if r.get("suite") == suite.name and r.get("record") == "measurement"]
        if suite.plot is None or not mine:
            continue
        try:
            figure = suite.plot(mine, environment)
        except KeyError as exc:  # a record written by another version, or by hand
            raise ValueError(f"suite {suite.name}: a record lacks the field {exc}") from None
        written.append(save(figure, folder / f"{suite.name}.png"))
    return written


def read_records(path: str) -> list[dict]:
    """The JSON lines of a saved run: a --json-out file, or the command's whole stdout (its markdown tables are
    passed over: only lines that start with "{" are records)."""
    records = []
    with open(path, encoding="utf-8") as file:
        for number, line in enumerate(file, start=1):
            if not line.startswith("{"):
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}, line {number}: not a JSON record ({exc.msg})") from None
    return records
