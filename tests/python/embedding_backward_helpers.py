"""Helpers of the embedding-backward tests (test_embedding_backward_*.py, test_embedding_cuda_small_path.py): the op
and a call of it with default options, the check against aten's float64 reference within the derived error bound,
an independent sequential implementation of the documented reduction order, gradients whose summation order shows
in the bits, buffers with canaries around them (CUDA tests of what a kernel writes out of bounds), and large cases
whose runs cross every kind of boundary of the order.
"""

from __future__ import annotations

import torch

from conftest import (
    TILE,
    TILE_GROUP,
    accumulation_dtype,
    assert_within_bound,
    fp64_reference_and_bound,
    normalise_padding_idx,
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


def wide_range_grad(shape, dtype, generator):
    """Values spread over ~2^-10..2^10 with both signs, so that the summation order changes fp32 results."""
    base = torch.randn(shape, generator=generator, dtype=torch.float64)
    exps = torch.randint(-10, 11, shape, generator=generator).to(torch.float64)
    values = base * torch.pow(2.0, exps)
    if dtype == torch.float16:
        values = values.clamp(-60000, 60000)
    return values.to(dtype)


CANARY_BYTES = 512
CANARY = 0xA5


class Canaried:
    """A [numel] dtype view with CANARY_BYTES of 0xA5 on each side (its own bytes start as 0xA5 too, so anything
    left unwritten also shows). The offset keeps the view 256-byte aligned, as the CUDA workspace must be."""

    def __init__(self, numel, dtype, device="cuda"):
        self.nbytes = numel * dtype.itemsize
        self.buffer = torch.full((self.nbytes + 2 * CANARY_BYTES,), CANARY, dtype=torch.uint8, device=device)
        self.view = self.buffer[CANARY_BYTES:CANARY_BYTES + self.nbytes].view(dtype)

    def intact(self):
        return bool((self.buffer[:CANARY_BYTES] == CANARY).all()) and bool(
            (self.buffer[CANARY_BYTES + self.nbytes:] == CANARY).all())


def multi_tile_item_case(rows: int, dim: int, dtype: torch.dtype, seed: int):
    """Indices whose runs cross tile, level-1 item and group boundaries at every offset (half the rows short, 1-40
    occurrences; most others 20-100; a few up to 5000; 5% never occur; about 150 occurrences per row), and a
    standard-normal gradient for them, made on the GPU (hundreds of millions of elements), returned on the CPU."""
    gen = torch.Generator().manual_seed(seed)
    kind = torch.rand(rows, generator=gen)
    lengths = torch.where(
        kind < 0.5,
        torch.randint(1, 41, (rows,), generator=gen),
        torch.where(kind < 0.95, torch.randint(20, 101, (rows,), generator=gen),
                    torch.randint(100, 5001, (rows,), generator=gen)),
    )
    lengths[torch.rand(rows, generator=gen) < 0.05] = 0
    flat = torch.repeat_interleave(torch.arange(rows), lengths)
    flat = flat[torch.randperm(flat.numel(), generator=gen)]
    cuda_gen = torch.Generator(device="cuda").manual_seed(seed)
    grad = torch.randn((flat.numel(), dim), generator=cuda_gen, device="cuda", dtype=torch.float32).to(dtype)
    return flat, grad.cpu()


# The edges between multi-tile level-1 items of the CUDA backend (backward_kernels.cuh): EDGE_ITEM_TILES-tile items
# are what tiles_per_item gives fp32 rows of EDGE_DIM (a block-wide thread group) over EDGE_TILES tiles.
EDGE_DIM, EDGE_ITEM_TILES, EDGE_TILES = 1024, 2, 4601  # the last item is one tile


def item_edge_case(seed: int):
    """Indices (EDGE_TILES * TILE of them, shuffled) whose sorted runs meet every case of an item edge, and the
    number of runs of each case, counted from the run layout alone with items of EDGE_ITEM_TILES tiles:
    'ends_in_next_item' (begins inside an item, ends inside the next, no group edge between),
    'ends_on_next_item_end' (of those, ends on the next item's last position), 'starts_on_item_start' (of those,
    begins on its item's first position), 'crosses_group_edge' (would end in the next item, but a tile group starts
    at the edge) and 'spans_next_item' (goes on past the next item)."""
    gen = torch.Generator().manual_seed(seed)
    n, item, group = EDGE_TILES * TILE, EDGE_ITEM_TILES * TILE, TILE * TILE_GROUP
    lengths, total = [], 0
    while total < n:
        kind = int(torch.randint(0, 10, (1,), generator=gen))
        if kind < 6:
            length = int(torch.randint(1, item + 8, (1,), generator=gen))
        elif kind < 8:  # end on the next item's last position, or one before or after it
            to_next_end = (total // item + 2) * item - total
            length = to_next_end + int(torch.randint(-1, 2, (1,), generator=gen))
        else:
            length = int(torch.randint(item, 3 * item, (1,), generator=gen))
        length = max(1, min(length, n - total))
        lengths.append(length)
        total += length
    counts = dict.fromkeys(("ends_in_next_item", "ends_on_next_item_end", "starts_on_item_start",
                            "crosses_group_edge", "spans_next_item"), 0)
    start = 0
    for length in lengths:
        end = start + length  # the run is [start, end)
        edge = (start // item + 1) * item  # the first edge after the run's start
        if end > edge:
            if end > edge + item:
                counts["spans_next_item"] += 1
            elif edge % group == 0:
                counts["crosses_group_edge"] += 1
            else:
                counts["ends_in_next_item"] += 1
                counts["ends_on_next_item_end"] += end == edge + item
                counts["starts_on_item_start"] += start % item == 0
        start = end
    flat = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    return flat[torch.randperm(n, generator=gen)], counts
