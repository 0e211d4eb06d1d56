"""graphsafe.compile_step: trace, rewrite, gate, partition, then run eagerly or captured.

Convention: a batch is a tensor or a tuple of tensors. The first `num_model_inputs` (default 1) go to the
model, the rest to the loss: `loss = loss_fn(model(*batch[:k]), *batch[k:])`. A lone tensor is the model
input and loss_fn(output) takes no target.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor

from .causal_attention import CausalAttentionReport, drop_constant_causal_masks
from .capture import (AutogradRunner, CaptureError, CaptureRunner, EagerRunner, FullCaptureRunner,
                      PiecewiseCaptureRunner, check_batch, written_buffers)
from .data_parallel import DataParallelPlan, resolve_data_parallel, sharded_findings
from ..optim._base import GraphsafeOptimizer
from .gate import GateReport, capture_gate
from .partition import PartitionReport, partition_for_capture
from .rewrite import RewriteReport, rewrite_embedding_backward
from .sparse_update import OutputLayout, SparseUpdateReport, fuse_sparse_embedding_update
from .trace import TensorSpec, TracedStep, as_batch, trace_training_step

__all__ = ["MODES", "StepReport", "CompiledStep", "compile_step"]

logger = logging.getLogger("graphsafe.graph")

MODES = ("auto", "full", "piecewise", "eager")


@dataclass
class StepReport:
    """Everything the passes found, and the mode chosen (str() gives a readable summary)."""

    requested_mode: str
    device: torch.device
    rewrite: RewriteReport
    gate: GateReport
    partition: PartitionReport
    mode: str = ""
    decision: str = ""
    fallbacks: list[str] = field(default_factory=list)
    data_parallel: DataParallelPlan | None = None
    traced: bool = True  # False: a model compile_step cannot trace (FSDP2), run through autograd
    sparse_update: SparseUpdateReport = field(default_factory=SparseUpdateReport)
    causal_attention: CausalAttentionReport = field(default_factory=CausalAttentionReport)

    def __str__(self) -> str:
        parts = [f"mode: {self.mode} (requested {self.requested_mode}) - {self.decision}"]
        parts += [f"fallback: {f}" for f in self.fallbacks]
        if self.data_parallel is not None:
            parts.append(str(self.data_parallel))
        parts += [str(self.rewrite), str(self.causal_attention), str(self.sparse_update), str(self.gate),
                  str(self.partition)]
        return "\n".join(parts)


class CompiledStep:
    """A training step as a callable: step(batch) -> loss (a detached 0-d tensor on the model's device).

    After a call, the parameters have been updated by `optimizer` exactly as by
    `loss = loss_fn(model(x), y); loss.backward(); optimizer.step(); optimizer.zero_grad()`, except that
    param.grad keeps this step's gradient (in captured modes, the static buffer the graphs write) instead of
    being reset to None. The model is traced on the first call (or at construction when example_batch is
    given); `.report` and `.mode` are available from then on.

    Sparse updates (sparse_updates=True, the default; sparse_update.py): an embedding table whose gradient is
    only its embedding backward and whose graphsafe optimizer group has skip_zeros=True is stepped row-sparse
    (graphsafe.optim.sparse_step after optimizer.step(), in the same captured graph): bitwise the same parameters
    and states, but its dense gradient is never built, so a fused table's param.grad stays None after a call.
    `.report.sparse_update` lists the fused tables and, for every other embedding weight, why not.

    Data parallelism (data_parallel.py, docs/multi-gpu.md): a DistributedDataParallel model, or data_parallel=
    True / a ProcessGroup / a DataParallel, makes the traced step average the gradients over the ranks inside the
    graph, as DDP does. Constructing such a step is a collective (rank 0's parameters and buffers are broadcast,
    as DDP's constructor does, unless the model is a DDP already). FSDP2 models are run eagerly through autograd.
    """

    def __init__(self, model: torch.nn.Module, loss_fn: Callable[..., Tensor], optimizer: torch.optim.Optimizer,
                 mode: str = "auto", *, num_model_inputs: int = 1, warmup_steps: int = 2,
                 example_batch: Any = None, data_parallel: Any = None, sparse_updates: bool = True) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if not isinstance(warmup_steps, int) or warmup_steps < 1:
            raise ValueError(f"warmup_steps must be an int >= 1 (eager steps before the capture), got {warmup_steps!r}")
        self.model, self.loss_fn, self.optimizer = model, loss_fn, optimizer
        self.requested_mode, self.num_model_inputs, self.warmup_steps = mode, num_model_inputs, warmup_steps
        self.sparse_updates = bool(sparse_updates)
        self.layout: OutputLayout | None = None
        self.device = _model_device(model)
        self.module, self.data_parallel = resolve_data_parallel(model, data_parallel)
        self.sharded = sharded_findings(self.module)
        if self.sharded and self.data_parallel is not None:
            raise ValueError(f"compile_step: data parallelism over a sharded model ({self.sharded[0].node}: "
                             f"{self.sharded[0].op}); FSDP2 averages the gradients itself, leave data_parallel out")
        if self.data_parallel is not None and self.data_parallel.source == "process group":
            self.data_parallel.sync_module(self.module)
        self.traced: TracedStep | None = None
        self.batch_specs: list[TensorSpec] | None = None
        self.report: StepReport | None = None
        self.graph_module: torch.fx.GraphModule | None = None
        self._runner = None
        if example_batch is not None:
            self._prepare(as_batch(example_batch))

    @property
    def mode(self) -> str:
        """The mode in use ("full", "piecewise" or "eager"); the requested one until the first call."""
        return self.report.mode if self.report is not None else self.requested_mode

    @property
    def captured(self) -> bool:
        return bool(self._runner is not None and self._runner.captured)

    def __call__(self, batch: Any) -> Tensor:
        batch = as_batch(batch)
        if self.batch_specs is None:
            self._prepare(batch)
        check_batch(batch, self.batch_specs)
        try:
            return self._runner(batch)
        except CaptureError as exc:
            if self.requested_mode != "auto":
                raise
            return self._fall_back(batch, exc)

    # ---- setup ----

    def _prepare(self, batch: tuple[Tensor, ...]) -> None:
        if self.sharded:
            return self._prepare_untraced(batch)
        traced = self._trace(batch)
        gm, rewrite = rewrite_embedding_backward(traced.graph_module)
        gm, causal = drop_constant_causal_masks(gm)  # on rewrite_embedding_backward's copy
        if self.sparse_updates:
            gm, sparse = fuse_sparse_embedding_update(gm, traced, self.optimizer)
        else:
            sparse = SparseUpdateReport(enabled=False, note="sparse_updates=False")
        _, gate = capture_gate(gm, self.device)
        split, partition = partition_for_capture(gm, gate, self.device)
        self.report = StepReport(self.requested_mode, self.device, rewrite, gate, partition,
                                 data_parallel=self.data_parallel, sparse_update=sparse, causal_attention=causal)
        mode, decision = self._choose_mode(gate, partition)  # may refuse the mode: then nothing is kept
        self.traced, self.graph_module, self.regions = traced, gm, split.regions
        self.layout = OutputLayout(traced.grad_params, sparse.fused_indices)
        self.batch_specs = traced.batch_specs
        self._use(mode, decision)

    def _trace(self, batch: tuple[Tensor, ...]) -> TracedStep:
        plan = self.data_parallel
        if plan is None:
            return trace_training_step(self.module, self.loss_fn, batch, self.num_model_inputs)
        traced = trace_training_step(self.module, self.loss_fn, batch, self.num_model_inputs,
                                     after_backward=plan.reduce_gradients)
        if not plan.broadcast_buffers:
            return traced
        # Only the buffers the step writes can differ between ranks after the sync at construction: those are
        # broadcast from rank 0 before each forward pass (DDP broadcasts every buffer each step to the same end).
        names = {id(b): n for n, b in zip(traced.buffer_names, traced.buffers)}
        buffer_names = {n for n, _ in self.module.named_buffers()}
        plan.broadcast = [names[id(b)] for b in written_buffers(traced, traced.graph_module)
                          if names[id(b)] in buffer_names and names[id(b)] not in plan.ignored]
        if not plan.broadcast:
            return traced
        return trace_training_step(self.module, self.loss_fn, batch, self.num_model_inputs,
                                   before_forward=plan.broadcast_written_buffers, after_backward=plan.reduce_gradients)

    def _prepare_untraced(self, batch: tuple[Tensor, ...]) -> None:
        """A model compile_step cannot trace (FSDP2, DTensor parameters): the gate's findings name the modules and
        the reason; the step runs eagerly through autograd, or is refused if a capture mode was asked for."""
        gate = GateReport(self.device, unsafe=list(self.sharded))
        self.report = StepReport(self.requested_mode, self.device, RewriteReport(), gate, PartitionReport(),
                                 traced=False, sparse_update=SparseUpdateReport(enabled=False, note="not traced"))
        first = self.sharded[0]
        if self.requested_mode in ("full", "piecewise"):
            raise CaptureError(f"mode={self.requested_mode!r}: this model cannot be traced, so nothing of its step can "
                               f"be captured ({first.node}: {first.reason}). Use mode='auto' or 'eager'")
        if not 1 <= self.num_model_inputs <= len(batch):
            raise ValueError(f"num_model_inputs must be between 1 and the batch length {len(batch)}, got "
                             f"{self.num_model_inputs}")
        self.batch_specs = [TensorSpec.of(t) for t in batch]
        self._runner = AutogradRunner(self.module, self.loss_fn, self.optimizer, self.num_model_inputs)
        kinds = sorted({f.rule for f in self.sharded})
        self.report.mode = "eager"
        self.report.decision = (f"not traced ({', '.join(kinds)}: {len(self.sharded)} finding(s), first "
                                f"{first.node}); the step runs eagerly through autograd and the module's hooks")
        logger.info("graphsafe.graph: mode=eager (%s)", self.report.decision)

    def _choose_mode(self, gate: GateReport, partition: PartitionReport) -> tuple[str, str]:
        counts = f"{len(self.report.rewrite.rewritten)} embedding backward(s) rewritten, {len(gate.unsafe)} unsafe node(s)"
        if self.report.sparse_update.fused:
            counts += f", {len(self.report.sparse_update.fused)} table(s) stepped row-sparse"
        optimizer_problem = _optimizer_not_capturable(self.optimizer)
        if self.device.type == "cuda" and optimizer_problem:
            # Known before any capture: a capture would fail at optimizer.step() after the regions ran.
            if self.requested_mode in ("full", "piecewise"):
                raise CaptureError(f"mode={self.requested_mode!r} captures optimizer.step(), but {optimizer_problem}")
            if self.requested_mode == "auto":
                return "eager", f"{optimizer_problem}; {counts}"
        if self.requested_mode != "auto":
            if self.requested_mode == "full" and not gate.passed and self.device.type == "cuda":
                rules = ", ".join(sorted(gate.by_rule()))
                raise CaptureError(f"mode='full' needs a graph without unsafe nodes; the gate found {len(gate.unsafe)} "
                                   f"({rules}). Use mode='piecewise' or 'auto', or see step.report / docs/graph.md.\n{gate}")
            return self.requested_mode, f"as requested; {counts}"
        if gate.passed:
            mode, why = "full", f"gate passed; {counts}"
        elif partition.num_capturable > 0:
            mode, why = "piecewise", (f"gate found unsafe nodes ({', '.join(sorted(gate.by_rule()))}); {counts}, "
                                      f"{partition.num_eager} eager region(s)")
        else:
            mode, why = "eager", f"nothing capturable; {counts}"
        if self.device.type != "cuda":
            return "eager", f"{self.device.type}: CUDA graphs need cuda (there auto would choose {mode}: {why})"
        return mode, why

    def _use(self, mode: str, decision: str) -> None:
        traced, gm, opt, layout = self.traced, self.graph_module, self.optimizer, self.layout
        if self.device.type != "cuda":
            # No capture on the CPU: the rewritten graph runs op by op (piecewise: region by region).
            self._runner = EagerRunner(traced, gm, opt, self.regions if mode == "piecewise" else None, layout)
            if self.requested_mode != "auto":
                decision += f"; {self.device.type}: run without capture"
        elif mode == "full":
            self._runner = FullCaptureRunner(traced, gm, opt, self.warmup_steps, layout=layout)
        elif mode == "piecewise":
            self._runner = PiecewiseCaptureRunner(traced, gm, opt, self.warmup_steps, self.regions, layout)
        else:
            self._runner = EagerRunner(traced, gm, opt, layout=layout)
        self.report.mode, self.report.decision = mode, decision
        logger.info("graphsafe.graph: mode=%s (%s)", mode, decision)

    def _fall_back(self, batch: tuple[Tensor, ...], exc: CaptureError) -> Tensor:
        # auto mode: a capture that fails falls back one level (full -> piecewise -> eager). The optimizer step
        # was not taken (a failed full capture ran no kernel; a piecewise one may have run regions before the
        # failing one, see docs/graph.md Limitations), so the next runner takes this call's step.
        next_mode = "piecewise" if self.mode == "full" and self.report.partition.num_capturable else "eager"
        self.report.fallbacks.append(f"{self.mode} -> {next_mode}: {exc}")
        logger.warning("graphsafe.graph: %s capture failed, falling back to %s: %s", self.mode, next_mode, exc)
        self._use(next_mode, f"fallback after a failed {self.mode} capture")
        if isinstance(self._runner, CaptureRunner):
            self._runner.calls = self.warmup_steps  # the warm-up steps were taken already: capture on this call
        return self(batch)


def compile_step(model: torch.nn.Module, loss_fn: Callable[..., Tensor], optimizer: torch.optim.Optimizer,
                 mode: str = "auto", *, num_model_inputs: int = 1, warmup_steps: int = 2,
                 example_batch: Any = None, data_parallel: Any = None, sparse_updates: bool = True) -> CompiledStep:
    """Compile `loss = loss_fn(model(*batch[:k]), *batch[k:]); backward; optimizer.step()` into one callable.

    mode: "auto" (full capture when the gate passes, else piecewise, else eager), "full", "piecewise" or
    "eager". On CUDA the first `warmup_steps` calls run eagerly (real steps), the next one captures. On the CPU
    nothing is captured: the traced, rewritten graph runs op by op. See docs/graph.md.

    data_parallel: None (data parallel only when model is a DistributedDataParallel), True (the default process
    group), a ProcessGroup, or a graphsafe.graph.DataParallel: the gradients are averaged over the group's ranks
    inside the traced step (bucketed functional all-reduces, DDP's numerics). See docs/multi-gpu.md.

    sparse_updates: fuse each embedding table that qualifies into a row-sparse gradient and
    graphsafe.optim.sparse_step (CompiledStep's docstring, docs/graph.md); False keeps every gradient dense.
    """
    return CompiledStep(model, loss_fn, optimizer, mode, num_model_inputs=num_model_inputs,
                        warmup_steps=warmup_steps, example_batch=example_batch, data_parallel=data_parallel,
                        sparse_updates=sparse_updates)


def _optimizer_not_capturable(optimizer: torch.optim.Optimizer) -> str:
    """Why optimizer.step() cannot be captured in a CUDA graph ("" if it can). graphsafe's optimizers keep lr
    and step on the device; torch.optim's need capturable=True in every param group."""
    if isinstance(optimizer, GraphsafeOptimizer):
        return ""
    groups = [g for g in optimizer.param_groups if not g.get("capturable", False)]
    if groups:
        return (f"{type(optimizer).__name__} has {len(groups)} param group(s) without capturable=True "
                "(torch.optim reads lr and step on the host then); use a graphsafe optimizer or capturable=True")
    return ""


def _model_device(model: torch.nn.Module) -> torch.device:
    if next(model.parameters(), None) is None:
        raise ValueError("compile_step: the model has no parameters (nothing to train)")
    devices = {p.device for p in model.parameters()} | {b.device for b in model.buffers()}
    if len(devices) != 1:
        raise ValueError(f"compile_step needs all parameters and buffers on one device, got {sorted(map(str, devices))}")
    return devices.pop()
