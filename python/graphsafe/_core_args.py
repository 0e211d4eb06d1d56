"""How torch values are handed to the core: the names it knows dtypes by, the CUDA stream it issues to (the
caller's, torch's current stream: nothing uses the legacy default stream), and scratch memory from torch's CUDA
caching allocator."""

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


# torch's CUDA caching allocator without a tensor around the block (what torch.cuda.caching_allocator_alloc and
# _delete call): the block comes from the same cache in the same way as a tensor's storage (ordered on the stream
# it is allocated on, taken from the graph's private pool while the stream captures, back to the cache when freed),
# but skips the Python call of torch.empty, several times the cost of the allocation itself. None where missing.
_raw_alloc = getattr(torch._C, "_cuda_cudaCachingAllocator_raw_alloc", None)
_raw_delete = getattr(torch._C, "_cuda_cudaCachingAllocator_raw_delete", None)
_current_cuda_device = getattr(torch._C, "_cuda_getDevice", None)


def cuda_scratch(device_index: int, nbytes: int, stream: int) -> int | None:
    """The address of nbytes of scratch memory on CUDA device `device_index` for work issued to `stream` (0 for
    none), to be handed back with free_cuda_scratch once that work is issued; None where the raw allocator is
    missing or `device_index` is not the current device (the caller then allocates a tensor)."""
    if _raw_alloc is None or _raw_delete is None or _current_cuda_device() != device_index:
        return None
    return _raw_alloc(nbytes, stream) if nbytes else 0


def free_cuda_scratch(address: int) -> None:
    """Hands back a cuda_scratch block (in stream order, as a freed tensor's storage)."""
    if address:
        _raw_delete(address)
