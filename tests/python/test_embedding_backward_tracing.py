"""graphsafe's embedding backward (torch.ops.graphsafe.embedding_backward) under torch's tooling, on the CPU:
torch.library.opcheck, the fake kernel's shapes and checks, and make_fx tracing (of the op, and of autograd through
graphsafe.ops.embedding).
"""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import graphsafe
from conftest import (
    assert_bitwise_equal,
    hot_row_indices,
    make_generator,
    random_grad,
    uniform_indices,
    zipf_indices,
)
from embedding_backward_helpers import op


# --------------------------------------------------------------------------------------------------------
# Fake kernel, opcheck, tracing
# --------------------------------------------------------------------------------------------------------


def _opcheck_cases():
    g = make_generator(1234)
    yield (random_grad((6, 5), torch.float32, g), uniform_indices(6, 9, g), 9, -1, False)
    yield (random_grad((3, 4, 8), torch.float16, g), zipf_indices((3, 4), 20, g, torch.int32), 20, 2, True)
    yield (random_grad((2, 3, 70, 3), torch.bfloat16, g), hot_row_indices((2, 3, 70), 11, g), 11, -2, True)
    yield (random_grad((0, 4), torch.float64, g), torch.empty(0, dtype=torch.int32), 3, -1, False)
    yield (random_grad((5, 1), torch.float64, g), uniform_indices(5, 4, g), 4, 3, False)


@pytest.mark.parametrize("args", list(_opcheck_cases()), ids=lambda a: f"{a[0].dtype}-{tuple(a[0].shape)}")
def test_opcheck(args):
    torch.library.opcheck(torch.ops.graphsafe.embedding_backward.default, args)


def test_fake_kernel_shapes_and_checks():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        grad = torch.empty(7, 3, 5, dtype=torch.bfloat16)
        indices = torch.empty(7, 3, dtype=torch.int32)
        out = op(grad, indices, 11, -1, True)
        assert out.shape == (11, 5) and out.dtype == torch.bfloat16
        with pytest.raises(ValueError, match="plus one trailing dimension"):
            op(grad, torch.empty(7, dtype=torch.int64), 11, -1, False)
        with pytest.raises(TypeError, match="indices must be int32 or int64"):
            op(grad, indices.float(), 11, -1, False)
    out = op(torch.empty(4, 2, device="meta"), torch.empty(4, dtype=torch.int64, device="meta"), 6, -1, False)
    assert out.device.type == "meta" and out.shape == (6, 2)


@pytest.mark.parametrize("tracing_mode", ["real", "fake", "symbolic"])
def test_make_fx_traces_the_op(tracing_mode, gen):
    def f(grad, indices):
        return torch.ops.graphsafe.embedding_backward(grad, indices, 13, -2, True)

    grad = random_grad((4, 6, 3), torch.float32, gen)
    indices = zipf_indices((4, 6), 13, gen)
    gm = make_fx(f, tracing_mode=tracing_mode)(grad, indices)
    targets = [str(node.target) for node in gm.graph.nodes if node.op == "call_function"]
    assert any("graphsafe.embedding_backward" in t for t in targets), targets
    assert_bitwise_equal(gm(grad, indices), f(grad, indices), "traced graph")


def test_make_fx_traces_autograd_through_graphsafe_embedding(gen):
    """The backward of graphsafe.ops.embedding is traceable and is graphsafe's op (not aten's)."""

    def f(weight, indices):
        out = graphsafe.ops.embedding(weight, indices, 2, False)
        return torch.autograd.grad((out * out).sum(), weight)[0]

    weight = torch.randn(10, 4, generator=gen, requires_grad=True)
    indices = uniform_indices((3, 5), 10, gen)
    gm = make_fx(f, tracing_mode="fake")(weight, indices)
    targets = [str(node.target) for node in gm.graph.nodes if node.op == "call_function"]
    assert "graphsafe.embedding_backward.default" in targets
    assert "aten.embedding_dense_backward.default" not in targets
    assert_bitwise_equal(gm(weight, indices), f(weight, indices), "traced backward")
