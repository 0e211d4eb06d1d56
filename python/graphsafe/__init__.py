"""graphsafe: deterministic, CUDA-graph-capturable training steps for embedding-heavy models."""

from . import ops, nn, optim, graph
from .graph import compile_step
from ._errors import DeviceIndexError, check_errors
from ._C import cuda_available as _cuda_backend_built

__all__ = ["ops", "nn", "optim", "graph", "compile_step", "check_errors", "DeviceIndexError", "cuda_backend_built"]
__version__ = "0.1.0"


def cuda_backend_built() -> bool:
    """True when this installation was compiled with its CUDA backend."""
    return bool(_cuda_backend_built())
