"""graphsafe: deterministic, CUDA-graph-capturable training steps for embedding-heavy models."""

from . import ops, nn, optim
from ._errors import DeviceIndexError, check_errors
from ._C import cuda_available as _cuda_backend_built

__all__ = ["ops", "nn", "optim", "graph", "compile_step", "check_errors", "DeviceIndexError", "cuda_backend_built"]
__version__ = "0.1.0"


def cuda_backend_built() -> bool:
    """True when this installation was compiled with its CUDA backend."""
    return bool(_cuda_backend_built())


def __getattr__(name: str):
    # graphsafe.graph (and compile_step) import torch.fx's tracing machinery (~0.4 s): loaded on first use.
    if name == "graph":
        from . import graph

        return graph
    if name == "compile_step":
        from .graph import compile_step

        return compile_step
    raise AttributeError(f"module 'graphsafe' has no attribute {name!r}")
