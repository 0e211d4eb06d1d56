"""CPU tests of the bits of graphsafe's embedding backward (torch.ops.graphsafe.embedding_backward).

Contract under test (include/graphsafe/embedding.h, DESIGN.md "Embedding backward"):
  out[r] = sum of grad[i] over positions i with indices[i] == r, dense [num_weights, D] in grad's dtype.
  The contributing occurrences are sorted by (row, position), so each row owns a run [s, e) of sorted
  positions; sorted positions are cut into aligned tiles of 32 and tiles into aligned groups of 32 tiles.
  A row inside one tile is the sum of its occurrences; a row spanning tiles of one group the sum of its
  per-tile sums; a row spanning groups the sum of its per-group sums. Every sum runs left to right from +0
  in fp32 (fp64 for fp64); then an optional division by the count and one rounding to grad's dtype.
  Padding rows and untouched rows are zero. Bad input raises a clear error before anything is returned
  (test_embedding_backward_errors.py).

Checked here:
  * bitwise against an independent sequential implementation of the documented order
    (embedding_backward_helpers.documented_order_reference): pins the bitwise contract that the CUDA backend
    must also meet;
  * bitwise repeatability and metamorphic checks (the bits depend only on the sorted (row, position) runs);
  * the canonical NaN encoding of NaN results.
The float64 reference checks are in test_embedding_backward_accuracy.py.
"""

from __future__ import annotations

import math
from collections import defaultdict

import pytest
import torch

from conftest import (
    TILE,
    GRAD_DTYPES,
    INDEX_DTYPES,
    INDEX_GENERATORS,
    assert_bitwise_equal,
    hot_row_indices,
    zipf_indices,
)
from embedding_backward_helpers import documented_order_reference, run_op, wide_range_grad


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


@pytest.mark.parametrize("dtype, dim, num_weights", [(torch.float32, 131, 9000), (torch.bfloat16, 1024, 20000)],
                         ids=["fp32-4.7MB", "bf16-41MB"])
def test_large_outputs_written_once(dtype, dim, num_weights, gen):
    """Dense outputs of 4 MB and more are written once, each row its sum or zeros, with streaming stores where their
    memory was used before and plain ones where it is fresh (src/embedding/cpu.cpp): zeros at both ends, between
    touched rows and at the padding row, sums as documented, on memory that held NaN just before (a block freed
    before the call, which the allocator hands out again) as on fresh memory. fp32 D=131: rows of 524 bytes, so
    the streamed rows start off 16-byte boundaries."""
    padding = 2
    touched = torch.tensor([1, 2, 3, num_weights // 2, num_weights // 2 + 1, num_weights - 2])
    touched = torch.cat([touched, torch.randint(5, num_weights - 5, (200,), generator=gen)])
    indices = touched[torch.randint(0, touched.numel(), (3000,), generator=gen)]
    grad = wide_range_grad((3000, dim), dtype, gen)
    expected = documented_order_reference(grad, indices, num_weights, padding)
    for _ in range(3):
        torch.full((num_weights, dim), float("nan"), dtype=dtype)  # freed at once: its block may be the output's
        out = run_op(grad, indices, num_weights, padding)
        assert_bitwise_equal(out, expected, "large output")
        del out


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
# NaN results
# --------------------------------------------------------------------------------------------------------


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
