"""CPU tests of graphsafe's row-sparse embedding backward (graphsafe.ops.embedding_backward_sparse).

Contract under test (include/graphsafe/embedding.h, docs/embedding.md "Row-sparse backward"): with
U = min(indices.numel(), num_weights), the op returns (rows, row_grads, count):
  rows int64 [U]: rows[:count] the distinct rows that receive a contribution (padding_idx left out), strictly
  increasing, rows[count:] = -1; row_grads [U, D] in grad's dtype: row_grads[k] bit for bit row rows[k] of the
  dense graphsafe.ops.embedding_backward, row_grads[count:] = +0; count an int64 0-d tensor on grad's device.
  Bad input raises exactly what the dense op raises.
Checked against two independent references: the dense op (bitwise; the rows are derived here from the indices,
not from the op) and aten.embedding_dense_backward in float64 within the derived error bound
(conftest.fp64_reference_and_bound), plus a hypothesis property test, torch's tooling (opcheck, fake kernel,
make_fx) and a fresh interpreter.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.fx.experimental.proxy_tensor import make_fx

import graphsafe
from conftest import (
    GRAD_DTYPES,
    INDEX_DTYPES,
    INDEX_GENERATORS,
    assert_bitwise_equal,
    hot_row_indices,
    make_generator,
    normalise_padding_idx,
    random_grad,
    uniform_indices,
    zipf_indices,
)
from embedding_backward_helpers import check_against_fp64, wide_range_grad

sparse_op = torch.ops.graphsafe.embedding_backward_sparse
dense_op = torch.ops.graphsafe.embedding_backward


def expected_rows(indices, num_weights, padding_idx):
    """The distinct contributing rows, increasing: from the indices alone."""
    pad = normalise_padding_idx(padding_idx, num_weights)
    return sorted(set(indices.reshape(-1).tolist()) - {pad})


def check_sparse(grad, indices, num_weights, padding_idx=-1, scale=False, what=""):
    """Runs the sparse op and checks every clause of the contract against the dense op; returns its result."""
    pad = -1 if padding_idx is None else padding_idx
    rows, row_grads, count = graphsafe.ops.embedding_backward_sparse(grad, indices, num_weights, pad, scale)
    dense = dense_op(grad, indices, num_weights, pad, scale)
    d = grad.shape[-1]
    u = min(indices.numel(), num_weights)
    what = what or f"{grad.dtype} {indices.dtype} V={num_weights} pad={padding_idx} scale={scale}"
    assert rows.dtype == torch.int64 and rows.shape == (u,), what
    assert row_grads.dtype == grad.dtype and row_grads.shape == (u, d), what
    assert count.dtype == torch.int64 and count.shape == () and count.device == grad.device, what
    c = int(count)
    want = expected_rows(indices, num_weights, pad)
    assert c == len(want), f"{what}: count {c} != {len(want)}"
    assert rows[:c].tolist() == want, what
    assert bool((rows[:c].diff() > 0).all()), f"{what}: rows not strictly increasing"
    assert bool((rows[c:] == -1).all()), f"{what}: unused slots' rows are not -1"
    assert_bitwise_equal(row_grads[:c], dense[rows[:c]], f"{what}: row_grads vs dense rows")
    assert_bitwise_equal(row_grads[c:], torch.zeros(u - c, d, dtype=grad.dtype), f"{what}: unused slots")
    unlisted = torch.ones(num_weights, dtype=torch.bool)
    unlisted[rows[:c]] = False
    assert_bitwise_equal(dense[unlisted], torch.zeros_like(dense[unlisted]), f"{what}: dense rows not listed")
    return rows, row_grads, count


def scatter(rows, row_grads, count, num_weights):
    """The dense [num_weights, D] gradient the sparse result stands for."""
    out = torch.zeros(num_weights, row_grads.shape[-1], dtype=row_grads.dtype)
    c = int(count)
    out[rows[:c]] = row_grads[:c]
    return out


# --------------------------------------------------------------------------------------------------------
# Against the dense op and aten's float64 reference
# --------------------------------------------------------------------------------------------------------

# (index shape, num_weights, D): N > V and N < V, multi-dim indices, V not a multiple of anything, rows of a few,
# of ~32 and of > 1024 occurrences (runs over tiles and tile groups).
SHAPE_CASES = {
    "uniform": [((3000,), 101, 5), ((40, 75), 4099, 16), ((6, 20, 25), 97, 3)],
    "zipf": [((3000,), 503, 8), ((50, 60), 1000, 5), ((5, 12, 50), 300, 1)],
    "hot": [((2600,), 53, 4), ((52, 50), 64, 7), ((4, 25, 26), 40, 9)],
}


def _padding_for(choice, indices, num_weights):
    if choice == "none":
        return None, indices
    if choice == "mode":  # the most frequent row: padding that removes many occurrences
        return int(torch.mode(indices.reshape(-1).long()).values), indices
    flat = indices.reshape(-1).clone()
    flat[::7] = num_weights - 2
    return -2, flat.reshape(indices.shape)


@pytest.mark.parametrize("option", [("none", False), ("mode", True), ("neg2", False), ("none", True)], ids=str)
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES, ids=str)
@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=str)
@pytest.mark.parametrize("dist", list(SHAPE_CASES))
def test_matches_dense_and_fp64_reference(dist, dtype, index_dtype, option, gen):
    padding, scale = option
    for shape, num_weights, d in SHAPE_CASES[dist]:
        indices = INDEX_GENERATORS[dist](shape, num_weights, gen, dtype=index_dtype)
        padding_idx, indices = _padding_for(padding, indices, num_weights)
        grad = random_grad((*shape, d), dtype, gen)
        rows, row_grads, count = check_sparse(grad, indices, num_weights, padding_idx, scale)
        check_against_fp64(grad, indices, num_weights, padding_idx, scale,
                           out=scatter(rows, row_grads, count, num_weights))


@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=str)
def test_tile_and_group_boundaries(dtype, gen):
    """Runs that start and end at every kind of tile / tile-group boundary (the layout of
    test_embedding_backward_order.py), on values whose summation order shows in the bits."""
    counts = [5, 27, 32, 33, 100, 810, 40, 2100, 1, 1024, 5 * 1024 - 4172, 1024, 2049, 31]
    flat = torch.cat([torch.full((c,), 3 * r + 1, dtype=torch.int64) for r, c in enumerate(counts)])
    flat = flat[torch.randperm(flat.numel(), generator=gen)]
    num_weights = 3 * len(counts) + 2
    grad = wide_range_grad((flat.numel(), 6), dtype, gen)
    for padding in (-1, 13, 22):
        for scale in (False, True):
            check_sparse(grad, flat, num_weights, padding, scale)


@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=str)
def test_int32_and_int64_indices_agree(dtype, gen):
    indices = zipf_indices((30, 40), 200, gen)
    grad = wide_range_grad((30, 40, 6), dtype, gen)
    a = sparse_op(grad, indices.to(torch.int32), 200, 5, True)
    b = sparse_op(grad, indices.to(torch.int64), 200, 5, True)
    for x, y, name in zip(a, b, ("rows", "row_grads", "count")):
        assert_bitwise_equal(x, y, name)


def test_two_calls_bitwise_equal(gen):
    indices = hot_row_indices(5000, 300, gen, num_hot=4)
    indices[::3] = zipf_indices(1667, 300, gen)
    grad = wide_range_grad((5000, 12), torch.float32, gen)
    first = sparse_op(grad, indices, 300, 7, True)
    second = sparse_op(grad, indices, 300, 7, True)
    for x, y, name in zip(first, second, ("rows", "row_grads", "count")):
        assert_bitwise_equal(x, y, name)


def test_nan_results_match_dense_bits(gen):
    grad = random_grad((300, 16), torch.float32, gen)
    indices = uniform_indices(300, 40, gen)
    grad[3, 2] = float("nan")
    grad[7, 5], grad[8, 5] = float("inf"), float("-inf")
    indices[8] = indices[7]
    for scale in (False, True):
        check_sparse(grad, indices, 40, -1, scale)


# --------------------------------------------------------------------------------------------------------
# Edges
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=str)
@pytest.mark.parametrize("index_shape", [(0,), (0, 4), (3, 0, 2)], ids=str)
def test_empty_batch(dtype, index_shape):
    for d in (1, 7):
        grad = torch.empty((*index_shape, d), dtype=dtype)
        indices = torch.empty(index_shape, dtype=torch.int64)
        rows, row_grads, count = check_sparse(grad, indices, 9, 2, True)
        assert rows.shape == (0,) and row_grads.shape == (0, d) and int(count) == 0
    rows, row_grads, count = check_sparse(torch.empty(0, 3, dtype=dtype), torch.empty(0, dtype=torch.int32), 0)
    assert rows.shape == (0,) and row_grads.shape == (0, 3) and int(count) == 0


def test_dim_zero_still_lists_rows(gen):
    indices = torch.tensor([5, 1, 5, 3, 1, 0])
    rows, row_grads, count = check_sparse(torch.empty(6, 0), indices, 8, 3)
    assert rows.tolist() == [0, 1, 5, -1, -1, -1] and row_grads.shape == (6, 0) and int(count) == 3


@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=str)
def test_all_padding(dtype, gen):
    indices = torch.full((4, 50), 6, dtype=torch.int32)
    grad = random_grad((4, 50, 3), dtype, gen, scale=100.0)
    for padding in (6, -4):
        rows, row_grads, count = check_sparse(grad, indices, 10, padding, True)
        assert int(count) == 0 and bool((rows == -1).all()) and rows.shape == (10,)


@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=str)
def test_single_row(dtype, gen):
    """One row, many times (one run over several tile groups), and a single index."""
    grad = random_grad((2500, 8), dtype, gen)
    rows, _, count = check_sparse(grad, torch.full((2500,), 17, dtype=torch.int64), 40, -1, True)
    assert int(count) == 1 and rows[0].item() == 17 and bool((rows[1:] == -1).all())
    rows, _, count = check_sparse(random_grad((1, 5), dtype, gen), torch.tensor([3]), 4)
    assert rows.tolist() == [3] and int(count) == 1
    rows, _, count = check_sparse(random_grad((7,), dtype, gen), torch.tensor(2), 4)  # 0-d indices: one lookup
    assert rows.tolist() == [2] and int(count) == 1


@pytest.mark.parametrize("index_dtype", INDEX_DTYPES, ids=str)
def test_more_indices_than_rows(index_dtype, gen):
    """N > V: U = V slots; every row occurs, so no slot is unused (and with padding exactly one is)."""
    num_weights = 7
    indices = torch.cat([torch.arange(num_weights), uniform_indices(5000, num_weights, gen)]).to(index_dtype)
    grad = random_grad((indices.numel(), 4), torch.float32, gen)
    rows, _, count = check_sparse(grad, indices, num_weights)
    assert rows.tolist() == list(range(num_weights)) and int(count) == num_weights
    rows, _, count = check_sparse(grad, indices, num_weights, 0, True)
    assert rows.tolist() == [1, 2, 3, 4, 5, 6, -1] and int(count) == 6


def test_largest_row_index():
    num_weights = 2**20 + 3
    indices = torch.tensor([num_weights - 1, 0, num_weights - 1], dtype=torch.int32)
    grad = torch.tensor([[1.0], [2.0], [3.0]])
    rows, row_grads, count = check_sparse(grad, indices, num_weights)
    assert rows.tolist() == [0, num_weights - 1, -1] and row_grads[:, 0].tolist() == [2.0, 4.0, 0.0]


# --------------------------------------------------------------------------------------------------------
# Errors: exactly the dense op's
# --------------------------------------------------------------------------------------------------------


def _bad_calls():
    grad, idx = torch.randn(4, 3), torch.tensor([0, 1, 2, 1])
    yield "grad dtype", (grad.to(torch.int32), idx, 5, -1, False)
    yield "index dtype", (grad, idx.float(), 5, -1, False)
    yield "index int16", (grad, idx.to(torch.int16), 5, -1, False)
    yield "shape", (grad, torch.zeros(5, dtype=torch.int64), 5, -1, False)
    yield "0-d grad", (torch.tensor(1.0), torch.tensor(0), 5, -1, False)
    yield "non-contiguous grad", (torch.randn(3, 4).t(), idx, 5, -1, False)
    yield "non-contiguous indices", (grad, torch.arange(8)[::2], 5, -1, False)
    yield "padding too large", (grad, idx, 5, 5, False)
    yield "padding too negative", (grad, idx, 5, -6, False)
    yield "negative num_weights", (grad, idx, -1, -1, False)
    yield "sparse grad", (grad.to_sparse(), idx, 5, -1, False)
    yield "out of range", (grad, torch.tensor([0, 1, 5, 1]), 5, -1, False)
    yield "negative index", (grad, torch.tensor([0, -1, 2, 1], dtype=torch.int32), 5, -1, False)
    yield "no rows", (grad, idx, 0, -1, False)


@pytest.mark.parametrize("case", list(_bad_calls()), ids=lambda c: c[0])
def test_errors_are_the_dense_ops(case):
    _, args = case
    with pytest.raises(Exception) as dense_error:
        dense_op(*args)
    with pytest.raises(type(dense_error.value)) as sparse_error:
        sparse_op(*args)
    assert str(sparse_error.value) == str(dense_error.value)
    assert isinstance(sparse_error.value, (TypeError, ValueError, IndexError))


def test_out_of_range_index_error_names_it():
    grad = torch.randn(50, 4)
    indices = torch.arange(50) % 10
    indices[37] = 10
    with pytest.raises(IndexError, match=r"index 10 at position 37 is out of range for an embedding with 10 rows"):
        graphsafe.ops.embedding_backward_sparse(grad, indices, 10)


# --------------------------------------------------------------------------------------------------------
# Property test
# --------------------------------------------------------------------------------------------------------


@st.composite
def embedding_cases(draw):
    num_weights = draw(st.integers(1, 60))
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(0, 9), min_size=ndim, max_size=ndim)))
    if draw(st.booleans()):  # sometimes one long axis, for runs over several tiles
        shape = (*shape[:-1], draw(st.integers(30, 300)))
    d = draw(st.integers(0, 9))
    dtype = draw(st.sampled_from(GRAD_DTYPES))
    index_dtype = draw(st.sampled_from(INDEX_DTYPES))
    dist = draw(st.sampled_from(list(INDEX_GENERATORS)))
    padding_idx = draw(st.one_of(st.none(), st.integers(-num_weights, num_weights - 1)))
    scale = draw(st.booleans())
    seed = draw(st.integers(0, 2**31 - 1))
    return num_weights, shape, d, dtype, index_dtype, dist, padding_idx, scale, seed


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(embedding_cases())
def test_property_matches_references(case):
    num_weights, shape, d, dtype, index_dtype, dist, padding_idx, scale, seed = case
    gen = make_generator(seed)
    indices = INDEX_GENERATORS[dist](shape, num_weights, gen, dtype=index_dtype)
    grad = random_grad((*shape, d), dtype, gen)
    rows, row_grads, count = check_sparse(grad, indices, num_weights, padding_idx, scale)
    if d > 0:
        check_against_fp64(grad, indices, num_weights, padding_idx, scale,
                           out=scatter(rows, row_grads, count, num_weights))
    again = sparse_op(grad, indices, num_weights, -1 if padding_idx is None else padding_idx, scale)
    for x, y, name in zip(again, (rows, row_grads, count), ("rows", "row_grads", "count")):
        assert_bitwise_equal(x, y, f"repeat {name}")


# --------------------------------------------------------------------------------------------------------
# torch tooling: opcheck, fake kernel, make_fx
# --------------------------------------------------------------------------------------------------------


def _opcheck_cases():
    g = make_generator(4321)
    yield (random_grad((6, 5), torch.float32, g), uniform_indices(6, 9, g), 9, -1, False)
    yield (random_grad((3, 4, 8), torch.float16, g), zipf_indices((3, 4), 20, g, torch.int32), 20, 2, True)
    yield (random_grad((2, 3, 70, 3), torch.bfloat16, g), hot_row_indices((2, 3, 70), 11, g), 11, -2, True)
    yield (random_grad((0, 4), torch.float64, g), torch.empty(0, dtype=torch.int32), 3, -1, False)
    yield (random_grad((5, 1), torch.float64, g), uniform_indices(5, 4, g), 4, 3, False)


@pytest.mark.parametrize("args", list(_opcheck_cases()), ids=lambda a: f"{a[0].dtype}-{tuple(a[0].shape)}")
def test_opcheck(args):
    torch.library.opcheck(sparse_op.default, args)


def test_fake_kernel_shapes_and_checks():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        grad = torch.empty(7, 3, 5, dtype=torch.bfloat16)
        indices = torch.empty(7, 3, dtype=torch.int32)
        for num_weights, u in ((11, 11), (100, 21)):
            rows, row_grads, count = sparse_op(grad, indices, num_weights, -1, True)
            assert rows.shape == (u,) and rows.dtype == torch.int64
            assert row_grads.shape == (u, 5) and row_grads.dtype == torch.bfloat16
            assert count.shape == () and count.dtype == torch.int64
        with pytest.raises(ValueError, match="plus one trailing dimension"):
            sparse_op(grad, torch.empty(7, dtype=torch.int64), 11, -1, False)
        with pytest.raises(TypeError, match="indices must be int32 or int64"):
            sparse_op(grad, indices.float(), 11, -1, False)
    rows, row_grads, count = sparse_op(torch.empty(4, 2, device="meta"), torch.empty(4, dtype=torch.int64, device="meta"),
                                       6, -1, False)
    assert rows.device.type == "meta" and rows.shape == (4,) and row_grads.shape == (4, 2) and count.shape == ()


@pytest.mark.parametrize("tracing_mode", ["real", "fake", "symbolic"])
def test_make_fx_traces_the_op(tracing_mode, gen):
    def f(grad, indices):
        rows, row_grads, count = torch.ops.graphsafe.embedding_backward_sparse(grad, indices, 13, -2, True)
        return rows, row_grads * 2, count

    grad = random_grad((4, 6, 3), torch.float32, gen)
    indices = zipf_indices((4, 6), 13, gen)
    gm = make_fx(f, tracing_mode=tracing_mode)(grad, indices)
    targets = [str(node.target) for node in gm.graph.nodes if node.op == "call_function"]
    assert any("graphsafe.embedding_backward_sparse" in t for t in targets), targets
    for x, y, name in zip(gm(grad, indices), f(grad, indices), ("rows", "row_grads", "count")):
        assert_bitwise_equal(x, y, f"traced {name}")


def test_torch_fx_symbolic_trace_keeps_the_op(gen):
    def f(grad, indices):
        return torch.ops.graphsafe.embedding_backward_sparse(grad, indices, 20, -1, False)

    gm = torch.fx.symbolic_trace(f)
    assert any(node.target is torch.ops.graphsafe.embedding_backward_sparse for node in gm.graph.nodes)
    grad, indices = random_grad((30, 4), torch.float16, gen), uniform_indices(30, 20, gen)
    for x, y in zip(gm(grad, indices), f(grad, indices)):
        assert_bitwise_equal(x, y)


def test_fresh_interpreter_outside_the_source_tree(tmp_path):
    """How users meet it: import graphsafe in a new process, from a directory with no sources in it."""
    script = r"""
import torch, graphsafe
assert "embedding_backward_sparse" in graphsafe.ops.__all__
grad = torch.arange(12, dtype=torch.float32).reshape(4, 3)
rows, row_grads, count = graphsafe.ops.embedding_backward_sparse(grad, torch.tensor([3, 1, 3, 0]), 5, padding_idx=0)
assert rows.tolist() == [1, 3, -1, -1] and int(count) == 2, (rows, count)
assert row_grads.tolist() == [[3, 4, 5], [0 + 6, 1 + 7, 2 + 8], [0, 0, 0], [0, 0, 0]], row_grads
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0 and "ok" in done.stdout, done.stdout + done.stderr
