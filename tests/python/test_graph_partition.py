"""graphsafe.graph on the CPU: partition_for_capture (eager regions hold exactly the unsafe nodes, captured regions
read static shapes only; piecewise == whole graph == eager, bitwise).

References are independent of the graph machinery: torch's own eager autograd (to tolerance, since graphsafe
sums embedding gradients in its own documented order), and eager autograd through graphsafe.nn.Embedding
(bitwise: the same kernels in the same order).
"""

from __future__ import annotations

import torch

from graphsafe.graph import (capture_gate, partition_for_capture, rewrite_embedding_backward, run_regions,
                             trace_training_step, use_graphsafe_embeddings)
from conftest import assert_bitwise_equal, make_generator
from graph_helpers import EmbeddingModel, Planted, ce_loss, eager_grads, make_batch


# ---------------------------------------------------------------------------------------------------------
# partition_for_capture
# ---------------------------------------------------------------------------------------------------------


def test_piecewise_equals_whole_graph_equals_eager_bitwise():
    torch.manual_seed(4)
    model = Planted(padding_idx=0, scale_grad_by_freq=True)
    batch = make_batch(make_generator(5), padding_idx=0)
    traced = trace_training_step(model, ce_loss, batch)
    gm, _ = rewrite_embedding_backward(traced.graph_module)
    _, gate = capture_gate(gm, "cpu")
    split, report = partition_for_capture(gm, gate)
    regions = split.regions

    # Eager regions hold exactly the unsafe nodes; together the regions hold every op node, in order.
    op_nodes = [n.name for n in gm.graph.nodes if n.op == "call_function"]
    assert [name for r in regions for name in r.nodes] == op_nodes
    assert {name for r in regions if not r.capturable for name in r.nodes} == gate.unsafe_nodes()
    assert report.num_eager >= 2 and report.num_capturable >= 2
    assert all(r.capturable != regions[i + 1].capturable for i, r in enumerate(regions[:-1]))
    # Captured regions only see static shapes and no host numbers read from the device.
    values = {n.name: n.meta.get("val") for n in gm.graph.nodes}
    for region in regions:
        if region.capturable:
            for name in region.inputs:
                value = values[name]
                assert not isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)), name
                assert all(isinstance(s, int) for s in getattr(value, "shape", ())), (name, value.shape)

    inputs = traced.inputs(batch)
    with torch.no_grad():
        whole = gm(*inputs)
        pieces = run_regions(regions, gm, inputs)
        split_outputs = split(*inputs)  # the split GraphModule calls the regions in order
    ref_loss, ref_grads = eager_grads(use_graphsafe_embeddings(model), ce_loss, batch)
    assert len(whole) == len(pieces) == len(split_outputs) == 1 + len(ref_grads)
    for w, p, s, r in zip(whole, pieces, split_outputs, [ref_loss, *ref_grads]):
        assert_bitwise_equal(w, p)
        assert_bitwise_equal(w, s)
        assert_bitwise_equal(w, r)
    assert [n.target for n in split.graph.nodes if n.op == "call_module"] == [f"region_{r.index}" for r in regions]


def test_partition_of_a_clean_graph_is_one_region():
    torch.manual_seed(4)
    model, batch = EmbeddingModel(), make_batch(make_generator(5))
    gm, _ = rewrite_embedding_backward(trace_training_step(model, ce_loss, batch).graph_module)
    split, report = partition_for_capture(gm, device="cpu")
    assert len(split.regions) == 1 and split.regions[0].capturable
    assert "1 regions (1 capturable, 0 eager)" in str(report)
