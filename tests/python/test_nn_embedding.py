"""CPU tests of graphsafe.nn.Embedding, the drop-in torch.nn.Embedding whose weight gradient comes from
torch.ops.graphsafe.embedding_backward.

Gradient checks compare each module's weight.grad with aten.embedding_dense_backward in float64 within an
error bound derived from the accumulation (conftest.fp64_reference_and_bound): graphsafe's bound assumes its
documented fp32 (fp64 for fp64) accumulation; torch's CPU kernel is held to the worst case of accumulating
in the parameter dtype. The two modules then agree within the sum of both bounds.
"""

from __future__ import annotations

import copy

import pytest
import torch

import graphsafe
from conftest import (
    OpRecorder,
    assert_bitwise_equal,
    assert_within_bound,
    fp64_reference_and_bound,
    hot_row_indices,
    make_generator,
    random_grad,
    uniform_indices,
    zipf_indices,
)

PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def make_pair(num_embeddings, dim, generator, dtype=torch.float32, **kwargs):
    """A torch.nn.Embedding and a graphsafe.nn.Embedding with identical weights and options."""
    ref = torch.nn.Embedding(num_embeddings, dim, dtype=dtype, **kwargs)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(num_embeddings, dim, generator=generator, dtype=torch.float64).to(dtype))
        if ref.padding_idx is not None:
            ref.weight[ref.padding_idx].zero_()
    gs = graphsafe.nn.Embedding(num_embeddings, dim, dtype=dtype, **kwargs)
    gs.load_state_dict(ref.state_dict())
    return ref, gs


def grads_via(module, indices, upstream):
    module.zero_grad(set_to_none=True)
    out = module(indices)
    (out * upstream).sum().backward()
    return out, module.weight.grad


def check_grads(ref, gs, indices, upstream):
    dtype = ref.weight.dtype
    out_ref, grad_ref = grads_via(ref, indices, upstream)
    with OpRecorder() as recorder:
        out_gs, grad_gs = grads_via(gs, indices, upstream)
    assert "graphsafe.embedding_backward.default" in recorder.ops
    assert "aten.embedding_dense_backward.default" not in recorder.ops
    assert_bitwise_equal(out_gs, out_ref, "forward")
    assert grad_gs.dtype == dtype and grad_gs.shape == gs.weight.shape

    # The gradient of the looked-up rows is upstream itself (d(out * upstream)/d out), in the param dtype.
    num_weights = gs.num_embeddings
    pad = gs.padding_idx  # already normalised by the constructor (-1 -> num_weights - 1)
    scale = gs.scale_grad_by_freq
    ref64, bound_gs = fp64_reference_and_bound(upstream, indices, num_weights, pad, scale)
    _, bound_torch = fp64_reference_and_bound(upstream, indices, num_weights, pad, scale, accumulation=dtype)
    assert_within_bound(grad_gs, ref64, bound_gs, "graphsafe grad vs fp64")
    assert_within_bound(grad_ref, ref64, bound_torch, "torch grad vs fp64")
    assert_within_bound(grad_gs, grad_ref.double(), bound_gs + bound_torch, "graphsafe grad vs torch grad")

    # And it is exactly the op applied to the upstream gradient.
    direct = torch.ops.graphsafe.embedding_backward(
        upstream.contiguous(), indices.contiguous(), num_weights, -1 if pad is None else pad, scale
    )
    assert_bitwise_equal(grad_gs, direct, "module grad vs op")
    if pad is not None:
        assert_bitwise_equal(grad_gs[pad], torch.zeros_like(grad_gs[pad]), "padding row")
    return grad_gs, grad_ref


@pytest.mark.parametrize("dtype", PARAM_DTYPES, ids=str)
@pytest.mark.parametrize("scale", [False, True], ids=["sum", "scaled"])
@pytest.mark.parametrize("padding_idx", [None, 3, -1, -4])
def test_matches_torch_embedding(padding_idx, scale, dtype, gen):
    num_embeddings, dim = 60, 12
    ref, gs = make_pair(num_embeddings, dim, gen, dtype, padding_idx=padding_idx, scale_grad_by_freq=scale)
    assert gs.padding_idx == ref.padding_idx
    indices = zipf_indices((8, 150), num_embeddings, gen)  # head rows occur hundreds of times
    if padding_idx is not None:
        indices[:, ::9] = ref.padding_idx
    upstream = random_grad((8, 150, dim), dtype, gen)
    check_grads(ref, gs, indices, upstream)


def test_padding_minus_one_is_last_row(gen):
    """In the module constructor, padding_idx=-1 means the last row (torch.nn.Embedding semantics), not
    "no padding" as in the op's argument."""
    ref, gs = make_pair(10, 3, gen, padding_idx=-1)
    assert gs.padding_idx == 9
    indices = torch.tensor([[9, 1, 9, 2], [3, 9, 9, 1]])
    upstream = random_grad((2, 4, 3), torch.float32, gen)
    grad_gs, _ = check_grads(ref, gs, indices, upstream)
    assert_bitwise_equal(grad_gs[9], torch.zeros(3), "last row")


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=str)
def test_hot_rows_and_index_dtypes(index_dtype, gen):
    ref, gs = make_pair(500, 8, gen)
    indices = hot_row_indices((4, 1100), 500, gen, dtype=index_dtype, num_hot=3)  # ~1470 occurrences a row
    assert torch.bincount(indices.reshape(-1).long()).max() > 1024
    upstream = random_grad((4, 1100, 8), torch.float32, gen)
    check_grads(ref, gs, indices, upstream)


def test_non_contiguous_upstream_grad(gen):
    """The module's output used after .transpose (and after .expand through .sum()) sends a non-contiguous
    gradient into the backward; it must still be right."""
    ref, gs = make_pair(40, 6, gen, scale_grad_by_freq=True)
    indices = uniform_indices((5, 7), 40, gen)
    weights_t = random_grad((7, 5, 6), torch.float32, gen)  # multiplies the transposed output

    seen = []
    results = []
    for module in (ref, gs):
        module.zero_grad(set_to_none=True)
        out = module(indices)
        out.register_hook(lambda g: seen.append(g.is_contiguous()))
        (out.transpose(0, 1) * weights_t).sum().backward()
        results.append(module.weight.grad.clone())
    assert seen == [False, False], "the upstream gradient was expected to be non-contiguous"
    upstream = weights_t.transpose(0, 1)
    ref64, bound = fp64_reference_and_bound(upstream, indices, 40, None, True)
    assert_within_bound(results[1], ref64, bound, "graphsafe grad")
    direct = torch.ops.graphsafe.embedding_backward(upstream.contiguous(), indices, 40, -1, True)
    assert_bitwise_equal(results[1], direct)
    assert_within_bound(results[0], ref64, bound, "torch grad")

    # out.sum(): the upstream gradient is an expanded (stride-0) tensor of ones.
    gs.zero_grad(set_to_none=True)
    out = gs(indices)
    out.register_hook(lambda g: seen.append(g.is_contiguous()))
    out.sum().backward()
    assert seen[-1] is False
    counts = torch.bincount(indices.reshape(-1), minlength=40).float()
    expected = (counts > 0).float().unsqueeze(1).expand(40, 6)  # scaled: count / count = 1 for touched rows
    assert_bitwise_equal(gs.weight.grad, expected.contiguous(), "sum() with scale_grad_by_freq")


def test_non_contiguous_indices(gen):
    ref, gs = make_pair(30, 4, gen, padding_idx=2)
    indices = uniform_indices((9, 6), 30, gen).t()  # [6, 9], not contiguous
    assert not indices.is_contiguous()
    upstream = random_grad((6, 9, 4), torch.float32, gen)
    check_grads(ref, gs, indices, upstream)


def test_gradient_accumulates_over_backward_calls(gen):
    _, gs = make_pair(20, 3, gen)
    a, b = uniform_indices(50, 20, gen), uniform_indices(50, 20, gen)
    ga, gb = random_grad((50, 3), torch.float32, gen), random_grad((50, 3), torch.float32, gen)
    (gs(a) * ga).sum().backward()
    (gs(b) * gb).sum().backward()
    op = torch.ops.graphsafe.embedding_backward
    assert_bitwise_equal(gs.weight.grad, op(ga, a, 20, -1, False) + op(gb, b, 20, -1, False))


def test_frozen_weight_runs_no_backward(gen):
    gs = graphsafe.nn.Embedding.from_pretrained(torch.randn(10, 3, generator=gen), freeze=True)
    x = torch.randn(4, 3, requires_grad=True)
    with OpRecorder() as recorder:
        (gs(torch.tensor([1, 2, 3, 1])) * x).sum().backward()
    assert gs.weight.grad is None
    assert "graphsafe.embedding_backward.default" not in recorder.ops


# --------------------------------------------------------------------------------------------------------
# Module plumbing
# --------------------------------------------------------------------------------------------------------


def test_is_a_torch_embedding():
    gs = graphsafe.nn.Embedding(7, 3)
    assert isinstance(gs, torch.nn.Embedding)
    assert gs.weight.shape == (7, 3) and gs.padding_idx is None and not gs.sparse and gs.max_norm is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_state_dict_round_trip(dtype, gen):
    ref = torch.nn.Embedding(12, 5, padding_idx=4, dtype=dtype)
    gs = graphsafe.nn.Embedding(12, 5, padding_idx=4, dtype=dtype)
    assert set(gs.state_dict()) == set(ref.state_dict()) == {"weight"}
    gs.load_state_dict(ref.state_dict())
    assert_bitwise_equal(gs.weight, ref.weight, "torch -> graphsafe")
    with torch.no_grad():
        gs.weight.copy_(torch.randn(12, 5, generator=gen).to(dtype))
    back = torch.nn.Embedding(12, 5, padding_idx=4, dtype=dtype)
    back.load_state_dict(gs.state_dict())
    assert_bitwise_equal(back.weight, gs.weight, "graphsafe -> torch")
    # deepcopy keeps the class (used by e.g. EMA helpers)
    assert type(copy.deepcopy(gs)) is graphsafe.nn.Embedding


@pytest.mark.parametrize("freeze", [True, False])
def test_from_pretrained(freeze, gen):
    table = torch.randn(9, 4, generator=gen)
    gs = graphsafe.nn.Embedding.from_pretrained(table, freeze=freeze, padding_idx=1, scale_grad_by_freq=True)
    assert type(gs) is graphsafe.nn.Embedding
    assert gs.weight.requires_grad is (not freeze)
    assert gs.padding_idx == 1 and gs.scale_grad_by_freq
    assert_bitwise_equal(gs.weight.detach(), table, "weights")
    indices = torch.tensor([[1, 2, 2], [8, 1, 0]])
    out = gs(indices)
    assert_bitwise_equal(out, table[indices], "forward")
    if not freeze:
        upstream = random_grad((2, 3, 4), torch.float32, gen)
        with OpRecorder() as recorder:
            (out * upstream).sum().backward()
        assert "graphsafe.embedding_backward.default" in recorder.ops
        expected = torch.ops.graphsafe.embedding_backward(upstream, indices, 9, 1, True)
        assert_bitwise_equal(gs.weight.grad, expected)
        assert_bitwise_equal(gs.weight.grad[1], torch.zeros(4), "padding row")


def test_max_norm_not_supported():
    with pytest.raises(NotImplementedError, match="max_norm") as info:
        graphsafe.nn.Embedding(10, 3, max_norm=1.0)
    message = str(info.value)
    assert "torch.nn.Embedding" in message and "embedding_renorm_" in message  # names alternatives
    with pytest.raises(NotImplementedError, match="max_norm"):
        graphsafe.nn.Embedding.from_pretrained(torch.randn(4, 2), max_norm=2.0)


def test_sparse_not_supported():
    with pytest.raises(NotImplementedError, match="sparse=True") as info:
        graphsafe.nn.Embedding(10, 3, sparse=True)
    message = str(info.value)
    assert "torch.nn.Embedding(sparse=True)" in message and "skip_zeros" in message  # names alternatives
    with pytest.raises(NotImplementedError, match="sparse=True"):
        graphsafe.nn.Embedding.from_pretrained(torch.randn(4, 2), sparse=True)


# --------------------------------------------------------------------------------------------------------
# A tiny training run
# --------------------------------------------------------------------------------------------------------


class TinyModel(torch.nn.Module):
    def __init__(self, embedding: torch.nn.Embedding, classes: int) -> None:
        super().__init__()
        self.embedding = embedding
        self.head = torch.nn.Linear(embedding.embedding_dim, classes)

    def forward(self, tokens):
        return self.head(self.embedding(tokens).mean(dim=1))


@pytest.mark.parametrize("padding_idx,scale", [(None, False), (0, True)])
def test_tiny_model_trains_like_torch(padding_idx, scale):
    gen = make_generator(7)
    vocab, dim, classes, batch, length = 80, 16, 5, 32, 12
    ref_emb = torch.nn.Embedding(vocab, dim, padding_idx=padding_idx, scale_grad_by_freq=scale)
    with torch.no_grad():
        ref_emb.weight.copy_(torch.randn(vocab, dim, generator=gen))
        if padding_idx is not None:
            ref_emb.weight[padding_idx].zero_()
    gs_emb = graphsafe.nn.Embedding(vocab, dim, padding_idx=padding_idx, scale_grad_by_freq=scale)
    gs_emb.load_state_dict(ref_emb.state_dict())
    ref_model = TinyModel(ref_emb, classes)
    gs_model = TinyModel(gs_emb, classes)
    gs_model.head.load_state_dict(ref_model.head.state_dict())

    # One fixed batch, seen 5 times, so the loss must go down.
    tokens = zipf_indices((batch, length), vocab, gen)
    labels = torch.randint(0, classes, (batch,), generator=gen)
    batches = [(tokens, labels)] * 5
    losses = {}
    for name, model in (("torch", ref_model), ("graphsafe", gs_model)):
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        losses[name] = []
        for tokens, labels in batches:
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(model(tokens), labels)
            loss.backward()
            opt.step()
            losses[name].append(loss.item())

    # The two runs differ only in the fp32 summation order inside the embedding gradient: per element at
    # most ~n * 2^-24 relative for a row with n occurrences (n <= batch * length = 384 here, so < 3e-5 of
    # the row's gradient magnitude, which is itself ~1e-2 of the weights at lr 0.5). Over 5 steps the loss
    # moves by orders of magnitude less than 1e-5 relative; anything larger would be a real discrepancy.
    torch.testing.assert_close(
        torch.tensor(losses["graphsafe"], dtype=torch.float64),
        torch.tensor(losses["torch"], dtype=torch.float64),
        rtol=1e-5,
        atol=0.0,
    )
    assert losses["graphsafe"][-1] < losses["graphsafe"][0], "the model did not learn"
    torch.testing.assert_close(gs_model.embedding.weight, ref_model.embedding.weight, rtol=1e-5, atol=1e-6)
    if padding_idx is not None:
        assert_bitwise_equal(gs_model.embedding.weight[padding_idx].detach(), torch.zeros(dim), "padding row")
