"""graphsafe.graph on the CPU: rewrite_embedding_backward (every embedding backward of a traced step replaced by
graphsafe's, what it leaves alone, tied weights).

References are independent of the graph machinery: torch's own eager autograd (to tolerance, since graphsafe
sums embedding gradients in its own documented order), and eager autograd through graphsafe.nn.Embedding
(bitwise: the same kernels in the same order).
"""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from graphsafe.graph import rewrite_embedding_backward, trace_training_step, use_graphsafe_embeddings
from conftest import assert_bitwise_equal, make_generator
from graph_helpers import (ATEN_EMB_BWD, DIM, GS_EMB_BWD, VOCAB, EmbeddingModel, ce_loss, count, eager_grads,
                           graph_grads, make_batch)


# ---------------------------------------------------------------------------------------------------------
# rewrite_embedding_backward
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("scale_grad_by_freq", [False, True])
@pytest.mark.parametrize("padding_idx", [None, 5, -1])
def test_rewrite_replaces_every_embedding_backward(padding_idx, scale_grad_by_freq, index_dtype, dtype):
    gen = make_generator(1234)
    torch.manual_seed(0)
    model = EmbeddingModel(padding_idx, scale_grad_by_freq, dtype)
    batch = make_batch(gen, index_dtype=index_dtype, padding_idx=padding_idx)
    traced = trace_training_step(model, ce_loss, batch)
    assert count(traced.graph_module, ATEN_EMB_BWD) == 2  # the traced graph really has aten's backward

    gm, report = rewrite_embedding_backward(traced.graph_module)
    assert count(gm, ATEN_EMB_BWD) == 0
    assert count(gm, GS_EMB_BWD) == 2
    assert len(report.rewritten) == 2 and not report.left_alone
    assert count(traced.graph_module, ATEN_EMB_BWD) == 2  # the pass works on a copy
    expected_padding = -1 if padding_idx is None else padding_idx % VOCAB
    assert f"padding_idx={expected_padding}" in str(report)

    loss, grads = graph_grads(gm, traced, batch)
    # Bitwise: eager autograd through graphsafe.nn.Embedding (same kernels, same order).
    ref_loss, ref_grads = eager_grads(use_graphsafe_embeddings(model), ce_loss, batch)
    assert_bitwise_equal(loss, ref_loss)
    assert len(grads) == len(ref_grads) == 4
    for g, r in zip(grads, ref_grads):
        assert_bitwise_equal(g, r)
    # To tolerance: torch's own eager backward (fp32 only: bf16 torch sums in another order and precision).
    if dtype == torch.float32:
        torch_loss, torch_grads = eager_grads(model, ce_loss, batch)
        torch.testing.assert_close(loss, torch_loss, rtol=0, atol=0)
        for g, r in zip(grads, torch_grads):
            torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-7)
    if padding_idx is not None:
        assert torch.count_nonzero(grads[0][padding_idx % VOCAB]) == 0


def test_rewrite_lists_what_it_leaves_alone():
    def fn(grad, indices):
        return torch.ops.aten.embedding_dense_backward(grad, indices, 10, -1, False)

    gm = make_fx(fn, tracing_mode="fake")(torch.zeros(5, 3, dtype=torch.complex64), torch.zeros(5, dtype=torch.long))
    rewritten, report = rewrite_embedding_backward(gm)
    assert count(rewritten, ATEN_EMB_BWD) == 1
    assert report.rewritten == []
    assert len(report.left_alone) == 1 and "complex64 is not supported" in report.left_alone[0][1]
    assert "left alone" in str(report)


def test_tied_weights_get_one_summed_gradient():
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(VOCAB, DIM, padding_idx=0)

        def forward(self, ids):
            return self.emb(ids) @ self.emb.weight.t()

    def loss_fn(out, target):  # predict a row of the table
        return torch.nn.functional.cross_entropy(out.flatten(0, 1), target.flatten() % VOCAB)

    torch.manual_seed(1)
    model, batch = Tied(), make_batch(make_generator(7))
    traced = trace_training_step(model, loss_fn, batch)
    gm, _ = rewrite_embedding_backward(traced.graph_module)
    _, grads = graph_grads(gm, traced, batch)
    _, ref = eager_grads(use_graphsafe_embeddings(model), loss_fn, batch)
    assert len(grads) == 1
    assert_bitwise_equal(grads[0], ref[0])
