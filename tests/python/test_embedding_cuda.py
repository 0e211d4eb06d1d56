"""CUDA tests of graphsafe's embedding backward (skipped without a GPU and graphsafe's CUDA backend).

The CPU backend is pinned to the documented reduction order by test_embedding_backward_order.py; here the CUDA
backend must reproduce it bit for bit (torch.equal is not enough: bit patterns are compared, so -0.0 vs
+0.0 would count), for every dtype, both index dtypes, the padding / scaling options, and shapes that take
each kernel path: D not a multiple of the vector width (scalar path), D a multiple of 8, D = 4096,
misaligned grad (scalar path for a vector-friendly D), rows spanning tiles and tile groups (N up to ~500k
with hot rows of far more than 1024 occurrences).

Also: bitwise repeatability, CUDA-graph capture and replay with fresh inputs, out-of-range indices (left
out of the sum, reported through graphsafe.check_errors / the next graphsafe call, also from a replayed
graph), and graphsafe.nn.Embedding on CUDA.
"""

from __future__ import annotations

import pytest
import torch

import graphsafe
from conftest import (
    GRAD_DTYPES,
    INDEX_DTYPES,
    INDEX_GENERATORS,
    assert_bitwise_equal,
    assert_within_bound,
    fp64_reference_and_bound,
    hot_row_indices,
    make_generator,
    random_grad,
    requires_cuda,
    stable_seed,
    uniform_indices,
    zipf_indices,
)
from embedding_backward_helpers import EDGE_DIM, item_edge_case, multi_tile_item_case

pytestmark = requires_cuda

op = torch.ops.graphsafe.embedding_backward
CUDA = "cuda"


@pytest.fixture(autouse=True)
def clean_device_error_record():
    """Every test starts with no pending device error, and one that does not expect an error must not
    leave one behind (a valid index flagged as out of range would show up here)."""
    torch.cuda.synchronize()
    try:
        graphsafe.check_errors()
    except graphsafe.DeviceIndexError:
        pass
    yield
    graphsafe.check_errors()


def poison_cached_block(num_weights, dim, dtype):
    """Leave a NaN-filled block of the output's size in the caching allocator, so that the op's
    torch.empty output most likely reuses it: any element the kernels fail to write shows up as NaN."""
    if num_weights * dim == 0:
        return
    junk = torch.full((num_weights, dim), float("nan"), dtype=dtype, device=CUDA)
    del junk


def cuda_op(grad, indices, num_weights, padding_idx=-1, scale=False, poison=True):
    grad_c, idx_c = grad.to(CUDA), indices.to(CUDA)
    if poison:
        poison_cached_block(num_weights, grad.shape[-1], grad.dtype)
    out = op(grad_c, idx_c, num_weights, padding_idx, scale)
    assert out.device.type == "cuda" and out.dtype == grad.dtype
    return out


def assert_cuda_matches_cpu(grad, indices, num_weights, padding_idx=-1, scale=False, what=""):
    """CUDA result == CPU result, bitwise; no device error recorded for valid indices."""
    expected = op(grad, indices, num_weights, padding_idx, scale)
    got = cuda_op(grad, indices, num_weights, padding_idx, scale)
    torch.cuda.synchronize()
    graphsafe.check_errors()
    assert_bitwise_equal(got.cpu(), expected, what or f"{grad.dtype} pad={padding_idx} scale={scale}")
    return got


OPTIONS = [(-1, False), ("mode", True), (-2, False), ("mode", False), (-1, True)]


def resolve_padding(choice, indices, num_weights):
    if choice == "mode":  # the most frequent row: padding that removes many occurrences
        return int(torch.mode(indices.reshape(-1).long()).values)
    return choice


# --------------------------------------------------------------------------------------------------------
# CUDA == CPU, bitwise
# --------------------------------------------------------------------------------------------------------

# (num_weights, D, index shape). D = 13: no dtype can use 16-byte vectors; D = 64: every dtype can;
# D = 100: fp32 (4 per vector) and fp64 (2) can, fp16/bf16 (8) cannot; D = 4096: wide rows.
SMALL_SIZES = [
    (1000, 13, (5000,)),
    (1000, 64, (40, 500)),
    (300, 100, (4, 10, 250)),
    (50, 4096, (3000,)),
]


@pytest.mark.parametrize("option", range(len(OPTIONS)))
@pytest.mark.parametrize("size", SMALL_SIZES, ids=lambda s: f"V{s[0]}-D{s[1]}-N{s[2]}")
@pytest.mark.parametrize("dist", list(INDEX_GENERATORS))
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES, ids=str)
@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=str)
def test_cuda_matches_cpu(dtype, index_dtype, dist, size, option):
    num_weights, dim, shape = size
    gen = make_generator(stable_seed(dtype, index_dtype, dist, size, option))
    indices = INDEX_GENERATORS[dist](shape, num_weights, gen, dtype=index_dtype)
    padding, scale = OPTIONS[option]
    if padding == -2:
        indices.view(-1)[::5] = num_weights - 2
    padding = resolve_padding(padding, indices, num_weights)
    grad = random_grad((*shape, dim), dtype, gen)
    assert_cuda_matches_cpu(grad, indices, num_weights, padding, scale)


@pytest.mark.parametrize("dist", ["zipf", "hot", "uniform"])
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES, ids=str)
@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=str)
def test_cuda_matches_cpu_large(dtype, index_dtype, dist):
    """N = 500k over 100k rows: zipf heads and hot rows of far more than 1024 occurrences (runs over many
    tile groups), uniform rows of a few occurrences each."""
    num_weights, n = 100_000, 500_000
    gen = make_generator(stable_seed(dtype, index_dtype, dist))
    if dist == "hot":
        indices = hot_row_indices(n, num_weights, gen, dtype=index_dtype, num_hot=40)
    else:
        indices = INDEX_GENERATORS[dist](n, num_weights, gen, dtype=index_dtype)
    if dist != "uniform":
        assert torch.bincount(indices.long()).max() > 1024
    for dim, (padding, scale) in [(64, (-1, False)), (24, ("mode", True)), (7, (-1, True))]:
        grad = random_grad((n, dim), dtype, gen)
        pad = resolve_padding(padding, indices, num_weights)
        assert_cuda_matches_cpu(grad, indices, num_weights, pad, scale, f"D={dim} pad={pad} scale={scale}")


# The run layout of test_embedding_backward_order.LAYOUT_COUNTS plus rows that straddle every kind of boundary:
# rows 0..9 own sorted positions [0,5) [5,32) [32,64) [64,97) [97,197) [197,1007) [1007,1047) [1047,3147)
# [3147,3148) [3148,4172); then [4172,5120) ends exactly at a group boundary, [5120,6144) is exactly one
# group, [6144,8193) spans two groups and one position of a third, [8193,8224) is a final short row.
LAYOUT_COUNTS = [5, 27, 32, 33, 100, 810, 40, 2100, 1, 1024, 5 * 1024 - 4172, 1024, 2049, 31]


@pytest.mark.parametrize("padding", [-1, 4, 9], ids=str)
@pytest.mark.parametrize("dim", [13, 64], ids=str)
@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=str)
def test_cuda_matches_cpu_tile_and_group_boundaries(dtype, dim, padding):
    gen = make_generator(99)
    flat = torch.cat([torch.full((c,), r, dtype=torch.int64) for r, c in enumerate(LAYOUT_COUNTS)])
    flat = flat[torch.randperm(flat.numel(), generator=gen)]
    num_weights = len(LAYOUT_COUNTS) + 3
    grad = random_grad((flat.numel(), dim), dtype, gen)
    for scale in (False, True):
        assert_cuda_matches_cpu(grad, flat, num_weights, padding, scale)


@pytest.mark.parametrize("seed", range(12))
def test_cuda_matches_cpu_random_run_lengths(seed):
    """Random run lengths (mostly short, some long), so runs start and end at every offset of tiles and
    groups; padding occurrences sprinkled in."""
    gen = make_generator(1000 + seed)
    rows = 400
    lengths = torch.where(
        torch.rand(rows, generator=gen) < 0.1,
        torch.randint(33, 3000, (rows,), generator=gen),
        torch.randint(1, 40, (rows,), generator=gen),
    )
    lengths[torch.rand(rows, generator=gen) < 0.05] = 0  # rows that never occur
    flat = torch.repeat_interleave(torch.arange(rows), lengths)
    flat = flat[torch.randperm(flat.numel(), generator=gen)]
    dtype = GRAD_DTYPES[seed % 4]
    dim = (5, 8, 16, 33)[seed % 4]
    grad = random_grad((flat.numel(), dim), dtype, gen)
    padding = int(flat[0]) if seed % 3 == 0 else -1
    assert_cuda_matches_cpu(grad, flat, rows + 1, padding, seed % 2 == 0)


# Wide rows and many tiles: level 1 takes several tiles per item (backward_kernels.cuh's tiles_per_item gives
# these 2, 4, 8 and 16 tiles), which must not change a bit.
@pytest.mark.parametrize(
    "dtype,dim,rows",
    [(torch.float32, 512, 2200), (torch.float32, 1024, 2200), (torch.bfloat16, 2048, 4400), (torch.float32, 1024, 8800)],
    ids=["2-tile-items", "4-tile-items", "8-tile-items", "16-tile-items"],
)
def test_cuda_matches_cpu_multi_tile_items(dtype, dim, rows):
    flat, grad = multi_tile_item_case(rows, dim, dtype, seed=rows + dim)
    for padding, scale in [(-1, False), (int(torch.mode(flat).values), True)]:
        assert_cuda_matches_cpu(grad, flat, rows + 2, padding, scale, f"D={dim} pad={padding} scale={scale}")


def test_cuda_matches_cpu_rows_at_item_edges():
    """Runs around the edges of multi-tile level-1 items (embedding_backward_helpers.item_edge_case): ending inside
    or on the end of the next item, starting on an item's start, crossing a group edge, spanning the next item."""
    flat, counts = item_edge_case(seed=7)
    assert min(counts.values()) >= 5, counts
    grad = random_grad((flat.numel(), EDGE_DIM), torch.float32, make_generator(7))
    num_weights = int(flat.max()) + 2
    for padding, scale in [(-1, False), (-1, True), (int(flat[0]), False)]:
        assert_cuda_matches_cpu(grad, flat, num_weights, padding, scale, f"pad={padding} scale={scale}")


@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=str)
def test_cuda_misaligned_grad_takes_scalar_path(dtype):
    """A contiguous grad whose data pointer is not 16-byte aligned (storage offset 1) with a D that would
    otherwise allow 16-byte vectors."""
    gen = make_generator(5)
    n, dim, num_weights = 20_000, 64, 700
    indices = zipf_indices(n, num_weights, gen)
    base = random_grad((n * dim + 1,), dtype, gen)
    grad_cuda = base.to(CUDA)[1:].view(n, dim)
    assert grad_cuda.is_contiguous() and grad_cuda.data_ptr() % 16 != 0
    expected = op(base[1:].view(n, dim).contiguous(), indices, num_weights, 3, True)
    poison_cached_block(num_weights, dim, dtype)
    got = op(grad_cuda, indices.to(CUDA), num_weights, 3, True)
    torch.cuda.synchronize()
    assert_bitwise_equal(got.cpu(), expected, "misaligned grad")


@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=str)
def test_cuda_edge_shapes(dtype):
    gen = make_generator(11)
    # N = 0: zeros (every row untouched), also with padding and scaling
    for shape in [(0,), (0, 3)]:
        grad = torch.empty((*shape, 9), dtype=dtype)
        idx = torch.empty(shape, dtype=torch.int64)
        out = assert_cuda_matches_cpu(grad, idx, 17, 2, True)
        assert_bitwise_equal(out.cpu(), torch.zeros(17, 9, dtype=dtype), "empty")
    # num_weights = 0 with N = 0; D = 0
    assert cuda_op(torch.empty(0, 4, dtype=dtype), torch.empty(0, dtype=torch.int32), 0).shape == (0, 4)
    assert cuda_op(torch.empty(6, 0, dtype=dtype), uniform_indices(6, 3, gen), 3).shape == (3, 0)
    torch.cuda.synchronize()
    # N = 1, D = 1, D = 2, a single row table
    assert_cuda_matches_cpu(random_grad((1, 1), dtype, gen), torch.tensor([0]), 1)
    assert_cuda_matches_cpu(random_grad((3000, 1), dtype, gen), zipf_indices(3000, 40, gen), 40)
    assert_cuda_matches_cpu(random_grad((3000, 2), dtype, gen), hot_row_indices(3000, 40, gen), 40, -1, True)
    assert_cuda_matches_cpu(random_grad((2500, 8), dtype, gen), torch.zeros(2500, dtype=torch.int64), 1)
    # a big table with few indices: almost every row is zero-filled by the untouched-row path
    big = 1 << 21
    idx = torch.tensor([5, big - 1, 5, 123_456, big - 1], dtype=torch.int32)
    out = assert_cuda_matches_cpu(random_grad((5, 16), dtype, gen), idx, big)
    assert int((out != 0).any(dim=1).sum()) == 3
    # 0-d indices
    assert_cuda_matches_cpu(random_grad((7,), dtype, gen), torch.tensor(2), 4)


def test_cuda_signed_zero_and_padding_rows_are_plus_zero():
    for dtype in GRAD_DTYPES:
        grad = torch.full((70, 3), -0.0, dtype=dtype)
        idx = torch.tensor([1] * 40 + [0] * 30)
        out = assert_cuda_matches_cpu(grad, idx, 3, 0)
        assert_bitwise_equal(out.cpu(), torch.zeros(3, 3, dtype=dtype), "all +0")


# --------------------------------------------------------------------------------------------------------
# Repeatability
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=str)
def test_cuda_bitwise_repeatable(dtype):
    gen = make_generator(21)
    n, dim, num_weights = 300_000, 32, 50_000
    indices = zipf_indices(n, num_weights, gen).to(CUDA)
    grad = random_grad((n, dim), dtype, gen).to(CUDA)
    first = op(grad, indices, num_weights, -1, True)
    results = [op(grad, indices, num_weights, -1, True) for _ in range(3)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        on_side = op(grad, indices, num_weights, -1, True)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    for k, r in enumerate(results + [on_side]):
        assert_bitwise_equal(r, first, f"call {k + 2}")


# --------------------------------------------------------------------------------------------------------
# CUDA graph capture
# --------------------------------------------------------------------------------------------------------


def capture_op(static_grad, static_idx, num_weights, padding_idx, scale):
    """Warm up on a side stream, then capture the op into a CUDAGraph. Returns (graph, static_out)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            op(static_grad, static_idx, num_weights, padding_idx, scale)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = torch.ops.graphsafe.embedding_backward(static_grad, static_idx, num_weights, padding_idx, scale)
    torch.cuda.synchronize()
    return graph, static_out


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
    graph, static_out = capture_op(static_grad, static_idx, num_weights, padding_idx, scale)

    for dist in ("zipf", "hot", "uniform"):  # three fresh inputs of the captured shapes
        idx = INDEX_GENERATORS[dist](n, num_weights, gen, dtype=index_dtype)
        grad = random_grad((n, dim), dtype, gen)
        static_grad.copy_(grad.to(CUDA))
        static_idx.copy_(idx.to(CUDA))
        graph.replay()
        torch.cuda.synchronize()
        replayed = static_out.clone()
        eager = op(static_grad, static_idx, num_weights, padding_idx, scale)
        torch.cuda.synchronize()
        graphsafe.check_errors()
        assert_bitwise_equal(replayed, eager, f"replay vs eager ({dist})")
        assert_bitwise_equal(replayed.cpu(), op(grad, idx, num_weights, padding_idx, scale), f"replay vs CPU ({dist})")


# --------------------------------------------------------------------------------------------------------
# Out-of-range indices
# --------------------------------------------------------------------------------------------------------


def _valid_only(grad, indices, num_weights):
    valid = (indices >= 0) & (indices < num_weights)
    return grad[valid].contiguous(), indices[valid].contiguous()


@pytest.mark.parametrize("index_dtype", INDEX_DTYPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cuda_out_of_range_eager(dtype, index_dtype):
    gen = make_generator(41)
    n, dim, num_weights = 20_000, 24, 1000
    indices = zipf_indices(n, num_weights, gen, dtype=index_dtype)
    indices[123] = num_weights
    indices[4567] = -3
    grad = random_grad((n, dim), dtype, gen)

    out = cuda_op(grad, indices, num_weights, 7, True)  # asynchronous: no error raised here
    torch.cuda.synchronize()
    grad_ok, idx_ok = _valid_only(grad, indices, num_weights)
    assert idx_ok.numel() == n - 2
    assert_bitwise_equal(out.cpu(), op(grad_ok, idx_ok, num_weights, 7, True), "valid rows")

    with pytest.raises(graphsafe.DeviceIndexError, match=r"index (1000|-3) is out of range for an embedding with 1000 rows"):
        graphsafe.check_errors()
    graphsafe.check_errors()  # the error was cleared by reporting it

    # One bad value only: the message names exactly it. DeviceIndexError is an IndexError.
    indices2 = uniform_indices(n, num_weights, gen, dtype=index_dtype)
    indices2[n - 1] = num_weights + 5
    cuda_op(grad, indices2, num_weights)
    with pytest.raises(IndexError, match=r"index 1005 is out of range for an embedding with 1000 rows") as info:
        graphsafe.check_errors()
    assert isinstance(info.value, graphsafe.DeviceIndexError)
    graphsafe.check_errors()


def test_cuda_pending_error_raised_by_next_op_call():
    gen = make_generator(43)
    n, dim, num_weights = 5000, 8, 100
    grad = random_grad((n, dim), torch.float32, gen).to(CUDA)
    good = uniform_indices(n, num_weights, gen).to(CUDA)
    bad = good.clone()
    bad[17] = 2**40
    op(grad, bad, num_weights, -1, False)
    torch.cuda.synchronize()  # the kernel has finished; nobody called check_errors
    with pytest.raises(graphsafe.DeviceIndexError, match=r"index 1099511627776 is out of range"):
        op(grad, good, num_weights, -1, False)
    # Reported once: the next call works and is right.
    out = op(grad, good, num_weights, -1, False)
    torch.cuda.synchronize()
    graphsafe.check_errors()
    assert_bitwise_equal(out.cpu(), op(grad.cpu(), good.cpu(), num_weights, -1, False), "after the error")


@pytest.mark.parametrize("dtype,dim", [(torch.float32, 64), (torch.float16, 13)], ids=str)
def test_cuda_out_of_range_in_graph_replay(dtype, dim):
    gen = make_generator(47)
    n, num_weights = 30_000, 2000
    static_grad = random_grad((n, dim), dtype, gen).to(CUDA)
    static_idx = hot_row_indices(n, num_weights, gen, num_hot=20).to(CUDA)
    graph, static_out = capture_op(static_grad, static_idx, num_weights, -1, True)

    # Fresh input with out-of-range values: replay must not write out of bounds, must get the valid
    # rows right, and must leave the error for check_errors.
    idx = zipf_indices(n, num_weights, gen)
    idx[0] = num_weights
    idx[n // 2] = -1
    idx[n - 1] = num_weights + 77
    grad = random_grad((n, dim), dtype, gen)
    static_grad.copy_(grad.to(CUDA))
    static_idx.copy_(idx.to(CUDA))
    graph.replay()
    torch.cuda.synchronize()
    grad_ok, idx_ok = _valid_only(grad, idx, num_weights)
    assert_bitwise_equal(static_out.cpu(), op(grad_ok, idx_ok, num_weights, -1, True), "valid rows after replay")
    with pytest.raises(graphsafe.DeviceIndexError, match=r"index (2000|-1|2077) is out of range for an embedding with 2000 rows"):
        graphsafe.check_errors()
    graphsafe.check_errors()

    # Valid input again: replay is clean.
    idx = uniform_indices(n, num_weights, gen)
    static_idx.copy_(idx.to(CUDA))
    graph.replay()
    torch.cuda.synchronize()
    graphsafe.check_errors()
    assert_bitwise_equal(static_out.cpu(), op(grad, idx, num_weights, -1, True), "clean replay")


# --------------------------------------------------------------------------------------------------------
# graphsafe.nn.Embedding on CUDA
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("padding_idx,scale", [(None, False), (5, True), (-1, False)], ids=str)
def test_nn_embedding_cuda_matches_torch(dtype, padding_idx, scale):
    gen = make_generator(53)
    num_embeddings, dim = 2000, 48
    ref = torch.nn.Embedding(num_embeddings, dim, padding_idx=padding_idx, scale_grad_by_freq=scale,
                             device=CUDA, dtype=dtype)
    with torch.no_grad():
        ref.weight.copy_(random_grad((num_embeddings, dim), dtype, gen).to(CUDA))
    gs = graphsafe.nn.Embedding(num_embeddings, dim, padding_idx=padding_idx, scale_grad_by_freq=scale,
                                device=CUDA, dtype=dtype)
    gs.load_state_dict(ref.state_dict())
    indices = zipf_indices((16, 512), num_embeddings, gen)
    if ref.padding_idx is not None:
        indices[:, ::11] = ref.padding_idx
    upstream = random_grad((16, 512, dim), dtype, gen)

    grads = {}
    for name, module in (("torch", ref), ("graphsafe", gs)):
        out = module(indices.to(CUDA))
        (out * upstream.to(CUDA)).sum().backward()
        grads[name] = module.weight.grad.cpu()
    assert_bitwise_equal(gs(indices.to(CUDA)).detach().cpu(), ref(indices.to(CUDA)).detach().cpu(), "forward")

    pad = gs.padding_idx
    ref64, bound_gs = fp64_reference_and_bound(upstream, indices, num_embeddings, pad, scale)
    _, bound_torch = fp64_reference_and_bound(upstream, indices, num_embeddings, pad, scale, accumulation=dtype)
    assert_within_bound(grads["graphsafe"], ref64, bound_gs, "graphsafe CUDA grad vs fp64")
    assert_within_bound(grads["torch"], ref64, bound_torch, "torch CUDA grad vs fp64")
    assert_within_bound(grads["graphsafe"], grads["torch"].double(), bound_gs + bound_torch, "graphsafe vs torch")
    # and bitwise what the CPU backend gives for the same upstream gradient
    cpu = op(upstream, indices, num_embeddings, -1 if pad is None else pad, scale)
    assert_bitwise_equal(grads["graphsafe"], cpu, "CUDA module grad vs CPU op")


def test_nn_embedding_training_step_captures():
    """Forward, backward and an SGD step of a graphsafe.nn.Embedding captured in one CUDA graph, replayed
    on fresh batches, give bit for bit the weights of the same steps run eagerly."""
    gen = make_generator(59)
    vocab, dim, batch, length = 3000, 32, 64, 40
    init = random_grad((vocab, dim), torch.float32, gen)

    def make():
        emb = graphsafe.nn.Embedding(vocab, dim, padding_idx=0, scale_grad_by_freq=True, device=CUDA)
        with torch.no_grad():
            emb.weight.copy_(init.to(CUDA))
        return emb, torch.optim.SGD(emb.parameters(), lr=0.1)

    def step(emb, opt, tokens, upstream):
        opt.zero_grad(set_to_none=False)
        loss = (emb(tokens) * upstream).sum()
        loss.backward()
        opt.step()
        return loss

    batches = [
        (zipf_indices((batch, length), vocab, gen).to(CUDA), random_grad((batch, length, dim), torch.float32, gen).to(CUDA))
        for _ in range(4)
    ]

    eager_emb, eager_opt = make()
    for tokens, upstream in batches:
        step(eager_emb, eager_opt, tokens, upstream)

    emb, opt = make()
    static_tokens = batches[0][0].clone()
    static_upstream = batches[0][1].clone()
    # warm-up on a side stream (allocates .grad), then restore the initial weights
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step(emb, opt, static_tokens, static_upstream)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    with torch.no_grad():
        emb.weight.copy_(init.to(CUDA))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(emb, opt, static_tokens, static_upstream)
    torch.cuda.synchronize()
    with torch.no_grad():
        emb.weight.copy_(init.to(CUDA))  # capture does not run the step, but be explicit

    for tokens, upstream in batches:
        static_tokens.copy_(tokens)
        static_upstream.copy_(upstream)
        graph.replay()
    torch.cuda.synchronize()
    graphsafe.check_errors()
    assert_bitwise_equal(emb.weight.detach(), eager_emb.weight.detach(), "captured training vs eager")


# --------------------------------------------------------------------------------------------------------
# Review follow-ups: NaN encoding, padding-heavy batches, the first call inside a capture
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_cuda_nan_results_match_cpu_bitwise(dtype):
    """NaN inputs and inf - inf give NaN rows; both backends write the same canonical NaN bits."""
    gen = make_generator(61)
    n, dim, num_weights = 300, 16, 40
    grad = random_grad((n, dim), dtype, gen)
    indices = uniform_indices(n, num_weights, gen)
    grad[3, 2] = float("nan")
    grad[7, 5] = float("inf")
    grad[8, 5] = float("-inf")
    indices[8] = indices[7]
    assert_cuda_matches_cpu(grad, indices, num_weights, -1, False, "NaN rows")
    assert_cuda_matches_cpu(grad, indices, num_weights, -1, True, "NaN rows, scaled")


@pytest.mark.parametrize("padding_fraction", [0.5, 0.9, 1.0], ids=str)
def test_cuda_mostly_padding_matches_cpu(padding_fraction):
    """Padding occurrences sort last and their gradient rows are skipped; the rest is unchanged."""
    gen = make_generator(67)
    n, dim, num_weights = 50_000, 64, 3000
    grad = random_grad((n, dim), torch.bfloat16, gen)
    indices = zipf_indices(n, num_weights, gen)
    pad = torch.rand(n, generator=gen) < padding_fraction
    indices[pad] = 0
    assert_cuda_matches_cpu(grad, indices, num_weights, 0, False, f"padding fraction {padding_fraction}")


def test_cuda_first_graphsafe_call_inside_a_capture():
    """A fresh process whose first graphsafe CUDA call is being captured (the error record is allocated
    then): capture succeeds and replays match the CPU."""
    import subprocess
    import sys

    script = r"""
import torch, graphsafe
g = torch.randn(1000, 32, device="cuda"); i = torch.randint(0, 100, (1000,), device="cuda")
s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    out = torch.ops.graphsafe.embedding_backward(g, i, 100, -1, False)
graph.replay(); torch.cuda.synchronize()
assert torch.equal(out.cpu(), torch.ops.graphsafe.embedding_backward(g.cpu(), i.cpu(), 100, -1, False))
graphsafe.check_errors()
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "ok" in done.stdout, done.stdout + done.stderr
