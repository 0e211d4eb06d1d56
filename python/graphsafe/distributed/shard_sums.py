"""Whole-tensor sums from per-shard partial sums, in a fixed order: what LAMB's and LARS's trust ratios need on
sharded parameters (the norm of the whole parameter, not of the local shard), bitwise the same on every rank and
in every run, and equal to a single process adding the same per-rank partials in rank order.

Why gather and add, not all_reduce: an all-reduce's summation order is the backend's (gloo's ring reduces each
chunk of the buffer starting from another rank; NCCL picks ring or tree by size and topology), so its bits can
differ between world sizes, message sizes, and from a single-process reference. Gathering the partials (a copy,
no arithmetic) and adding the rows in rank order with a plain loop of element-wise adds fixes the order: every
rank runs the same adds on the same bits, so every rank gets the same result. torch.sum over the gathered rows
would not do: its reduction order is not specified (it vectorises and splits across threads and blocks).

Collective used: torch.distributed._functional_collectives.all_gather_tensor, not the in-place
dist.all_gather_into_tensor. It allocates its own output (no buffer to keep per parameter), and it is the form
torch.compile and make_fx trace (the op _c10d_functional.all_gather_into_tensor and its wait_tensor), so a traced
step (compile_step) keeps it as a graph node with its data dependencies instead of an opaque side effect. Eager
it is the same c10d all-gather on the group's backend (gloo here; on CUDA NCCL, whose collectives can be recorded
in a CUDA graph; that capture is not tested on this machine: it needs two GPUs). Nothing is read on the host: no
.item(), no .tolist(), no data-dependent shape.
"""

from __future__ import annotations

from torch import Tensor

from .shard_views import ShardSpec, _spec_of

__all__ = ["sum_across_shards", "sum_rows_in_order"]


def sum_rows_in_order(rows: Tensor) -> Tensor:
    """rows[0] + rows[1] + ... + rows[n-1], added left to right, one element-wise add per row (the order
    sum_across_shards uses; also the single-process reference). Starts from rows[0] itself, not from zeros
    (0.0 + -0.0 is +0.0: a sum of one row keeps its bits)."""
    if rows.shape[0] == 0:
        raise ValueError("sum_rows_in_order: no rows to add")
    total = rows[0].clone()
    for i in range(1, rows.shape[0]):
        total = total + rows[i]
    return total


def sum_across_shards(partials: Tensor, param: Tensor | ShardSpec | None) -> Tensor:
    """The totals over every shard of `param` of this rank's partial sums `partials` (a small floating-point
    tensor on the parameter's device, e.g. [sum p*p, sum u*u] per tensor; any shape, summed element-wise), the
    same bits on every rank: the partials gathered over each mesh dimension that shards the parameter, then
    added in rank order (the mesh's row-major order of those dimensions' coordinates; ranks along Replicate
    dimensions hold the same shard and count once: they are not gathered over). For a plain parameter (or None,
    or one replicated on every mesh dimension) the partials are the totals and are returned as they are.

    Equal, bit for bit, to sum_rows_in_order over the per-rank partials stacked in rank order. A collective on
    each sharded mesh dimension: every rank of those groups must call it, with partials of the same shape and
    dtype (one call may carry the partials of many parameters of the same placement, concatenated)."""
    spec = _spec_of(param)
    if spec is None:
        return partials
    if not isinstance(partials, Tensor) or not partials.is_floating_point():
        raise TypeError(f"sum_across_shards: partials must be a floating-point tensor, got "
                        f"{getattr(partials, 'dtype', type(partials).__name__)}")
    if any(placement.is_partial() for placement in spec.placements):
        raise ValueError(f"sum_across_shards: a parameter placed {spec.placements} holds partial values, not "
                         "shards; its whole value is not a sum of per-shard sums")
    if partials.device.type != spec.mesh.device_type:
        raise ValueError(f"sum_across_shards: partials on {partials.device}, but the parameter's mesh is on "
                         f"{spec.mesh.device_type}: the collective runs on the mesh's devices")
    dims = [d for d in spec.sharded_mesh_dims if spec.mesh.size(d) > 1]
    if not dims:
        return partials
    from torch.distributed import _functional_collectives as funcol

    rows = partials.reshape(1, *partials.shape).contiguous()
    # Innermost (last) mesh dimension first: after gathering over dimension d, row i*n_d + j comes from coordinate i
    # of the dimensions gathered next and j of d, so the final rows are in row-major order of mesh coordinates.
    for d in reversed(dims):
        rows = funcol.all_gather_tensor(rows.contiguous(), 0, (spec.mesh, d))
        if isinstance(rows, funcol.AsyncCollectiveTensor):
            rows = rows.wait()
    return sum_rows_in_order(rows)

