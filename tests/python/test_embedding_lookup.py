"""graphsafe.ops.embedding (the forward lookup of graphsafe.nn.Embedding) against weight[indices].

The lookup copies rows, so it must equal torch's gather bit for bit, on the CPU and on CUDA; on CUDA an
out-of-range index gives a zero row and a DeviceIndexError later, never a device-side assert.
"""

from __future__ import annotations

import pytest
import torch

import graphsafe
from conftest import CUDA_USABLE, assert_bitwise_equal, make_generator, requires_cuda

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64)
DEVICES = ["cpu"] + (["cuda"] if CUDA_USABLE else [])


def _weight(num_weights, dim, dtype, gen):
    if dtype.is_floating_point:
        return torch.randn(num_weights, dim, generator=gen).to(dtype)
    return torch.randint(-1000, 1000, (num_weights, dim), generator=gen, dtype=dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("index_dtype", (torch.int32, torch.int64), ids=str)
@pytest.mark.parametrize("shape,dim", [((37,), 8), ((4, 9), 13), ((2, 3, 5), 1), ((0,), 4), ((6,), 0)], ids=str)
def test_lookup_equals_gather(device, dtype, index_dtype, shape, dim):
    gen = make_generator(5)
    weight = _weight(50, dim, dtype, gen).to(device)
    indices = torch.randint(0, 50, shape, generator=gen).to(index_dtype).to(device)
    out = graphsafe.ops.embedding(weight, indices, -1, False)
    assert out.shape == (*shape, dim) and out.dtype == dtype
    assert_bitwise_equal(out.cpu(), weight.cpu()[indices.cpu().long()], "lookup")


@pytest.mark.parametrize("device", DEVICES)
def test_lookup_accepts_non_contiguous_indices(device):
    gen = make_generator(6)
    weight = _weight(30, 16, torch.float32, gen).to(device)
    indices = torch.randint(0, 30, (8, 6), generator=gen).to(device).t()
    assert not indices.is_contiguous()
    assert_bitwise_equal(graphsafe.ops.embedding(weight, indices).cpu(), weight.cpu()[indices.cpu()], "lookup")


def test_lookup_out_of_range_on_cpu_raises_index_error():
    weight = torch.randn(10, 4)
    for bad in (10, -1):
        with pytest.raises(IndexError, match=rf"index {bad} at position 2 is out of range for an embedding with 10 rows"):
            graphsafe.ops.embedding(weight, torch.tensor([1, 2, bad, 3]))


def test_lookup_rejects_bad_input():
    with pytest.raises(TypeError, match="int32 or int64"):
        graphsafe.ops.embedding(torch.randn(10, 4), torch.tensor([1.0]))
    with pytest.raises(ValueError, match="2-D"):
        graphsafe.ops.embedding(torch.randn(10), torch.tensor([1]))
    with pytest.raises(ValueError, match="meta"):
        graphsafe.ops.embedding(torch.randn(10, 4), torch.tensor([1], device="meta"))


@requires_cuda
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_cuda_lookup_out_of_range_gives_zero_row_and_error(dtype):
    gen = make_generator(7)
    weight = _weight(100, 24, dtype, gen).cuda()
    indices = torch.tensor([3, 100, 7, -5, 99], device="cuda")
    out = graphsafe.ops.embedding(weight, indices)
    torch.cuda.synchronize()
    expected = weight[indices.clamp(0, 99)].clone()
    expected[1] = 0
    expected[3] = 0
    assert_bitwise_equal(out.cpu(), expected.cpu(), "valid rows kept, bad rows zero")
    with pytest.raises(graphsafe.DeviceIndexError, match=r"index (100|-5) is out of range for an embedding with 100 rows"):
        graphsafe.check_errors()
    graphsafe.check_errors()  # reported once


@requires_cuda
def test_cuda_module_step_with_bad_batch_in_replay_stays_alive():
    """A captured forward+backward replayed on a batch with a bad index: no assert, a clear error, and the
    process keeps working (the next clean replay is right)."""
    gen = make_generator(8)
    emb = graphsafe.nn.Embedding(500, 32).cuda()
    static_idx = torch.randint(0, 500, (64,), generator=gen).cuda()

    def step():
        emb.weight.grad = None
        emb(static_idx).square().sum().backward()
        return emb.weight.grad

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    emb.weight.grad = None
    with torch.cuda.graph(graph):
        emb(static_idx).square().sum().backward()
    static_grad = emb.weight.grad

    bad = torch.randint(0, 500, (64,), generator=gen)
    bad[5] = 500
    static_idx.copy_(bad.cuda())
    graph.replay()
    torch.cuda.synchronize()
    with pytest.raises(graphsafe.DeviceIndexError):
        graphsafe.check_errors()

    good = torch.randint(0, 500, (64,), generator=gen)
    static_idx.copy_(good.cuda())
    graph.replay()
    torch.cuda.synchronize()
    graphsafe.check_errors()
    reference = torch.nn.Embedding(500, 32).cuda()
    with torch.no_grad():
        reference.weight.copy_(emb.weight)
    reference(good.cuda()).square().sum().backward()
    torch.testing.assert_close(static_grad, reference.weight.grad, rtol=1e-5, atol=1e-5)
