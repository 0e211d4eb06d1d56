"""torch.optim-compatible optimizers with skip_zeros, device-resident lr and step, and no host syncs."""

import torch

from ._base import GraphsafeOptimizer
from .algorithms import SGD, AdEMAMix, Adagrad, Adam, AdamW, LAMB, LARS, Lion, RMSprop

__all__ = ["Adam", "AdamW", "SGD", "RMSprop", "Adagrad", "Lion", "LAMB", "LARS", "AdEMAMix", "GraphsafeOptimizer",
           "state_bytes"]


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state of any torch optimizer: every tensor held in optimizer.state."""
    return sum(
        v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)
    )
