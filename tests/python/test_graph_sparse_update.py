"""fuse_sparse_embedding_update (graph/sparse_update.py) on the CPU: which tables it fuses and which it refuses (with
the reason), and that compile_step with the fused row-sparse step leaves parameters and optimizer states bitwise
equal to the same compile_step with sparse_updates=False (the dense rewritten path)."""

from __future__ import annotations

import copy

import pytest
import torch

import graphsafe
from graphsafe.graph import fuse_sparse_embedding_update, rewrite_embedding_backward, trace_training_step
from conftest import assert_bitwise_equal, make_generator
from graph_helpers import CLASSES, DIM, GS_EMB_BWD, VOCAB, EmbeddingModel, Planted, ce_loss, count, make_batch

SPARSE_BWD = torch.ops.graphsafe.embedding_backward_sparse.default

OPTIMIZERS = {
    "adamw32": lambda params: graphsafe.optim.AdamW(params, lr=1e-2, weight_decay=0.01, skip_zeros=True),
    "adamw8": lambda params: graphsafe.optim.AdamW(params, lr=1e-2, weight_decay=0.01, skip_zeros=True, state_bits=8,
                                                   min_8bit_size=0),
    "sgd_momentum": lambda params: graphsafe.optim.SGD(params, lr=0.1, momentum=0.9, skip_zeros=True),
}


class TiedLM(torch.nn.Module):
    """An LM head sharing the input table: the table's gradient is embedding backward + the head's matmul."""

    def __init__(self):
        super().__init__()
        self.tokens = torch.nn.Embedding(VOCAB, DIM)

    def forward(self, ids):
        return torch.tanh(self.tokens(ids)) @ self.tokens.weight.t()


def tied_loss(out, target):
    return torch.nn.functional.cross_entropy(out.flatten(0, 1), target.flatten() % VOCAB)


def assert_same_state(model_a, opt_a, model_b, opt_b, what):
    for (name, a), b in zip(model_a.named_parameters(), model_b.parameters()):
        assert_bitwise_equal(a.detach(), b.detach(), f"{what}: {name}")
        state_a, state_b = opt_a.state[a], opt_b.state[b]
        assert sorted(state_a) == sorted(state_b), f"{what}: {name} state keys"
        for key, value in state_a.items():
            if isinstance(value, torch.Tensor):
                assert_bitwise_equal(value, state_b[key], f"{what}: {name} state {key}")
            else:
                assert value == state_b[key], f"{what}: {name} state {key}"


def run_both(model, make_optimizer, batches, mode="auto", loss_fn=ce_loss):
    """(fused step, its model and optimizer, dense model and optimizer) after one compile_step per path."""
    dense_model = copy.deepcopy(model)
    opt, dense_opt = make_optimizer(model), make_optimizer(dense_model)
    step = graphsafe.compile_step(model, loss_fn, opt, mode=mode)
    dense_step = graphsafe.compile_step(dense_model, loss_fn, dense_opt, mode=mode, sparse_updates=False)
    for i, batch in enumerate(batches):
        loss, dense_loss = step(batch), dense_step(batch)
        assert_bitwise_equal(loss, dense_loss, f"loss after step {i}")
        assert_same_state(model, opt, dense_model, dense_opt, f"after step {i}")
    return step, opt, dense_step


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("padding_idx, scale", [(None, False), (2, True)])
def test_fused_step_equals_the_dense_step_bitwise(optimizer, padding_idx, scale):
    torch.manual_seed(0)
    model = EmbeddingModel(padding_idx=padding_idx, scale_grad_by_freq=scale)
    gen = make_generator(7)
    batches = [make_batch(gen, padding_idx=padding_idx) for _ in range(5)]
    step, _, dense_step = run_both(model, lambda m: OPTIMIZERS[optimizer](m.parameters()), batches)
    report = step.report.sparse_update
    assert report.fused_names == ["tokens.weight", "positions.weight"] and not report.refused
    assert "fused   tokens.weight [257, 16]" in str(step.report)
    assert "off (sparse_updates=False)" in str(dense_step.report.sparse_update)
    # The dense gradient of a fused table is never built: no dense embedding backward is left in the graph.
    assert count(step.graph_module, GS_EMB_BWD) == 0 and count(step.graph_module, SPARSE_BWD) == 2
    assert count(dense_step.graph_module, GS_EMB_BWD) == 2
    assert model.tokens.weight.grad is None and model.positions.weight.grad is None
    assert model.head.weight.grad is not None
    assert "2 table(s) stepped row-sparse" in step.report.decision


def test_fused_step_region_by_region_equals_the_dense_step():
    # Piecewise on the CPU runs the regions eagerly, with the planted .item() in an eager region of its own.
    torch.manual_seed(1)
    model = Planted(padding_idx=2, scale_grad_by_freq=True)
    gen = make_generator(8)
    batches = [make_batch(gen, padding_idx=2) for _ in range(4)]
    step, _, _ = run_both(model, lambda m: OPTIMIZERS["adamw32"](m.parameters()), batches, mode="piecewise")
    assert step.report.partition.num_eager >= 1 and len(step.report.sparse_update.fused) == 2


def test_two_tables_one_fused_the_other_in_a_group_without_skip_zeros():
    torch.manual_seed(2)
    model = EmbeddingModel(padding_idx=0)

    def make(m):
        return graphsafe.optim.AdamW([{"params": [m.tokens.weight], "skip_zeros": True},
                                      {"params": [m.positions.weight, *m.head.parameters()]}], lr=1e-2)

    gen = make_generator(9)
    step, _, _ = run_both(model, make, [make_batch(gen, padding_idx=0) for _ in range(4)])
    report = step.report.sparse_update
    assert report.fused_names == ["tokens.weight"]
    assert [name for name, _ in report.refused] == ["positions.weight"]
    assert "skip_zeros=False" in report.refused[0][1]
    assert "refused positions.weight: its param group has skip_zeros=False" in str(step.report)
    assert model.tokens.weight.grad is None and model.positions.weight.grad is not None


def test_weight_tied_lm_head_is_refused():
    torch.manual_seed(3)
    model = TiedLM()
    gen = make_generator(10)
    batches = [make_batch(gen) for _ in range(3)]
    step, _, _ = run_both(model, lambda m: OPTIMIZERS["adamw32"](m.parameters()), batches, loss_fn=tied_loss)
    report = step.report.sparse_update
    assert not report.fused and [n for n, _ in report.refused] == ["tokens.weight"]
    assert "dense contribution" in report.refused[0][1] and "weight tying" in report.refused[0][1]
    assert model.tokens.weight.grad is not None


def test_torch_optim_is_refused():
    torch.manual_seed(4)
    model = EmbeddingModel()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = graphsafe.compile_step(model, ce_loss, optimizer, example_batch=make_batch(make_generator(11)))
    report = step.report.sparse_update
    assert not report.fused and len(report.refused) == 2
    assert all("torch.optim.adamw.AdamW, not a graphsafe optimizer" in reason for _, reason in report.refused)
    step(make_batch(make_generator(12)))
    assert model.tokens.weight.grad is not None


def test_layerwise_optimizer_is_refused():
    model = EmbeddingModel()
    optimizer = graphsafe.optim.LAMB(model.parameters(), lr=1e-2, skip_zeros=True)
    step = graphsafe.compile_step(model, ce_loss, optimizer, example_batch=make_batch(make_generator(13)))
    assert all("layer-wise" in reason for _, reason in step.report.sparse_update.refused)


def test_summed_lookups_of_one_table_are_refused():
    class TwoLookups(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.tokens = torch.nn.Embedding(VOCAB, DIM)
            self.head = torch.nn.Linear(DIM, CLASSES)

        def forward(self, ids):
            return self.head(self.tokens(ids) * self.tokens(ids.flip(-1)))

    model = TwoLookups()
    optimizer = OPTIMIZERS["adamw32"](model.parameters())
    step = graphsafe.compile_step(model, ce_loss, optimizer, example_batch=make_batch(make_generator(14)))
    (name, reason), = step.report.sparse_update.refused
    assert name == "tokens.weight" and "looked up 2 times" in reason


def test_pass_on_its_own_keeps_node_metadata_and_the_input_graph():
    torch.manual_seed(5)
    model = EmbeddingModel(padding_idx=1, scale_grad_by_freq=True)
    batch = make_batch(make_generator(15), padding_idx=1)
    optimizer = OPTIMIZERS["adamw32"](model.parameters())
    traced = trace_training_step(model, ce_loss, batch)
    gm, _ = rewrite_embedding_backward(traced.graph_module)
    fused, report = fuse_sparse_embedding_update(gm, traced, optimizer)
    assert count(gm, GS_EMB_BWD) == 2  # the pass works on a copy
    assert len(report.fused) == 2
    for node in fused.graph.nodes:
        if node.op == "call_function":
            assert "val" in node.meta, node.name
    # The outputs: loss, the head's two gradients, then (rows, row_grads, count) per table; shapes from the metadata.
    outputs = next(n for n in fused.graph.nodes if n.op == "output").args[0]
    assert len(outputs) == 1 + 2 + 2 * 3
    n_indices = batch[0].numel()
    rows, row_grads, count_ = (o.meta["val"] for o in outputs[3:6])
    assert rows.shape == (n_indices,) and rows.dtype == torch.int64
    assert row_grads.shape == (n_indices, DIM) and count_.shape == () and count_.dtype == torch.int64
    # Run: each table's rows equal the dense gradient's nonzero rows, bitwise.
    with torch.no_grad():
        dense_out = gm(*traced.inputs(batch))
        sparse_out = fused(*traced.inputs(batch))
    assert_bitwise_equal(sparse_out[0], dense_out[0], "loss")
    for k, (table, dense_grad) in enumerate(zip(report.fused, [dense_out[1], dense_out[2]])):
        assert traced.grad_param_names[table.grad_index] == table.name
        rows, row_grads, n = sparse_out[3 + 3 * k:6 + 3 * k]
        n = int(n)
        assert_bitwise_equal(row_grads[:n], dense_grad[rows[:n]], f"{table.name} rows")
        mask = torch.ones(dense_grad.shape[0], dtype=torch.bool)
        mask[rows[:n]] = False
        assert not dense_grad[mask].any()
