"""CUDA tests of graphsafe's row-sparse embedding backward (skipped without a GPU and graphsafe's CUDA backend).

The CPU result is pinned to the contract by test_embedding_backward_sparse.py; here the CUDA result must equal it
bit for bit (rows, row_grads, count), and equal the CUDA dense result's rows, for every dtype, both index dtypes,
padding / scaling, and shapes that take each kernel path (16-byte vectors or not, misaligned grad, runs over tiles
and tile groups). Also: capture in a CUDA graph and replay with fresh indices (== eager, == CPU), and out-of-range
indices left out and reported (graphsafe.DeviceIndexError), eagerly and inside a replay, with canary bytes around
every buffer the op writes (outputs and workspace) to show nothing is written out of bounds.
"""

from __future__ import annotations

import pytest
import torch

import graphsafe
from graphsafe import _C
from graphsafe._core_args import current_stream, dtype_name
from conftest import (
    GRAD_DTYPES,
    INDEX_DTYPES,
    INDEX_GENERATORS,
    assert_bitwise_equal,
    hot_row_indices,
    make_generator,
    random_grad,
    requires_cuda,
    stable_seed,
    uniform_indices,
    zipf_indices,
)
from embedding_backward_helpers import EDGE_DIM, Canaried, item_edge_case, multi_tile_item_case

pytestmark = requires_cuda

sparse_op = torch.ops.graphsafe.embedding_backward_sparse
dense_op = torch.ops.graphsafe.embedding_backward
CUDA = "cuda"
NAMES = ("rows", "row_grads", "count")


@pytest.fixture(autouse=True)
def clean_device_error_record():
    """Every test starts with no pending device error, and one that does not expect an error must not leave one."""
    torch.cuda.synchronize()
    try:
        graphsafe.check_errors()
    except graphsafe.DeviceIndexError:
        pass
    yield
    graphsafe.check_errors()


def poison_cached_blocks(capacity, dim, dtype):
    """Leave NaN / -7 blocks of the outputs' sizes in the caching allocator, so that the op's torch.empty outputs
    most likely reuse them: any element the kernels fail to write shows up."""
    if capacity * dim:
        del_me = torch.full((capacity, dim), float("nan"), dtype=dtype, device=CUDA)
        del del_me
    if capacity:
        del_me = torch.full((capacity,), -7, dtype=torch.int64, device=CUDA)
        del del_me


def assert_results_equal(got, expected, what):
    for x, y, name in zip(got, expected, NAMES):
        assert_bitwise_equal(x.cpu(), y.cpu(), f"{what}: {name}")


def assert_cuda_matches_cpu(grad, indices, num_weights, padding_idx=-1, scale=False, what=""):
    """CUDA sparse == CPU sparse, and CUDA sparse rows == CUDA dense rows, bitwise; no device error."""
    what = what or f"{grad.dtype} {indices.dtype} V={num_weights} pad={padding_idx} scale={scale}"
    expected = sparse_op(grad, indices, num_weights, padding_idx, scale)
    grad_c, idx_c = grad.to(CUDA), indices.to(CUDA)
    poison_cached_blocks(min(indices.numel(), num_weights), grad.shape[-1], grad.dtype)
    got = sparse_op(grad_c, idx_c, num_weights, padding_idx, scale)
    assert all(t.device.type == "cuda" for t in got)
    dense = dense_op(grad_c, idx_c, num_weights, padding_idx, scale)
    torch.cuda.synchronize()
    graphsafe.check_errors()
    assert_results_equal(got, expected, what)
    rows, row_grads, count = got
    c = int(count)
    assert_bitwise_equal(row_grads[:c], dense[rows[:c]], f"{what}: CUDA sparse vs CUDA dense")
    return got


OPTIONS = [(-1, False), ("mode", True), (-2, False), (-1, True)]


def resolve_padding(choice, indices):
    if choice == "mode":  # the most frequent row: padding that removes many occurrences
        return int(torch.mode(indices.reshape(-1).long()).values)
    return choice


# --------------------------------------------------------------------------------------------------------
# CUDA == CPU, bitwise
# --------------------------------------------------------------------------------------------------------

# (num_weights, D, index shape). D = 13: no dtype takes 16-byte vectors; D = 64: every dtype does; D = 100: fp32
# and fp64 do, fp16/bf16 do not; D = 4096: wide rows. N > V and N < V both occur.
SIZES = [
    (1000, 13, (5000,)),
    (4099, 64, (40, 50)),
    (300, 100, (4, 10, 250)),
    (50, 4096, (3000,)),
]


@pytest.mark.parametrize("option", range(len(OPTIONS)))
@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"V{s[0]}-D{s[1]}-N{s[2]}")
@pytest.mark.parametrize("dist", list(INDEX_GENERATORS))
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES, ids=str)
@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=str)
def test_cuda_matches_cpu(dtype, index_dtype, dist, size, option):
    num_weights, dim, shape = size
    gen = make_generator(stable_seed("sparse", dtype, index_dtype, dist, size, option))
    indices = INDEX_GENERATORS[dist](shape, num_weights, gen, dtype=index_dtype)
    padding, scale = OPTIONS[option]
    if padding == -2:
        indices.view(-1)[::5] = num_weights - 2
    grad = random_grad((*shape, dim), dtype, gen)
    assert_cuda_matches_cpu(grad, indices, num_weights, resolve_padding(padding, indices), scale)


@pytest.mark.parametrize("dist", ["zipf", "hot", "uniform"])
@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=str)
def test_cuda_matches_cpu_large(dtype, dist):
    """N = 500k over 100k rows: zipf heads and hot rows far past 1024 occurrences, uniform rows of a few each."""
    num_weights, n = 100_000, 500_000
    gen = make_generator(stable_seed("sparse-large", dtype, dist))
    if dist == "hot":
        indices = hot_row_indices(n, num_weights, gen, num_hot=40)
    else:
        indices = INDEX_GENERATORS[dist](n, num_weights, gen)
    for dim, (padding, scale) in [(64, (-1, False)), (7, ("mode", True))]:
        grad = random_grad((n, dim), dtype, gen)
        assert_cuda_matches_cpu(grad, indices, num_weights, resolve_padding(padding, indices), scale)


LAYOUT_COUNTS = [5, 27, 32, 33, 100, 810, 40, 2100, 1, 1024, 5 * 1024 - 4172, 1024, 2049, 31]


@pytest.mark.parametrize("padding", [-1, 4, 9], ids=str)
@pytest.mark.parametrize("dim", [13, 64], ids=str)
@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=str)
def test_cuda_matches_cpu_tile_and_group_boundaries(dtype, dim, padding):
    """Runs that start and end at every kind of tile / tile-group boundary, on rows spread over the table."""
    gen = make_generator(99)
    flat = torch.cat([torch.full((c,), 5 * r + 2, dtype=torch.int64) for r, c in enumerate(LAYOUT_COUNTS)])
    flat = flat[torch.randperm(flat.numel(), generator=gen)]
    num_weights = 5 * len(LAYOUT_COUNTS) + 3
    grad = random_grad((flat.numel(), dim), dtype, gen)
    for scale in (False, True):
        assert_cuda_matches_cpu(grad, flat, num_weights, 5 * padding + 2 if padding >= 0 else -1, scale)


@pytest.mark.parametrize("seed", range(8))
def test_cuda_matches_cpu_random_run_lengths(seed):
    gen = make_generator(2000 + seed)
    rows = 400
    lengths = torch.where(
        torch.rand(rows, generator=gen) < 0.1,
        torch.randint(33, 3000, (rows,), generator=gen),
        torch.randint(1, 40, (rows,), generator=gen),
    )
    lengths[torch.rand(rows, generator=gen) < 0.05] = 0
    flat = torch.repeat_interleave(torch.arange(rows), lengths)
    flat = flat[torch.randperm(flat.numel(), generator=gen)]
    dtype = GRAD_DTYPES[seed % 4]
    dim = (5, 8, 16, 33)[seed % 4]
    grad = random_grad((flat.numel(), dim), dtype, gen)
    padding = int(flat[0]) if seed % 3 == 0 else -1
    assert_cuda_matches_cpu(grad, flat, rows + 1, padding, seed % 2 == 0)


@pytest.mark.parametrize("dtype,dim,rows", [(torch.float32, 1024, 2200), (torch.bfloat16, 2048, 4400)],
                         ids=["4-tile-items", "8-tile-items"])
def test_cuda_matches_cpu_multi_tile_items(dtype, dim, rows):
    """Level 1 with several tiles per item (as test_embedding_cuda.test_cuda_matches_cpu_multi_tile_items)."""
    flat, grad = multi_tile_item_case(rows, dim, dtype, seed=rows + dim + 1)
    assert_cuda_matches_cpu(grad, flat, rows + 2, int(torch.mode(flat).values), True)


def test_cuda_matches_cpu_rows_at_item_edges():
    """Runs around multi-tile item edges (as test_embedding_cuda.test_cuda_matches_cpu_rows_at_item_edges): each row
    in its own slot, with its count under scale_grad_by_freq."""
    flat, counts = item_edge_case(seed=8)
    assert min(counts.values()) >= 5, counts
    grad = random_grad((flat.numel(), EDGE_DIM), torch.float32, make_generator(8))
    for padding, scale in [(-1, True), (int(flat[0]), False)]:
        assert_cuda_matches_cpu(grad, flat, int(flat.max()) + 2, padding, scale)


@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=str)
def test_cuda_misaligned_grad_takes_scalar_path(dtype):
    gen = make_generator(5)
    n, dim, num_weights = 20_000, 64, 700
    indices = zipf_indices(n, num_weights, gen)
    base = random_grad((n * dim + 1,), dtype, gen)
    grad_cuda = base.to(CUDA)[1:].view(n, dim)
    assert grad_cuda.is_contiguous() and grad_cuda.data_ptr() % 16 != 0
    expected = sparse_op(base[1:].view(n, dim).contiguous(), indices, num_weights, 3, True)
    got = sparse_op(grad_cuda, indices.to(CUDA), num_weights, 3, True)
    torch.cuda.synchronize()
    assert_results_equal(got, expected, "misaligned grad")


@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=str)
def test_cuda_edge_shapes(dtype):
    gen = make_generator(11)
    for shape in [(0,), (0, 3)]:  # N = 0
        rows, row_grads, count = assert_cuda_matches_cpu(torch.empty((*shape, 9), dtype=dtype),
                                                         torch.empty(shape, dtype=torch.int64), 17, 2, True)
        assert rows.shape == (0,) and row_grads.shape == (0, 9) and int(count) == 0
    # num_weights = 0 with N = 0; D = 0 (rows and count still right)
    assert_cuda_matches_cpu(torch.empty(0, 4, dtype=dtype), torch.empty(0, dtype=torch.int32), 0)
    rows, _, count = assert_cuda_matches_cpu(torch.empty(6, 0, dtype=dtype), torch.tensor([5, 1, 5, 3, 1, 0]), 8, 3)
    assert rows.tolist() == [0, 1, 5, -1, -1, -1] and int(count) == 3
    # all padding: count 0, every slot unused
    rows, _, count = assert_cuda_matches_cpu(random_grad((200, 8), dtype, gen), torch.full((200,), 4), 10, 4, True)
    assert int(count) == 0 and bool((rows == -1).all())
    # a single row, one long run; a single index; a single-row table; 0-d indices
    assert_cuda_matches_cpu(random_grad((2500, 8), dtype, gen), torch.full((2500,), 17, dtype=torch.int64), 40)
    assert_cuda_matches_cpu(random_grad((1, 1), dtype, gen), torch.tensor([0]), 1)
    assert_cuda_matches_cpu(random_grad((3000, 2), dtype, gen), torch.zeros(3000, dtype=torch.int32), 1, -1, True)
    assert_cuda_matches_cpu(random_grad((7,), dtype, gen), torch.tensor(2), 4)
    # N > V with every row used (no unused slot), and a big table with few indices
    idx = torch.cat([torch.arange(9), uniform_indices(4000, 9, gen)])
    assert_cuda_matches_cpu(random_grad((idx.numel(), 16), dtype, gen), idx, 9)
    big = 1 << 21
    idx = torch.tensor([5, big - 1, 5, 123_456, big - 1], dtype=torch.int32)
    rows, _, count = assert_cuda_matches_cpu(random_grad((5, 16), dtype, gen), idx, big)
    assert rows.tolist() == [5, 123_456, big - 1, -1, -1] and int(count) == 3


def test_cuda_signed_zero_sums_and_unused_slots_are_plus_zero():
    for dtype in GRAD_DTYPES:
        grad = torch.full((70, 3), -0.0, dtype=dtype)
        idx = torch.tensor([1] * 40 + [0] * 30)
        _, row_grads, _ = assert_cuda_matches_cpu(grad, idx, 3, 0)
        assert_bitwise_equal(row_grads.cpu(), torch.zeros(3, 3, dtype=dtype), "all +0")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cuda_bitwise_repeatable(dtype):
    gen = make_generator(21)
    n, dim, num_weights = 300_000, 32, 50_000
    indices = zipf_indices(n, num_weights, gen).to(CUDA)
    grad = random_grad((n, dim), dtype, gen).to(CUDA)
    first = sparse_op(grad, indices, num_weights, -1, True)
    again = [sparse_op(grad, indices, num_weights, -1, True) for _ in range(3)]
    torch.cuda.synchronize()
    for k, r in enumerate(again):
        assert_results_equal(r, first, f"call {k + 2}")


# --------------------------------------------------------------------------------------------------------
# CUDA graph capture
# --------------------------------------------------------------------------------------------------------


def capture(fn):
    """Warm fn up on a side stream, then capture it into a CUDAGraph. Returns (graph, its static outputs)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    torch.cuda.synchronize()
    return graph, out


@pytest.mark.parametrize(
    "dtype,index_dtype,dim,padding_idx,scale",
    [
        (torch.float32, torch.int64, 64, -1, False),
        (torch.bfloat16, torch.int32, 128, 3, True),
        (torch.float16, torch.int64, 13, -2, True),
        (torch.float64, torch.int32, 40, -1, True),
    ],
    ids=str,
)
def test_cuda_graph_capture_and_replay(dtype, index_dtype, dim, padding_idx, scale):
    gen = make_generator(31)
    n, num_weights = 60_000, 5_000
    static_grad = random_grad((n, dim), dtype, gen).to(CUDA)
    static_idx = uniform_indices(n, num_weights, gen, dtype=index_dtype).to(CUDA)
    graph, static_out = capture(lambda: sparse_op(static_grad, static_idx, num_weights, padding_idx, scale))
    # Fresh index values of the captured shapes, including ones with far fewer distinct rows (more unused slots)
    # and one with more distinct rows than the previous replay left (unused slots must be rewritten).
    for dist in ("zipf", "hot", "uniform", "hot"):
        idx = INDEX_GENERATORS[dist](n, num_weights, gen, dtype=index_dtype)
        grad = random_grad((n, dim), dtype, gen)
        static_grad.copy_(grad.to(CUDA))
        static_idx.copy_(idx.to(CUDA))
        graph.replay()
        torch.cuda.synchronize()
        replayed = tuple(t.clone() for t in static_out)
        eager = sparse_op(static_grad, static_idx, num_weights, padding_idx, scale)
        torch.cuda.synchronize()
        graphsafe.check_errors()
        assert_results_equal(replayed, eager, f"replay vs eager ({dist})")
        assert_results_equal(replayed, sparse_op(grad, idx, num_weights, padding_idx, scale), f"replay vs CPU ({dist})")


# --------------------------------------------------------------------------------------------------------
# Out-of-range indices, with canaries around every buffer the op writes
# --------------------------------------------------------------------------------------------------------


class RawSparseCall:
    """The core's entry point through graphsafe._C, on buffers the test owns (so they can carry canaries)."""

    def __init__(self, grad, indices, num_weights, padding_idx, scale):
        self.grad, self.indices = grad, indices
        self.args = (num_weights, padding_idx, scale)
        n, dim = indices.numel(), grad.shape[-1]
        capacity = min(n, num_weights)
        self.rows = Canaried(capacity, torch.int64)
        self.row_grads = Canaried(capacity * dim, grad.dtype)
        self.count = Canaried(1, torch.int64)
        self.workspace_bytes = _C.embedding_backward_sparse_workspace_bytes(
            "cuda", grad.device.index or 0, dtype_name(grad.dtype), n, dim, num_weights)
        self.workspace = Canaried(self.workspace_bytes, torch.uint8)
        self.shape = (capacity, dim)

    def __call__(self):
        num_weights, padding_idx, scale = self.args
        _C.embedding_backward_sparse(
            "cuda", self.grad.device.index or 0, current_stream(self.grad.device), self.rows.view.data_ptr(),
            self.row_grads.view.data_ptr(), self.count.view.data_ptr(), self.grad.data_ptr(), dtype_name(self.grad.dtype),
            self.indices.data_ptr(), dtype_name(self.indices.dtype), self.indices.numel(), self.grad.shape[-1],
            num_weights, padding_idx, scale, self.workspace.view.data_ptr(), self.workspace_bytes)

    def result(self):
        return self.rows.view.clone(), self.row_grads.view.view(self.shape).clone(), self.count.view[0].clone()

    def canaries_intact(self):
        return all(b.intact() for b in (self.rows, self.row_grads, self.count, self.workspace))


def _valid_only(grad, indices, num_weights):
    valid = (indices >= 0) & (indices < num_weights)
    return grad[valid].contiguous(), indices[valid].contiguous()


def assert_valid_part_matches_cpu(got, grad, indices, num_weights, padding_idx, scale, what):
    """Out-of-range occurrences get no slot: the first slots are the CPU result of the valid occurrences alone,
    and every further slot is unused (-1, +0)."""
    rows, row_grads, count = (t.cpu() for t in got)
    exp_rows, exp_grads, exp_count = sparse_op(*_valid_only(grad, indices, num_weights), num_weights, padding_idx, scale)
    c = int(exp_count)
    assert int(count) == c, what
    assert_bitwise_equal(rows[:c], exp_rows[:c], f"{what}: rows")
    assert_bitwise_equal(row_grads[:c], exp_grads[:c], f"{what}: row_grads")
    assert bool((rows[c:] == -1).all()), f"{what}: unused rows"
    assert_bitwise_equal(row_grads[c:], torch.zeros_like(row_grads[c:]), f"{what}: unused row_grads")


@pytest.mark.parametrize("index_dtype", INDEX_DTYPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cuda_out_of_range_eager(dtype, index_dtype):
    gen = make_generator(41)
    n, dim, num_weights = 20_000, 24, 1000
    indices = zipf_indices(n, num_weights, gen, dtype=index_dtype)
    indices[123] = num_weights
    indices[4567] = -3
    grad = random_grad((n, dim), dtype, gen)

    got = sparse_op(grad.to(CUDA), indices.to(CUDA), num_weights, 7, True)  # asynchronous: no error raised here
    torch.cuda.synchronize()
    assert_valid_part_matches_cpu(got, grad, indices, num_weights, 7, True, "public op")
    with pytest.raises(graphsafe.DeviceIndexError, match=r"index (1000|-3) is out of range for an embedding with 1000 rows"):
        graphsafe.check_errors()
    graphsafe.check_errors()  # cleared by reporting it

    raw = RawSparseCall(grad.to(CUDA), indices.to(CUDA), num_weights, 7, True)
    raw()
    torch.cuda.synchronize()
    assert raw.canaries_intact()
    assert_valid_part_matches_cpu(raw.result(), grad, indices, num_weights, 7, True, "raw call")
    with pytest.raises(graphsafe.DeviceIndexError):
        graphsafe.check_errors()


def test_cuda_every_index_out_of_range():
    """No valid occurrence at all: count 0, every slot unused, the error reported, canaries intact."""
    grad = torch.randn(300, 8)
    indices = torch.arange(300) + 50
    raw = RawSparseCall(grad.to(CUDA), indices.to(CUDA), 50, -1, False)
    raw()
    torch.cuda.synchronize()
    assert raw.canaries_intact()
    rows, row_grads, count = raw.result()
    assert int(count) == 0 and bool((rows == -1).all()) and not bool(row_grads.ne(0).any())
    with pytest.raises(graphsafe.DeviceIndexError, match="out of range for an embedding with 50 rows"):
        graphsafe.check_errors()


def test_cuda_pending_error_raised_by_next_op_call():
    gen = make_generator(43)
    n, dim, num_weights = 5000, 8, 100
    grad = random_grad((n, dim), torch.float32, gen).to(CUDA)
    good = uniform_indices(n, num_weights, gen).to(CUDA)
    bad = good.clone()
    bad[17] = 2**40
    sparse_op(grad, bad, num_weights, -1, False)
    torch.cuda.synchronize()
    with pytest.raises(graphsafe.DeviceIndexError, match=r"index 1099511627776 is out of range"):
        sparse_op(grad, good, num_weights, -1, False)
    got = sparse_op(grad, good, num_weights, -1, False)
    torch.cuda.synchronize()
    graphsafe.check_errors()
    assert_results_equal(got, sparse_op(grad.cpu(), good.cpu(), num_weights, -1, False), "after the error")


@pytest.mark.parametrize("dtype,dim", [(torch.float32, 64), (torch.float16, 13)], ids=str)
def test_cuda_out_of_range_in_graph_replay(dtype, dim):
    gen = make_generator(47)
    n, num_weights = 30_000, 2000
    static_grad = random_grad((n, dim), dtype, gen).to(CUDA)
    static_idx = hot_row_indices(n, num_weights, gen, num_hot=20).to(CUDA)
    raw = RawSparseCall(static_grad, static_idx, num_weights, -1, True)
    graph, _ = capture(raw)
    public_graph, public_out = capture(lambda: sparse_op(static_grad, static_idx, num_weights, -1, True))

    # Fresh input with out-of-range values: replay must not write out of bounds, must get the valid rows right,
    # and must leave the error for check_errors.
    idx = zipf_indices(n, num_weights, gen)
    idx[0] = num_weights
    idx[n // 2] = -1
    idx[n - 1] = num_weights + 77
    grad = random_grad((n, dim), dtype, gen)
    static_grad.copy_(grad.to(CUDA))
    static_idx.copy_(idx.to(CUDA))
    for g, result in ((graph, raw.result), (public_graph, lambda: public_out)):
        g.replay()
        torch.cuda.synchronize()
        assert raw.canaries_intact()
        assert_valid_part_matches_cpu(result(), grad, idx, num_weights, -1, True, "after replay")
        with pytest.raises(graphsafe.DeviceIndexError,
                           match=r"index (2000|-1|2077) is out of range for an embedding with 2000 rows"):
            graphsafe.check_errors()
        graphsafe.check_errors()

    # Valid input again: replays are clean and right.
    idx = uniform_indices(n, num_weights, gen)
    static_idx.copy_(idx.to(CUDA))
    graph.replay()
    public_graph.replay()
    torch.cuda.synchronize()
    graphsafe.check_errors()
    assert raw.canaries_intact()
    expected = sparse_op(grad, idx, num_weights, -1, True)
    assert_results_equal(raw.result(), expected, "clean replay (raw)")
    assert_results_equal(public_out, expected, "clean replay (public op)")
