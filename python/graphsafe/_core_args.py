"""How torch values are handed to the core: the names it knows dtypes by, and the CUDA stream it issues to
(the caller's, torch's current stream: nothing uses the legacy default stream)."""

from __future__ import annotations

import functools
from typing import Callable

import torch

# The raw CUDA stream torch is issuing to on a device, without the Stream object torch.cuda.current_stream builds
# at every call (a noticeable part of a small eager step's host time); that public call where this private one is
# missing.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype as the core names it, and as error messages do: 'float32', 'bfloat16', 'int64', ..."""
    return str(dtype).removeprefix("torch.")


def current_stream(device: torch.device) -> int:
    """The raw CUDA stream torch is issuing to on `device` (its current device where it has no index); 0 for
    any other device type (the CPU core takes no stream)."""
    if device.type != "cuda":
        return 0
    if _raw_stream is not None:
        return _raw_stream(device.index if device.index is not None else torch.cuda.current_device())
    return torch.cuda.current_stream(device).cuda_stream


def current_stream_getter(device: torch.device) -> Callable[[], int]:
    """current_stream(device) as a function of no arguments, with the device bound once (for a caller that issues
    to the same device again and again: it skips current_stream's checks of the device)."""
    if device.type == "cuda" and _raw_stream is not None and device.index is not None:
        return functools.partial(_raw_stream, device.index)
    return functools.partial(current_stream, device)
