"""graphsafe's ops as declared in ops.py (torch.library.Library, with a cache of passed input checks): the schemas
and tags, the Autograd kernel's paths (direct call, redispatch, backward), torch.compile, opcheck of every op, and
that a remembered check never lets a bad call through."""

from __future__ import annotations

import pytest
import torch

import graphsafe.ops as gops

G = torch.arange(32, dtype=torch.float32).reshape(4, 8)
I = torch.tensor([1, 3, 3, 0])


def test_schemas_and_tags():
    expected = {
        "embedding_backward": "graphsafe::embedding_backward(Tensor grad, Tensor indices, SymInt num_weights, "
                              "SymInt padding_idx=-1, bool scale_grad_by_freq=False) -> Tensor",
        "embedding_backward_sparse": "graphsafe::embedding_backward_sparse(Tensor grad, Tensor indices, SymInt "
                                     "num_weights, SymInt padding_idx=-1, bool scale_grad_by_freq=False) -> "
                                     "(Tensor, Tensor, Tensor)",
        "embedding": "graphsafe::embedding(Tensor weight, Tensor indices, SymInt padding_idx=-1, bool "
                     "scale_grad_by_freq=False) -> Tensor",
    }
    for name, schema in expected.items():
        op = getattr(torch.ops.graphsafe, name)
        assert getattr(gops, name) is op.default
        assert str(op.default._schema) == schema
        assert torch.Tag.pt2_compliant_tag in op.default.tags


def test_a_remembered_check_still_refuses_other_bad_calls():
    """A signature that passed is remembered; calls with the same shapes but another dtype, device, padding_idx,
    layout or class are checked in full, every time."""
    gops.embedding_backward(G, I, 5, 2)
    for _ in range(2):  # not remembered as a pass after the first refusal either
        with pytest.raises(TypeError, match="grad must be float32"):
            gops.embedding_backward(G.to(torch.int32), I, 5, 2)
        with pytest.raises(TypeError, match="indices must be int32 or int64"):
            gops.embedding_backward(G, I.to(torch.int16), 5, 2)
        with pytest.raises(ValueError, match="padding_idx 5 is out of range"):
            gops.embedding_backward(G, I, 5, 5)
        with pytest.raises(ValueError, match="num_weights must be >= 0"):
            gops.embedding_backward(G, I, -1)
        with pytest.raises(ValueError, match="must be contiguous"):
            gops.embedding_backward(G.t().contiguous().t(), I, 5, 2)
        with pytest.raises(ValueError, match="grad is on cpu but indices are on meta"):
            gops.embedding_backward(G, I.to("meta"), 5, 2)
        with pytest.raises(TypeError, match="dense"):
            gops.embedding_backward_sparse(G.to_sparse(), I, 5, 2)
        with pytest.raises(IndexError):
            gops.embedding_backward(G, torch.tensor([1, 3, 9, 0]), 5, 2)  # values are never part of a signature
    assert gops._PLANS, "the good call's signature is remembered"
    assert len(gops._PLANS) <= gops._MAX_PLANS


def test_signature_cache_is_bounded():
    for n in range(gops._MAX_PLANS + 10):
        gops.embedding_backward(G, I, 4 + n)
    assert len(gops._PLANS) <= gops._MAX_PLANS
    gops.embedding_backward(G, I, 4)  # checked again after being dropped


def test_autograd_paths():
    weight = torch.randn(5, 8, requires_grad=True)
    out = gops.embedding(weight, I, 1)
    (grad,) = torch.autograd.grad(out, weight, G)
    assert torch.equal(grad, gops.embedding_backward(G, I, 5, 1))
    with torch.no_grad():
        assert not gops.embedding(weight, I).requires_grad
    with torch.inference_mode():
        assert torch.equal(gops.embedding(weight, I), weight.detach()[I])
    # Backpropagating through a backward op raises, as custom_op did (no double backward).
    g = G.clone().requires_grad_(True)
    for result in (gops.embedding_backward(g, I, 5), gops.embedding_backward_sparse(g, I, 5)[1]):
        assert result.requires_grad
        with pytest.raises(RuntimeError, match="no autograd formula was registered"):
            result.sum().backward()
    # A create_graph backward of embedding gives such a result too.
    out = gops.embedding(weight, I)
    (grad,) = torch.autograd.grad(out, weight, g, create_graph=True)
    assert torch.equal(grad, gops.embedding_backward(G, I, 5))
    with pytest.raises(RuntimeError, match="no autograd formula was registered"):
        grad.sum().backward()


def test_opcheck_every_op():
    weight = torch.randn(5, 8)
    torch.library.opcheck(torch.ops.graphsafe.embedding_backward.default, (G, I, 5, -2, True))
    torch.library.opcheck(torch.ops.graphsafe.embedding_backward_sparse.default, (G, I.int(), 5, 1, False))
    torch.library.opcheck(torch.ops.graphsafe.embedding.default, (weight.requires_grad_(True), I, -1, False))


def test_torch_compile_runs_the_ops():
    def step(weight, indices):
        out = gops.embedding(weight, indices, 0)
        return (out * out).sum(), gops.embedding_backward_sparse(out.detach(), indices, 5)

    def run(fn):
        weight = torch.arange(40, dtype=torch.float32).reshape(5, 8).requires_grad_(True)
        loss, sparse = fn(weight, I)
        loss.backward()
        return weight.grad, sparse

    expected = run(step)
    got = run(torch.compile(step, backend="aot_eager", fullgraph=True))
    assert torch.equal(got[0], expected[0])
    for a, b in zip(got[1], expected[1]):
        assert torch.equal(a, b)
