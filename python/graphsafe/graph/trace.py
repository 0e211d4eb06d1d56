"""Tracing: one training step (forward, loss, backward) as one FX graph of aten ops.

The graph takes every parameter, every buffer and the batch as inputs and returns the loss and the
gradients, so nothing in it refers to the module object: the same GraphModule can be split, rewritten,
captured and replayed with the module's own tensors as inputs.

Why fake tracing: make_fx's "fake" mode runs no kernel (tracing a 32K-row table costs nothing) and gives
each node a FakeTensor in node.meta["val"] with its device, shape and dtype; data-dependent results
(`.item()`, `nonzero`, ...) get unbacked symbols (u0, u1, ...), which is what the capture gate looks for.
The price: Python control flow on a tensor's value (`if loss.item() > 1:`) cannot be traced, and is
reported as a TraceError.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import Tensor
from torch.fx import GraphModule
from torch.fx.experimental.proxy_tensor import make_fx

__all__ = ["TensorSpec", "TracedStep", "TraceError", "trace_training_step", "trace_function", "as_batch"]


class TraceError(RuntimeError):
    """The step could not be traced into one graph (the message says why and what to do)."""


@dataclass(frozen=True)
class TensorSpec:
    """What a traced graph was specialised to for one batch tensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    @staticmethod
    def of(t: Tensor) -> "TensorSpec":
        return TensorSpec(tuple(t.shape), t.dtype, t.device)

    def __str__(self) -> str:
        return f"shape {list(self.shape)}, {str(self.dtype).removeprefix('torch.')}, on {self.device}"


@dataclass
class TracedStep:
    """A traced training step: graph(*params, *buffers, *batch) -> (loss, *grads).

    grads holds one gradient per entry of grad_params (the parameters the loss depends on, in
    named_parameters order); parameters the loss does not reach get no gradient, as in eager autograd.
    """

    graph_module: GraphModule
    param_names: list[str]
    params: list[Tensor]
    buffer_names: list[str]
    buffers: list[Tensor]
    grad_params: list[Tensor]
    grad_param_names: list[str]
    batch_specs: list[TensorSpec]
    num_model_inputs: int

    @property
    def num_state_inputs(self) -> int:
        return len(self.params) + len(self.buffers)

    def inputs(self, batch: Sequence[Tensor]) -> list[Tensor]:
        """The graph's inputs for one batch: the module's own tensors (read live), then the batch."""
        return [*self.params, *self.buffers, *batch]


def as_batch(batch: Any) -> tuple[Tensor, ...]:
    """A batch as a tuple of tensors (a lone tensor is a one-tuple); anything else is a TypeError."""
    items = (batch,) if isinstance(batch, Tensor) else tuple(batch) if isinstance(batch, (tuple, list)) else None
    if items is None or not items or not all(isinstance(t, Tensor) for t in items):
        raise TypeError(
            f"a batch must be a tensor or a non-empty tuple/list of tensors (model inputs first, then loss targets), "
            f"got {type(batch).__name__}"
        )
    return items


_VIEW_OPS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)


def _views_as_reshapes(gm: GraphModule) -> GraphModule:
    """aten.view -> aten.reshape, in place.

    Fake kernels do not always predict the strides a real kernel returns (e.g. CPU batch_norm on a transposed
    input gives a contiguous result where its meta kernel keeps the input's strides). The trace then holds a
    view that the real strides cannot honour. reshape is a view whenever view would work, and a copy
    otherwise, so the graph runs either way with the same values. Under capture the choice is made once, at
    capture, from strides that do not change between replays.
    """
    changed = False
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in _VIEW_OPS:
            node.target = torch.ops.aten.reshape.default
            changed = True
    if changed:
        gm.recompile()
    return gm


def trace_function(fn: Callable[..., Any], *example_args: Tensor) -> GraphModule:
    """make_fx in fake mode, with the failure modes a user meets explained."""
    try:
        return _views_as_reshapes(make_fx(fn, tracing_mode="fake")(*example_args))
    except TraceError:
        raise
    except Exception as exc:  # noqa: BLE001 - re-raised with an explanation, original chained
        text = str(exc)
        if "data-dependent" in text or "GuardOnDataDependentSymNode" in type(exc).__name__ or "DataDependent" in type(exc).__name__:
            raise TraceError(
                "graphsafe could not trace the step: Python code branches on (or sizes a tensor by) a value computed "
                "on the device, e.g. `if x.item() > 0:` or `torch.zeros(int(n))`. A traced graph records ops, not Python "
                "decisions. Move the decision out of the step, make it a tensor op (torch.where), or use mode='eager' "
                f"with a plain loop.\nOriginal error: {type(exc).__name__}: {text.splitlines()[0] if text else ''}"
            ) from exc
        raise TraceError(f"graphsafe could not trace the step: {type(exc).__name__}: {text}") from exc


def trace_training_step(
    model: torch.nn.Module,
    loss_fn: Callable[..., Tensor],
    batch: Any,
    num_model_inputs: int = 1,
    *,
    before_forward: Callable[[dict[str, Tensor]], None] | None = None,
    after_backward: Callable[[list[str], list[Tensor]], list[Tensor]] | None = None,
) -> TracedStep:
    """Trace `loss = loss_fn(model(*batch[:k]), *batch[k:])` and its gradients (k = num_model_inputs).

    before_forward(buffers) runs first, on the traced buffers by name (it may update them in place: the ops are
    part of the graph); after_backward(names, grads) maps the gradients (of the parameters named, in parameter
    order) to the ones the graph returns. Data parallelism puts its collectives there (data_parallel.py)."""
    batch = as_batch(batch)
    if not 1 <= num_model_inputs <= len(batch):
        raise ValueError(f"num_model_inputs must be between 1 and the batch length {len(batch)}, got {num_model_inputs}")
    named_params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    param_names = [n for n, _ in named_params]
    params = [p for _, p in named_params]
    if not params:
        raise ValueError("the model has no parameter that requires grad: there is nothing to train")
    # Frozen parameters travel with the buffers: inputs of the graph, never given a gradient.
    frozen = [(n, p) for n, p in model.named_parameters() if not p.requires_grad]
    named_buffers = frozen + list(model.named_buffers())
    buffer_names = [n for n, _ in named_buffers]
    buffers = [b for _, b in named_buffers]
    num_params, num_buffers = len(params), len(buffers)
    has_grad: list[bool] = []  # filled while tracing: which parameters the loss reaches
    traced_buffers: dict[str, Tensor] = {}  # the buffer tensors of the call being traced

    def refuse_reassigned_buffers(module, args, output):
        # functional_call swaps the traced tensors in for the forward and puts the module's own back afterwards,
        # so a buffer *reassigned* in forward (self.n = self.n + 1) would be silently dropped; in-place updates
        # (self.n.add_(1)) are ops of the graph and are kept.
        changed = [n for n, b in traced_buffers.items() if model.get_buffer(n) is not b]
        if changed:
            raise TraceError(
                f"graphsafe could not trace the step: forward assigns a new tensor to buffer(s) {', '.join(changed)}; "
                "the traced step would drop that update. Update the buffer in place instead (e.g. "
                "`self.count.add_(1)` or `self.stat.copy_(new)`), as nn.BatchNorm does.")
        return output

    def step(*flat: Tensor):
        p_in, b_in, batch_in = flat[:num_params], flat[num_params:num_params + num_buffers], flat[num_params + num_buffers:]
        state = dict(zip(param_names, p_in)) | dict(zip(buffer_names, b_in))
        traced_buffers.clear()
        traced_buffers.update((n, b) for n, b in zip(buffer_names[len(frozen):], b_in[len(frozen):]))
        if before_forward is not None:
            before_forward(dict(traced_buffers))
        hook = model.register_forward_hook(refuse_reassigned_buffers)
        try:
            output = torch.func.functional_call(model, state, tuple(batch_in[:num_model_inputs]))
        finally:
            hook.remove()
        loss = loss_fn(output, *batch_in[num_model_inputs:])
        if not isinstance(loss, Tensor) or loss.numel() != 1 or not loss.is_floating_point():
            raise TypeError(f"loss_fn must return a floating-point tensor with one element, got {_describe(loss)}")
        grads = torch.autograd.grad(loss, p_in, allow_unused=True)
        has_grad[:] = [g is not None for g in grads]
        reached = [g for g in grads if g is not None]
        if after_backward is not None:
            reached = after_backward([n for n, g in zip(param_names, grads) if g is not None], reached)
        return (loss.detach(), *reached)

    # The parameters are traced as fresh leaves that require grad, so autograd.grad differentiates
    # with respect to exactly these inputs (not to the module's own tensors).
    example = [p.detach().requires_grad_(True) for p in params] + [b.detach() for b in buffers] + list(batch)
    with torch.enable_grad():
        gm = trace_function(step, *example)
    if not any(has_grad):
        raise ValueError("the loss does not depend on any parameter that requires grad")
    grad_params = [p for p, g in zip(params, has_grad) if g]
    grad_names = [n for n, g in zip(param_names, has_grad) if g]
    return TracedStep(gm, param_names, params, buffer_names, buffers, grad_params, grad_names,
                      [TensorSpec.of(t) for t in batch], num_model_inputs)


def _describe(value: Any) -> str:
    if isinstance(value, Tensor):
        return f"a {str(value.dtype).removeprefix('torch.')} tensor of shape {list(value.shape)}"
    return type(value).__name__
