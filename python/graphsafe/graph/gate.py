"""Pass: the capture gate. Names every node that cannot be captured in a CUDA graph, and why.

A CUDA graph records device work once and replays it: every kernel, with the same arguments and the same
addresses. So a node cannot be captured when it needs the host during the step (it reads a device value
back, sizes its output from data, runs on the CPU), or when a replay would silently reuse a value frozen at
capture (a host number read from the device). Each rule below is one row of RULES: its name, the test on the
node, and the reason shown to the user. docs/graph.md documents every rule and says which claims were
checked against a real capture (tests/python/test_graph_cuda.py checks each one on a GPU).

The gate reads node.meta["val"] (FakeTensors from make_fx's fake mode): device, and unbacked symbols
(u0, u1, ...) in shapes and scalars, which mark values that only exist once the device has computed them.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor
from torch.fx import GraphModule, Node
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

__all__ = ["Rule", "RULES", "NOTES", "Finding", "GateReport", "capture_gate", "node_findings"]

aten = torch.ops.aten


def _packets(*names: str) -> frozenset:
    """The aten overload packets that exist in this torch (a missing name is skipped, not an error)."""
    return frozenset(getattr(aten, n) for n in names if hasattr(aten, n))


# Ops that read a device value on the host, or return a Python value computed from device data.
_HOST_READ_OPS = _packets("_local_scalar_dense", "item", "equal", "is_nonzero", "allclose")
# Ops whose output size is computed from the data: the host must read the size back before allocating.
_DYNAMIC_SHAPE_OPS = _packets("nonzero", "unique", "_unique", "_unique2", "unique_dim", "unique_consecutive",
                              "masked_select", "nonzero_numpy", "argwhere")


def _packet(node: Node):
    return getattr(node.target, "overloadpacket", None)


def _val(node) -> object:
    return node.meta.get("val") if isinstance(node, Node) else None


def _tensors(value) -> list[Tensor]:
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


def _unbacked(value) -> bool:
    try:
        return bool(free_unbacked_symbols(value))
    except Exception:  # noqa: BLE001 - values the helper does not understand carry no symbols
        return False


def _input_nodes(node: Node) -> list[Node]:
    return list(node.all_input_nodes)


# ---- the rule tests: (node, step device) -> bool ----


def _is_host_read(node: Node, device: torch.device) -> bool:
    return _packet(node) in _HOST_READ_OPS


def _is_dynamic_shape_op(node: Node, device: torch.device) -> bool:
    if _packet(node) in _DYNAMIC_SHAPE_OPS:
        return True
    if _packet(node) is aten.repeat_interleave:
        # repeat_interleave(repeats) must sum repeats on the host unless output_size is given.
        return node.kwargs.get("output_size") is None and (len(node.args) < 3 or node.args[-1] is None)
    return False


def _is_bool_mask_index(node: Node, device: torch.device) -> bool:
    if _packet(node) not in (aten.index, aten._unsafe_index, aten.index_put, aten.index_put_, aten._index_put_impl_):
        return False
    # x[mask] and x[mask] = v: torch turns a bool (or legacy uint8) mask into positions with nonzero.
    indices = node.args[1] if len(node.args) > 1 else node.kwargs.get("indices", ())
    return any(isinstance(_val(i), Tensor) and _val(i).dtype in (torch.bool, torch.uint8) for i in indices or ())


def _has_data_dependent_shape(node: Node, device: torch.device) -> bool:
    # Inputs count too: a kernel captured on a tensor of data-dependent size (e.g. the mean of nonzero's
    # result) would replay with the size seen at capture.
    values = _tensors(_val(node)) + [t for i in _input_nodes(node) for t in _tensors(_val(i))]
    return any(_unbacked(t.shape) for t in values)


def _uses_device_scalar(node: Node, device: torch.device) -> bool:
    # A host number (SymInt/SymFloat/SymBool) that came from device data, read by this node, or this node
    # computes such a number (Python arithmetic on the result of .item()).
    if not isinstance(_val(node), (torch.SymInt, torch.SymFloat, torch.SymBool)):
        scalars = [i for i in _input_nodes(node) if isinstance(_val(i), (torch.SymInt, torch.SymFloat, torch.SymBool))]
        return any(_unbacked(_val(i)) for i in scalars)
    return _unbacked(_val(node))


def _is_device_to_host_copy(node: Node, device: torch.device) -> bool:
    if device.type != "cuda" or _packet(node) not in (aten._to_copy, aten.copy, aten.copy_, aten.to):
        return False
    outs, ins = _tensors(_val(node)), [t for i in _input_nodes(node) for t in _tensors(_val(i))]
    return any(o.device.type == "cpu" for o in outs) and any(t.device.type == "cuda" for t in ins)


def _is_host_to_device_copy(node: Node, device: torch.device) -> bool:
    if device.type != "cuda" or _packet(node) not in (aten._to_copy, aten.copy, aten.copy_, aten.to):
        return False
    outs, ins = _tensors(_val(node)), [t for i in _input_nodes(node) for t in _tensors(_val(i))]
    return any(o.device.type == "cuda" for o in outs) and any(t.device.type == "cpu" for t in ins)


def _runs_on_cpu(node: Node, device: torch.device) -> bool:
    # Small CPU scalars (0-d tensors such as torch.tensor(2.0)) are fine: kernels take them as constants.
    if device.type != "cuda" or _is_device_to_host_copy(node, device):
        return False
    return any(t.device.type == "cpu" and t.dim() > 0 for t in _tensors(_val(node)))


_COLLECTIVE_NAMESPACES = ("_c10d_functional", "c10d_functional")


def _is_collective(node: Node, device: torch.device | None = None) -> bool:
    return node.op == "call_function" and getattr(node.target, "namespace", None) in _COLLECTIVE_NAMESPACES


def collective_backend(node: Node, device: torch.device) -> str | None:
    """The backend that runs a functional collective node on `device`'s tensors ("nccl", "gloo", ...; None when the
    group cannot be found in this process). wait_tensor nodes belong to the collective they wait for."""
    while _is_collective(node) and _packet(node) is getattr(torch.ops._c10d_functional, "wait_tensor", None):
        inputs = _input_nodes(node)
        if not inputs:
            return None
        node = inputs[0]
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return None
    names = [a.name for a in schema.arguments]
    if "group_name" not in names:
        return None
    position = names.index("group_name")
    group_name = node.args[position] if position < len(node.args) else node.kwargs.get("group_name")
    try:
        from torch.distributed.distributed_c10d import _resolve_process_group
        group = _resolve_process_group(group_name)
        return str(group._get_backend(torch.device(device.type)).name())
    except Exception:  # noqa: BLE001 - no such group in this process, or an older torch
        return None


def _is_host_collective(node: Node, device: torch.device) -> bool:
    # NCCL launches collectives as kernels on a stream, which a CUDA graph records; gloo (and an unknown backend)
    # runs them on the host.
    return device.type == "cuda" and _is_collective(node) and collective_backend(node, device) != "nccl"


@dataclass(frozen=True)
class Rule:
    name: str
    test: Callable[[Node, torch.device], bool]
    reason: str
    checked_on_gpu: str  # what tests/python/test_graph_cuda.py checks (documented in docs/graph.md)


# The rules, in the order a node is tested (the first that matches names the node). Every reason says what
# goes wrong and what to do instead.
RULES: tuple[Rule, ...] = (
    Rule("host_read", _is_host_read,
         "reads a device value on the host (.item(), float(t), int(t), torch.equal): the CPU waits for the GPU, "
         "which is not allowed while a CUDA graph is recorded, and a replay would reuse the value read at capture. "
         "Keep the value as a tensor (e.g. torch.where instead of an if), or read it outside the step",
         "test_flagged_op_fails_under_capture[host_read]: .item() inside torch.cuda.graph raises"),
    Rule("dynamic_output_shape", _is_dynamic_shape_op,
         "output size depends on the data (nonzero, unique, masked_select, repeat_interleave without output_size): "
         "the CPU must read the size back from the GPU before it can allocate the result. Use a fixed-size "
         "formulation (torch.where, a mask multiply, nonzero_static, repeat_interleave(..., output_size=n))",
         "test_flagged_op_fails_under_capture[nonzero]: nonzero inside torch.cuda.graph raises; "
         "test_unflagged_op_captures_and_replays_like_eager: nonzero_static captures"),
    Rule("bool_mask_index", _is_bool_mask_index,
         "indexes with a boolean mask (x[mask] or x[mask] = v): torch converts the mask to positions with nonzero, "
         "whose size depends on the data. Use torch.where(mask, ..., ...) or a multiply by the mask",
         "test_flagged_op_fails_under_capture[bool_mask_index]: x[mask] inside torch.cuda.graph raises"),
    Rule("data_dependent_shape", _has_data_dependent_shape,
         "its shape, or an input's, depends on values computed on the device (it follows one of the nodes above): "
         "a captured kernel would keep the size seen at capture, so it runs eagerly with them",
         "not checked on a GPU yet (CPU tests only: captured regions read static shapes, test_graph_partition.py)"),
    Rule("device_scalar", _uses_device_scalar,
         "uses (or computes) a host number that was read from the device (e.g. the result of .item()): a captured "
         "graph would keep the value from the capture forever",
         "test_device_scalar_is_frozen_at_capture; test_piecewise_host_read_equals_eager_and_is_faster"),
    Rule("host_collective", _is_host_collective,
         "collective (all-reduce, all-gather, broadcast or its wait) on a process group whose backend for CUDA "
         "tensors is not NCCL: gloo runs it on the host, staging CUDA tensors through host memory synchronously, "
         "which a CUDA graph cannot record. It runs eagerly between captured regions; for a whole-step capture use "
         "the NCCL backend (init_process_group('nccl'), or 'cpu:gloo,cuda:nccl')",
         "not checked on a GPU yet (multi-GPU runs: issue 23)"),
    Rule("device_to_host_copy", _is_device_to_host_copy,
         "copies a GPU tensor to the CPU (.cpu(), .tolist(), .numpy()): the CPU waits for the GPU, not allowed "
         "while capturing. Keep the tensor on the GPU",
         "test_flagged_op_fails_under_capture[device_to_host_copy]: .cpu() inside torch.cuda.graph raises"),
    Rule("host_to_device_copy", _is_host_to_device_copy,
         "copies a CPU tensor to the GPU inside the step: from pageable memory the copy is synchronous (not allowed "
         "while capturing), and even from pinned memory a replay re-reads the host buffer captured. Create the "
         "tensor on the GPU (device=...) or register it as a buffer of the module",
         "test_flagged_op_fails_under_capture[host_to_device_copy]: a pageable .to('cuda') inside "
         "torch.cuda.graph raises; test_pinned_host_to_device_copy_captures_and_rereads_the_same_buffer"),
    Rule("cpu_op", _runs_on_cpu,
         "runs on the CPU while the step runs on CUDA: a CUDA graph records only GPU work, so a replay would not "
         "redo it (its result would be frozen). Create the tensors on the GPU",
         "test_cpu_op_is_flagged_and_not_replayed: a CPU op inside torch.cuda.graph is not replayed"),
)


def _is_rng(node: Node, device: torch.device) -> bool:
    tags = getattr(node.target, "tags", ())
    return torch.Tag.nondeterministic_seeded in tags


# Notes do not make a node unsafe; they are listed so the user knows what a capture implies.
NOTES: tuple[Rule, ...] = (
    Rule("rng", _is_rng,
         "random op: capturable with the default CUDA generator (torch registers it with the graph and advances its "
         "philox offset on every replay, so each replay draws new numbers; another generator must be registered with "
         "graph.register_generator_state), but captured and eager runs need not draw the same numbers, so bitwise "
         "comparisons with eager do not hold for it",
         "test_rng_captures_and_draws_new_numbers_per_replay: torch.rand captures, replays draw new numbers"),
    Rule("collective", _is_collective,
         "collective over a process group (data parallelism): every rank runs it at the same point of every step; "
         "with NCCL on CUDA it is recorded into the CUDA graph, so each replay is a collective and every rank must "
         "replay its graph the same number of times",
         "not checked on a GPU yet (multi-GPU runs: issue 23)"),
)


@dataclass(frozen=True)
class Finding:
    node: str
    op: str
    rule: str
    reason: str


@dataclass
class GateReport:
    device: torch.device
    unsafe: list[Finding] = field(default_factory=list)
    notes: list[Finding] = field(default_factory=list)
    num_nodes: int = 0

    @property
    def passed(self) -> bool:
        return not self.unsafe

    def unsafe_nodes(self) -> set[str]:
        return {f.node for f in self.unsafe}

    def by_rule(self) -> dict[str, list[Finding]]:
        grouped: dict[str, list[Finding]] = {}
        for f in self.unsafe:
            grouped.setdefault(f.rule, []).append(f)
        return grouped

    def __str__(self) -> str:
        head = (f"capture_gate ({self.device}): {self.num_nodes} op nodes, "
                + ("all capturable" if self.passed else f"{len(self.unsafe)} cannot be captured"))
        lines = [head]
        lines += [f"  UNSAFE {f.node} ({f.op}) [{f.rule}]: {f.reason}" for f in self.unsafe]
        lines += [f"  note   {f.node} ({f.op}) [{f.rule}]: {f.reason}" for f in self.notes]
        return "\n".join(lines)


def _op_name(node: Node) -> str:
    target = node.target
    return str(target) if isinstance(target, torch._ops.OpOverload) else getattr(target, "__name__", str(target))


def node_findings(node: Node, device: torch.device) -> tuple[Finding | None, list[Finding]]:
    """The first rule a node breaks (or None) and the notes that apply to it."""
    unsafe = next((Finding(node.name, _op_name(node), r.name, r.reason) for r in RULES if r.test(node, device)), None)
    notes = [Finding(node.name, _op_name(node), r.name, r.reason) for r in NOTES if r.test(node, device)]
    return unsafe, notes


def capture_gate(gm: GraphModule, device: torch.device | str = "cuda") -> tuple[GraphModule, GateReport]:
    """Check every call_function node of a make_fx graph against RULES for a step that runs on `device`.

    Returns the graph unchanged and the report. On a CPU step the device-placement rules (CPU ops, copies)
    do not apply; the others still do, since they describe the graph, not the machine.
    """
    device = torch.device(device)
    report = GateReport(device)
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is operator.getitem and _input_nodes(node) and _input_nodes(node)[0].name in report.unsafe_nodes():
            # Unpacking the result of an unsafe node (e.g. unique's tuple) belongs to it.
            finding = next(f for f in report.unsafe if f.node == _input_nodes(node)[0].name)
            report.unsafe.append(Finding(node.name, "getitem", finding.rule, f"part of the result of {finding.node}"))
            report.num_nodes += 1
            continue
        report.num_nodes += 1
        unsafe, notes = node_findings(node, device)
        if unsafe is not None:
            report.unsafe.append(unsafe)
        report.notes += notes
    return gm, report
