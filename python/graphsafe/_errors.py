"""Errors that CUDA kernels record in mapped host memory instead of stopping the process.

A kernel that meets an out-of-range index leaves it out of the result (nothing is written out of bounds,
also inside a replayed CUDA graph) and records it (DeviceIndexError); an optimizer step that finds a NaN or
negative learning rate in its lr tensor writes nothing and records it (DeviceValueError, a ValueError, as the
CPU step raises at once). Reading the record never synchronises: every graphsafe
op called on a CUDA tensor checks it, and `check_errors()` synchronises first so that the answer is final.
"""

from __future__ import annotations

import torch

from . import _C


class DeviceIndexError(IndexError):
    """An index that a graphsafe CUDA kernel found out of range (the result left it out)."""


class DeviceValueError(ValueError):
    """A value that a graphsafe CUDA kernel found invalid (an optimizer's NaN or negative learning rate in its lr
    tensor: that step changed nothing)."""


# The first words of the core's message for DeviceErrorCode::InvalidLearningRate (src/common/device_error.cu);
# _C.take_device_error returns the message only.
_INVALID_LEARNING_RATE = "invalid learning rate"


def raise_pending_device_error() -> None:
    """Raise what a kernel has recorded so far (no synchronisation; finished kernels only)."""
    message = _C.take_device_error(True)
    if message:
        if message.startswith(_INVALID_LEARNING_RATE):
            raise DeviceValueError(message)
        raise DeviceIndexError(message)


def check_errors(device: torch.device | int | None = None) -> None:
    """Synchronise `device` (default: the current CUDA device) and raise any error graphsafe kernels recorded.

    Call it outside graph capture, e.g. after a replay or at the end of a training step; it is a no-op
    when CUDA is not in use. The record is shared by all GPUs of the process: with several in use,
    synchronise each of them before the answer is final for all.
    """
    if _C.cuda_available() and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize(device)
    raise_pending_device_error()
