"""Pass: a scaled-dot-product attention whose mask is a constant causal pattern -> the same op with is_causal=True.

Why: a model that builds its causal mask from token positions cannot tell, while traced with fake tensors, that no
sequence in the batch is packed (Hugging Face's masking utilities skip the mask only after reading the positions,
which a fake tensor cannot give), so the traced graph carries a materialised (batch, 1, L, L) mask into the
attention op where the eager model passes none. With a mask, torch's kernels score every (query, key) pair; with
is_causal they skip the upper triangle (on CUDA in fp32, the memory-efficient kernel: half its work).

The mask depends on no input of the step (it comes from constants such as arange), so it is evaluated here, once.
The op is rewritten only when every broadcast slice of it is exactly the causal pattern of a square (L == S)
attention: key j attends query i iff j <= i (a bool mask True there and False elsewhere; a float mask 0 there and
-inf or the dtype's lowest value elsewhere, which the softmax turns into exactly 0 as is_causal does), there is no
dropout, and the backward op that goes with the forward (same inputs and mask) is rewritten alongside it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.fx import Graph, GraphModule, Node

__all__ = ["CausalAttentionReport", "drop_constant_causal_masks"]

_aten = torch.ops.aten


@dataclass(frozen=True)
class _AttentionOp:
    """Where an attention op keeps its mask, dropout and is_causal (positions in args, else keyword names)."""

    mask: int | str
    dropout: int
    is_causal: int


# Forward ops with a mask argument, and their backward ops. Efficient attention (CUDA, fp32 or when flash cannot
# run) takes the mask as attn_bias in args; the CPU's flash kernel as the attn_mask keyword.
_FORWARD = {
    _aten._scaled_dot_product_efficient_attention.default: _AttentionOp(mask=3, dropout=5, is_causal=6),
    _aten._scaled_dot_product_flash_attention_for_cpu.default: _AttentionOp(mask="attn_mask", dropout=3, is_causal=4),
}
_BACKWARD = {
    _aten._scaled_dot_product_efficient_attention_backward.default: _AttentionOp(mask=4, dropout=9, is_causal=11),
    _aten._scaled_dot_product_flash_attention_for_cpu_backward.default: _AttentionOp(mask="attn_mask", dropout=6,
                                                                                    is_causal=7),
}
# The mask's gradient (efficient backward's output 3) is only asked for (grad_input_mask[3]) when the mask needs
# one, which a constant never does; an op that asks is left alone.
_EFFICIENT_BACKWARD = _aten._scaled_dot_product_efficient_attention_backward.default


@dataclass
class CausalAttentionReport:
    rewritten: list[str] = field(default_factory=list)  # per dropped mask: "its attention nodes: mask name, shape"
    left_alone: list[tuple[str, str]] = field(default_factory=list)  # (node, reason), masked attention only

    def __str__(self) -> str:
        lines = [f"drop_constant_causal_masks: {len(self.rewritten)} mask(s) dropped for is_causal, "
                 f"{len(self.left_alone)} attention op(s) left with their mask"]
        lines += [f"  is_causal  {entry}" for entry in self.rewritten]
        lines += [f"  left alone {name}: {reason}" for name, reason in self.left_alone]
        return "\n".join(lines)


def _get(node: Node, where: int | str, default=None):
    if isinstance(where, str):
        return node.kwargs.get(where, default)
    return node.args[where] if where < len(node.args) else default


def _set(node: Node, where: int | str, value) -> None:
    if isinstance(where, str):
        node.kwargs = {**node.kwargs, where: value}
        return
    args = list(node.args)
    # make_fx leaves trailing arguments at their defaults out: fill them in from the op's schema up to `where`
    args += [a.default_value for a in node.target._schema.arguments[len(args):where + 1]]
    args[where] = value
    node.args = tuple(args)


def _constant_ancestors(node: Node) -> list[Node] | None:
    """node and every node it depends on, in graph order, or None if any of them is an input of the graph."""
    seen: dict[Node, None] = {}
    stack = [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        if n.op == "placeholder":
            return None
        seen[n] = None
        stack.extend(n.all_input_nodes)
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    return sorted(seen, key=order.__getitem__)


def _evaluate(gm: GraphModule, nodes: list[Node]) -> object:
    """The value of nodes[-1], computed by running `nodes` (which read no graph input) in a graph of their own."""
    graph = Graph()
    env: dict[Node, Node] = {}
    for n in nodes:
        env[n] = graph.node_copy(n, env.__getitem__)
    graph.output(env[nodes[-1]])
    with torch.no_grad():
        return GraphModule(gm, graph)()


def _causal_reason(mask: object, query: Tensor, key: Tensor) -> str | None:
    """Why `mask` is not the causal pattern of this attention (None when it is)."""
    if not isinstance(mask, Tensor):
        return "the mask is not a tensor"
    length, keys = query.shape[-2], key.shape[-2]
    if length != keys:
        return f"{length} queries against {keys} keys (is_causal means a square pattern here)"
    if mask.dim() < 2 or tuple(mask.shape[-2:]) != (length, keys):
        return f"mask of shape {tuple(mask.shape)} for {length} x {keys} scores"
    causal = torch.ones(length, keys, dtype=torch.bool, device=mask.device).tril()
    if mask.dtype == torch.bool:
        return None if bool((mask == causal).all()) else "the mask is not the causal pattern"
    if not mask.is_floating_point():
        return f"mask of dtype {mask.dtype}"
    attend, masked = mask[..., causal], mask[..., ~causal]
    lowest = torch.finfo(mask.dtype).min
    if not bool((attend == 0).all()) or not bool(((masked == float("-inf")) | (masked == lowest)).all()):
        return "the mask is not the causal pattern (0 where keys attend, -inf or the dtype's lowest elsewhere)"
    return None


def drop_constant_causal_masks(gm: GraphModule) -> tuple[GraphModule, CausalAttentionReport]:
    """Make every attention op whose mask is a constant causal pattern is_causal=True without the mask (the module
    docstring says when). A mask is usually shared by every layer's forward and backward op: all of them are
    rewritten, or none. Rewrites `gm` in place (compile_step runs it on the trace's own graph) and removes the
    mask's computation where nothing else reads it."""
    report = CausalAttentionReport()
    masks: dict[Node, None] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in _FORWARD:
            mask = _get(node, _FORWARD[node.target].mask)
            if isinstance(mask, Node):
                masks[mask] = None
    for mask in masks:
        ops = [u for u in mask.users if _op_of(u) is not None and _get(u, _op_of(u).mask) is mask]
        forwards = [u for u in ops if u.target in _FORWARD]
        computation = _constant_ancestors(mask)
        reason = _why_not(gm, mask, ops, computation)
        if reason is not None:
            report.left_alone.extend((f.name, reason) for f in forwards)
            continue
        for n in ops:
            _set(n, _op_of(n).mask, None)
            _set(n, _op_of(n).is_causal, True)
        shape = tuple(mask.meta["val"].shape) if "val" in mask.meta else "?"
        report.rewritten.append(f"{', '.join(n.name for n in ops)}: mask {mask.name} {shape}")
        _erase_unused(gm, computation)
    if report.rewritten:
        gm.graph.lint()
        gm.recompile()
    return gm, report


def _op_of(node: Node) -> _AttentionOp | None:
    if node.op != "call_function":
        return None
    return _FORWARD.get(node.target) or _BACKWARD.get(node.target)


def _why_not(gm: GraphModule, mask: Node, ops: list[Node], computation: list[Node] | None) -> str | None:
    """Why the attention ops `ops`, all the readers of `mask` that take it as their mask, keep it (None: they
    need not)."""
    readers = [u for u in mask.users if u not in ops]
    if readers:
        return f"the mask is also read by {readers[0].name}"
    for n in ops:
        op = _op_of(n)
        if _get(n, op.is_causal, False):
            return f"{n.name} has is_causal already set beside a mask"
        if _get(n, op.dropout, 0.0) != 0.0:
            return f"{n.name} has dropout"
        if n.target is _EFFICIENT_BACKWARD and n.args[10][3]:
            return f"{n.name} computes the mask's gradient"
    if computation is None:
        return "the mask depends on the step's inputs"
    try:
        value = _evaluate(gm, computation)
    except Exception as exc:  # noqa: BLE001 - a mask that cannot be computed here is left as it is
        return f"the mask could not be evaluated ({type(exc).__name__}: {exc})"
    for n in ops:
        first = 1 if n.target in _BACKWARD else 0  # a backward op takes the output's gradient first
        query, key = (a.meta.get("val") if isinstance(a, Node) else None for a in n.args[first:first + 2])
        if not isinstance(query, Tensor) or not isinstance(key, Tensor):
            return f"no tensor metadata on {n.name}'s query or key"
        reason = _causal_reason(value, query, key)
        if reason is not None:
            return reason
    return None


def _erase_unused(gm: GraphModule, computation: list[Node]) -> None:
    """Remove the dropped mask's computation, last node first, as far as nothing else reads it (a node another
    part of the graph shares, such as the positions, stays)."""
    for n in reversed(computation):
        if not n.users:
            gm.graph.erase_node(n)
