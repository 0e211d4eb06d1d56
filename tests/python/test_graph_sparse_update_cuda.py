"""The fused row-sparse embedding update (graph/sparse_update.py) under a real CUDA graph capture: the captured step
(the sparse backward in the graph, sparse_step in the same CUDA graph as optimizer.step()) equals the eager loop
with the dense skip_zeros step, bitwise. Skipped without a GPU and graphsafe's CUDA backend."""

from __future__ import annotations

import pytest
import torch

import graphsafe
from graphsafe.graph import use_graphsafe_embeddings
from conftest import assert_bitwise_equal, make_generator, requires_cuda
from graph_helpers import ce_loss
from test_graph_cuda import EmbeddingModel, PlantedHostRead, eager_step, make_batch

pytestmark = requires_cuda

OPTIMIZERS = [
    ("AdamW", dict(lr=1e-2, weight_decay=0.1, skip_zeros=True)),
    ("AdamW", dict(lr=1e-2, skip_zeros=True, state_bits=8, min_8bit_size=0)),
    ("SGD", dict(lr=0.1, momentum=0.9, skip_zeros=True)),
]


def _assert_states_equal(model, optimizer, reference, ref_optimizer, what):
    for (name, p), r in zip(model.named_parameters(), reference.parameters()):
        assert_bitwise_equal(p, r, f"{name} {what}")
        for key, value in optimizer.state[p].items():
            if isinstance(value, torch.Tensor):
                assert_bitwise_equal(value, ref_optimizer.state[r][key], f"{name} state {key} {what}")


@pytest.mark.parametrize("model_cls, mode", [(EmbeddingModel, "full"), (PlantedHostRead, "piecewise")])
@pytest.mark.parametrize("name, options", OPTIMIZERS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(OPTIMIZERS)])
def test_captured_fused_step_equals_eager_bitwise(name, options, model_cls, mode):
    torch.manual_seed(0)
    model = model_cls().cuda()
    reference = use_graphsafe_embeddings(model)  # the eager loop: dense gradients, optimizer.step()
    opt_cls = getattr(graphsafe.optim, name)
    optimizer, ref_optimizer = opt_cls(model.parameters(), **options), opt_cls(reference.parameters(), **options)
    step = graphsafe.compile_step(model, ce_loss, optimizer, mode=mode)
    gen = make_generator(1)
    for i in range(10):  # 2 eager warm-up steps, the capture, 7 replays
        batch = make_batch(gen)
        assert_bitwise_equal(step(batch), eager_step(reference, ref_optimizer, batch), f"loss at step {i}")
        _assert_states_equal(model, optimizer, reference, ref_optimizer, f"after step {i}")
    assert step.mode == mode and step.captured
    assert step.report.sparse_update.fused_names == ["tokens.weight", "extra.weight"]
    assert model.tokens.weight.grad is None and model.extra.weight.grad is None
    graphsafe.check_errors()
