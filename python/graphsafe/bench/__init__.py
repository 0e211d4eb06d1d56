"""`graphsafe bench`: benchmark suites, side by side with the PyTorch equivalents, as % of copy bandwidth.

Suites register themselves on import; to add one, write a module that calls `register_suite` and import it
below.
"""

from .harness import BenchContext, BenchOptions, Suite, Target, register_suite, run_bench, suites
from . import embedding  # noqa: F401,E402 - registers the "embedding" suite
from . import optim  # noqa: F401,E402 - registers the "optim" suite
from . import train  # noqa: F401,E402 - registers the "train" suite
from . import distributed  # noqa: F401,E402 - registers the "dist" suite
from . import sparse  # noqa: F401,E402 - registers the "sparse" suite
from . import cpu  # noqa: F401,E402 - registers the "cpu" suite

__all__ = ["BenchContext", "BenchOptions", "Suite", "Target", "register_suite", "run_bench", "suites", "run_demo"]


def run_demo(device: str | None = None) -> int:
    from .demo import run_demo as _run_demo

    return _run_demo(device)
