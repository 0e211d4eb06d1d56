"""torch.optim-compatible optimizers with skip_zeros, device-resident lr and step, and no host syncs."""

import torch

from . import algorithms
from ._base import GraphsafeOptimizer
from ._sparse import sparse_step
from .algorithms import *  # noqa: F403 (the optimizer classes: algorithms.__all__)

__all__ = [*algorithms.__all__, "GraphsafeOptimizer", "sparse_step", "state_bytes"]


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state of any torch optimizer: every tensor held in optimizer.state."""
    return sum(
        v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)
    )
