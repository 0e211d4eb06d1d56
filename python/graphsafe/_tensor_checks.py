"""Whether graphsafe's kernels can read a tensor: the core reads and writes tensors through their raw addresses,
so every entry point refuses, with a clear error, a tensor whose memory is not its data (a tensor subclass with
its own dispatch such as DTensor, a sparse, nested or meta tensor) instead of handing the core an address that is
null or points at something else."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

# What a tensor class without a __torch_dispatch__ of its own (Tensor, Parameter, Buffer, plain subclasses) has.
_PLAIN_DISPATCH = torch._C._disabled_torch_dispatch_impl


def unreadable_reason(t: Any) -> str | None:
    """Why the core cannot read t through its address (a phrase naming what t is), or None if it can."""
    if not isinstance(t, Tensor):
        return f"not a tensor but {type(t).__name__}"
    cls = type(t)
    if cls is not Tensor and cls.__torch_dispatch__ is not _PLAIN_DISPATCH:
        if cls.__name__ == "DTensor":
            return ("a DTensor (an FSDP2 or torch.distributed.tensor shard), whose memory is its local shard, not "
                    "the tensor: pass its .to_local() (graphsafe's optimizers take DTensor parameters themselves)")
        return f"a {cls.__name__}, a tensor subclass with its own __torch_dispatch__ (its memory is not its data)"
    if t.is_nested:
        return "a nested tensor"
    if t.layout != torch.strided:
        return f"a {str(t.layout).removeprefix('torch.')} tensor (graphsafe takes dense, strided tensors)"
    if t.device.type == "meta":
        return "a meta tensor (it has no data)"
    return None


def require_readable(where: str, what: str, t: Any) -> None:
    """TypeError naming `what` (an argument, a parameter) unless the core can read t (unreadable_reason)."""
    reason = unreadable_reason(t)
    if reason is not None:
        raise TypeError(f"{where}: {what} is {reason}")
