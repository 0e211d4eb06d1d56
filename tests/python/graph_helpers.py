"""Helpers of the graphsafe.graph tests (test_graph_*.py): a small embedding model (and one with a planted host read
and data-dependent shapes), batches, the loss, the eager references a traced or compiled step is compared with,
and a count of a graph's calls to an op.
"""

from __future__ import annotations

import torch

from conftest import assert_bitwise_equal


ATEN_EMB_BWD = torch.ops.aten.embedding_dense_backward.default
GS_EMB_BWD = torch.ops.graphsafe.embedding_backward.default
VOCAB, DIM, CLASSES = 257, 16, 11


class EmbeddingModel(torch.nn.Module):
    """Two plain torch embedding tables (one with the options under test) summed, then a linear head."""

    def __init__(self, padding_idx=None, scale_grad_by_freq=False, dtype=torch.float32):
        super().__init__()
        self.tokens = torch.nn.Embedding(VOCAB, DIM, padding_idx=padding_idx, scale_grad_by_freq=scale_grad_by_freq,
                                         dtype=dtype)
        self.positions = torch.nn.Embedding(8, DIM, dtype=dtype)
        self.head = torch.nn.Linear(DIM, CLASSES, dtype=dtype)

    def forward(self, ids):
        pos = torch.arange(ids.shape[1], device=ids.device)
        h = self.tokens(ids) + self.positions(pos)
        return self.head(torch.tanh(h)).float()


def ce_loss(out, target):
    return torch.nn.functional.cross_entropy(out.flatten(0, 1), target.flatten())


def assert_step_equals_eager_loop(loss, model, reference, ref_optimizer, batch, what=""):
    """Takes one step of the plain eager loop on `reference` and asserts that compile_step's `loss` and the
    parameters of `model` equal it bitwise."""
    ref_loss = ce_loss(reference(batch[0]), batch[1])
    ref_loss.backward()
    ref_optimizer.step()
    ref_optimizer.zero_grad()
    assert_bitwise_equal(loss, ref_loss.detach(), f"loss {what}")
    for p, r in zip(model.parameters(), reference.parameters()):
        assert_bitwise_equal(p.detach(), r.detach(), f"parameters {what}")


def make_batch(gen, batch=4, seq=8, index_dtype=torch.int64, padding_idx=None):
    ids = torch.randint(0, VOCAB, (batch, seq), generator=gen)
    ids[:, :3] = ids[0, 0]  # repeated rows, so scale_grad_by_freq and the summation order matter
    if padding_idx is not None:
        ids[:, -1] = padding_idx % VOCAB
    target = torch.randint(0, CLASSES, (batch, seq), generator=gen)
    return ids.to(index_dtype), target


def eager_grads(model, loss_fn, batch):
    """Plain eager autograd: the independent reference."""
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model(batch[0]), *batch[1:])
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()]


def graph_grads(gm, traced, batch):
    with torch.no_grad():
        out = gm(*traced.inputs(batch))
    return out[0], list(out[1:])


def count(gm, target):
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is target)


class Planted(EmbeddingModel):
    """EmbeddingModel plus a planted host read (.item()) and a planted data-dependent shape (nonzero)."""

    def forward(self, ids):
        out = super().forward(ids)
        hot = (ids > VOCAB // 2).sum().item()  # host read
        nonzero_rows = torch.nonzero(ids).shape[0]  # data-dependent shape (a host number from its size)
        found = torch.nonzero(ids == ids[0, 0]).float().mean()
        return out * (1.0 + hot / 1000.0) + found * 1e-3 + nonzero_rows * 1e-6
