"""`graphsafe train --plot FILE`: the loss and the step time of each method a run trained with, step by step.

matplotlib is the optional extra `graphsafe[plot]`; bench/plots.py draws with it and says what its absence raises.
That module is imported where it is used: graphsafe.bench imports the trainer (its `train` suite), so a module-level
import from here would be circular.
"""

from __future__ import annotations

FORMATS = (".png", ".svg", ".pdf")


def require_matplotlib() -> None:
    """bench.plots.require_matplotlib: PlotUnavailable, naming the extra, unless matplotlib imports."""
    from ..bench.plots import require_matplotlib as require

    require()


def plot_training(curves: dict, title: str, path: str) -> None:
    """curves: legend label -> RunStats (losses and step_ms per step). Step times on a log scale: the first steps
    (trace, warm-up, capture) take tens to hundreds of times a later step."""
    from ..bench.plots import new_figure, save

    figure = new_figure(12, 4.5)
    loss_axes, time_axes = figure.subplots(1, 2)
    for (label, stats), style in zip(curves.items(), ("-", "--", ":")):  # dashes show curves that coincide
        steps = range(1, len(stats.losses) + 1)
        loss_axes.plot(steps, stats.losses, style, label=label)
        time_axes.plot(steps, stats.step_ms, style, label=label)
    loss_axes.set_ylabel("loss")
    time_axes.set_ylabel("step time, ms")
    time_axes.set_yscale("log")
    for axes in (loss_axes, time_axes):
        axes.set_xlabel("step")
        axes.grid(True, alpha=0.3)
        axes.legend(fontsize="small")
    figure.suptitle(title, fontsize="medium")
    save(figure, path)
