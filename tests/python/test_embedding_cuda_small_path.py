"""CUDA tests of the dense embedding backward's small-problem path (src/embedding/cuda_small.cu) and its border with
the general path (skipped without a GPU and graphsafe's CUDA backend).

The small path takes N <= SMALL_MAX indices whose row and position fit a 32-bit sort key (a shapes-only choice):
one launch sorts in shared memory and zero-fills untouched rows, a second sums tiles and finishes rows spanning
tiles from their pieces. Its results must equal the CPU backend bit for bit, exactly as the general path's do, so
every case here runs just below and just above the threshold: every dtype, both index dtypes, padding_idx, scale_grad_by_freq, hot rows (all indices equal: one run
over several tile groups), runs ending at every offset of tiles and groups, tables much larger than N (zero-fill
blocks with many rows each), the scalar path, and out-of-range indices inside a captured replay with canary
bytes around the output and the workspace.
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
    make_generator,
    random_grad,
    requires_cuda,
    stable_seed,
    uniform_indices,
    zipf_indices,
)
from embedding_backward_helpers import Canaried

pytestmark = requires_cuda

op = torch.ops.graphsafe.embedding_backward
CUDA = "cuda"
SMALL_MAX = 4096  # kSmallMaxIndices in src/embedding/cuda_small.cu
BORDER = (SMALL_MAX - 1, SMALL_MAX, SMALL_MAX + 1)


@pytest.fixture(autouse=True)
def clean_device_error_record():
    torch.cuda.synchronize()
    try:
        graphsafe.check_errors()
    except graphsafe.DeviceIndexError:
        pass
    yield
    graphsafe.check_errors()


def poisoned_op(grad, indices, num_weights, padding_idx=-1, scale=False):
    """The op on CUDA copies, after leaving a NaN block of the output's size in the caching allocator (an element
    the kernels fail to write most likely shows up as NaN)."""
    if num_weights * grad.shape[-1]:
        junk = torch.full((num_weights, grad.shape[-1]), float("nan"), dtype=grad.dtype, device=CUDA)
        del junk
    return op(grad.to(CUDA), indices.to(CUDA), num_weights, padding_idx, scale)


def assert_cuda_matches_cpu(grad, indices, num_weights, padding_idx=-1, scale=False, what=""):
    expected = op(grad, indices, num_weights, padding_idx, scale)
    got = poisoned_op(grad, indices, num_weights, padding_idx, scale)
    torch.cuda.synchronize()
    graphsafe.check_errors()
    what = what or f"{grad.dtype} N={indices.numel()} pad={padding_idx} scale={scale}"
    assert_bitwise_equal(got.cpu(), expected, what)
    return got


@pytest.mark.parametrize("n", BORDER, ids=lambda n: f"N{n}")
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES, ids=str)
@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=str)
def test_both_sides_of_the_threshold_match_cpu(dtype, index_dtype, n):
    """D = 64 (16-byte vectors for every dtype) and D = 13 (scalar); uniform, zipf and hot rows; with and without
    padding (the most frequent row) and scaling."""
    gen = make_generator(stable_seed(dtype, index_dtype, n))
    num_weights = 3000
    for dist in ("uniform", "zipf", "hot"):
        indices = INDEX_GENERATORS[dist](n, num_weights, gen, dtype=index_dtype)
        mode = int(torch.mode(indices.long()).values)
        for dim in (64, 13):
            grad = random_grad((n, dim), dtype, gen)
            for padding, scale in ((-1, False), (mode, True), (-1, True)):
                assert_cuda_matches_cpu(grad, indices, num_weights, padding, scale, f"{dist} D={dim} pad={padding}")


@pytest.mark.parametrize("n", BORDER, ids=lambda n: f"N{n}")
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES, ids=str)
@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=str)
def test_one_hot_row(dtype, index_dtype, n):
    """Every index equal: one run over every tile and several tile groups, finished from its pieces; also as the
    padding row (all rows zero) and scaled."""
    gen = make_generator(stable_seed("hot", dtype, index_dtype, n))
    indices = torch.full((n,), 7, dtype=index_dtype)
    grad = random_grad((n, 40), dtype, gen)
    for padding, scale in ((-1, False), (-1, True), (7, False)):
        out = assert_cuda_matches_cpu(grad, indices, 9, padding, scale)
        assert int((out != 0).any(dim=1).sum()) == (0 if padding == 7 else 1)


@pytest.mark.parametrize("seed", range(8))
def test_random_run_lengths_below_the_threshold(seed):
    """Runs of random lengths (some longer than a tile group) in at most SMALL_MAX indices, so runs start and end
    at every offset of tiles and groups; rows that never occur; padding sprinkled in."""
    gen = make_generator(2000 + seed)
    rows = 60
    lengths = torch.where(torch.rand(rows, generator=gen) < 0.15, torch.randint(33, 1500, (rows,), generator=gen),
                          torch.randint(1, 40, (rows,), generator=gen))
    lengths[torch.rand(rows, generator=gen) < 0.1] = 0
    flat = torch.repeat_interleave(torch.arange(rows), lengths)[:SMALL_MAX]
    flat = flat[torch.randperm(flat.numel(), generator=gen)]
    dtype = GRAD_DTYPES[seed % 4]
    dim = (5, 8, 16, 33)[seed % 4]
    grad = random_grad((flat.numel(), dim), dtype, gen)
    padding = int(flat[0]) if seed % 3 == 0 else -1
    assert_cuda_matches_cpu(grad, flat.to(INDEX_DTYPES[seed % 2]), rows + 1, padding, seed % 2 == 0)


@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=str)
def test_tables_much_larger_than_n(dtype):
    """Zero-fill blocks owning many rows each: a 2M-row table with 5 indices, a 500k-row table of 1-element rows
    (2-byte stores for fp16/bf16, the most rows per block), and LLM-sized rows (D = 4096). Tables whose row and
    position need more than 32 key bits together take the general path (a 3M-row table with 4000 indices)."""
    gen = make_generator(stable_seed("large table", dtype))
    big = 1 << 21
    idx = torch.tensor([5, big - 1, 5, 123_456, big - 1], dtype=torch.int32)
    out = assert_cuda_matches_cpu(random_grad((5, 16), dtype, gen), idx, big)
    assert int((out != 0).any(dim=1).sum()) == 3
    for rows in (500_000, 3_000_000):
        assert_cuda_matches_cpu(random_grad((4000, 1), dtype, gen), uniform_indices(4000, rows, gen), rows, 17, True)
    assert_cuda_matches_cpu(random_grad((SMALL_MAX, 4096), dtype, gen), zipf_indices(SMALL_MAX, 3000, gen), 3000)


@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=str)
def test_misaligned_grad_below_the_threshold(dtype):
    """A grad whose data pointer is not 16-byte aligned takes the scalar reduce path; the zero fill still uses
    the output's own alignment."""
    gen = make_generator(stable_seed("misaligned", dtype))
    n, dim, num_weights = 3000, 64, 700
    indices = zipf_indices(n, num_weights, gen)
    base = random_grad((n * dim + 1,), dtype, gen)
    grad_cuda = base.to(CUDA)[1:].view(n, dim)
    assert grad_cuda.data_ptr() % 16 != 0
    expected = op(base[1:].view(n, dim).contiguous(), indices, num_weights, 3, True)
    got = op(grad_cuda, indices.to(CUDA), num_weights, 3, True)
    torch.cuda.synchronize()
    assert_bitwise_equal(got.cpu(), expected, "misaligned grad")


# --------------------------------------------------------------------------------------------------------
# Capture, replay and out-of-range indices, with canaries around the output and the workspace
# --------------------------------------------------------------------------------------------------------


class RawDenseCall:
    """The core's dense entry point through graphsafe._C, on buffers the test owns (so they carry canaries)."""

    def __init__(self, grad, indices, num_weights, padding_idx, scale):
        self.grad, self.indices, self.args = grad, indices, (num_weights, padding_idx, scale)
        n, dim = indices.numel(), grad.shape[-1]
        self.out = Canaried(num_weights * dim, grad.dtype)
        self.workspace_bytes = _C.embedding_backward_workspace_bytes(
            "cuda", grad.device.index or 0, dtype_name(grad.dtype), n, dim, num_weights)
        self.workspace = Canaried(self.workspace_bytes, torch.uint8)
        self.shape = (num_weights, dim)

    def __call__(self):
        num_weights, padding_idx, scale = self.args
        _C.embedding_backward_dense(
            "cuda", self.grad.device.index or 0, current_stream(self.grad.device), self.out.view.data_ptr(),
            self.grad.data_ptr(), dtype_name(self.grad.dtype), self.indices.data_ptr(), dtype_name(self.indices.dtype),
            self.indices.numel(), self.grad.shape[-1], num_weights, padding_idx, scale, self.workspace.view.data_ptr(),
            self.workspace_bytes)

    def result(self):
        return self.out.view.view(self.shape).clone()

    def canaries_intact(self):
        return self.out.intact() and self.workspace.intact()


def capture(fn):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph


def _valid_only(grad, indices, num_weights):
    valid = (indices >= 0) & (indices < num_weights)
    return grad[valid].contiguous(), indices[valid].contiguous()


@pytest.mark.parametrize("n", (SMALL_MAX, SMALL_MAX + 1), ids=lambda n: f"N{n}")
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES, ids=str)
@pytest.mark.parametrize("dtype,dim", [(torch.float32, 64), (torch.bfloat16, 128), (torch.float16, 13),
                                       (torch.float64, 40)], ids=str)
def test_out_of_range_in_replay_keeps_canaries(dtype, dim, index_dtype, n):
    """Replays with fresh indices (zipf, hot rows, one hot row): equal to eager and to the CPU; then out-of-range
    values: left out, reported once, nothing written outside the output or the workspace; then clean again."""
    gen = make_generator(stable_seed("replay", dtype, index_dtype, n))
    num_weights, padding, scale = 2000, 3, True
    static_grad = random_grad((n, dim), dtype, gen).to(CUDA)
    static_idx = uniform_indices(n, num_weights, gen, dtype=index_dtype).to(CUDA)
    raw = RawDenseCall(static_grad, static_idx, num_weights, padding, scale)
    graph = capture(raw)
    assert raw.canaries_intact()

    fresh = [INDEX_GENERATORS["zipf"](n, num_weights, gen, dtype=index_dtype),
             INDEX_GENERATORS["hot"](n, num_weights, gen, dtype=index_dtype), torch.full((n,), 11, dtype=index_dtype)]
    for k, idx in enumerate(fresh):
        grad = random_grad((n, dim), dtype, gen)
        static_grad.copy_(grad.to(CUDA))
        static_idx.copy_(idx.to(CUDA))
        graph.replay()
        torch.cuda.synchronize()
        graphsafe.check_errors()
        assert raw.canaries_intact()
        replayed = raw.result()
        assert_bitwise_equal(replayed, op(static_grad, static_idx, num_weights, padding, scale), f"replay {k} vs eager")
        assert_bitwise_equal(replayed.cpu(), op(grad, idx, num_weights, padding, scale), f"replay {k} vs CPU")

    idx = zipf_indices(n, num_weights, gen, dtype=index_dtype)
    idx[0] = num_weights
    idx[n // 2] = -1
    idx[n - 1] = num_weights + 77
    static_idx.copy_(idx.to(CUDA))
    graph.replay()
    torch.cuda.synchronize()
    assert raw.canaries_intact()
    grad = static_grad.cpu()
    assert_bitwise_equal(raw.result().cpu(), op(*_valid_only(grad, idx, num_weights), num_weights, padding, scale),
                         "valid rows after a replay with out-of-range indices")
    with pytest.raises(graphsafe.DeviceIndexError,
                       match=r"index (2000|-1|2077) is out of range for an embedding with 2000 rows"):
        graphsafe.check_errors()
    graphsafe.check_errors()

    idx = uniform_indices(n, num_weights, gen, dtype=index_dtype)
    static_idx.copy_(idx.to(CUDA))
    graph.replay()
    torch.cuda.synchronize()
    graphsafe.check_errors()
    assert raw.canaries_intact()
    assert_bitwise_equal(raw.result().cpu(), op(grad, idx, num_weights, padding, scale), "clean replay")


def test_every_index_out_of_range_or_padding():
    """No contributing occurrence: every row zero, the error reported once, canaries intact."""
    grad = torch.randn(300, 8).to(CUDA)
    indices = (torch.arange(300) % 2 * 60).to(CUDA)  # 0 (padding) and 60 (out of range for 50 rows)
    raw = RawDenseCall(grad, indices, 50, 0, False)
    raw()
    torch.cuda.synchronize()
    assert raw.canaries_intact()
    assert not bool(raw.result().ne(0).any())
    with pytest.raises(graphsafe.DeviceIndexError, match="index 60 is out of range for an embedding with 50 rows"):
        graphsafe.check_errors()
