"""CPU tests of graphsafe's embedding backward (torch.ops.graphsafe.embedding_backward).

Contract under test (include/graphsafe/embedding.h, DESIGN.md "Embedding backward"):
  out[r] = sum of grad[i] over positions i with indices[i] == r, dense [num_weights, D] in grad's dtype.
  The contributing occurrences are sorted by (row, position), so each row owns a run [s, e) of sorted
  positions; sorted positions are cut into aligned tiles of 32 and tiles into aligned groups of 32 tiles.
  A row inside one tile is the sum of its occurrences; a row spanning tiles of one group the sum of its
  per-tile sums; a row spanning groups the sum of its per-group sums. Every sum runs left to right from +0
  in fp32 (fp64 for fp64); then an optional division by the count and one rounding to grad's dtype.
  Padding rows and untouched rows are zero. Bad input raises a clear error before anything is returned.

Three kinds of numerical checks:
  * against aten.embedding_dense_backward in float64, within an error bound derived from the accumulation
    (conftest.fp64_reference_and_bound explains it): catches wrong sums / wrong rows / wrong scaling;
  * bitwise against an independent sequential implementation of the documented order
    (`documented_order_reference` below): pins the bitwise contract that the CUDA backend must also meet;
  * bitwise repeatability and metamorphic checks (the bits depend only on the sorted (row, position) runs).
"""

from __future__ import annotations

import math
from collections import defaultdict

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.fx.experimental.proxy_tensor import make_fx

import graphsafe
from graphsafe import _C
from conftest import (
    TILE,
    TILE_GROUP,
    GRAD_DTYPES,
    INDEX_DTYPES,
    INDEX_GENERATORS,
    accumulation_dtype,
    assert_bitwise_equal,
    assert_within_bound,
    fp64_reference_and_bound,
    hot_row_indices,
    make_generator,
    normalise_padding_idx,
    random_grad,
    uniform_indices,
    zipf_indices,
)

op = torch.ops.graphsafe.embedding_backward


def run_op(grad, indices, num_weights, padding_idx=None, scale_grad_by_freq=False):
    pad = -1 if padding_idx is None else padding_idx
    return op(grad, indices, num_weights, pad, scale_grad_by_freq)


def check_against_fp64(grad, indices, num_weights, padding_idx, scale, out=None):
    if out is None:
        out = run_op(grad, indices, num_weights, padding_idx, scale)
    assert out.dtype == grad.dtype
    assert out.shape == (num_weights, grad.shape[-1])
    ref, bound = fp64_reference_and_bound(grad, indices, num_weights, padding_idx, scale)
    assert_within_bound(out, ref, bound, f"{grad.dtype} pad={padding_idx} scale={scale}")
    return out


# --------------------------------------------------------------------------------------------------------
# An independent, deliberately plain implementation of the documented reduction order.
# --------------------------------------------------------------------------------------------------------


def documented_order_reference(grad, indices, num_weights, padding_idx=None, scale_grad_by_freq=False):
    """Sequential Python/torch version of the order documented in include/graphsafe/embedding.h.

    Every arithmetic step is a single elementwise torch op on [D]-shaped tensors in the accumulation dtype
    (fp32, or fp64 for fp64): each element is one IEEE operation, rounded to nearest even, exactly what a
    scalar fp32 loop does. Division uses a full tensor (not a Python scalar) so that no kernel can turn it
    into a multiplication by a reciprocal. The final .to(dtype) is a single round-to-nearest-even.

    Sorted positions count contributing occurrences only: occurrences of the padding row are left out
    before positions are numbered. (embedding.h says "the occurrences are sorted"; both backends give the
    padding row's occurrences no sorted position among the real rows — the CPU drops them, CUDA sorts them
    behind every row — and CPU/CUDA agreement needs exactly this reading.)
    """
    d = grad.shape[-1]
    g = grad.reshape(-1, d)
    acc_dtype = accumulation_dtype(grad.dtype)
    pad = normalise_padding_idx(padding_idx, num_weights)

    # (row, position) pairs of the contributing occurrences, sorted; index p in this list = sorted position.
    order = sorted((row, position) for position, row in enumerate(indices.reshape(-1).tolist()) if row != pad)
    runs: dict[int, list[int]] = {}  # row -> [s, e)
    for p, (row, _) in enumerate(order):
        runs.setdefault(row, [p, p])[1] = p + 1

    def zeros():
        return torch.zeros(d, dtype=acc_dtype)  # +0

    def sum_occurrences(first, stop):  # sorted positions [first, stop), left to right from +0
        acc = zeros()
        for p in range(first, stop):
            acc = acc + g[order[p][1]].to(acc_dtype)
        return acc

    def sum_tile_sums(s, e, first_tile, last_tile):  # the row's per-tile sums over tiles [first, last]
        acc = zeros()
        for t in range(first_tile, last_tile + 1):
            acc = acc + sum_occurrences(max(s, t * TILE), min(e, (t + 1) * TILE))
        return acc

    out = torch.zeros(num_weights, d, dtype=grad.dtype)
    for row, (s, e) in runs.items():
        first_tile, last_tile = s // TILE, (e - 1) // TILE
        first_group, last_group = first_tile // TILE_GROUP, last_tile // TILE_GROUP
        if first_tile == last_tile:  # inside one tile
            total = sum_occurrences(s, e)
        elif first_group == last_group:  # tiles of one group
            total = sum_tile_sums(s, e, first_tile, last_tile)
        else:  # several groups: sum of per-group sums, each the sum of the row's tile sums in that group
            total = zeros()
            for u in range(first_group, last_group + 1):
                lo = max(first_tile, u * TILE_GROUP)
                hi = min(last_tile, (u + 1) * TILE_GROUP - 1)
                total = total + sum_tile_sums(s, e, lo, hi)
        if scale_grad_by_freq:
            total = total / torch.full_like(total, float(e - s))
        out[row] = total.to(grad.dtype)
    return out


def row_relative_chunk_order(grad, indices, num_weights):
    """An alternative (wrong) order for the teeth test: each row's occurrences, in position order, in chunks
    of 32 counted from the row's own first occurrence, chunk sums added left to right."""
    d = grad.shape[-1]
    g = grad.reshape(-1, d)
    rows: dict[int, list[int]] = defaultdict(list)
    for position, row in enumerate(indices.reshape(-1).tolist()):
        rows[row].append(position)
    out = torch.zeros(num_weights, d, dtype=grad.dtype)
    for row, positions in rows.items():
        total = torch.zeros(d, dtype=torch.float32)
        for start in range(0, len(positions), TILE):
            acc = torch.zeros(d, dtype=torch.float32)
            for position in positions[start : start + TILE]:
                acc = acc + g[position].float()
            total = total + acc
        out[row] = total.to(grad.dtype)
    return out


def indices_with_counts(counts, num_weights, generator, dtype=torch.int64):
    """Indices in which row rows[k] occurs counts[k] times, positions shuffled; rows chosen at random."""
    rows = torch.randperm(num_weights, generator=generator)[: len(counts)]
    flat = torch.cat([torch.full((c,), int(r), dtype=torch.int64) for r, c in zip(rows, counts)])
    flat = flat[torch.randperm(flat.numel(), generator=generator)]
    return flat.to(dtype), rows


def wide_range_grad(shape, dtype, generator):
    """Values spread over ~2^-10..2^10 with both signs, so that the summation order changes fp32 results."""
    base = torch.randn(shape, generator=generator, dtype=torch.float64)
    exps = torch.randint(-10, 11, shape, generator=generator).to(torch.float64)
    values = base * torch.pow(2.0, exps)
    if dtype == torch.float16:
        values = values.clamp(-60000, 60000)
    return values.to(dtype)


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
# Bitwise against the documented order
# --------------------------------------------------------------------------------------------------------

# Rows 0..9 in increasing id own consecutive runs of sorted positions, so these counts fix the layout:
#   row: count -> run [s, e)       what it exercises
#   0:  5  -> [0, 5)              inside tile 0
#   1: 27  -> [5, 32)             inside a tile, ends exactly at its end
#   2: 32  -> [32, 64)            exactly one aligned tile
#   3: 33  -> [64, 97)            two tiles of group 0
#   4: 100 -> [97, 197)           four tiles, unaligned both ends
#   5: 810 -> [197, 1007)         many tiles, still group 0
#   6: 40  -> [1007, 1047)        two tiles in two groups (crosses sorted position 1024)
#   7: 2100 -> [1047, 3147)       three groups
#   8: 1   -> [3147, 3148)        single occurrence between long rows
#   9: 1024 -> [3148, 4172)       a group's worth of occurrences, not aligned: spans groups 3 and 4
# Positions are shuffled, so each row's occurrences are spread over the input; the padding variants drop a
# row's occurrences from the sorted positions, which shifts the alignment of every later row.
LAYOUT_COUNTS = [5, 27, 32, 33, 100, 810, 40, 2100, 1, 1024]


def layout_indices(generator, dtype=torch.int64, extra_rows=2):
    flat = torch.cat([torch.full((c,), r, dtype=torch.int64) for r, c in enumerate(LAYOUT_COUNTS)])
    flat = flat[torch.randperm(flat.numel(), generator=generator)]
    return flat.to(dtype), len(LAYOUT_COUNTS) + extra_rows


@pytest.mark.parametrize("scale", [False, True], ids=["sum", "scaled"])
@pytest.mark.parametrize("padding", [None, 4, 6, -2], ids=str)
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES, ids=str)
@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=str)
def test_bitwise_documented_order(dtype, index_dtype, padding, scale, gen):
    indices, num_weights = layout_indices(gen, index_dtype)
    if padding == -2:
        indices[::13] = num_weights - 2  # a row above all others: padding occurrences sorted nowhere
    grad = wide_range_grad((indices.numel(), 5), dtype, gen)
    out = run_op(grad, indices, num_weights, padding, scale)
    expected = documented_order_reference(grad, indices, num_weights, padding, scale)
    assert_bitwise_equal(out, expected, "documented order")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("dist", list(INDEX_GENERATORS))
def test_bitwise_documented_order_multidim(dist, dtype, gen):
    shape, num_weights, d = (3, 7, 40), 30, 4
    indices = INDEX_GENERATORS[dist](shape, num_weights, gen)
    grad = wide_range_grad((*shape, d), dtype, gen)
    for scale in (False, True):
        out = run_op(grad, indices, num_weights, None, scale)
        assert_bitwise_equal(out, documented_order_reference(grad, indices, num_weights, None, scale))


def test_documented_order_reference_has_teeth(gen):
    """Sanity check of the check: for a 1100-occurrence row whose run starts at sorted position 5 (not
    tile-aligned) and crosses a group boundary, on wide-range fp32 data, two other plausible orders give
    different bits while the documented one matches. So the bitwise tests would catch a backend that
    used another order."""
    indices = torch.cat([torch.zeros(5, dtype=torch.int64), torch.ones(1100, dtype=torch.int64)])
    indices = indices[torch.randperm(indices.numel(), generator=gen)]
    grad = wide_range_grad((indices.numel(), 16), torch.float32, gen)
    out = run_op(grad, indices, 3)
    assert_bitwise_equal(out, documented_order_reference(grad, indices, 3))
    plain = torch.zeros(16, dtype=torch.float32)
    for i in (indices == 1).nonzero().reshape(-1).tolist():
        plain = plain + grad[i]
    assert not torch.equal(plain, out[1]), "data too benign: a plain sequential sum agrees"
    chunked = row_relative_chunk_order(grad, indices, 3)
    assert not torch.equal(chunked[1], out[1]), "data too benign: row-relative chunks agree"


def test_rounding_edges_fp16_bf16():
    """Single-rounding edge cases, expected bits written out by hand (not via the reference)."""
    # fp16: 32768 + 32736 = 65504 (max finite); 32768 + 32752 = 65520 is the tie with 65536 -> +inf (RNE).
    g16 = torch.tensor([[32768.0], [32736.0], [32768.0], [32752.0]], dtype=torch.float16)
    out = run_op(g16, torch.tensor([0, 0, 1, 1]), 2)
    assert out[0, 0].item() == 65504.0 and out[1, 0].item() == math.inf
    # fp16 subnormals in and out: 2^-24 (smallest subnormal) + 2^-24 = 2^-23, exact; 3 * 2^-25 is not
    # representable... but inputs are fp16, so use 2^-24 * k sums that stay exact.
    tiny = 2.0**-24
    g16 = torch.tensor([[tiny], [tiny], [tiny], [-tiny]], dtype=torch.float16)
    out = run_op(g16, torch.tensor([0, 0, 0, 1]), 2)
    assert out[0, 0].item() == 3 * tiny and out[1, 0].item() == -tiny
    # fp16 subnormal result from scaling: (2^-24) / 2 = 2^-25 is a tie between 0 and 2^-24 -> 0 (even);
    # (3 * 2^-24) / 2 = 1.5 * 2^-24 -> 2 * 2^-24 (even).
    g16 = torch.tensor([[tiny], [-tiny], [tiny], [2 * tiny], [0.0]], dtype=torch.float16)
    out = run_op(g16, torch.tensor([0, 0, 1, 1, 0]), 2, None, True)
    assert out[0, 0].item() == 0.0  # (tiny - tiny + 0) / 3 = 0
    assert out[1, 0].item() == 2 * tiny
    g16 = torch.tensor([[tiny], [0.0]], dtype=torch.float16)
    out = run_op(g16, torch.tensor([0, 0]), 1, None, True)
    assert out[0, 0].item() == 0.0  # 2^-25 ties to even (0)
    # bf16 (8 significant bits): 1 + 2^-8 is the tie between 1 and 1 + 2^-7 -> 1 (even);
    # 1 + 2^-7 + 2^-8 is the tie between 1 + 2^-7 and 1 + 2^-6 -> 1 + 2^-6 (even).
    gb = torch.tensor([[1.0], [2.0**-8], [1.0 + 2.0**-7], [2.0**-8]], dtype=torch.bfloat16)
    out = run_op(gb, torch.tensor([0, 0, 1, 1]), 2)
    assert out[0, 0].item() == 1.0 and out[1, 0].item() == 1.0 + 2.0**-6
    # The fp32 accumulator is what is rounded, not a running bf16 sum: 256 + 1 + 1 in bf16 steps would stay
    # 256 (each +1 is a tie to even), but in fp32 it is 258, which bf16 represents.
    gb = torch.tensor([[256.0], [1.0], [1.0]], dtype=torch.bfloat16)
    out = run_op(gb, torch.tensor([0, 0, 0]), 1)
    assert out[0, 0].item() == 258.0


def test_signed_zero_sums_start_from_plus_zero():
    """A row whose gradients are all -0.0 sums (from +0) to +0.0; the bits must say so."""
    for dtype in GRAD_DTYPES:
        grad = torch.full((3, 2), -0.0, dtype=dtype)
        out = run_op(grad, torch.tensor([1, 1, 1]), 2)
        assert_bitwise_equal(out, torch.zeros(2, 2, dtype=dtype), f"{dtype} signed zero")
        # A single -0.0 occurrence too (a one-element sum still starts from +0).
        out = run_op(grad[:1], torch.tensor([0]), 1)
        assert_bitwise_equal(out, torch.zeros(1, 2, dtype=dtype), f"{dtype} single signed zero")


# --------------------------------------------------------------------------------------------------------
# Repeatability and metamorphic properties
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=str)
def test_bitwise_repeatable(dtype, gen):
    indices = zipf_indices((20, 300), 700, gen)
    grad = wide_range_grad((20, 300, 24), dtype, gen)
    for scale in (False, True):
        first = run_op(grad, indices, 700, 3, scale)
        second = run_op(grad, indices, 700, 3, scale)
        assert_bitwise_equal(first, second, "second call")


def test_result_independent_of_thread_count(gen):
    indices = hot_row_indices(20000, 300, gen, num_hot=40)
    grad = wide_range_grad((20000, 33), torch.float32, gen)
    reference = run_op(grad, indices, 300)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = run_op(grad, indices, 300)
    finally:
        torch.set_num_threads(previous)
    assert_bitwise_equal(single, reference, "one thread")


def test_result_fixed_by_sorted_runs(gen):
    """The order depends only on the sorted (row, position) list: so
    (a) moving occurrences around while keeping each row's own occurrences in the same relative order,
    (b) inserting occurrences of the padding row anywhere, and
    (c) adding occurrences of a row above every existing row (they sort behind all of them)
    leave the bits of every existing row unchanged."""
    num_weights, d, pad = 40, 6, 30
    indices, _ = layout_indices(gen)  # rows 0..9
    grad = wide_range_grad((indices.numel(), d), torch.float32, gen)
    base = run_op(grad, indices, num_weights, pad)
    n = indices.numel()

    # (a) a random interleaving that keeps every row's occurrences in order
    keys = torch.rand(n, generator=gen)
    for row in range(len(LAYOUT_COUNTS)):
        where = (indices == row).nonzero().reshape(-1)
        keys[where] = keys[where].sort().values
    perm = keys.argsort()
    moved = run_op(grad[perm].contiguous(), indices[perm].contiguous(), num_weights, pad)
    assert_bitwise_equal(moved, base, "re-interleaved occurrences")

    def insert(extra_rows):
        m = extra_rows.numel()
        is_extra = torch.zeros(n + m, dtype=torch.bool)
        is_extra[torch.randperm(n + m, generator=gen)[:m]] = True
        mixed_idx = torch.empty(n + m, dtype=torch.int64)
        mixed_grad = torch.empty(n + m, d)
        mixed_idx[~is_extra], mixed_grad[~is_extra] = indices, grad
        mixed_idx[is_extra], mixed_grad[is_extra] = extra_rows, wide_range_grad((m, d), torch.float32, gen)
        return mixed_grad, mixed_idx

    # (b) padding occurrences anywhere
    mixed_grad, mixed_idx = insert(torch.full((700,), pad, dtype=torch.int64))
    assert_bitwise_equal(run_op(mixed_grad, mixed_idx, num_weights, pad), base, "with padding occurrences")

    # (c) rows above all existing ones (and padding) anywhere
    extra = torch.randint(20, num_weights, (900,), generator=gen)
    mixed_grad, mixed_idx = insert(extra)
    mixed = run_op(mixed_grad, mixed_idx, num_weights, pad)
    assert_bitwise_equal(mixed[:20], base[:20], "rows below the inserted ones")
    assert_bitwise_equal(mixed, documented_order_reference(mixed_grad, mixed_idx, num_weights, pad), "all rows")


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


def test_nan_results_use_the_canonical_encoding():
    """NaN results are written as one NaN encoding (so CPU and CUDA agree bitwise): 0x7fc00000 in fp32,
    0x7e00 in fp16, 0x7fc0 in bf16, whichever NaN the arithmetic produced (NaN input or inf - inf)."""
    canonical = {torch.float32: (torch.int32, 0x7FC00000), torch.float16: (torch.int16, 0x7E00),
                 torch.bfloat16: (torch.int16, 0x7FC0)}
    for dtype, (int_dtype, bits) in canonical.items():
        grad = torch.ones(4, 2, dtype=dtype)
        grad[0, 0] = float("nan")
        grad[1, 1] = float("inf")
        grad[2, 1] = float("-inf")
        out = torch.ops.graphsafe.embedding_backward(grad, torch.tensor([0, 1, 1, 2]), 3, -1, False)
        assert out[0, 0].isnan() and out[1, 1].isnan()
        assert out.view(int_dtype)[0, 0].item() & 0xFFFFFFFF == bits
        assert out.view(int_dtype)[1, 1].item() & 0xFFFFFFFF == bits
