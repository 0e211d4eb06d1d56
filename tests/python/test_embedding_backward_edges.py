"""CPU tests of graphsafe's embedding backward (torch.ops.graphsafe.embedding_backward) at the edges: empty
indices, D of 1 and 0, 0-d indices, untouched and padding rows, negative padding_idx, scale_grad_by_freq, both
index dtypes, the largest row indices.
"""

from __future__ import annotations

import pytest
import torch

from conftest import (
    GRAD_DTYPES,
    assert_bitwise_equal,
    random_grad,
    uniform_indices,
    zipf_indices,
)
from embedding_backward_helpers import check_against_fp64, documented_order_reference, run_op, wide_range_grad


# --------------------------------------------------------------------------------------------------------
# Shapes at the edges
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=str)
@pytest.mark.parametrize("index_shape", [(0,), (0, 4), (3, 0, 2)], ids=str)
def test_empty_indices_give_zeros(dtype, index_shape):
    for d in (1, 7):
        grad = torch.empty((*index_shape, d), dtype=dtype)
        indices = torch.empty(index_shape, dtype=torch.int64)
        for scale in (False, True):
            out = run_op(grad, indices, 9, 2, scale)
            assert_bitwise_equal(out, torch.zeros(9, d, dtype=dtype), "empty indices")
    out = run_op(torch.empty(0, 3, dtype=dtype), torch.empty(0, dtype=torch.int32), 0)
    assert out.shape == (0, 3) and out.dtype == dtype


@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=str)
def test_dim_one(dtype, gen):
    indices = zipf_indices(2000, 50, gen)
    grad = random_grad((2000, 1), dtype, gen)
    out = check_against_fp64(grad, indices, 50, None, False)
    assert out.shape == (50, 1)
    if dtype != torch.float64:
        assert_bitwise_equal(out, documented_order_reference(grad, indices, 50))


def test_dim_zero(gen):
    indices = uniform_indices(10, 4, gen)
    out = run_op(torch.empty(10, 0), indices, 4)
    assert out.shape == (4, 0)


def test_zero_dim_indices(gen):
    """indices of shape () with grad of shape (D,) is one lookup."""
    grad = random_grad((5,), torch.float32, gen)
    out = run_op(grad, torch.tensor(3), 6)
    expected = torch.zeros(6, 5)
    expected[3] = grad
    assert_bitwise_equal(out, expected)


@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=str)
def test_untouched_and_padding_rows_exactly_zero(dtype, gen):
    num_weights = 1000
    indices = uniform_indices(500, 100, gen) * 3  # rows that are multiples of 3 below 300 only
    indices[::5] = 0
    grad = random_grad((500, 9), dtype, gen, scale=100.0)  # large values: any leak would be visible
    for scale in (False, True):
        out = run_op(grad, indices, num_weights, 0, scale)
        touched = torch.zeros(num_weights, dtype=torch.bool)
        touched[indices] = True
        touched[0] = False  # padding
        zeros = torch.zeros_like(out[~touched])
        assert_bitwise_equal(out[~touched], zeros, "untouched and padding rows")
        assert (out[touched] != 0).any(dim=1).all()


def test_negative_padding_counts_from_end(gen):
    num_weights = 10
    indices = torch.arange(10).repeat(3)
    grad = random_grad((30, 2), torch.float32, gen)
    for padding_idx, row in [(-2, 8), (-10, 0), (9, 9), (0, 0)]:
        out = run_op(grad, indices, num_weights, padding_idx)
        assert_bitwise_equal(out[row], torch.zeros(2), f"padding_idx={padding_idx}")
        others = [r for r in range(10) if r != row]
        assert (out[others] != 0).all()
    # -1 means none: every row gets its gradient.
    assert (run_op(grad, indices, num_weights, -1) != 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_scale_grad_by_freq_divides_by_contributing_count(dtype):
    # Row 1 occurs 4 times, row 2 once; the padding row's occurrences count for nothing.
    grad = torch.tensor([[4.0], [2.0], [1.0], [8.0], [1.0], [3.0], [5.0]], dtype=dtype)
    indices = torch.tensor([1, 1, 0, 1, 2, 1, 0])
    out = run_op(grad, indices, 3, 0, True)
    assert out[:, 0].tolist() == [0.0, (4 + 2 + 8 + 3) / 4, 1.0]


def test_int32_and_int64_indices_agree(gen):
    indices = zipf_indices((30, 40), 200, gen)
    grad = wide_range_grad((30, 40, 6), torch.float32, gen)
    a = run_op(grad, indices.to(torch.int32), 200, 5, True)
    b = run_op(grad, indices.to(torch.int64), 200, 5, True)
    assert_bitwise_equal(a, b)


def test_largest_int32_row_index_is_accepted():
    """Row indices near the top of the sorting key range (num_weights up to 2^31 - 2)."""
    num_weights = 2**20 + 3
    indices = torch.tensor([num_weights - 1, 0, num_weights - 1], dtype=torch.int32)
    grad = torch.tensor([[1.0], [2.0], [3.0]])
    out = run_op(grad, indices, num_weights)
    assert out[num_weights - 1, 0].item() == 4.0 and out[0, 0].item() == 2.0
    assert int((out != 0).sum()) == 2
