"""Bad-input matrix for graphsafe's public entry points other than the optimizers (issue 18, item 2):
graphsafe.ops.* (embedding_backward, embedding_backward_sparse, embedding, quantize_blockwise, dequantize_blockwise,
quantization_map, check_block_size), graphsafe.nn.Embedding, and `import graphsafe` itself (graphsafe.compile_step:
test_bad_inputs_compile_step.py).

Each case feeds one kind of bad input (wrong dtype, meta or mixed devices, non-contiguous and zero-stride
views, empty tensors, sizes past int32/int64, out-of-range and negative indices, tensor subclasses, sparse
and nested tensors) and asserts either a refusal (exception type plus a message fragment a user can act on)
or the documented handling (README.md, docs/embedding.md, docs/optim.md). Inputs a C++ kernel could read
through a wrong pointer run in a subprocess (`run_isolated`), so that a crash fails one test instead of
ending pytest. The optimizers' half of the matrix is test_bad_inputs_optim.py and test_bad_inputs_checkpoints.py;
the helpers all three use are in bad_inputs.py.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import graphsafe
import graphsafe.ops as gops
from bad_inputs import (LAYOUT_WORDS, META, NESTED_REFUSAL, Wrapper, as_sub, check_isolated, dense, gen_tensor,
                        handled_or_refused, idx, isolated_fixture, refused, same)

HERE = os.path.dirname(os.path.abspath(__file__))
NAN, INF = float("nan"), float("inf")
CUDA = torch.cuda.is_available() and graphsafe.cuda_backend_built()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device and graphsafe's CUDA backend")

# --------------------------------------------------------------------------------------------------------
# graphsafe.ops.embedding_backward and embedding_backward_sparse (the same checks: every refusal is asked of both)
# --------------------------------------------------------------------------------------------------------


def eb(grad, indices, num_weights=8, padding_idx=-1, scale=False, op=gops.embedding_backward):
    def call():
        return op(grad, indices, num_weights, padding_idx, scale)
    call.args = (grad, indices, num_weights, padding_idx, scale)  # to ask the other op the same
    return call


def ebs(grad, indices, num_weights=8, padding_idx=-1, scale=False):
    return eb(grad, indices, num_weights, padding_idx, scale, op=gops.embedding_backward_sparse)


G34 = gen_tensor(3, 4)
I3 = idx(0, 5, 2)

EB_REFUSED = {
    **{f"grad-{d}": (eb(torch.ones(3, 4, dtype=d), I3), TypeError, r"grad.*float32")
       for d in (torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64)},
    **{f"indices-{d}": (eb(G34, torch.zeros(3, dtype=d)), TypeError, r"indices.*int32 or int64")
       for d in (torch.float32, torch.float64, torch.int16, torch.uint8, torch.bool)},
    "grad-meta-indices-cpu": (eb(G34.to(META), I3), (ValueError, RuntimeError), r"meta"),
    "grad-cpu-indices-meta": (eb(G34, I3.to(META)), (ValueError, RuntimeError), r"meta"),
    "grad-0d": (eb(torch.tensor(1.0), torch.tensor(0)), ValueError, r"grad.*shape|0-d"),
    "shape-mismatch": (eb(gen_tensor(2, 4), I3), ValueError, r"shape"),
    "grad-transposed": (eb(gen_tensor(4, 3).t(), I3), ValueError, r"contiguous"),
    "grad-expanded-stride0": (eb(gen_tensor(1, 4).expand(3, 4), I3), ValueError, r"contiguous"),
    "indices-transposed": (eb(gen_tensor(3, 2, 4), idx(0, 1, 2, 3, 4, 5).view(2, 3).t()), ValueError, r"contiguous"),
    "indices-expanded-stride0": (eb(G34, idx(1).expand(3)), ValueError, r"contiguous"),
    "index-too-large": (eb(G34, idx(0, 8, 1)), IndexError, r"8"),
    "index-negative": (eb(G34, idx(0, -1, 1)), IndexError, r"-1"),
    "index-negative-int32": (eb(G34, idx(0, -3, 1, dtype=torch.int32)), IndexError, r"-3"),
    "index-past-int32-range": (eb(G34, idx(0, 2**32 + 1, 1)), IndexError, r"4294967297|range"),
    "index-int64-min": (eb(G34, idx(0, -(2**63), 1)), IndexError, r"range|-9223372036854775808"),
    "index-on-zero-rows": (eb(G34, I3, num_weights=0), IndexError, r"range|0 rows|num_weights"),
    "padding-idx-too-large": (eb(G34, I3, padding_idx=8), ValueError, r"padding_idx"),
    "padding-idx-too-negative": (eb(G34, I3, padding_idx=-10), ValueError, r"padding_idx"),
    "num-weights-negative": (eb(G34, I3, num_weights=-1), ValueError, r"num_weights"),
    "num-weights-int32-max": (eb(G34, I3, num_weights=2**31 - 1), ValueError, r"num_weights"),
    "num-weights-past-int64": (eb(G34, I3, num_weights=2**63), (ValueError, RuntimeError, OverflowError),
                               r"num_weights|int64|overflow|range"),
    "indices-past-int32-count-meta": (eb(torch.empty(2**31, 1, device=META), torch.empty(2**31, dtype=torch.int64,
                                                                                        device=META)),
                                      ValueError, r"2\^31|indices"),
    "2^31-indices-zero-stride": (eb(torch.zeros(1, 1).expand(2**31 + 1, 1), idx(0).expand(2**31 + 1)), ValueError,
                                 r"contiguous|2\^31"),
    # [2^30, 2^40] has 2^70 elements: no int64 can count the result. (The row-sparse result of no index has no
    # rows: test_embedding_backward_sparse_sizes_its_result_by_min_n_and_rows.)
    "result-past-int64-meta": (eb(torch.empty(0, 2**40, device=META), torch.empty(0, dtype=torch.int64, device=META),
                                  num_weights=2**30), (ValueError, RuntimeError), r"overflow|size|num_weights|2\^"),
}


@pytest.mark.parametrize("case", EB_REFUSED)
def test_embedding_backward_refuses(case):
    fn, types, pattern = EB_REFUSED[case]
    refused(fn, types, pattern, f"embedding_backward[{case}]")


@pytest.mark.parametrize("case", [c for c in EB_REFUSED if c != "result-past-int64-meta"])
def test_embedding_backward_sparse_refuses_as_the_dense_op(case):
    """The same call with embedding_backward_sparse: the same exception type and message."""
    dense_fn, types, pattern = EB_REFUSED[case]
    dense_error = refused(dense_fn, types, pattern, f"embedding_backward[{case}]")
    sparse_error = refused(ebs(*dense_fn.args), types, pattern, f"embedding_backward_sparse[{case}]")
    assert type(sparse_error) is type(dense_error)
    # torch's own argument errors quote the op's schema; graphsafe's are word for word the dense op's.
    if not str(dense_error).startswith("graphsafe::embedding_backward("):
        assert str(sparse_error) == str(dense_error)


def test_embedding_backward_sparse_sizes_its_result_by_min_n_and_rows():
    """U = min(N, num_weights): no index asks for no rows however wide or tall the table (nothing allocated)."""
    rows, row_grads, count = gops.embedding_backward_sparse(torch.empty(0, 2**40, device=META),
                                                            torch.empty(0, dtype=torch.int64, device=META), 2**30)
    assert rows.shape == (0,) and row_grads.shape == (0, 2**40) and count.shape == ()
    rows, row_grads, count = gops.embedding_backward_sparse(torch.empty(0, 2**40), idx(), 2**30)
    assert rows.shape == (0,) and row_grads.shape == (0, 2**40) and int(count) == 0


def _ref_backward(grad, indices, num_weights):
    return torch.ops.aten.embedding_dense_backward(grad.double(), indices.long(), num_weights, -1, False).to(grad.dtype)


EB_HANDLED = {
    "grad-float64": (gen_tensor(3, 4, dtype=torch.float64), I3, 8),
    "no-indices": (torch.empty(0, 4), idx(), 5),
    "no-indices-2d": (torch.empty(2, 0, 4), torch.empty(2, 0, dtype=torch.int64), 5),
    "zero-rows-no-indices": (torch.empty(0, 4), idx(), 0),
    "zero-width": (torch.empty(3, 0), I3, 8),
    "0d-index": (gen_tensor(4), torch.tensor(2), 8),
    "int32-indices-at-last-row": (G34, idx(7, 7, 0, dtype=torch.int32), 8),
}


@pytest.mark.parametrize("case", EB_HANDLED)
def test_embedding_backward_handles(case):
    grad, indices, num_weights = EB_HANDLED[case]
    out = gops.embedding_backward(grad, indices, num_weights)
    assert out.shape == (num_weights, grad.shape[-1]) and out.dtype == grad.dtype
    assert torch.equal(out, _ref_backward(grad, indices, num_weights))


@pytest.mark.parametrize("case", EB_HANDLED)
def test_embedding_backward_sparse_handles(case):
    grad, indices, num_weights = EB_HANDLED[case]
    rows, row_grads, count = gops.embedding_backward_sparse(grad, indices, num_weights)
    u, c = min(indices.numel(), num_weights), int(count)
    assert rows.shape == (u,) and row_grads.shape == (u, grad.shape[-1]) and row_grads.dtype == grad.dtype
    scattered = torch.zeros(num_weights, grad.shape[-1], dtype=grad.dtype)
    scattered[rows[:c]] = row_grads[:c]
    assert torch.equal(scattered, _ref_backward(grad, indices, num_weights)) and bool((rows[c:] == -1).all())


def test_embedding_backward_on_meta_tensors_gives_the_shape():
    out = gops.embedding_backward(G34.to(META), I3.to(META), 8)
    assert out.device.type == "meta" and out.shape == (8, 4) and out.dtype == torch.float32


def test_embedding_backward_on_meta_tensors_past_int32_rows():
    out = gops.embedding_backward(torch.empty(3, 2, device=META), I3.to(META), 2**31 - 2)
    assert out.shape == (2**31 - 2, 2)


def test_out_of_range_index_writes_nothing_and_the_op_still_works():
    refused(eb(G34, idx(0, 9, 1)), IndexError, r"9")
    assert torch.equal(gops.embedding_backward(G34, I3, 8), _ref_backward(G34, I3, 8))
    refused(ebs(G34, idx(0, 9, 1)), IndexError, r"9")
    rows, row_grads, count = gops.embedding_backward_sparse(G34, I3, 8)
    assert rows.tolist() == [0, 2, 5] and int(count) == 3
    assert torch.equal(row_grads, _ref_backward(G34, I3, 8)[[0, 2, 5]])


# --------------------------------------------------------------------------------------------------------
# graphsafe.ops.embedding (lookup) and graphsafe.nn.Embedding
# --------------------------------------------------------------------------------------------------------

W54 = gen_tensor(5, 4, seed=1)


def lookup(weight, indices, padding_idx=-1):
    return lambda: gops.embedding(weight, indices, padding_idx)


LOOKUP_REFUSED = {
    **{f"indices-{d}": (lookup(W54, torch.zeros(3, dtype=d)), TypeError, r"indices.*int32 or int64")
       for d in (torch.float32, torch.int16, torch.bool, torch.uint8)},
    "weight-1d": (lookup(W54.view(-1), I3), ValueError, r"weight.*2-D"),
    "weight-3d": (lookup(W54.view(5, 2, 2), I3), ValueError, r"weight.*2-D"),
    "weight-cpu-indices-meta": (lookup(W54, I3.to(META)), (ValueError, RuntimeError), r"meta"),
    "weight-meta-indices-cpu": (lookup(W54.to(META), I3), (ValueError, RuntimeError), r"meta"),
    "index-too-large": (lookup(W54, idx(0, 5)), IndexError, r"5|range"),
    "index-negative": (lookup(W54, idx(0, -1)), IndexError, r"-1|range"),
    "index-past-int32-range": (lookup(W54, idx(0, 2**32 + 1)), IndexError, r"4294967297|range"),
    "index-on-zero-rows": (lookup(torch.empty(0, 4), idx(0)), IndexError, r"out of range|0 rows"),
    "index-on-zero-rows-int32": (lookup(torch.empty(0, 4), idx(0, dtype=torch.int32)), IndexError,
                                 r"out of range|0 rows"),
    "padding-idx-too-large": (lookup(W54, I3.clamp(max=4), padding_idx=5), ValueError, r"padding_idx"),
    "transposed-weight-index-too-large": (lookup(gen_tensor(4, 5).t(), idx(7)), IndexError, r"range|7"),
}


@pytest.mark.parametrize("case", LOOKUP_REFUSED)
def test_embedding_lookup_refuses(case):
    fn, types, pattern = LOOKUP_REFUSED[case]
    refused(fn, types, pattern, f"embedding[{case}]")


LOOKUP_HANDLED = {
    "no-indices": (W54, idx()),
    "no-indices-2d": (W54, torch.empty(2, 0, dtype=torch.int64)),
    "zero-rows-no-indices": (torch.empty(0, 4), idx()),
    "zero-width": (torch.empty(5, 0), I3.clamp(max=4)),
    "0d-index": (W54, torch.tensor(3)),
    "transposed-weight": (gen_tensor(4, 5).t(), I3.clamp(max=4)),
    "expanded-weight-stride0": (gen_tensor(1, 4).expand(5, 4), I3.clamp(max=4)),
    "transposed-indices": (W54, idx(0, 1, 2, 3, 4, 0).view(2, 3).t()),
    "expanded-indices-stride0": (W54, idx(4).expand(6)),
    "int32-indices": (W54, idx(4, 0, 3, dtype=torch.int32)),
    **{f"weight-{d}": (W54.to(d), idx(4, 0, 3)) for d in (torch.float64, torch.float16, torch.bfloat16)},
}


@pytest.mark.parametrize("case", LOOKUP_HANDLED)
def test_embedding_lookup_handles(case):
    weight, indices = LOOKUP_HANDLED[case]
    same(gops.embedding(weight, indices), F.embedding(indices, weight), f"embedding[{case}]")


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.complex64], ids=str)
def test_embedding_lookup_of_a_non_float_weight_matches_torch_or_is_refused(dtype):
    weight = (W54 * 10).to(dtype)
    indices = idx(4, 0, 3)
    handled_or_refused(lambda: gops.embedding(weight, indices),
                       lambda out: same(out, F.embedding(indices, weight)), TypeError, r"weight.*dtype|float",
                       f"embedding of a {dtype} weight")


def test_embedding_lookup_on_meta_tensors_past_int32_sizes():
    weight = torch.empty(2**31 + 10, 2, device=META)
    assert gops.embedding(weight, I3.to(META)).shape == (3, 2)
    handled_or_refused(lambda: gops.embedding(W54.to(META), torch.empty(2**31 + 1, dtype=torch.int64, device=META)),
                       lambda out: out.shape == (2**31 + 1, 4), ValueError, r"2\^31|indices")


NN_REFUSED = {
    "max_norm": (lambda: graphsafe.nn.Embedding(5, 4, max_norm=1.0), NotImplementedError, r"max_norm.*renorm"),
    "sparse": (lambda: graphsafe.nn.Embedding(5, 4, sparse=True), NotImplementedError, r"sparse.*skip_zeros"),
    "float-indices": (lambda: graphsafe.nn.Embedding(5, 4)(torch.zeros(3)), TypeError, r"indices"),
    "index-too-large": (lambda: graphsafe.nn.Embedding(5, 4)(idx(5)), IndexError, r"5|range"),
    "index-negative": (lambda: graphsafe.nn.Embedding(5, 4)(idx(-1)), IndexError, r"-1|range"),
    "zero-rows-index": (lambda: graphsafe.nn.Embedding(0, 4)(idx(0)), IndexError, r"out of range|0 rows"),
    "meta-indices": (lambda: graphsafe.nn.Embedding(5, 4)(I3.to(META)), (ValueError, RuntimeError), r"meta"),
}


@pytest.mark.parametrize("case", NN_REFUSED)
def test_nn_embedding_refuses(case):
    fn, types, pattern = NN_REFUSED[case]
    refused(fn, types, pattern, f"nn.Embedding[{case}]")


@pytest.mark.parametrize("shape", [(0,), (2, 0)], ids=str)
@pytest.mark.parametrize("rows", [0, 5])
def test_nn_embedding_with_no_indices_gives_an_empty_result_and_a_zero_gradient(rows, shape):
    emb = graphsafe.nn.Embedding(rows, 4)
    out = emb(torch.empty(shape, dtype=torch.int64))
    assert out.shape == (*shape, 4)
    out.sum().backward()
    assert emb.weight.grad is not None and torch.equal(emb.weight.grad, torch.zeros(rows, 4))


def test_nn_embedding_non_contiguous_indices_and_gradient_match_torch():
    emb = graphsafe.nn.Embedding(6, 3)
    ref = torch.nn.Embedding(6, 3)
    ref.weight.data.copy_(emb.weight.data)
    indices = idx(0, 1, 2, 3, 4, 5, 5, 0).view(2, 4).t()  # non-contiguous, repeated rows
    upstream = gen_tensor(3, 4, 2).permute(1, 2, 0)  # non-contiguous incoming gradient [4, 2, 3]
    emb(indices).backward(upstream)
    ref(indices).backward(upstream)
    torch.testing.assert_close(emb.weight.grad, ref.weight.grad, rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------------------------------------
# 8-bit blockwise quantisation ops
# --------------------------------------------------------------------------------------------------------

X = gen_tensor(3, 100, seed=2)
CODES, ABSMAX = gops.quantize_blockwise(X, 256)


def quant(x, block_size=256, signed=True):
    return lambda: gops.quantize_blockwise(x, block_size, signed)


def dequant(codes, absmax, block_size=256, signed=True):
    return lambda: gops.dequantize_blockwise(codes, absmax, block_size, signed)


BAD_BLOCK_SIZES = [0, -256, 16, 100, 2048, True, 256.0, "256", None]

QUANT_REFUSED = {
    **{f"x-{d}": (quant(torch.ones(8).to(d)), TypeError, r"floating")
       for d in (torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64)},
    "x-list": (quant([1.0, 2.0]), TypeError, r"tensor"),
    "x-meta": (quant(X.to(META)), (TypeError, ValueError), r"meta"),
    "x-meta-past-int32": (quant(torch.empty(2**31 + 1, device=META)), (TypeError, ValueError), r"meta"),
    **{f"block-size-{b!r}": (quant(X, b), ValueError, r"block_size") for b in BAD_BLOCK_SIZES},
    **{f"dequant-codes-{d}": (dequant(CODES.to(d), ABSMAX), TypeError, r"codes.*uint8")
       for d in (torch.int8, torch.int32, torch.float32, torch.bool)},
    **{f"dequant-absmax-{d}": (dequant(CODES, ABSMAX.to(d)), TypeError, r"absmax.*float32")
       for d in (torch.float64, torch.float16, torch.int32)},
    "dequant-absmax-short": (dequant(CODES, ABSMAX[:-1]), ValueError, r"absmax"),
    "dequant-absmax-long": (dequant(CODES, torch.cat([ABSMAX, ABSMAX])), ValueError, r"absmax"),
    "dequant-absmax-empty": (dequant(CODES, torch.empty(0)), ValueError, r"absmax"),
    "dequant-codes-meta": (dequant(CODES.to(META), ABSMAX.to(META)), (TypeError, ValueError), r"meta"),
    "dequant-absmax-meta": (dequant(CODES, ABSMAX.to(META)), (TypeError, ValueError), r"meta"),
    "dequant-codes-meta-absmax-cpu": (dequant(CODES.to(META), ABSMAX), (TypeError, ValueError), r"meta"),
    **{f"dequant-block-size-{b!r}": (dequant(CODES, ABSMAX, b), ValueError, r"block_size") for b in BAD_BLOCK_SIZES},
    # 2^33 codes as a zero-stride view (nothing allocated) with 3 scales: refused by counting, before any copy.
    "dequant-2^33-codes-wrong-absmax": (dequant(torch.zeros(1, dtype=torch.uint8).expand(2**33), ABSMAX),
                                        ValueError, r"absmax"),
}


@pytest.mark.parametrize("case", QUANT_REFUSED)
def test_quantization_ops_refuse(case):
    fn, types, pattern = QUANT_REFUSED[case]
    refused(fn, types, pattern, f"quantization[{case}]")


@pytest.mark.parametrize("bad", BAD_BLOCK_SIZES, ids=repr)
def test_check_block_size_refuses(bad):
    refused(lambda: gops.check_block_size(bad), ValueError, r"block_size.*power of two")


def test_check_block_size_accepts_the_documented_range():
    for b in (32, 64, 128, 256, 512, 1024):
        gops.check_block_size(b)


QUANT_HANDLED = {
    "float64": gen_tensor(300, dtype=torch.float64),
    "float16": gen_tensor(300, dtype=torch.float16),
    "bfloat16": gen_tensor(300, dtype=torch.bfloat16),
    "transposed": gen_tensor(100, 3).t(),
    "expanded-stride0": gen_tensor(1, 100).expand(3, 100),
    "empty": torch.empty(0),
    "empty-2d": torch.empty(3, 0),
    "0d": torch.tensor(-2.5),
}


@pytest.mark.parametrize("case", QUANT_HANDLED)
def test_quantization_handles_views_dtypes_and_empty(case):
    x = QUANT_HANDLED[case]
    codes, absmax = gops.quantize_blockwise(x, 32)
    ref_codes, ref_absmax = gops.quantize_blockwise(x.float().contiguous().clone(), 32)
    assert codes.shape == x.shape and codes.dtype == torch.uint8
    assert absmax.shape == ((x.numel() + 31) // 32,) and absmax.dtype == torch.float32
    same(codes, ref_codes, "codes")
    same(absmax, ref_absmax, "absmax")
    # dequantize of non-contiguous / zero-stride codes and absmax: the values of the contiguous ones
    out = gops.dequantize_blockwise(codes.t() if codes.dim() == 2 else codes, absmax, 32)
    ref = gops.dequantize_blockwise((ref_codes.t() if codes.dim() == 2 else ref_codes).contiguous(), ref_absmax, 32)
    same(out, ref, "dequantized")


def test_dequantize_with_zero_stride_absmax():
    codes, absmax = gops.quantize_blockwise(torch.full((64,), 0.5), 32)
    out = gops.dequantize_blockwise(codes, absmax[:1].expand(2), 32)
    same(out, gops.dequantize_blockwise(codes, absmax, 32))


@pytest.mark.parametrize("signed", [True, False])
def test_quantize_non_finite_values_leave_their_block_as_a_zero_would(signed):
    """DESIGN.md: one non-finite value never damages its block's scale or its neighbours' codes. As
    src/optim/blockwise.h now states it: a non-finite value is stored as 0 and takes no part in the absmax, so
    the block is quantised exactly as with 0 in its place. (docs/optim.md said before: inf as FLT_MAX, NaN
    makes the absmax NaN.)"""
    x = torch.tensor([1.0, INF, -2.0] + [0.5] * 29 + [NAN] + [0.25] * 30 + [-INF] + [0.125] * 32)
    zeroed = torch.where(torch.isfinite(x), x, torch.zeros(()))
    codes, absmax = gops.quantize_blockwise(x, 32, signed)
    ref_codes, ref_absmax = gops.quantize_blockwise(zeroed, 32, signed)
    same(absmax, ref_absmax, "absmax")
    same(codes, ref_codes, "codes")


@pytest.mark.parametrize("signed", [True, False])
def test_quantization_map_on_meta_and_cpu(signed):
    qmap = gops.quantization_map(signed)
    assert qmap.shape == (256,) and qmap.dtype == torch.float32 and bool((qmap[1:] > qmap[:-1]).all())
    assert gops.quantization_map(signed, device="meta").shape == (256,)


def test_quantization_map_bad_device_is_refused():
    refused(lambda: gops.quantization_map(True, device="no_such_device"), (RuntimeError, ValueError), r"device")


def test_every_public_op_is_in_the_matrix():
    covered = {"embedding_backward", "embedding_backward_sparse", "embedding", "quantize_blockwise",
               "dequantize_blockwise", "quantization_map"}
    assert set(gops.__all__) <= covered, f"new entry points without bad-input cases: {set(gops.__all__) - covered}"


# --------------------------------------------------------------------------------------------------------
# Subclasses, sparse and nested tensors, and sizes that must not crash: each in a child Python
# --------------------------------------------------------------------------------------------------------

CLEAR_SUBCLASS = r"subclass|Sub|Wrapper|" + LAYOUT_WORDS


def _nested_float():
    return torch.nested.nested_tensor([gen_tensor(2, 4), gen_tensor(1, 4)])


def _nested_index():
    return torch.nested.nested_tensor([idx(0, 1), idx(2)])


def _eb_sub(make_grad, make_indices):
    def case():
        grad, indices = make_grad(G34), make_indices(I3)
        handled_or_refused(lambda: gops.embedding_backward(grad, indices, 8),
                           lambda out: same(out, _ref_backward(G34, I3, 8)), (TypeError, ValueError), CLEAR_SUBCLASS)
    return case


def _ebs_sub(make_grad, make_indices):
    def case():
        grad, indices = make_grad(G34), make_indices(I3)

        def check(out):
            rows, row_grads, count = (dense(t) for t in out)
            same(rows, idx(0, 2, 5), "rows")
            same(row_grads, _ref_backward(G34, I3, 8)[[0, 2, 5]], "row_grads")
            assert int(count) == 3
        handled_or_refused(lambda: gops.embedding_backward_sparse(grad, indices, 8), check, (TypeError, ValueError),
                           CLEAR_SUBCLASS)
    return case


def _lookup_sub(make_weight, make_indices):
    def case():
        weight, indices = make_weight(W54), make_indices(I3.clamp(max=4))
        handled_or_refused(lambda: gops.embedding(weight, indices), lambda out: same(dense(out), W54[I3.clamp(max=4)]),
                           (TypeError, ValueError), CLEAR_SUBCLASS)
    return case


def _quant_sub(make_x):
    def case():
        x = make_x(X)
        handled_or_refused(lambda: gops.quantize_blockwise(x, 32),
                           lambda out: (same(out[0], gops.quantize_blockwise(X, 32)[0]),
                                        same(out[1], gops.quantize_blockwise(X, 32)[1])),
                           (TypeError, ValueError), CLEAR_SUBCLASS)
    return case


def _refuses(fn, pattern=LAYOUT_WORDS, types=(TypeError, ValueError)):
    return lambda: refused(fn, types, pattern)


def _keep(t):
    return t


ISOLATED_OPS = {
    "eb-grad-subclass": _eb_sub(as_sub, _keep),
    "eb-indices-subclass": _eb_sub(_keep, as_sub),
    "eb-grad-wrapper": _eb_sub(Wrapper, _keep),
    "eb-both-wrapper": _eb_sub(Wrapper, Wrapper),
    "eb-grad-sparse-coo": _refuses(lambda: gops.embedding_backward(G34.to_sparse(), I3, 8)),
    "eb-grad-sparse-csr": _refuses(lambda: gops.embedding_backward(G34.to_sparse_csr(), I3, 8)),
    "eb-indices-sparse": _refuses(lambda: gops.embedding_backward(G34, I3.to_sparse(), 8)),
    "eb-grad-nested": _refuses(lambda: gops.embedding_backward(_nested_float(), _nested_index(), 8),
                               types=NESTED_REFUSAL),
    # An empty [0, 2^40] gradient asks for a [2^20, 2^40] result (2^62 bytes) or a [2^30, 2^40] one (past int64).
    "eb-result-2^62-bytes": _refuses(lambda: gops.embedding_backward(torch.empty(0, 2**40), idx(), 2**20),
                                     r"memory|alloc|size|overflow|2\^", (ValueError, RuntimeError, MemoryError)),
    "eb-result-past-int64": _refuses(lambda: gops.embedding_backward(torch.empty(0, 2**40), idx(), 2**30),
                                     r"overflow|size|2\^", (ValueError, RuntimeError)),
    "ebs-grad-subclass": _ebs_sub(as_sub, _keep),
    "ebs-indices-subclass": _ebs_sub(_keep, as_sub),
    "ebs-grad-wrapper": _ebs_sub(Wrapper, _keep),
    "ebs-grad-sparse-coo": _refuses(lambda: gops.embedding_backward_sparse(G34.to_sparse(), I3, 8)),
    "ebs-grad-sparse-csr": _refuses(lambda: gops.embedding_backward_sparse(G34.to_sparse_csr(), I3, 8)),
    "ebs-indices-sparse": _refuses(lambda: gops.embedding_backward_sparse(G34, I3.to_sparse(), 8)),
    "ebs-grad-nested": _refuses(lambda: gops.embedding_backward_sparse(_nested_float(), _nested_index(), 8),
                                types=NESTED_REFUSAL),
    "lookup-weight-subclass": _lookup_sub(as_sub, _keep),
    "lookup-indices-subclass": _lookup_sub(_keep, as_sub),
    "lookup-weight-wrapper": _lookup_sub(Wrapper, _keep),
    # A sparse weight may go through torch's own kernel (the op's docstring: rare layouts), or be refused.
    "lookup-weight-sparse-coo": _lookup_sub(lambda w: w.to_sparse(), _keep),
    "lookup-weight-sparse-csr": _lookup_sub(lambda w: w.to_sparse_csr(), _keep),
    "lookup-indices-sparse": _refuses(lambda: gops.embedding(W54, I3.clamp(max=4).to_sparse())),
    # A nested tensor may be refused by the dispatcher itself (NotImplementedError naming NestedTensor).
    "lookup-indices-nested": _refuses(lambda: gops.embedding(W54, _nested_index()), types=NESTED_REFUSAL),
    "lookup-weight-nested": _refuses(lambda: gops.embedding(_nested_float(), I3), types=NESTED_REFUSAL),
    "nn-embedding-nested-indices": _refuses(lambda: graphsafe.nn.Embedding(5, 4)(_nested_index()),
                                            types=NESTED_REFUSAL),
    "quant-subclass": _quant_sub(as_sub),
    "quant-wrapper": _quant_sub(Wrapper),
    "quant-sparse-coo": _refuses(lambda: gops.quantize_blockwise(X.to_sparse(), 32)),
    "quant-sparse-csr": _refuses(lambda: gops.quantize_blockwise(X.to_sparse_csr(), 32)),
    "quant-nested": _refuses(lambda: gops.quantize_blockwise(_nested_float(), 32), types=NESTED_REFUSAL),
    "dequant-codes-sparse": _refuses(lambda: gops.dequantize_blockwise(CODES.to_sparse(), ABSMAX)),
    "dequant-absmax-sparse": _refuses(lambda: gops.dequantize_blockwise(CODES, ABSMAX.to_sparse())),
    "dequant-codes-subclass": lambda: handled_or_refused(
        lambda: gops.dequantize_blockwise(as_sub(CODES), ABSMAX),
        lambda out: same(out, gops.dequantize_blockwise(CODES, ABSMAX)), (TypeError, ValueError), CLEAR_SUBCLASS),
}

_start_isolated_ops, isolated_ops_results = isolated_fixture(__name__, "ISOLATED_OPS")


@pytest.mark.parametrize("case", ISOLATED_OPS)
def test_ops_on_unreadable_tensors_refuse_without_crashing(isolated_ops_results, case):
    check_isolated(isolated_ops_results, case)


# --------------------------------------------------------------------------------------------------------
# CUDA mixing (skipped without a GPU)
# --------------------------------------------------------------------------------------------------------


@needs_cuda
def test_cuda_mixed_devices_are_refused():
    cuda = torch.device("cuda")
    refused(eb(G34.to(cuda), I3), ValueError, r"cuda.*cpu|cpu.*cuda")
    refused(eb(G34, I3.to(cuda)), ValueError, r"cuda.*cpu|cpu.*cuda")
    refused(ebs(G34.to(cuda), I3), ValueError, r"cuda.*cpu|cpu.*cuda")
    refused(lookup(W54.to(cuda), I3.clamp(max=4)), ValueError, r"cuda.*cpu|cpu.*cuda")
    refused(dequant(CODES.to(cuda), ABSMAX), ValueError, r"cuda.*cpu|cpu.*cuda")
    emb = graphsafe.nn.Embedding(5, 4, device=cuda)
    refused(lambda: emb(I3.clamp(max=4)), ValueError, r"cuda.*cpu|cpu.*cuda")


# --------------------------------------------------------------------------------------------------------
# import graphsafe (fresh interpreters, outside the source tree; started with the module's first test)
# --------------------------------------------------------------------------------------------------------

IMPORT_CASES = {  # each the first use of graphsafe.graph in its interpreter
    "graph-attribute": "import graphsafe\nassert callable(graphsafe.graph.capture_gate)",
    "hasattr-graph-then-compile_step": (
        "import graphsafe\nassert hasattr(graphsafe, 'graph')\nassert callable(graphsafe.compile_step)\n"
        "try:\n    graphsafe.no_such_name\nexcept AttributeError as e:\n    assert 'no_such_name' in str(e)\n"
        "else:\n    raise SystemExit('no AttributeError')"),
    "star-import": "from graphsafe import *\nassert graph.capture_gate and compile_step and ops and optim and nn",
}


@pytest.fixture(scope="module", autouse=True)
def import_processes(tmp_path_factory):
    """Started when the module's first test runs, read by test_import_in_a_fresh_interpreter."""
    cwd = tmp_path_factory.mktemp("fresh_import")  # not the source tree: the installed graphsafe
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    procs = {name: subprocess.Popen([sys.executable, "-c", code], cwd=cwd, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True) for name, code in IMPORT_CASES.items()}
    yield procs
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


@pytest.mark.parametrize("case", IMPORT_CASES)
def test_import_in_a_fresh_interpreter(import_processes, case):
    _, stderr = import_processes[case].communicate(timeout=180)
    rc = import_processes[case].returncode
    assert rc == 0, f"{IMPORT_CASES[case]!r} failed in a fresh interpreter (exit {rc}): {stderr[-1500:]}"
