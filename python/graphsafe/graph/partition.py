"""Pass: split a graph into capturable and eager regions.

Regions follow the traced node order: a maximal run of capturable nodes forms one capturable region, a run of
unsafe nodes (as named by the gate) one eager region, so eager regions hold the unsafe nodes and nothing else.
Each region is a GraphModule with explicit inputs (values defined before it) and outputs (values used after
it), so regions can be run, or captured, one by one; run in order they execute exactly the ops of the whole
graph, in the same order, on the same inputs, so the results are bitwise those of the whole graph.

Nodes are not reordered (that would be a way to merge regions, but it changes the order of random-number
draws and is left for later).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch.fx import Graph, GraphModule, Node
from torch.fx.node import map_arg

from .gate import GateReport, capture_gate

__all__ = ["Region", "PartitionReport", "partition_for_capture", "split_regions", "run_regions"]


@dataclass
class Region:
    index: int
    capturable: bool
    module: GraphModule
    inputs: list[str]  # names of the values (whole-graph node names) the region reads, in call order
    outputs: list[str]  # names of the values it defines that later regions or the graph's output read
    nodes: list[str]

    @property
    def kind(self) -> str:
        return "captured" if self.capturable else "eager"

    def __call__(self, *args: Any) -> tuple:
        return self.module(*args)


@dataclass
class PartitionReport:
    regions: list[tuple[int, str, int, list[str]]] = field(default_factory=list)  # (index, kind, #nodes, eager nodes)

    @property
    def num_eager(self) -> int:
        return sum(1 for _, kind, _, _ in self.regions if kind == "eager")

    @property
    def num_capturable(self) -> int:
        return sum(1 for _, kind, _, _ in self.regions if kind == "captured")

    def __str__(self) -> str:
        lines = [f"partition_for_capture: {len(self.regions)} regions ({self.num_capturable} capturable, "
                 f"{self.num_eager} eager)"]
        for index, kind, count, names in self.regions:
            detail = f": {', '.join(names)}" if kind == "eager" else ""
            lines.append(f"  region {index}: {kind}, {count} nodes{detail}")
        return "\n".join(lines)


def _compute_nodes(graph: Graph) -> list[Node]:
    return [n for n in graph.nodes if n.op == "call_function"]


def partition_for_capture(
    gm: GraphModule, gate: GateReport | None = None, device: torch.device | str = "cuda"
) -> tuple[GraphModule, PartitionReport]:
    """Split gm into regions (see the module docstring); returns the split graph and the report.

    The split graph is a GraphModule with gm's inputs and outputs whose body calls the regions in order
    (submodules region_0, region_1, ...); calling it equals calling gm. Its `regions` attribute is the ordered
    list of Region objects (module, capturable, named inputs and outputs), which is what the capture runners
    use. Placeholders stay outside the regions; get_attr nodes (constants) are copied into each region that
    uses them. `gate` defaults to capture_gate(gm, device).
    """
    regions, report = split_regions(gm, gate, device)
    return _split_graph_module(gm, regions), report


def split_regions(
    gm: GraphModule, gate: GateReport | None = None, device: torch.device | str = "cuda"
) -> tuple[list[Region], PartitionReport]:
    """The ordered list of regions behind partition_for_capture."""
    if gate is None:
        _, gate = capture_gate(gm, device)
    unsafe = gate.unsafe_nodes()
    groups: list[tuple[bool, list[Node]]] = []
    for node in _compute_nodes(gm.graph):
        capturable = node.name not in unsafe
        if groups and groups[-1][0] == capturable:
            groups[-1][1].append(node)
        else:
            groups.append((capturable, [node]))

    output_node = next(n for n in gm.graph.nodes if n.op == "output")
    position = {node: i for i, node in enumerate(gm.graph.nodes)}
    regions, report = [], PartitionReport()
    for index, (capturable, nodes) in enumerate(groups):
        members = set(nodes)
        last = position[nodes[-1]]
        inputs: list[Node] = []
        for node in nodes:
            for source in node.all_input_nodes:
                if source not in members and source.op != "get_attr" and source not in inputs:
                    inputs.append(source)
        # A value is an output if anything after the region reads it (a later node or the graph's output).
        outputs = [n for n in nodes if any(user is output_node or position[user] > last for user in n.users)]
        module = _region_module(gm, nodes, inputs, outputs)
        regions.append(Region(index, capturable, module, [n.name for n in inputs], [n.name for n in outputs],
                              [n.name for n in nodes]))
        report.regions.append((index, "captured" if capturable else "eager", len(nodes),
                               [] if capturable else [n.name for n in nodes]))
    return regions, report


def _region_module(gm: GraphModule, nodes: list[Node], inputs: list[Node], outputs: list[Node]) -> GraphModule:
    graph = Graph()
    env: dict[Node, Node] = {}
    for source in inputs:
        placeholder = graph.placeholder(source.name)
        placeholder.meta = dict(source.meta)
        env[source] = placeholder

    def lookup(n: Node) -> Node:
        if n not in env:  # a get_attr constant: copied into this region
            assert n.op == "get_attr", f"partition: {n.name} used before it is defined"
            env[n] = graph.node_copy(n)
        return env[n]

    for node in nodes:
        for source in node.all_input_nodes:
            lookup(source)
        env[node] = graph.node_copy(node, lookup)
    graph.output(tuple(env[n] for n in outputs))
    graph.lint()
    return GraphModule(gm, graph, class_name="Region")


def _split_graph_module(gm: GraphModule, regions: list[Region]) -> GraphModule:
    """A GraphModule with gm's signature that calls the regions in order."""
    root = torch.nn.Module()
    graph = Graph()
    env: dict[str, Node] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            env[node.name] = graph.placeholder(node.name)
            env[node.name].meta = dict(node.meta)
        elif node.op == "get_attr":  # constants the graph returns directly (rare)
            setattr(root, node.target.replace(".", "_"), _get_attr(gm, node.target))
            env[node.name] = graph.get_attr(node.target.replace(".", "_"))
    for region in regions:
        name = f"region_{region.index}"
        root.add_module(name, region.module)
        call = graph.call_module(name, tuple(env[n] for n in region.inputs))
        for i, output in enumerate(region.outputs):
            env[output] = graph.call_function(operator.getitem, (call, i))
    output_node = next(n for n in gm.graph.nodes if n.op == "output")
    graph.output(map_arg(output_node.args[0], lambda n: env[n.name]))
    graph.lint()
    split = GraphModule(root, graph, class_name="PartitionedGraph")
    split.regions = regions
    return split


def run_regions(regions: Sequence[Region], gm: GraphModule, inputs: Sequence[Any]) -> Any:
    """Run the regions in order on the whole graph's inputs; returns what gm(*inputs) returns."""
    env: dict[str, Any] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(inputs):
        raise ValueError(f"the graph takes {len(placeholders)} inputs, got {len(inputs)}")
    env.update({n.name: v for n, v in zip(placeholders, inputs)})
    for region in regions:
        env.update(zip(region.outputs, region(*[env[name] for name in region.inputs])))
    return output_from_env(gm, env)


def output_from_env(gm: GraphModule, env: dict[str, Any]) -> Any:
    """The whole graph's output structure, filled from named values."""
    output_node = next(n for n in gm.graph.nodes if n.op == "output")
    constants = {n.name: _get_attr(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr"}
    return map_arg(output_node.args[0], lambda n: env[n.name] if n.name in env else constants[n.name])


def _get_attr(module: torch.nn.Module, target: str) -> Any:
    for part in target.split("."):
        module = getattr(module, part)
    return module
