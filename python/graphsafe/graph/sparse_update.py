"""Pass: an embedding table's dense gradient -> a row-sparse gradient and graphsafe.optim.sparse_step.

After rewrite_embedding_backward, a table's gradient is graphsafe::embedding_backward, a dense [V, D] tensor that
is mostly zeros: a skip_zeros optimizer then reads all V rows to update the few the batch touched. When that
gradient is nothing but the embedding backward and the table's optimizer group has skip_zeros=True, the pass
swaps the node for graphsafe::embedding_backward_sparse (same arguments) and the graph returns the table's
(rows, row_grads, count) instead of its gradient; the runners (capture.py) then step the table with
graphsafe.optim.sparse_step after optimizer.step(). The dense gradient is never materialised, and the result is
bitwise the dense skip_zeros step (DESIGN.md "Sparse updates"; graphsafe.optim.sparse_step's contract).

The graph's outputs become (loss, *dense grads, *(rows, row_grads, count) per fused table): the grads of the
parameters that were not fused, in grad_params order, then one triple per fused table (OutputLayout says which).
Every embedding weight that is not fused is listed in the report with the reason.
"""

from __future__ import annotations

import copy
import operator
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import Tensor
from torch.fx import GraphModule, Node

from ..optim._base import _LAYERWISE, GraphsafeOptimizer
from ..optim._sparse import sparse_step
from .trace import TracedStep

__all__ = ["FusedTable", "SparseUpdateReport", "OutputLayout", "fuse_sparse_embedding_update"]

_DENSE = torch.ops.graphsafe.embedding_backward.default
_SPARSE = torch.ops.graphsafe.embedding_backward_sparse.default
_ATEN_BACKWARD = torch.ops.aten.embedding_dense_backward.default
_EMBEDDING_FORWARDS = (torch.ops.aten.embedding.default, torch.ops.graphsafe.embedding.default)
_SUMS = (torch.ops.aten.add.Tensor, torch.ops.aten.add_.Tensor)


@dataclass
class FusedTable:
    name: str  # the parameter's name
    grad_index: int  # its position in TracedStep.grad_params
    node: str  # the embedding_backward_sparse node
    shape: tuple[int, ...]
    capacity: int  # rows the sparse gradient holds: min(indices, rows of the table)

    def __str__(self) -> str:
        return (f"{self.name} {list(self.shape)}: {self.node}, up to {self.capacity} of {self.shape[0]} rows per step "
                "(row-sparse gradient + graphsafe.optim.sparse_step)")


@dataclass
class SparseUpdateReport:
    enabled: bool = True
    fused: list[FusedTable] = field(default_factory=list)
    refused: list[tuple[str, str]] = field(default_factory=list)  # (parameter name, reason)
    note: str = ""  # why the pass did not run, when it did not

    @property
    def fused_names(self) -> list[str]:
        return [t.name for t in self.fused]

    @property
    def fused_indices(self) -> list[int]:
        return [t.grad_index for t in self.fused]

    def __str__(self) -> str:
        if not self.enabled:
            return f"fuse_sparse_embedding_update: off ({self.note})"
        lines = [f"fuse_sparse_embedding_update: {len(self.fused)} fused, {len(self.refused)} refused"]
        lines += [f"  fused   {t}" for t in self.fused]
        lines += [f"  refused {name}: {reason}" for name, reason in self.refused]
        return "\n".join(lines)


class OutputLayout:
    """How a step graph's outputs map to parameters: (loss, *dense grads, *(rows, row_grads, count) per fused
    table). What every runner does with them is here, so eager and captured steps do the same thing."""

    def __init__(self, grad_params: Sequence[Tensor], fused_indices: Sequence[int] = ()) -> None:
        fused = set(fused_indices)
        self.dense_params = [p for i, p in enumerate(grad_params) if i not in fused]
        self.sparse_params = [grad_params[i] for i in fused_indices]

    def split(self, outputs: Sequence[Any]) -> tuple[Tensor, list[Tensor], list[tuple[Tensor, Tensor, Tensor]]]:
        n = len(self.dense_params)
        rest = list(outputs[1 + n:])
        return outputs[0], list(outputs[1:1 + n]), [tuple(rest[3 * k:3 * k + 3]) for k in range(len(rest) // 3)]

    def install(self, grads: Sequence[Tensor]) -> None:
        """param.grad = its gradient; a fused table's stays None, so optimizer.step() skips it (its step is
        sparse_step's). Skips assignments that change nothing: a captured graph reads these exact tensors."""
        for p, g in zip(self.dense_params, grads):
            if p.grad is not g:
                p.grad = g
        for p in self.sparse_params:
            if p.grad is not None:
                p.grad = None

    def step(self, optimizer: torch.optim.Optimizer, sparse: Sequence[tuple[Tensor, Tensor, Tensor]]) -> None:
        optimizer.step()
        for p, (rows, row_grads, count) in zip(self.sparse_params, sparse):
            sparse_step(optimizer, p, rows, row_grads, count)


def _embedding_weights(gm: GraphModule, traced: TracedStep) -> dict[int, list[Node]]:
    """{index into traced.params: its embedding lookups} for every parameter some lookup reads as its table."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    index = {node: k for k, node in enumerate(placeholders[:len(traced.params)])}
    found: dict[int, list[Node]] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in _EMBEDDING_FORWARDS and node.args[0] in index:
            found.setdefault(index[node.args[0]], []).append(node)
    return found


def _optimizer_reason(optimizer: torch.optim.Optimizer, param: Tensor) -> str | None:
    if not isinstance(optimizer, GraphsafeOptimizer):
        return (f"the optimizer is {type(optimizer).__module__}.{type(optimizer).__name__}, not a graphsafe optimizer "
                "(the row-sparse step needs graphsafe.optim with skip_zeros=True)")
    group = next((g for g in optimizer.param_groups if any(p is param for p in g["params"])), None)
    if group is None:
        return "not in any of the optimizer's param groups"
    if not group["skip_zeros"]:
        return ("its param group has skip_zeros=False (without skip_zeros every row changes on every step, so the "
                "update cannot be row-sparse); give the table a group with skip_zeros=True")
    if optimizer.algorithm in _LAYERWISE:
        return (f"{type(optimizer).__name__} is layer-wise (its trust ratio needs the whole table's norms), so the "
                "step would build the dense gradient anyway")
    return None


def _param_reason(param: Tensor) -> str | None:
    if type(param) is not Tensor and type(param) is not torch.nn.Parameter:
        return f"a {type(param).__name__} parameter (sharded; the row-sparse step takes plain tensors)"
    if param.dim() != 2:
        return f"not 2-D (shape {list(param.shape)})"
    if not param.is_contiguous():
        return "not contiguous"
    return None


def _ancestors_have_collective(node: Node) -> bool:
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n in seen or n.op != "call_function" or n.target is _DENSE:
            continue
        seen.add(n)
        if "c10d" in str(getattr(n.target, "namespace", "")) or "c10d" in str(n.target):
            return True
        todo.extend(n.all_input_nodes)
    return False


def _summed_lookups(node: Node) -> int:
    """How many embedding backwards `node` sums with nothing else (0: something else is in the sum)."""
    if node.op == "call_function" and node.target is _DENSE:
        return 1
    if node.op == "call_function" and node.target in _SUMS and len(node.args) == 2 and not node.kwargs:
        parts = [_summed_lookups(a) if isinstance(a, Node) else 0 for a in node.args]
        return sum(parts) if all(parts) else 0
    return 0


def _graph_reason(grad: Node, output: Node) -> str | None:
    if grad.op == "call_function" and grad.target is _DENSE:
        others = [u.name for u in grad.users if u is not output]
        if others:
            return f"the dense gradient is also read in the graph (by {', '.join(others[:3])})"
        if sum(1 for a in output.args[0] if a is grad) != 1:
            return "the same gradient is returned for several parameters"
        return None
    if grad.op == "call_function" and grad.target is _ATEN_BACKWARD:
        return "its embedding backward was not rewritten (see rewrite_embedding_backward's report)"
    if _ancestors_have_collective(grad):
        return "its gradient is averaged across ranks (data parallel) after the embedding backward"
    lookups = _summed_lookups(grad)
    if lookups > 1:
        return (f"the table is looked up {lookups} times and their gradients are summed (not fused yet; one lookup "
                "of the concatenated indices would be)")
    what = getattr(grad.target, "__name__", str(grad.target))
    return (f"a dense contribution reaches its gradient ({what}): the weight is also used outside the lookup, e.g. "
            "weight tying (an LM head sharing the table) or a regulariser")


def _sparse_meta(dense: Node) -> tuple | None:
    """The fake (rows, row_grads, count) of the sparse op on dense's inputs, from their meta["val"]."""
    grad, indices = dense.args[0], dense.args[1]
    values = [a.meta.get("val") if isinstance(a, Node) else None for a in (grad, indices)]
    if not all(isinstance(v, Tensor) for v in values):
        return None
    fake_mode = torch._guards.detect_fake_mode(values)
    if fake_mode is None:
        return None
    with fake_mode:
        # contiguous(): the rewrite copied the un-made-contiguous input's meta, whose strides may differ.
        grad_val, indices_val = (v.contiguous() for v in values)
        return _SPARSE(grad_val, indices_val, *dense.args[2:], **dense.kwargs)


def fuse_sparse_embedding_update(gm: GraphModule, traced: TracedStep, optimizer: torch.optim.Optimizer
                                 ) -> tuple[GraphModule, SparseUpdateReport]:
    """Fuse every embedding table that qualifies (module docstring); list the others with why. Works on a copy.

    Runs after rewrite_embedding_backward. Node metadata of the new nodes comes from the sparse op's fake kernel,
    so the gate and partition passes run on the result as before."""
    gm = GraphModule(gm, copy.deepcopy(gm.graph), class_name=type(gm).__name__)
    report = SparseUpdateReport()
    output = next(n for n in gm.graph.nodes if n.op == "output")
    loss, *grads = output.args[0]
    grad_index = {id(p): i for i, p in enumerate(traced.grad_params)}
    replacements: dict[int, list[Node]] = {}
    for k, lookups in sorted(_embedding_weights(gm, traced).items()):
        param, name = traced.params[k], traced.param_names[k]
        i = grad_index.get(id(param))
        if i is None:
            continue  # the loss does not reach it: no gradient, nothing to step
        reason = _optimizer_reason(optimizer, param) or _param_reason(param) or _graph_reason(grads[i], output)
        dense = grads[i]
        meta = None
        if reason is None:
            meta = _sparse_meta(dense)
            if meta is None:
                reason = "no tensor metadata on the embedding backward's inputs (graph not traced with make_fx?)"
            elif meta[1].dtype != param.dtype or tuple(dense.meta["val"].shape) != tuple(param.shape):
                reason = (f"its gradient ({meta[1].dtype}, {list(dense.meta['val'].shape)}) does not match the "
                          f"parameter ({param.dtype}, {list(param.shape)})")
        if reason is not None:
            report.refused.append((name, reason))
            continue
        with gm.graph.inserting_after(dense):
            sparse = gm.graph.call_function(_SPARSE, dense.args, dense.kwargs)
        sparse.meta = dict(dense.meta, val=meta)
        parts = []
        for position in range(3):
            with gm.graph.inserting_after(parts[-1] if parts else sparse):
                part = gm.graph.call_function(operator.getitem, (sparse, position))
            part.meta = {"val": meta[position]}
            parts.append(part)
        replacements[i] = parts
        report.fused.append(FusedTable(name, i, sparse.name, tuple(param.shape), int(meta[0].shape[0])))
    if not replacements:
        return gm, report
    fused = [t.grad_index for t in report.fused]
    dense_grads = [g for i, g in enumerate(grads) if i not in replacements]
    output.args = ((loss, *dense_grads, *[n for i in fused for n in replacements[i]]),)
    for i in fused:
        gm.graph.erase_node(grads[i])  # its only user was the output
    gm.graph.lint()
    gm.recompile()
    return gm, report
