"""Running a traced step: eagerly, or captured in CUDA graphs (whole step, or piecewise around unsafe nodes).

Every runner does the same thing per call: feed the batch, compute (loss, *grads) with the rewritten graph,
put the gradients in param.grad, call optimizer.step(), return the loss. Tables fused by
fuse_sparse_embedding_update come out of the graph as (rows, row_grads, count) instead of a gradient: their
.grad stays None (step() skips them) and graphsafe.optim.sparse_step steps them right after optimizer.step(),
in the same CUDA graph where the step is captured (sparse_update.OutputLayout). They differ in what is recorded:

* EagerRunner: runs the whole graph (or its regions, in order) op by op. Used on the CPU, in mode "eager",
  and on CUDA for the warm-up steps before a capture.
* FullCaptureRunner ("full"): one torch.cuda.CUDAGraph holds the graph *and* optimizer.step(); a call is
  one copy of the batch into static buffers plus one replay.
* PiecewiseCaptureRunner ("piecewise"): one CUDAGraph per capturable region and one for optimizer.step();
  eager regions run in between, reading and writing static buffers.

All graphs of a runner share one memory pool, so regions pass tensors to each other without copies; they are
replayed in the order they were captured (what a shared pool requires). Capturing does not run anything: the
first captured call captures the graphs and then replays them on its batch, so every call is a real step and a
captured run takes exactly the steps an eager loop takes (the warm-up steps included).

The contract on inputs: a captured graph is specialised to the shapes, dtypes and devices of the batch it was
traced with; a different batch raises InputMismatchError (all modes, because the trace itself is specialised).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor

from .partition import Region, output_from_env, run_regions
from .sparse_update import OutputLayout
from .trace import TensorSpec, TracedStep

__all__ = ["InputMismatchError", "CaptureError", "EagerRunner", "AutogradRunner", "CaptureRunner", "FullCaptureRunner",
           "PiecewiseCaptureRunner", "check_batch"]


class InputMismatchError(ValueError):
    """A batch does not match the shapes/dtypes/devices the step was traced (and captured) with."""


class CaptureError(RuntimeError):
    """A CUDA graph capture failed (the message names the region and the original error)."""


def check_batch(batch: Sequence[Tensor], specs: Sequence[TensorSpec]) -> None:
    """InputMismatchError unless every batch tensor has its traced shape, dtype and device."""
    if len(batch) != len(specs):
        raise InputMismatchError(
            f"the step was compiled for batches of {len(specs)} tensors, got {len(batch)}. "
            "Call graphsafe.compile_step again for the new batch structure."
        )
    for position, (t, spec) in enumerate(zip(batch, specs)):
        if t.dtype != spec.dtype or tuple(t.shape) != spec.shape or t.device != spec.device:
            raise InputMismatchError(
                f"batch tensor {position} has {TensorSpec.of(t)}, but the step was traced and captured for {spec}. "
                "A compiled step is specialised to one batch shape: pad or drop the last partial batch "
                "(DataLoader(drop_last=True)), or compile another step for the new shape."
            )


class EagerRunner:
    """The traced (rewritten) graph run op by op, whole or region by region. No capture, any device."""

    captured = False

    def __init__(self, traced: TracedStep, gm: torch.fx.GraphModule, optimizer: torch.optim.Optimizer,
                 regions: Sequence[Region] | None = None, layout: OutputLayout | None = None) -> None:
        self.traced, self.gm, self.optimizer, self.regions = traced, gm, optimizer, regions
        self.layout = layout if layout is not None else OutputLayout(traced.grad_params)

    def compute(self, batch: Sequence[Tensor]) -> tuple[Tensor, list[Tensor], list[tuple[Tensor, Tensor, Tensor]]]:
        inputs = self.traced.inputs(batch)
        # The graph is already forward + backward in aten ops: autograd must not record it again.
        with torch.no_grad():
            outputs = self.gm(*inputs) if self.regions is None else run_regions(self.regions, self.gm, inputs)
        return self.layout.split(outputs)

    def __call__(self, batch: Sequence[Tensor]) -> Tensor:
        loss, grads, sparse = self.compute(batch)
        self.layout.install(grads)
        self.layout.step(self.optimizer, sparse)
        return loss


class AutogradRunner:
    """The step as a plain loop runs it, through autograd and the module's own hooks, without a trace: for
    models compile_step cannot trace (FSDP2, DTensor parameters; data_parallel.sharded_findings says why)."""

    captured = False

    def __init__(self, model: torch.nn.Module, loss_fn, optimizer: torch.optim.Optimizer,
                 num_model_inputs: int) -> None:
        self.model, self.loss_fn, self.optimizer, self.num_model_inputs = model, loss_fn, optimizer, num_model_inputs
        self.params = [p for p in model.parameters() if p.requires_grad]

    def __call__(self, batch: Sequence[Tensor]) -> Tensor:
        k = self.num_model_inputs
        for p in self.params:  # this step's gradient only, as in the traced runners (not accumulated)
            p.grad = None
        loss = self.loss_fn(self.model(*batch[:k]), *batch[k:])
        if not isinstance(loss, Tensor) or loss.numel() != 1 or not loss.is_floating_point():
            raise TypeError("loss_fn must return a floating-point tensor with one element")
        loss.backward()
        self.optimizer.step()
        return loss.detach()


def _warm_up(runner: EagerRunner, batch: Sequence[Tensor]) -> Tensor:
    """One real eager step on a side stream (torch.cuda.graph's docs ask for warm-up there: lazy
    initialisation such as cuBLAS handles and the optimizer's states happens before the capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        loss = runner(batch)
    torch.cuda.current_stream().wait_stream(side)
    return loss


def _settle_after_failed_capture(stream: torch.cuda.Stream) -> None:
    # torch.cuda.graph's __exit__ can leave its capture stream current when capture_end raises: restore ours.
    torch.cuda.set_stream(stream)
    try:
        torch.cuda.synchronize()
    except Exception:  # noqa: BLE001 - the capture error is what gets reported
        pass


class CaptureRunner:
    """What full and piecewise capture share: warm-up calls, static batch buffers, one pool, replay."""

    captured = True

    def __init__(self, traced: TracedStep, gm: torch.fx.GraphModule, optimizer: torch.optim.Optimizer,
                 warmup_steps: int, regions: Sequence[Region] | None = None, layout: OutputLayout | None = None) -> None:
        self.traced, self.gm, self.optimizer = traced, gm, optimizer
        self.layout = layout if layout is not None else OutputLayout(traced.grad_params)
        self.warmup_steps = warmup_steps
        self.written_buffers = written_buffers(traced, gm)
        # The warm-up steps run sparse_step eagerly too: its states and the lr tensor exist before the capture.
        self.eager = EagerRunner(traced, gm, optimizer, regions, self.layout)
        self.calls = 0
        self.pool = None
        self.static_batch: list[Tensor] | None = None
        self.static_grads: list[Tensor] = []  # one per layout.dense_params
        self.static_sparse: list[tuple[Tensor, Tensor, Tensor]] = []  # one per layout.sparse_params
        self.static_loss: Tensor | None = None

    def __call__(self, batch: Sequence[Tensor]) -> Tensor:
        self.calls += 1
        if self.calls <= self.warmup_steps:
            return _warm_up(self.eager, batch)
        if self.static_batch is None:
            self.static_batch = [t.clone() for t in batch]
            self.pool = torch.cuda.graph_pool_handle()
            stream = torch.cuda.current_stream()
            torch.cuda.synchronize()
            grads_before = [p.grad for p in self.traced.grad_params]
            buffers_before: list[Tensor] = []
            try:
                # A piecewise capture runs its eager regions for real; if a later region's capture fails, an
                # in-place buffer update they made (BatchNorm statistics) must not count, or the fallback's
                # step would apply it a second time. So the buffers the graph writes are copied first.
                buffers_before = [b.detach().clone() for b in self.written_buffers]
                self._capture_and_run()
            except Exception as exc:
                _settle_after_failed_capture(stream)
                self.static_batch = None  # nothing usable was kept; the step was not taken
                # The capture set param.grad to tensors of the aborted graph that nothing computed.
                for p, g in zip(self.traced.grad_params, grads_before):
                    p.grad = g
                with torch.no_grad():
                    for b, saved in zip(self.written_buffers, buffers_before):
                        b.copy_(saved)
                raise CaptureError(f"{type(self).__name__}: capture failed: {type(exc).__name__}: {exc}") from exc
            return self.static_loss.clone()
        for static, t in zip(self.static_batch, batch):
            static.copy_(t, non_blocking=True)
        self._replay()
        # A clone, so the caller's loss survives the next replay (which overwrites the static one).
        return self.static_loss.clone()

    def _install_grads(self) -> None:
        # The graphs read and write these exact tensors; someone may have called zero_grad() in between. A fused
        # table's .grad goes back to None, which is what the captured step saw.
        self.layout.install(self.static_grads)


class FullCaptureRunner(CaptureRunner):
    """Graph + optimizer.step() in one CUDA graph."""

    def _capture_and_run(self) -> None:
        graph = torch.cuda.CUDAGraph()
        inputs = self.traced.inputs(self.static_batch)
        with torch.no_grad(), torch.cuda.graph(graph, pool=self.pool):
            loss, grads, sparse = self.layout.split(self.gm(*inputs))
            self.layout.install(grads)
            self.layout.step(self.optimizer, sparse)  # fused tables' sparse_step in the same graph
        self.graph, self.static_loss, self.static_grads, self.static_sparse = graph, loss, grads, sparse
        graph.replay()

    def _replay(self) -> None:
        self._install_grads()
        self.graph.replay()


class PiecewiseCaptureRunner(CaptureRunner):
    """One CUDA graph per capturable region, eager regions in between, one CUDA graph for optimizer.step() (and the
    fused tables' sparse_step)."""

    def __init__(self, traced, gm, optimizer, warmup_steps, regions: Sequence[Region],
                 layout: OutputLayout | None = None) -> None:
        super().__init__(traced, gm, optimizer, warmup_steps, regions, layout)
        self.regions = list(regions)
        output_names = _output_names(gm)
        self.grad_names = output_names[1:]  # the gradients and the fused tables' (rows, row_grads, count)
        # Tensors an eager region makes that a captured graph reads (a later captured region, or the optimizer
        # graph through param.grad) are copied into static buffers, whose addresses the graphs keep.
        read_by_graphs = set(self.grad_names)
        for region in self.regions:
            if region.capturable:
                read_by_graphs.update(region.inputs)
        self.needs_static = [[n for n in r.outputs if n in read_by_graphs] if not r.capturable else []
                             for r in self.regions]

    def _capture_and_run(self) -> None:
        env: dict[str, Any] = dict(zip(_placeholder_names(self.gm), self.traced.inputs(self.static_batch)))
        self.graphs: list[torch.cuda.CUDAGraph | None] = []
        self.static_buffers: dict[str, Tensor] = {}
        for region, static_names in zip(self.regions, self.needs_static):
            args = [env[name] for name in region.inputs]
            if region.capturable:
                graph = torch.cuda.CUDAGraph()
                try:
                    with torch.no_grad(), torch.cuda.graph(graph, pool=self.pool):
                        outputs = region(*args)
                except Exception as exc:
                    raise CaptureError(f"region {region.index} ({len(region.nodes)} nodes, "
                                       f"{region.nodes[0]}..{region.nodes[-1]}): {exc}") from exc
                graph.replay()  # capturing ran nothing: compute this step's values for the regions after it
                self.graphs.append(graph)
                env.update(zip(region.outputs, outputs))
            else:
                with torch.no_grad():
                    outputs = region(*args)
                self.graphs.append(None)
                env.update(zip(region.outputs, outputs))
                for name in static_names:
                    if isinstance(env[name], Tensor):
                        self.static_buffers[name] = env[name] = env[name].clone()
        self.env = env
        loss, grads, sparse = self.layout.split(output_from_env(self.gm, env))
        self.static_loss, self.static_grads, self.static_sparse = loss, grads, sparse
        self._install_grads()
        self.optimizer_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.optimizer_graph, pool=self.pool):
            self.layout.step(self.optimizer, sparse)
        self.optimizer_graph.replay()

    def _replay(self) -> None:
        env = self.env
        for region, graph in zip(self.regions, self.graphs):
            if graph is not None:
                graph.replay()
                continue
            with torch.no_grad():
                outputs = region(*[env[name] for name in region.inputs])
            for name, value in zip(region.outputs, outputs):
                static = self.static_buffers.get(name)
                if static is None:
                    env[name] = value
                elif static.shape != value.shape:  # not a CaptureError: auto must not fall back mid-step
                    raise RuntimeError(f"eager region {region.index} made {name} of shape {list(value.shape)}, but "
                                       f"it had shape {list(static.shape)} at capture; a captured region reads it")
                else:
                    static.copy_(value)
        self.static_loss = output_from_env(self.gm, env)[0]  # the loss may come from an eager region
        self._install_grads()
        self.optimizer_graph.replay()


def _placeholder_names(gm: torch.fx.GraphModule) -> list[str]:
    return [n.name for n in gm.graph.nodes if n.op == "placeholder"]


def _output_names(gm: torch.fx.GraphModule) -> list[str]:
    output = next(n for n in gm.graph.nodes if n.op == "output")
    return [n.name for n in output.args[0]]


# Ops that update their running statistics in place although their schemas do not mark those arguments as
# written (their running_mean and running_var, arguments 3 and 4, in training mode).
_UNMARKED_WRITES = {torch.ops.aten.native_batch_norm.default: (3, 4), torch.ops.aten.cudnn_batch_norm.default: (3, 4),
                    torch.ops.aten.miopen_batch_norm.default: (3, 4)}


def written_buffers(traced: TracedStep, gm: torch.fx.GraphModule) -> list[Tensor]:
    """The buffers (and frozen parameters) that the graph writes in place, directly or through a view: an op
    whose schema marks an argument as written (or one of _UNMARKED_WRITES), on a graph input or a view of one."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    first = len(traced.params)
    index = {node: k - first for k, node in enumerate(placeholders) if first <= k < first + len(traced.buffers)}
    written: set[int] = set()
    for node in gm.graph.nodes:
        schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
        if schema is None:
            continue
        positions = [i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write]
        for position in positions + list(_UNMARKED_WRITES.get(node.target, ())):
            name = schema.arguments[position].name
            value = node.args[position] if position < len(node.args) else node.kwargs.get(name)
            for item in value if isinstance(value, (list, tuple)) else (value,):  # Tensor(a!)[] too
                root = _view_root(item)
                if isinstance(root, torch.fx.Node) and root in index:
                    written.add(index[root])
    return [traced.buffers[k] for k in sorted(written)]


def _view_root(value: Any) -> Any:
    """The value whose memory `value` is (the value itself when it is not a view or an in-place op's result):
    an op whose first result aliases an argument (a view, or an in-place op returning its input) is followed
    to its first argument."""
    while isinstance(value, torch.fx.Node) and value.op == "call_function" and value.args:
        schema = getattr(value.target, "_schema", None)
        if schema is None or not schema.returns or schema.returns[0].alias_info is None:
            break
        value = value.args[0]
    return value
