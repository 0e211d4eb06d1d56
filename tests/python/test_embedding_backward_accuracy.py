"""CPU tests of graphsafe's embedding backward (torch.ops.graphsafe.embedding_backward) against
aten.embedding_dense_backward in float64, within an error bound derived from the accumulation
(conftest.fp64_reference_and_bound explains it): catches wrong sums / wrong rows / wrong scaling. A property test
draws random cases and checks them against that reference and, bitwise, against the documented order
(test_embedding_backward_order.py states the contract).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import (
    GRAD_DTYPES,
    INDEX_DTYPES,
    INDEX_GENERATORS,
    assert_bitwise_equal,
    make_generator,
    normalise_padding_idx,
    random_grad,
    uniform_indices,
)
from embedding_backward_helpers import check_against_fp64, documented_order_reference, run_op


def indices_with_counts(counts, num_weights, generator, dtype=torch.int64):
    """Indices in which row rows[k] occurs counts[k] times, positions shuffled; rows chosen at random."""
    rows = torch.randperm(num_weights, generator=generator)[: len(counts)]
    flat = torch.cat([torch.full((c,), int(r), dtype=torch.int64) for r, c in zip(rows, counts)])
    flat = flat[torch.randperm(flat.numel(), generator=generator)]
    return flat.to(dtype), rows


# --------------------------------------------------------------------------------------------------------
# Against the float64 aten reference
# --------------------------------------------------------------------------------------------------------

# (distribution, index shape, num_weights, D). Sizes chosen so that the rows cover: single occurrences,
# counts around a tile (32), hundreds (zipf head), and > 1024 (hot rows, spanning tile groups).
SHAPE_CASES = {
    "uniform": [((3000,), 100, 5), ((40, 75), 150, 16), ((6, 20, 25), 97, 3)],
    "zipf": [((3000,), 500, 8), ((50, 60), 1000, 5), ((5, 12, 50), 300, 1)],
    "hot": [((2600,), 50, 4), ((52, 50), 64, 7), ((4, 25, 26), 40, 9)],
}


def _padding_for(choice, indices, num_weights):
    """None, the most frequent row (positive), or -2 (num_weights - 2, made to occur)."""
    if choice == "none":
        return None, indices
    if choice == "positive":
        return int(torch.mode(indices.reshape(-1).long()).values), indices
    flat = indices.reshape(-1).clone()
    flat[::7] = num_weights - 2  # make sure the row -2 stands for occurs, often
    return -2, flat.reshape(indices.shape)


@pytest.mark.parametrize("scale", [False, True], ids=["sum", "scaled"])
@pytest.mark.parametrize("padding", ["none", "positive", "neg2"])
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES, ids=str)
@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=str)
@pytest.mark.parametrize("dist", list(SHAPE_CASES))
def test_matches_fp64_reference(dist, dtype, index_dtype, padding, scale, gen):
    for shape, num_weights, d in SHAPE_CASES[dist]:
        indices = INDEX_GENERATORS[dist](shape, num_weights, gen, dtype=index_dtype)
        padding_idx, indices = _padding_for(padding, indices, num_weights)
        grad = random_grad((*shape, d), dtype, gen)
        out = check_against_fp64(grad, indices, num_weights, padding_idx, scale)
        if padding_idx is not None:
            pad_row = normalise_padding_idx(padding_idx, num_weights)
            assert (indices == pad_row).any()
            assert_bitwise_equal(out[pad_row], torch.zeros_like(out[pad_row]), "padding row")


def test_shape_cases_cover_long_rows(gen):
    """The cases above really produce rows of > 32 occurrences (zipf head, uniform around 32) and of
    > 1024 occurrences (hot rows, which span tile groups)."""
    def max_counts(dist):
        return [
            int(torch.bincount(INDEX_GENERATORS[dist](shape, v, gen).reshape(-1)).max())
            for shape, v, _ in SHAPE_CASES[dist]
        ]

    assert all(c > 1024 for c in max_counts("hot"))
    assert all(c > 32 for c in max_counts("zipf"))
    counts = torch.bincount(uniform_indices(3000, 100, gen))
    assert counts.max() > 32 and counts.min() < 32


@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=str)
def test_very_long_rows_fp64_reference(dtype, gen):
    """Rows of 1024 + a few and ~5000 occurrences, interleaved with short rows."""
    indices, _ = indices_with_counts([1025, 5003, 33, 1, 64], 20, gen)
    grad = random_grad((indices.numel(), 6), dtype, gen)
    for scale in (False, True):
        check_against_fp64(grad, indices, 20, None, scale)


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
    d = draw(st.integers(1, 9))
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
    out = check_against_fp64(grad, indices, num_weights, padding_idx, scale)
    assert_bitwise_equal(out, documented_order_reference(grad, indices, num_weights, padding_idx, scale))
    assert_bitwise_equal(run_op(grad, indices, num_weights, padding_idx, scale), out, "repeat")
