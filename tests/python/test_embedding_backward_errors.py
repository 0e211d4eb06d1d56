"""Bad input to graphsafe's embedding backward (torch.ops.graphsafe.embedding_backward) on the CPU raises a clear
error before anything is returned: wrong dtypes, shapes, layouts, devices, padding_idx, num_weights and
out-of-range indices; a failed call writes nothing and leaves no state.
"""

from __future__ import annotations

import pytest
import torch

import graphsafe
from graphsafe import _C
from conftest import (
    INDEX_DTYPES,
    assert_bitwise_equal,
    random_grad,
    uniform_indices,
)
from embedding_backward_helpers import op, run_op


# --------------------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------------------


def _ok_args():
    grad = torch.randn(4, 3)
    indices = torch.tensor([0, 1, 2, 1])
    return grad, indices


@pytest.mark.parametrize(
    "grad_dtype", [torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64], ids=str
)
def test_wrong_grad_dtype(grad_dtype):
    grad, indices = _ok_args()
    with pytest.raises(TypeError, match=r"grad must be float32, float16, bfloat16 or float64, got torch\."):
        op(grad.to(grad_dtype), indices, 5, -1, False)


@pytest.mark.parametrize("index_dtype", [torch.float32, torch.int16, torch.uint8, torch.int8], ids=str)
def test_wrong_index_dtype(index_dtype):
    grad, indices = _ok_args()
    with pytest.raises(TypeError, match=r"indices must be int32 or int64, got " + str(index_dtype)):
        op(grad, indices.to(index_dtype), 5, -1, False)


@pytest.mark.parametrize(
    "grad_shape,index_shape",
    [((4, 3), (5,)), ((4, 3), (4, 1)), ((2, 2, 3), (4,)), ((4,), (4,)), ((4, 3), ())],
    ids=str,
)
def test_shape_mismatch(grad_shape, index_shape):
    grad = torch.randn(grad_shape)
    indices = torch.zeros(index_shape, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"must be indices shape .* plus one trailing dimension D"):
        op(grad, indices, 5, -1, False)


def test_zero_dim_grad():
    with pytest.raises(ValueError, match="0-d"):
        op(torch.tensor(1.0), torch.tensor(0), 5, -1, False)


def test_non_contiguous_grad():
    grad = torch.randn(3, 4).t()  # [4, 3], not contiguous
    with pytest.raises(ValueError, match="contiguous"):
        op(grad, torch.tensor([0, 1, 2, 1]), 5, -1, False)
    grad = torch.randn(4, 6)[:, ::2]  # strided last dim
    with pytest.raises(ValueError, match="contiguous"):
        op(grad, torch.tensor([0, 1, 2, 1]), 5, -1, False)


def test_non_contiguous_indices():
    grad = torch.randn(4, 3)
    with pytest.raises(ValueError, match="contiguous"):
        op(grad, torch.arange(8)[::2], 5, -1, False)
    with pytest.raises(ValueError, match="contiguous"):
        op(torch.randn(2, 2, 3), torch.zeros(2, 2, dtype=torch.int64).t(), 5, -1, False)


def test_sparse_grad_rejected():
    grad = torch.randn(4, 3).to_sparse()
    with pytest.raises(TypeError, match="dense"):
        op(grad, torch.tensor([0, 1, 2, 1]), 5, -1, False)


def test_mismatched_devices():
    """Only meta vs cpu can be tried without a GPU; the check runs in the real and the fake kernel."""
    grad, indices = _ok_args()
    with pytest.raises(ValueError, match="grad is on meta but indices are on cpu"):
        op(grad.to("meta"), indices, 5, -1, False)
    with pytest.raises(ValueError, match="grad is on cpu but indices are on meta"):
        op(grad, indices.to("meta"), 5, -1, False)


@pytest.mark.parametrize("num_weights", [1, 5, 100])
@pytest.mark.parametrize("which", ["num_weights", "num_weights+7", "-num_weights-1", "-num_weights-2"])
def test_padding_idx_out_of_range(num_weights, which):
    """Valid padding_idx: -1 (none) or [-num_weights, num_weights) as in torch.nn.Embedding. In particular
    -num_weights-1 is out of range; it must not be read as -1 ("no padding") after adding num_weights."""
    bad = {
        "num_weights": num_weights,
        "num_weights+7": num_weights + 7,
        "-num_weights-1": -num_weights - 1,
        "-num_weights-2": -num_weights - 2,
    }[which]
    grad, indices = _ok_args()
    indices = indices.clamp(max=num_weights - 1)
    with pytest.raises(ValueError, match=rf"padding_idx {bad} is out of range for {num_weights} rows"):
        op(grad, indices, num_weights, bad, False)


def test_padding_idx_bounds_accepted():
    grad, indices = _ok_args()
    for ok in (-1, -5, 0, 4):
        op(grad, indices, 5, ok, False)


def test_negative_num_weights():
    grad, indices = _ok_args()
    with pytest.raises(ValueError, match="num_weights must be >= 0, got -3"):
        op(grad, indices, -3, -1, False)


def test_num_weights_too_large():
    with pytest.raises(ValueError, match=r"num_weights must be < 2\^31 - 1"):
        op(torch.empty(0, 0), torch.empty(0, dtype=torch.int64), 2**31, -1, False)


@pytest.mark.parametrize("index_dtype", INDEX_DTYPES, ids=str)
@pytest.mark.parametrize(
    "bad_value,position", [(5, 3), (6, 0), (-1, 2), (-3, 3), (2**31 - 1, 1), (-(2**31), 0)], ids=str
)
def test_out_of_range_index_cpu(index_dtype, bad_value, position):
    grad = torch.randn(4, 3)
    indices = torch.tensor([0, 1, 2, 1], dtype=torch.int64)
    indices[position] = bad_value
    indices = indices.to(index_dtype)
    with pytest.raises(IndexError) as info:
        op(grad, indices, 5, -1, False)
    assert not isinstance(info.value, graphsafe.DeviceIndexError)
    message = str(info.value)
    assert f"index {bad_value} " in message and f"position {position}" in message and "5 rows" in message


def test_out_of_range_index_int64_beyond_int32():
    grad = torch.randn(3, 2)
    with pytest.raises(IndexError, match=r"index 1099511627776 at position 2 .* 7 rows"):
        op(grad, torch.tensor([0, 1, 2**40]), 7, -1, False)


def test_out_of_range_index_rejected_even_if_padding_or_empty_rows():
    """An out-of-range index is an error whatever the options: padding_idx=-1 does not make index -1 legal,
    scale_grad_by_freq does not matter, and D == 0 still checks the indices."""
    grad = torch.randn(3, 2)
    with pytest.raises(IndexError, match="index -1 at position 1"):
        op(grad, torch.tensor([0, -1, 1]), 4, -1, True)
    with pytest.raises(IndexError, match="index 4 at position 0"):
        op(torch.empty(3, 0), torch.tensor([4, 0, 1]), 4, -1, False)
    with pytest.raises(IndexError, match="index 0 at position 0 is out of range for an embedding with 0 rows"):
        op(torch.empty(1, 2), torch.tensor([0]), 0, -1, False)


def test_failed_call_returns_nothing_and_leaves_no_state(gen):
    """The op raises before returning, and a following good call is unaffected."""
    grad = random_grad((100, 4), torch.float32, gen)
    indices = uniform_indices(100, 10, gen)
    good = run_op(grad, indices, 10)
    bad = indices.clone()
    bad[-1] = 10
    result = None
    with pytest.raises(IndexError):
        result = run_op(grad, bad, 10)
    assert result is None
    assert_bitwise_equal(run_op(grad, indices, 10), good, "call after a failure")


@pytest.mark.parametrize("bad_position", [0, 57, 99])
def test_failed_call_writes_nothing_to_output(bad_position, gen):
    """The C++ CPU backend checks every index before writing: an output buffer handed to the core directly
    keeps its previous contents (sentinel NaNs) when an index is out of range (embedding.h)."""
    n, d, num_weights = 100, 4, 10
    grad = random_grad((n, d), torch.float32, gen)
    indices = uniform_indices(n, num_weights, gen)
    indices[bad_position] = num_weights + 2
    out = torch.full((num_weights, d), float("nan"))
    ws_bytes = _C.embedding_backward_workspace_bytes("cpu", 0, "float32", n, d, num_weights)
    workspace = torch.zeros(max(ws_bytes, 1), dtype=torch.uint8)
    with pytest.raises(IndexError, match=f"index {num_weights + 2} at position {bad_position}"):
        _C.embedding_backward_dense(
            "cpu", 0, 0, out.data_ptr(), grad.data_ptr(), "float32", indices.data_ptr(), "int64",
            n, d, num_weights, -1, False, workspace.data_ptr(), ws_bytes,
        )
    assert torch.isnan(out).all(), "the failed call wrote into its output"
