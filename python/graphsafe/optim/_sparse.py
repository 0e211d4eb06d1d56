"""The row-sparse step (graphsafe.optim.sparse_step): one parameter of a graphsafe optimizer updated from a gradient
given as rows, as graphsafe.ops.embedding_backward_sparse returns it, touching only those rows (the core's
include/graphsafe/optim_sparse.h has the contract: bitwise the dense skip_zeros step on the scattered gradient)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .. import _C
from .._core_args import current_stream, dtype_name
from .._tensor_checks import require_readable
from ._learning_rate import _check_lr, _lr_tensor
from ._state_storage import _check_state_tensors, _in_step_form, _state_keys, _storage_bits


def _check_sparse_gradient(name: str, param: Tensor, rows: Tensor, row_grads: Tensor, count: Tensor) -> None:
    if type(param) is not Tensor and type(param) is not torch.nn.Parameter:
        raise TypeError(f"{name}: the parameter must be a plain tensor or Parameter (DTensor parameters are not "
                        f"supported by the sparse step), got {type(param).__name__}")
    if param.dim() != 2 or not param.is_contiguous():
        raise ValueError(f"{name}: the parameter must be a contiguous 2-D table [rows, D], got shape "
                         f"{tuple(param.shape)}" + ("" if param.is_contiguous() else " (not contiguous)"))
    for what, tensor in (("rows", rows), ("row_grads", row_grads), ("count", count)):
        if not isinstance(tensor, Tensor) or tensor.layout != torch.strided:
            raise TypeError(f"{name}: {what} must be a dense tensor, got {type(tensor).__name__}")
        if tensor.device != param.device:
            raise ValueError(f"{name}: {what} is on {tensor.device} but the parameter is on {param.device}")
        if not tensor.is_contiguous():
            raise ValueError(f"{name}: {what} must be contiguous")
        require_readable(name, what, tensor)
    if rows.dtype != torch.int64 or rows.dim() != 1:
        raise ValueError(f"{name}: rows must be a 1-D int64 tensor, got {rows.dtype} of shape {tuple(rows.shape)}")
    if row_grads.dtype != param.dtype or tuple(row_grads.shape) != (rows.shape[0], param.shape[1]):
        raise ValueError(f"{name}: row_grads must be {param.dtype} of shape {(rows.shape[0], param.shape[1])} (rows, "
                         f"D), got {row_grads.dtype} of shape {tuple(row_grads.shape)}")
    if count.dtype != torch.int64 or count.numel() != 1:
        raise ValueError(f"{name}: count must be one int64 value, got {count.dtype} of shape {tuple(count.shape)}")


def sparse_step(optimizer: Any, param: Tensor, rows: Tensor, row_grads: Tensor, count: Tensor) -> None:
    """One step of `optimizer` for `param` alone, from a row-sparse gradient: the first `count` entries of `rows`
    (int64, strictly increasing) with `row_grads[k]` the gradient of row `rows[k]`, every other row's gradient zero
    (what graphsafe.ops.embedding_backward_sparse returns). The result is bitwise what `optimizer.step()` would
    give `param` with that dense gradient, and only the listed rows are touched (8-bit states: the quantisation
    blocks those rows share; LAMB and LARS go through a dense gradient, their trust ratio needing the whole table).

    param must be a contiguous 2-D parameter of one of the optimizer's groups, and that group must have
    skip_zeros=True (without it every row changes on every step). Like a step, it counts the parameter's step and
    reads nothing on the host: on CUDA it can be captured in a CUDA graph (count is read on the device). Call it
    for the table and `optimizer.step()` for the other parameters (leave the table's .grad None: step() skips it).
    """
    name = "sparse_step"
    if not hasattr(optimizer, "_sparse_step"):
        raise TypeError(f"{name}: optimizer must be a graphsafe optimizer, got {type(optimizer).__name__}")
    optimizer._sparse_step(param, rows, row_grads, count)


class _SparseStep:
    """GraphsafeOptimizer's part that runs sparse_step."""

    def _sparse_step(self, param: Tensor, rows: Tensor, row_grads: Tensor, count: Tensor) -> None:
        name = f"{type(self).__name__}.sparse_step"
        group = next((g for g in self.param_groups if any(p is param for p in g["params"])), None)
        if group is None:
            raise ValueError(f"{name}: the parameter is not in any of the optimizer's param groups")
        if not group["skip_zeros"]:
            raise ValueError(f"{name}: the parameter's group has skip_zeros=False; the sparse step equals the dense "
                             "step only with skip_zeros=True (without it every row changes on every step)")
        _check_sparse_gradient(name, param, rows, row_grads, count)
        device, dtype = param.device, param.dtype
        options, names = self._bucket_options(group, dtype)
        lr = group["lr"]
        if not isinstance(lr, Tensor) or lr.device != device or lr.dtype is not torch.float32 or lr.numel() != 1:
            if not isinstance(lr, Tensor):
                _check_lr(lr)
            group["lr"] = lr = _lr_tensor(lr, device)
        bits = _storage_bits(group["state_bits"], group["min_8bit_size"], param.numel())
        block_size = group["block_size"]
        schedule = self._schedule_names
        state = self.state[param]
        if not _in_step_form(state, names, bits, block_size, schedule):
            state = self._state_of(group, param, names, bits)
        _check_state_tensors(type(self).__name__, param, state, names, bits, block_size, schedule)
        # _state_keys' order: the states, then (8-bit) their absmax, then the schedule values, then the step.
        keys = _state_keys(names, bits, schedule)
        pointers = [state[key].data_ptr() for key in keys]
        state_count, schedule_count = len(names), len(schedule)
        schedule_start = len(keys) - 1 - schedule_count
        workspace_bytes = _C.optim_sparse_workspace_bytes(device.type, self.algorithm, options,
                                                          dtype_name(dtype), param.numel())
        workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=device) if workspace_bytes else None
        _C.optim_step_sparse(
            device_type=device.type, device_index=device.index or 0, stream=current_stream(device),
            algorithm=self.algorithm, options=options, param_dtype=dtype_name(dtype), lr=lr.data_ptr(),
            param=param.data_ptr(), states=pointers[:state_count], absmax=pointers[state_count:schedule_start],
            step=pointers[-1], numel=param.numel(), schedule=pointers[schedule_start:-1], rows=rows.data_ptr(),
            row_grads=row_grads.data_ptr(), count=count.data_ptr(), capacity=rows.shape[0],
            row_length=param.shape[1], workspace=workspace.data_ptr() if workspace is not None else 0,
            workspace_bytes=workspace_bytes, state_bits=bits, block_size=block_size)
