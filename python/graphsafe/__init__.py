"""graphsafe: deterministic, CUDA-graph-capturable training steps for embedding-heavy models."""

import importlib

from . import ops, nn, optim
from ._errors import DeviceIndexError, DeviceValueError, check_errors
from ._C import cuda_available as _cuda_backend_built

__all__ = ["ops", "nn", "optim", "graph", "compile_step", "check_errors", "DeviceIndexError", "DeviceValueError",
           "cuda_backend_built"]
__version__ = "0.1.0"


def cuda_backend_built() -> bool:
    """True when this installation was compiled with its CUDA backend."""
    return bool(_cuda_backend_built())


def __getattr__(name: str):
    # graphsafe.graph (and compile_step) import torch.fx's tracing machinery: loaded on first use. Imported by
    # importlib, never by `from . import graph`: that form asks this module for the attribute first, which calls
    # this function again, without end. Once imported, the submodule is an attribute of this module and this
    # function is not called for it again.
    if name in ("graph", "compile_step"):
        graph = importlib.import_module(f"{__name__}.graph")
        return graph if name == "graph" else graph.compile_step
    raise AttributeError(f"module 'graphsafe' has no attribute {name!r}")
