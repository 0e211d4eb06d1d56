"""Optimizers on DTensor parameters: FSDP2's fully_shard, or any DTensor with Shard and Replicate placements.

The core updates each rank's local shard: a step hands it the parameter's and the gradient's local tensors
(graphsafe.distributed.local_view), and a parameter's states are plain tensors of the local shard's shape, kept
in optimizer.state as for any parameter (so every check, conversion and cache of a step works unchanged). Only
the state_dict boundary sees DTensors: state_dict() gives each element-wise state as a DTensor of its
parameter's layout (as torch.optim's states under FSDP2 are), so that torch.distributed.checkpoint saves each
rank's shard and can reshard it; load_state_dict takes such DTensors, or whole plain tensors, back to this
rank's shard. 8-bit states leave as their fp32 values (quantisation blocks are the local shard's, so codes and
scales do not reshard; quantising the dequantised values again gives back the same codes and scales, so a
resumed run continues bitwise). The step count and schedule values are the same on every rank (every rank
steps every parameter, an empty shard included) and stay plain 0-d tensors.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .. import _C, ops
from .._tensor_checks import require_readable
from ..distributed.shard_sums import sum_across_shards
from ..distributed.shard_views import ShardSpec, dtensor_class, is_dtensor, like_param, local_view


def local_of(t: Any) -> Any:
    """The tensor the core reads for t: a DTensor's own local tensor, anything else itself."""
    cls = dtensor_class()
    if cls is None or not isinstance(t, cls):
        return t
    return local_view(t)[0]


def check_param(owner: str, p: Tensor) -> None:
    """The clear error for a DTensor parameter the step cannot update shard by shard."""
    if not is_dtensor(p):
        return
    partial = [placement for placement in p.placements if placement.is_partial()]
    if partial:
        raise ValueError(f"{owner}: a DTensor parameter placed {tuple(p.placements)} holds partial sums on each "
                         "rank, not a shard; redistribute it to Shard or Replicate placements")
    require_readable(owner, "a parameter's local shard", local_of(p))


def check_grad(owner: str, p: Tensor, g: Tensor) -> None:
    """The clear error for a gradient that does not lie as its DTensor parameter does (the step pairs local
    shards element by element), or a DTensor gradient of a plain parameter."""
    if is_dtensor(p) != is_dtensor(g):
        raise TypeError(f"{owner}: a {'DTensor' if is_dtensor(p) else 'plain'} parameter has a "
                        f"{'DTensor' if is_dtensor(g) else 'plain'} gradient")
    if is_dtensor(p) and (tuple(g.placements) != tuple(p.placements) or g.device_mesh != p.device_mesh):
        raise ValueError(f"{owner}: a gradient placed {tuple(g.placements)} on {g.device_mesh} does not lie as its "
                         f"parameter ({tuple(p.placements)} on {p.device_mesh}); redistribute it first")


def shareable_state(optimizer: Any, group: dict[str, Any], p: Tensor, state: dict[str, Any]) -> dict[str, Any]:
    """A DTensor parameter's saved state: each element-wise state a DTensor of p's layout (8-bit ones as their fp32
    values), the step and schedule values as they are."""
    names = optimizer._state_names(group)
    options = optimizer._core_options(group)
    local = local_of(p)
    out = {key: value for key, value in state.items()
           if not (key.endswith("_absmax") or key.endswith("_qmap") or key == "block_size")}
    for j, name in enumerate(names):
        value = state.get(name)
        if not isinstance(value, Tensor):
            continue
        if value.dtype == torch.uint8 and f"{name}_absmax" in state:  # 8-bit codes: their fp32 values
            signed = _C.optim_state_is_signed(optimizer.algorithm, options, j)
            value = ops.dequantize_blockwise(value, state[f"{name}_absmax"], state["block_size"], signed)
            value = value.reshape(local.shape)
        out[name] = like_param(value, p)
    return out


def localized_state(owner: str, p: Tensor, saved: dict[str, Any], element_names: set[str]) -> dict[str, Any]:
    """A saved state of DTensor parameter p brought to this rank's shard, on its device: element-wise states
    given as DTensors of p's layout (state_dict's, DCP's) or as whole plain tensors of p's shape (a checkpoint
    of one process; 8-bit ones dequantised first) become plain local tensors; the rest is kept."""
    local = local_of(p)
    out = dict(saved)
    for name in element_names:
        value = saved.get(name)
        if value is None:
            continue
        if is_dtensor(value):
            if tuple(value.shape) != tuple(p.shape) or tuple(value.placements) != tuple(p.placements):
                raise ValueError(
                    f"{owner}: the saved state '{name}' is a DTensor of shape {tuple(value.shape)} placed "
                    f"{tuple(value.placements)}, its parameter {tuple(p.shape)} placed {tuple(p.placements)}; "
                    "load it with torch.distributed.checkpoint.state_dict.set_state_dict, which redistributes it")
            out[name] = local_view(value)[0]
            continue
        if not isinstance(value, Tensor):
            continue
        require_readable(owner, f"the saved state '{name}'", value)
        if value.dtype == torch.uint8 and f"{name}_absmax" in saved:  # a whole 8-bit state: its fp32 values
            from ._state_storage import _state_as_fp32
            whole = torch.empty(p.shape, dtype=torch.float32, device=local.device)
            value = _state_as_fp32(saved, name, whole, owner)
            for key in (f"{name}_absmax", f"{name}_qmap"):
                out.pop(key, None)
        if tuple(value.shape) != tuple(p.shape):
            raise ValueError(f"{owner}: the saved state '{name}' has shape {tuple(value.shape)}, its parameter "
                             f"{tuple(p.shape)} (a DTensor whose shard here is {tuple(local.shape)})")
        out[name] = _shard_of(value, p).to(local.device)
    if not any(key.endswith("_absmax") for key in out):
        out.pop("block_size", None)
    return out


def _shard_of(whole: Tensor, p: Tensor) -> Tensor:
    """This rank's part of a whole tensor laid out as DTensor p (DTensor's own rule for the local shape and
    offset), without any collective."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    index = tuple(slice(start, start + size) for start, size in zip(offset, shape))
    return whole[index]


def shard_layouts(params: list[Tensor]) -> list[ShardSpec | None] | None:
    """Per parameter of a LAMB/LARS core call, its layout (None for a plain one), if any is split over more than
    one rank (its norms then need the other shards'); None if none is."""
    layouts = [local_view(p)[1] for p in params]
    split = any(layout is not None and any(layout.mesh.size(d) > 1 for d in layout.sharded_mesh_dims)
                for layout in layouts)
    return layouts if split else None


def whole_tensor_norms(partials: Tensor, layouts: list[ShardSpec | None]) -> Tensor:
    """Each tensor's squared norms over the whole parameter: the core's per-shard partials (one row per tensor,
    [param², update²]) summed across the shards in rank order (sum_across_shards: the same bits on every rank),
    one collective per run of consecutive parameters laid out alike; a plain parameter's row is its own total.
    No host reads, no index tensors (a captured step copies nothing from the host)."""
    pieces, start = [], 0
    while start < len(layouts):
        layout = layouts[start]
        end = start + 1
        while end < len(layouts) and _same_layout(layouts[end], layout):
            end += 1
        run = partials[start:end]
        pieces.append(run if layout is None else sum_across_shards(run.contiguous(), layout))
        start = end
    return torch.cat(pieces).contiguous() if len(pieces) > 1 else pieces[0].contiguous()


def _same_layout(a: ShardSpec | None, b: ShardSpec | None) -> bool:
    """Whether two parameters' partials can be gathered together: the same mesh and placements (or both plain)."""
    if a is None or b is None:
        return a is b
    return a.mesh == b.mesh and a.placements == b.placements
