"""Data parallelism inside a traced step: the gradient all-reduce as nodes of the graph.

compile_step(model, ..., data_parallel=...) or compile_step(DDP(model), ...) traces the *unwrapped* module
(DDP's reducer works through autograd hooks on the module's own parameters, which the trace never runs: it
differentiates fresh leaves) and appends to the traced backward what DDP's reducer does:

* every gradient multiplied by 1/world, then summed over the ranks. That is torch 2.11's reducer with no comm
  hook (Reducer::mark_variable_ready_dense: mul_out(bucket_view, grad, wrapped_scalar_tensor(1. / div_factor))
  then an all-reduce of the bucket with op SUM), so on 2 ranks the result is DDP's bit for bit. (When a gradient
  already aliases its bucket view - gradient_as_bucket_view=True with grads kept between steps - the reducer
  divides instead, bucket_view.div_(world): the same bits for world sizes that are powers of two.)
* gradients flattened into buckets in parameter order (named_parameters order, the ones the loss reaches), one
  dtype per bucket, closed when the next gradient would take it past the cap; one collective per bucket. DDP
  orders its buckets by reversed registration order, then by the order gradients became ready in the first
  step; a fixed order here makes every rank, every run and every world size build the same buckets.
* buffers the step writes in place (BatchNorm statistics) broadcast from rank 0 before the forward pass, as
  DDP's broadcast_buffers does each step. Buffers the step only reads cannot diverge inside it: they are synced
  once, when the step is traced (DDP's constructor syncs everything once the same way).

The collectives are torch.distributed._functional_collectives (all_reduce / all_gather_tensor / broadcast and
their wait_tensor): make_fx records them as graph nodes with their data dependencies, the gate checks them like
any node, and on CUDA with NCCL they are recorded into the step's CUDA graph. reduction="rank_order" gathers
each bucket from every rank and adds the rows in rank order instead (graphsafe.distributed.sum_rows_in_order):
world times the memory of an all-reduce, but the sum's order no longer depends on the backend's algorithm
(gloo's ring starts each chunk at another rank; NCCL picks rings or trees by size and topology), so it equals
a single process adding the ranks' gradients in rank order, on every world size.

FSDP2 (fully_shard) and other DTensor-parameter models are not traced: see sharded_findings.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import Tensor

from .gate import Finding

__all__ = ["DataParallel", "DataParallelPlan", "REDUCTIONS", "resolve_data_parallel", "sharded_findings"]

REDUCTIONS = ("all_reduce", "rank_order")
_DEFAULT_BUCKET_CAP_MB = 25.0  # DDP's default bucket_cap_mb


@dataclass(frozen=True)
class DataParallel:
    """Data parallelism for compile_step: average the gradients over the ranks of `group` inside the step.

    group: a torch.distributed ProcessGroup (None: the default group). bucket_cap_mb: the largest bucket of
    flattened gradients per collective (None: DDP's, 25, or the wrapped DDP's own). broadcast_buffers: broadcast
    the buffers the step writes from rank 0 before each forward pass (None: True, or the DDP's own setting).
    reduction: "all_reduce" (DDP's numerics: grad * 1/world, summed by the backend) or "rank_order" (gathered,
    then added in rank order: bitwise equal to a single-process sum in rank order on any world size).
    """

    group: Any = None
    bucket_cap_mb: float | None = None
    broadcast_buffers: bool | None = None
    reduction: str = "all_reduce"

    def __post_init__(self) -> None:
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"DataParallel: reduction must be one of {', '.join(REDUCTIONS)}, got {self.reduction!r}")
        if self.bucket_cap_mb is not None and not self.bucket_cap_mb > 0:
            raise ValueError(f"DataParallel: bucket_cap_mb must be > 0, got {self.bucket_cap_mb}")


@dataclass
class Bucket:
    grad_indices: list[int]  # positions in the traced step's gradient list
    dtype: torch.dtype
    numel: int

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass
class DataParallelPlan:
    """What the traced step does across ranks; built by resolve_data_parallel, completed while tracing."""

    group: Any
    world_size: int
    rank: int
    backend: str
    source: str  # "DistributedDataParallel" or "process group"
    bucket_cap_bytes: int
    broadcast_buffers: bool
    reduction: str
    ignored: frozenset = frozenset()  # parameter and buffer names DDP was told to leave alone
    buckets: list[Bucket] = field(default_factory=list)  # filled by reduce_gradients while tracing
    broadcast: list[str] = field(default_factory=list)  # buffer names broadcast each step
    unreduced: list[str] = field(default_factory=list)  # gradients left local (ignored parameters)

    # ---- traced parts ----

    def reduce_gradients(self, names: Sequence[str], grads: Sequence[Tensor]) -> list[Tensor]:
        """The averaged gradients (traceable). names: the gradients' parameter names, in parameter order."""
        from torch.distributed import _functional_collectives as funcol

        out = list(grads)
        self.buckets = _assign_buckets(names, grads, self.ignored, self.bucket_cap_bytes)
        self.unreduced = [n for n in names if n in self.ignored]
        scale = 1.0 / self.world_size  # a Python float: traced as mul by a wrapped scalar, as DDP's reducer does
        for bucket in self.buckets:
            parts = [grads[i].reshape(-1) for i in bucket.grad_indices]
            flat = (torch.cat(parts) if len(parts) > 1 else parts[0]) * scale
            if self.reduction == "all_reduce":
                flat = _wait(funcol.all_reduce(flat, "sum", self.group))
            else:
                from ..distributed import sum_rows_in_order
                rows = _wait(funcol.all_gather_tensor(flat, 0, self.group))
                flat = sum_rows_in_order(rows.reshape(self.world_size, -1))
            sizes = [grads[i].numel() for i in bucket.grad_indices]
            for i, piece in zip(bucket.grad_indices, flat.split(sizes)):
                out[i] = piece.view(grads[i].shape)
        return out

    def broadcast_written_buffers(self, buffers: dict[str, Tensor]) -> None:
        """Rank 0's values copied into this rank's buffers, in place (traceable)."""
        from torch.distributed import _functional_collectives as funcol

        for name in self.broadcast:
            buffer = buffers[name]
            buffer.copy_(_wait(funcol.broadcast(buffer, 0, self.group)))

    # ---- outside the graph ----

    def sync_module(self, module: torch.nn.Module) -> None:
        """Parameters and buffers from rank 0 on every rank, once (what DDP's constructor does), after checking
        that every rank has the same parameter shapes."""
        from torch.distributed.utils import _sync_module_states, _verify_param_shape_across_processes

        params = [p for n, p in module.named_parameters() if n not in self.ignored]
        _verify_param_shape_across_processes(self.group, params)
        # DDP's broadcast bucket size (250 MiB) and its rule: buffers too unless broadcast_buffers is off
        _sync_module_states(module, self.group, 250 * 1024 * 1024, 0, self.ignored, self.broadcast_buffers)

    def __str__(self) -> str:
        total = sum(b.nbytes for b in self.buckets)
        how = ("all_reduce(sum) of grad * 1/world (DDP's average)" if self.reduction == "all_reduce"
               else "all_gather, then rows added in rank order, of grad * 1/world")
        lines = [f"data_parallel ({self.source}): {self.backend}, world {self.world_size}, rank {self.rank}; "
                 f"{len(self.buckets)} gradient bucket(s) in parameter order, {total / 2**20:.2f} MiB, {how}"]
        lines += [f"  bucket {k}: {len(b.grad_indices)} gradient(s), {b.numel} {str(b.dtype).removeprefix('torch.')}"
                  for k, b in enumerate(self.buckets)]
        if self.unreduced:
            lines.append(f"  left local (DDP's parameters to ignore): {', '.join(self.unreduced)}")
        lines.append("  buffers broadcast from rank 0 each step: "
                     + (", ".join(self.broadcast) if self.broadcast else
                        "none (the step writes none)" if self.broadcast_buffers else "none (broadcast_buffers off)"))
        return "\n".join(lines)


def _wait(t: Tensor) -> Tensor:
    # Eager functional collectives return an AsyncCollectiveTensor; under make_fx the wait is a graph node anyway.
    from torch.distributed import _functional_collectives as funcol
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


def _assign_buckets(names: Sequence[str], grads: Sequence[Tensor], ignored, cap_bytes: int) -> list[Bucket]:
    """Consecutive gradients of one dtype and device, in the given (parameter) order, up to cap_bytes each (a
    gradient larger than the cap gets a bucket of its own)."""
    buckets: list[Bucket] = []
    current: Bucket | None = None
    current_device = None
    for i, (name, g) in enumerate(zip(names, grads)):
        if name in ignored:
            continue
        size = g.numel() * g.dtype.itemsize
        if (current is None or g.dtype != current.dtype or g.device != current_device
                or current.nbytes + size > cap_bytes):
            current, current_device = Bucket([], g.dtype, 0), g.device
            buckets.append(current)
        current.grad_indices.append(i)
        current.numel += g.numel()
    return buckets


def _ddp_class():
    try:
        from torch.nn.parallel import DistributedDataParallel
        return DistributedDataParallel
    except ImportError:  # pragma: no cover - torch without distributed
        return None


def resolve_data_parallel(model: torch.nn.Module, data_parallel: Any) -> tuple[torch.nn.Module, DataParallelPlan | None]:
    """(the module to trace, the plan or None) for compile_step's model and data_parallel arguments.

    data_parallel: None (data parallel only if model is a DistributedDataParallel), True (the default group), a
    ProcessGroup, or a DataParallel. A DDP model's own group, bucket cap and broadcast_buffers are used unless a
    DataParallel overrides them (its group must then be None or the DDP's). Settings whose numerics compile_step
    does not reproduce (a comm hook, DDP's mixed_precision) are refused with ValueError rather than run
    differently from DDP."""
    import torch.distributed as dist

    ddp_cls = _ddp_class()
    ddp = model if ddp_cls is not None and isinstance(model, ddp_cls) else None
    if data_parallel is None and ddp is None:
        return model, None
    if data_parallel is False:
        if ddp is not None:
            raise ValueError("compile_step: data_parallel=False with a DistributedDataParallel model; pass "
                             "model.module to train it without averaging gradients")
        return model, None
    if data_parallel is True or data_parallel is None:
        spec = DataParallel()
    elif isinstance(data_parallel, DataParallel):
        spec = data_parallel
    elif isinstance(data_parallel, dist.ProcessGroup):
        spec = DataParallel(group=data_parallel)
    else:
        raise TypeError(f"compile_step: data_parallel must be None, True, a ProcessGroup or a graphsafe.graph."
                        f"DataParallel, got {type(data_parallel).__name__}")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("compile_step: data parallelism needs torch.distributed's default process group "
                           "(torch.distributed.init_process_group) first")
    ignored: frozenset = frozenset()
    if ddp is not None:
        _refuse_unsupported_ddp(ddp)
        if spec.group is not None and spec.group is not ddp.process_group:
            raise ValueError("compile_step: data_parallel names a process group other than the DDP model's")
        group, source = ddp.process_group, "DistributedDataParallel"
        cap = spec.bucket_cap_mb * 2**20 if spec.bucket_cap_mb is not None else ddp.bucket_bytes_cap
        broadcast = spec.broadcast_buffers if spec.broadcast_buffers is not None else ddp.broadcast_buffers
        ignored = frozenset(ddp.parameters_to_ignore)
        module = ddp.module
    else:
        group = spec.group if spec.group is not None else dist.group.WORLD
        source = "process group"
        cap = (spec.bucket_cap_mb if spec.bucket_cap_mb is not None else _DEFAULT_BUCKET_CAP_MB) * 2**20
        broadcast = spec.broadcast_buffers if spec.broadcast_buffers is not None else True
        module = model
    plan = DataParallelPlan(group=group, world_size=dist.get_world_size(group), rank=dist.get_rank(group),
                            backend=str(dist.get_backend(group)), source=source, bucket_cap_bytes=int(cap),
                            broadcast_buffers=bool(broadcast), reduction=spec.reduction, ignored=ignored)
    return module, plan


def _refuse_unsupported_ddp(ddp) -> None:
    logging_data = {}
    try:
        logging_data = ddp._get_ddp_logging_data()
    except Exception:  # noqa: BLE001 - only used to name a builtin comm hook
        pass
    hook = logging_data.get("comm_hook") if isinstance(logging_data, dict) else None
    if getattr(ddp, "_comm_hooks", None) or hook:
        name = hook or getattr(ddp._comm_hooks[0][0], "__qualname__", "a comm hook")
        raise ValueError(f"compile_step: the DDP model has a communication hook ({name}); compile_step averages "
                         "gradients as DDP does without one (grad * 1/world, summed) and would silently drop it. "
                         "Remove the hook, or train the DDP model with a plain loop")
    if getattr(ddp, "mixed_precision", None) is not None:
        raise ValueError("compile_step: the DDP model uses DDP's mixed_precision, which compile_step does not "
                         "reproduce; cast the model instead, or train it with a plain loop")


def sharded_findings(model: torch.nn.Module) -> list[Finding]:
    """Why compile_step cannot trace `model` (empty when it can): FSDP2 modules and DTensor parameters.

    FSDP2 (fully_shard) gathers each module's parameters in forward pre-hooks and reduce-scatters the gradients
    in backward hooks, with in-place collectives (dist.all_gather_into_tensor, reduce_scatter_tensor), stream
    events and storage resizes of the unsharded parameters: none of this is visible to make_fx, which traces
    the module functionally with its parameters swapped for plain tensors. A DTensor parameter (tensor
    parallelism) would be swapped for a plain tensor the same way, losing its placement. compile_step then runs
    the step eagerly through autograd (forward, backward with the module's hooks, optimizer.step()): correct,
    not captured."""
    findings: list[Finding] = []
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        FSDPModule = None
    if FSDPModule is not None:
        for name, module in model.named_modules():
            if isinstance(module, FSDPModule):
                findings.append(Finding(
                    f"module {name or '<root>'}", "fully_shard", "fsdp2",
                    "FSDP2 module: its all-gathers and reduce-scatters run in forward/backward hooks with in-place "
                    "collectives, stream events and storage resizes that make_fx cannot trace, so the step runs "
                    "eagerly through autograd (not captured)"))
    if not findings:
        try:
            from torch.distributed.tensor import DTensor
        except ImportError:  # pragma: no cover
            DTensor = None
        if DTensor is not None:
            for name, p in model.named_parameters():
                if isinstance(p, DTensor):
                    findings.append(Finding(
                        f"parameter {name}", "DTensor", "dtensor_param",
                        f"DTensor parameter ({p.placements}): tracing swaps parameters for plain tensors and would "
                        "lose the placement, so the step runs eagerly through autograd (not captured)"))
    return findings
