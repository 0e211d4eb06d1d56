"""The learning rate as the core reads it: a 0-d fp32 tensor on the group's device, whose address every step
passes (so lr schedulers' in-place fill_ reach captured steps too), and the check of a value given for it."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .._core_args import dtype_name
from .._tensor_checks import require_readable


def _lr_tensor(lr: float | Tensor, device: torch.device) -> Tensor:
    if isinstance(lr, Tensor):
        if lr.numel() != 1:
            raise ValueError(f"lr must be a number or a one-element tensor, got a tensor of shape {tuple(lr.shape)}")
        require_readable("optimizer", "lr", lr)
        return lr.detach().to(device=device, dtype=torch.float32, copy=True).reshape(())
    return torch.tensor(float(lr), dtype=torch.float32, device=device)


def _check_lr(lr: Any) -> None:
    """ValueError unless lr is a number or a one-element tensor >= 0 (+inf allowed, NaN not: torch.optim's rule).
    Reads a tensor's value on the host: for construction, add_param_group and load_state_dict only, never a
    step (a captured step cannot read it; the core checks the lr it reads there)."""
    if isinstance(lr, Tensor):
        if lr.numel() != 1:
            raise ValueError(f"lr must be a number or a one-element tensor, got a tensor of shape {tuple(lr.shape)}")
        require_readable("optimizer", "lr", lr)
        if lr.is_complex() or lr.dtype == torch.bool:
            raise TypeError(f"lr must be a real number, got a {dtype_name(lr.dtype)} tensor")
        value = float(lr.detach().to("cpu", torch.float64))
    else:
        try:
            value = float(lr)
        except (TypeError, ValueError):
            raise TypeError(f"lr must be a number or a one-element tensor, got {type(lr).__name__} {lr!r}") from None
    if not value >= 0.0:  # (NaN fails too)
        raise ValueError(f"Invalid learning rate: {value}")
