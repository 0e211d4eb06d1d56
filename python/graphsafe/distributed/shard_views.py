"""A parameter's local shard and back: what an optimizer step needs to update a DTensor parameter (FSDP2's
fully_shard, or any DTensor with Shard/Replicate placements) through raw addresses, and to keep its states as
DTensors of the parameter's placement, so that optimizer.state_dict() and torch.distributed.checkpoint (DCP)
see them as torch.optim's states under FSDP2 are seen, and can save and reshard them.

What must hold (checked on torch 2.11, gloo, 2 and 3 processes; tests/python/test_distributed_helpers.py):
  * A DTensor's own data is its local tensor: a plain, contiguous tensor for FSDP2 parameters and gradients,
    empty (shape (0, ...)) on ranks past the last row when dim 0 does not divide by the world size. A DTensor's
    data_ptr() is 0, and its shape, stride and numel() are the whole tensor's: the core must be given the
    local tensor, its address and its numel().
  * Under no_grad, DTensor.to_local() returns the DTensor's own local tensor, the same object at every call (in
    grad mode an autograd alias, a new object each call): local_view reads it with grad mode off, so that
    identity caches (the fast path's) keep working.
  * DTensor.from_local(local, ...) wraps a view of local (the same memory, another tensor object): a step that
    writes the local tensor in place is seen through the wrapper, and the other way round (DCP's load writes
    into a state DTensor's local tensor).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

# DTensor is looked up where it is used, never imported here: importing torch.distributed.tensor takes most of a
# second, which every `import graphsafe` would pay, and no DTensor can exist before that module is imported.
_DTENSOR_MODULE = "torch.distributed.tensor"


def dtensor_class() -> type | None:
    """torch's DTensor class if torch.distributed.tensor has been imported (else no DTensor exists), else None."""
    module = sys.modules.get(_DTENSOR_MODULE)
    return getattr(module, "DTensor", None) if module is not None else None


__all__ = ["ShardSpec", "local_view", "like_param", "is_dtensor", "dtensor_class"]


@dataclass(frozen=True)
class ShardSpec:
    """How a DTensor lies across its mesh: what DTensor.from_local needs to wrap a local tensor of the same layout
    (mesh, placements, the whole tensor's shape and stride), and which mesh dimensions split it."""

    mesh: Any  # torch.distributed.device_mesh.DeviceMesh
    placements: tuple
    shape: torch.Size
    stride: tuple[int, ...]

    @property
    def sharded_mesh_dims(self) -> tuple[int, ...]:
        """The mesh dimensions whose ranks hold different parts of the tensor: every placement but Replicate (whose
        ranks hold copies) and Partial (whose ranks hold addends of the whole; refused where a whole-tensor value
        is formed, sum_across_shards). Shard, and FSDP2-with-TP's _StridedShard, which in torch 2.11 is not a
        Shard subclass and answers False to is_shard()."""
        return tuple(d for d, placement in enumerate(self.placements)
                     if not placement.is_replicate() and not placement.is_partial())


def is_dtensor(t: Any) -> bool:
    """Whether t is a torch.distributed DTensor."""
    cls = dtensor_class()
    return cls is not None and isinstance(t, cls)


def local_view(tensor: Tensor) -> tuple[Tensor, ShardSpec | None]:
    """(the tensor the core can read and write, how it lies across its mesh): for a DTensor its own local tensor
    (the same object at every call, sharing the DTensor's memory) and its ShardSpec; for any other tensor the
    tensor itself and None. Reads nothing on the device and issues no collective."""
    if not is_dtensor(tensor):
        return tensor, None
    if torch.is_grad_enabled():
        with torch.no_grad():
            local = tensor.to_local()
    else:
        local = tensor.to_local()
    return local, ShardSpec(tensor.device_mesh, tuple(tensor.placements), tensor.shape, tuple(tensor.stride()))


def _spec_of(param: Tensor | ShardSpec | None) -> ShardSpec | None:
    if param is None or isinstance(param, ShardSpec):
        return param
    if not isinstance(param, Tensor):
        raise TypeError(f"expected a parameter (a tensor or a DTensor) or a ShardSpec, got {type(param).__name__}")
    return local_view(param)[1]


def like_param(local_state: Tensor, param: Tensor | ShardSpec | None) -> Tensor:
    """local_state (a state of the local shard's shape: a step's fp32/bf16 state or 8-bit codes) as a DTensor with
    param's mesh, placements, global shape and stride, sharing local_state's memory; local_state itself for a
    plain parameter (or None). param may be the ShardSpec local_view gave for it.

    Any dtype is kept (a state's dtype need not be the parameter's). A local_state whose shape is not the local
    shard's is refused (ValueError): wrapped with the parameter's global shape it would describe another
    layout, which DCP would save and reshard wrongly (an 8-bit state's per-block absmax needs a layout of its own).
    """
    if not isinstance(local_state, Tensor) or is_dtensor(local_state):
        raise TypeError(f"like_param: the state must be a plain (local) tensor, got {type(local_state).__name__}")
    spec = _spec_of(param)
    if spec is None:
        return local_state
    if isinstance(param, Tensor):
        expected = tuple(local_view(param)[0].shape)
    else:  # only the spec: the local shape DTensor's own rule gives for this rank
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
        expected = tuple(compute_local_shape_and_global_offset(spec.shape, spec.mesh, spec.placements)[0])
    if tuple(local_state.shape) != expected:
        raise ValueError(f"like_param: a local state of shape {tuple(local_state.shape)} does not fit this rank's "
                         f"shard {expected} of a parameter of shape {tuple(spec.shape)} placed {spec.placements}")
    return dtensor_class().from_local(local_state, spec.mesh, spec.placements, run_check=False, shape=spec.shape,
                              stride=spec.stride)
