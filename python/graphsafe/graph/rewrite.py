"""Pass: aten.embedding_dense_backward -> graphsafe.embedding_backward.

torch.nn.Embedding's backward is aten.embedding_dense_backward, whose reduction order depends on the
backend's kernel (CUDA: not bitwise repeatable with scale_grad_by_freq or duplicate rows, and some backends
read a count back to the host). graphsafe.embedding_backward takes the same arguments with the same meaning
(padding_idx -1 = none; aten receives it already normalised by F.embedding), sizes everything from shapes,
and is deterministic, so the swap changes no semantics and makes the step capturable and repeatable.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.fx import GraphModule, Node

from .. import nn as gs_nn
from .._core_args import dtype_name
from .._C import cuda_available as _cuda_backend_built

__all__ = ["RewriteReport", "rewrite_embedding_backward", "use_graphsafe_embeddings"]

_ATEN_EMBEDDING_BACKWARD = torch.ops.aten.embedding_dense_backward.default
_GRAPHSAFE_EMBEDDING_BACKWARD = torch.ops.graphsafe.embedding_backward.default
_GRAD_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_INDEX_DTYPES = (torch.int32, torch.int64)


@dataclass
class RewriteReport:
    rewritten: list[str] = field(default_factory=list)  # "node: options" per rewritten node
    left_alone: list[tuple[str, str]] = field(default_factory=list)  # (node, reason)

    def __str__(self) -> str:
        lines = [f"rewrite_embedding_backward: {len(self.rewritten)} rewritten, {len(self.left_alone)} left alone"]
        lines += [f"  rewritten  {entry}" for entry in self.rewritten]
        lines += [f"  left alone {name}: {reason}" for name, reason in self.left_alone]
        return "\n".join(lines)


def _contiguous(t: Tensor) -> Tensor:
    """The op requires contiguous inputs; a no-op (no copy) when they already are, which is the usual case."""
    return t.contiguous()


def _unsupported_reason(grad, indices, num_weights, padding_idx) -> str | None:
    if not isinstance(grad, Tensor) or not isinstance(indices, Tensor):
        return "no tensor metadata on the inputs (graph not traced with make_fx?)"
    if grad.dtype not in _GRAD_DTYPES:
        return f"gradient dtype {grad.dtype} is not supported (float32, float16, bfloat16, float64)"
    if indices.dtype not in _INDEX_DTYPES:
        return f"index dtype {indices.dtype} is not supported (int32, int64)"
    if grad.device.type not in ("cpu", "cuda"):
        return f"device {grad.device} is not supported (cpu, cuda)"
    if grad.device.type == "cuda" and not _cuda_backend_built():
        return "graphsafe was built without its CUDA backend"
    if not isinstance(num_weights, int) or not isinstance(padding_idx, int):
        return "num_weights or padding_idx is symbolic (traced with dynamic shapes)"
    if not (padding_idx == -1 or 0 <= padding_idx < num_weights):
        return f"padding_idx {padding_idx} out of range for {num_weights} rows"
    return None


def rewrite_embedding_backward(gm: GraphModule) -> tuple[GraphModule, RewriteReport]:
    """Replace every aten.embedding_dense_backward the graphsafe op supports; list the others with why.

    Works on a copy: the input GraphModule is left unchanged. Node metadata (meta["val"]) is carried over,
    so the gate and partition passes can run on the result.
    """
    gm = _copy_graph_module(gm)
    report = RewriteReport()
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not _ATEN_EMBEDDING_BACKWARD:
            continue
        grad, indices, num_weights, padding_idx, scale = _embedding_backward_args(node)
        reason = _unsupported_reason(grad.meta.get("val"), indices.meta.get("val"), num_weights, padding_idx)
        if reason is not None:
            report.left_alone.append((node.name, reason))
            continue
        with gm.graph.inserting_before(node):
            grad_c = gm.graph.call_function(_contiguous, (grad,))
            indices_c = gm.graph.call_function(_contiguous, (indices,))
            new = gm.graph.call_function(_GRAPHSAFE_EMBEDDING_BACKWARD,
                                         (grad_c, indices_c, num_weights, padding_idx, bool(scale)))
        grad_c.meta["val"] = grad.meta["val"]  # shape/dtype/device are what the gate reads; strides do not matter
        indices_c.meta["val"] = indices.meta["val"]
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        index_dtype = dtype_name(indices.meta["val"].dtype)
        report.rewritten.append(
            f"{new.name} (was {node.name}): {num_weights} rows, padding_idx={padding_idx}, "
            f"scale_grad_by_freq={bool(scale)}, {index_dtype} indices"
        )
    gm.graph.lint()
    gm.recompile()
    return gm, report


def _embedding_backward_args(node: Node):
    names = ("grad_output", "indices", "num_weights", "padding_idx", "scale_grad_by_freq")
    values = list(node.args) + [node.kwargs[n] for n in names[len(node.args):]]
    return tuple(values)


def _copy_graph_module(gm: GraphModule) -> GraphModule:
    """A new GraphModule with a copied graph (node meta included) over the same attributes."""
    graph = copy.deepcopy(gm.graph)
    return GraphModule(gm, graph, class_name=type(gm).__name__)


def use_graphsafe_embeddings(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of `model` with every torch.nn.Embedding replaced by graphsafe.nn.Embedding (same weights).

    The module-level counterpart of rewrite_embedding_backward: an eager model that computes the same
    gradients as the rewritten graph. Used as the reference in tests and for --check-determinism.
    """
    model = copy.deepcopy(model)
    for parent in model.modules():
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Embedding:
                if child.max_norm is not None or child.sparse:
                    raise NotImplementedError(f"{name}: max_norm and sparse=True have no graphsafe equivalent")
                swapped = gs_nn.Embedding(child.num_embeddings, child.embedding_dim, padding_idx=child.padding_idx,
                                          scale_grad_by_freq=child.scale_grad_by_freq, _weight=child.weight,
                                          device=child.weight.device, dtype=child.weight.dtype)
                swapped.weight = child.weight  # the copy's own Parameter object, so tied weights stay tied
                setattr(parent, name, swapped)
    return model
