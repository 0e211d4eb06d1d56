"""The blockwise quantisation behind 8-bit optimizer states (state_bits=8): the maps and the quantize_blockwise /
dequantize_blockwise ops, on the CPU.

What is checked, and against what:

* The maps: graphsafe.ops.quantization_map is rebuilt (optim_8bit_helpers.documented_map) from the formula in
  src/optim/blockwise.h and docs/optim.md (a sign, a decade 10^-d for d = 0..6, equal steps inside a decade,
  midpoints), so the test does not trust the library's own table; plus the basic shape (256 strictly increasing
  values, exact -1/0/1 in the signed map, 0/1 and nothing negative in the unsigned one).
* quantize_blockwise / dequantize_blockwise against an independent reference (optim_8bit_helpers.reference_quantize):
  absmax per block over its finite values only, x / absmax formed in fp32 (as the library documents) and then the
  nearest map value found by brute force over all 256 values in float64, exact ties going to the value
  nearer zero; NaN and ±inf get the code of 0 (docs/optim.md, "Non-finite values"). Codes and absmax must be *equal*, not close. The round-trip error bound is derived from the
  rounding rule alone: |dequant(quant(x)) - x| <= (half the gap between the two map values around
  x / absmax) * absmax + 4 fp32 ulps of absmax (one rounding of x / absmax, one of map[code] * absmax,
  doubled for margin). Nothing in it is fitted to the implementation.
* Argument checking of the ops.
"""

from __future__ import annotations

import pytest
import torch

import graphsafe.ops as ops
from conftest import assert_bitwise_equal, make_generator
from optim_8bit_helpers import FP32_ULP, MAPS, local_half_gap, reference_quantize


# --------------------------------------------------------------------------------------------------------
# Maps
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_map_shape(signed):
    m = ops.quantization_map(signed)
    assert m.dtype == torch.float32 and m.shape == (256,)
    assert bool((m[1:] > m[:-1]).all()), "map values are not strictly increasing"
    values = set(m.tolist())
    assert 0.0 in values and 1.0 in values and float(m[-1]) == 1.0
    if signed:
        assert -1.0 in values and float(m[0]) == -1.0
        assert int(m.eq(0).nonzero()) == 127  # -1, 126 negative levels, then 0
    else:
        assert float(m[0]) == 0.0 and bool((m >= 0).all()), "unsigned map holds negative values"


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_map_matches_its_documented_construction(signed):
    assert_bitwise_equal(ops.quantization_map(signed), MAPS[signed], "quantization_map vs the documented formula")


# --------------------------------------------------------------------------------------------------------
# quantize_blockwise / dequantize_blockwise
# --------------------------------------------------------------------------------------------------------


def heavy_tailed(n, gen, signed):
    """Values spread over many decades (so every decade of the map is used), some exact zeros."""
    x = torch.randn(n, generator=gen) * torch.exp(2.5 * torch.randn(n, generator=gen))
    x[torch.rand(n, generator=gen) < 0.02] = 0.0
    return x if signed else x.abs()


def assert_quantize_matches_reference(x, block_size, signed, what):
    codes, absmax = ops.quantize_blockwise(x, block_size, signed)
    ref_codes, ref_absmax = reference_quantize(x, block_size, signed)
    assert codes.dtype == torch.uint8 and codes.shape == x.shape, what
    assert absmax.dtype == torch.float32 and absmax.shape == (-(-x.numel() // block_size),), what
    assert_bitwise_equal(absmax, ref_absmax, f"{what}: absmax")
    mismatch = codes != ref_codes
    assert not bool(mismatch.any()), (
        f"{what}: {int(mismatch.sum())} code(s) differ from the reference; first at "
        f"{mismatch.nonzero()[0].tolist()}: got {int(codes[mismatch][0])}, expected {int(ref_codes[mismatch][0])}"
    )
    return codes, absmax


@pytest.mark.parametrize("block_size", [32, 64, 256, 1024])
@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_quantize_matches_reference_and_error_bound(signed, block_size):
    gen = make_generator(100 + block_size + signed)
    for n in (block_size, 3 * block_size + 7, 5000, 1):  # whole blocks and a partial last block
        x = heavy_tailed(n, gen, signed)
        what = f"signed={signed} block={block_size} n={n}"
        codes, absmax = assert_quantize_matches_reference(x, block_size, signed, what)
        # 2-D input: the blocks run over the row-major order
        x2 = heavy_tailed(n * 3, gen, signed).reshape(3, n)
        assert_quantize_matches_reference(x2, block_size, signed, what + " 2-D")

        out = ops.dequantize_blockwise(codes, absmax, block_size, signed)
        assert out.dtype == torch.float32 and out.shape == x.shape
        expected = MAPS[signed][codes.long()] * absmax.repeat_interleave(block_size)[:n]
        assert_bitwise_equal(out, expected, f"{what}: dequantised = map[code] * absmax")
        scale = absmax.repeat_interleave(block_size)[:n].double()
        ratio = torch.where(scale > 0, x.double() / scale, torch.zeros_like(scale))
        bound = local_half_gap(ratio, signed) * scale + 4 * FP32_ULP * scale
        err = (out.double() - x.double()).abs()
        assert bool((err <= bound).all()), f"{what}: round-trip error above half the local map gap"
        # and so below half the largest gap of the map times absmax
        largest = float((MAPS[signed][1:] - MAPS[signed][:-1]).max()) / 2
        assert bool((err <= largest * scale + 4 * FP32_ULP * scale).all())


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_quantize_exact_ties_go_toward_zero(signed):
    """Inputs at the exact midpoint of two map values (those representable in fp32), and one fp32 ulp to
    either side, in blocks whose absmax is 1 (so x / absmax = x exactly)."""
    qmap = MAPS[signed].to(torch.float64)
    mids64 = (qmap[1:] + qmap[:-1]) / 2
    mids = mids64.to(torch.float32)
    exact = mids.double() == mids64
    assert int(exact.sum()) > 50, "too few exact midpoints to test the tie rule"
    below = torch.nextafter(mids, torch.tensor(-2.0))
    above = torch.nextafter(mids, torch.tensor(2.0))
    values = torch.stack([below, mids, above], dim=1).reshape(-1)
    block = 32
    per_block = block - 1
    chunks = [torch.cat([torch.ones(1), values[i : i + per_block]]) for i in range(0, values.numel(), per_block)]
    x = torch.cat(chunks)
    codes, absmax = assert_quantize_matches_reference(x, block, signed, f"ties signed={signed}")
    assert bool((absmax == 1).all())
    # explicitly: an exact tie decodes to the map value of smaller magnitude
    lookup = {float(v): i for i, v in enumerate(x.tolist())}
    for k in exact.nonzero().flatten().tolist():
        got = float(MAPS[signed][int(codes[lookup[float(mids[k])]])])
        lo, hi = float(qmap[k]), float(qmap[k + 1])
        assert got == (lo if abs(lo) < abs(hi) else hi), f"tie between {lo} and {hi} went to {got}"


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_quantize_zero_blocks_and_nan(signed):
    block = 64
    gen = make_generator(7)
    x = heavy_tailed(5 * block + 9, gen, signed)
    x[block : 2 * block] = 0.0  # an all-zero block
    x[2 * block : 3 * block] = -0.0 if signed else 0.0
    x[3 * block + 5] = float("nan")  # a NaN in block 3
    x[4 * block :] = float("nan")  # a block (the partial last one) of NaN only
    codes, absmax = assert_quantize_matches_reference(x, block, signed, f"zeros and NaN signed={signed}")
    zero_code = 127 if signed else 0
    for b in (1, 2, 4):
        assert float(absmax[b]) == 0.0
        assert bool((codes[b * block : (b + 1) * block] == zero_code).all()), "all-zero block: codes are not 0"
    # The NaN is stored as 0 and leaves the block's scale and its neighbours' codes as 0 in its place would.
    zeroed = x.clone()
    zeroed[3 * block + 5] = 0.0
    codes0, absmax0 = ops.quantize_blockwise(zeroed[: 4 * block], block, signed)
    assert_bitwise_equal(absmax[:4], absmax0, "absmax with the NaN vs with 0 in its place")
    assert_bitwise_equal(codes[: 4 * block], codes0, "codes with the NaN vs with 0 in its place")
    out = ops.dequantize_blockwise(codes, absmax, block, signed)
    assert bool(torch.isfinite(out).all()), "a NaN was stored"
    assert bool((out[block : 3 * block] == 0).all()) and float(out[3 * block + 5]) == 0.0


def test_quantize_unsigned_clamps_negatives_to_zero():
    x = torch.tensor([0.5, -0.25, 1.0, -2.0] * 8)
    codes, absmax = assert_quantize_matches_reference(x, 32, False, "unsigned with negatives")
    out = ops.dequantize_blockwise(codes, absmax, 32, False)
    assert float(absmax[0]) == 2.0
    assert bool((out[x < 0] == 0).all())


def test_quantize_other_float_dtypes_are_taken_as_fp32():
    gen = make_generator(8)
    x = heavy_tailed(700, gen, True)
    for dtype in (torch.float64, torch.bfloat16, torch.float16):
        xd = x.to(dtype)
        codes, absmax = ops.quantize_blockwise(xd, 128, True)
        ref_codes, ref_absmax = ops.quantize_blockwise(xd.float(), 128, True)
        assert torch.equal(codes, ref_codes) and torch.equal(absmax, ref_absmax), dtype


def test_quantize_empty():
    codes, absmax = ops.quantize_blockwise(torch.empty(0), 256)
    assert codes.shape == (0,) and absmax.shape == (0,)
    assert ops.dequantize_blockwise(codes, absmax, 256).shape == (0,)


# --------------------------------------------------------------------------------------------------------
# Bad input to the ops
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [0, -256, 16, 31, 48, 100, 2048, 256.0, True])
def test_ops_reject_bad_block_size(block_size):
    x = torch.randn(300)
    with pytest.raises(ValueError):
        ops.quantize_blockwise(x, block_size)
    codes, absmax = ops.quantize_blockwise(x, 256)
    with pytest.raises(ValueError):
        ops.dequantize_blockwise(codes, absmax, block_size)


@pytest.mark.parametrize("bad", [torch.arange(10, dtype=torch.int32), torch.ones(10, dtype=torch.bool),
                                 torch.ones(10, dtype=torch.uint8), [0.5, 1.0]], ids=["int32", "bool", "uint8", "list"])
def test_quantize_rejects_non_float_input(bad):
    with pytest.raises(TypeError):
        ops.quantize_blockwise(bad, 32)


def test_dequantize_rejects_bad_codes_and_absmax():
    codes, absmax = ops.quantize_blockwise(torch.randn(300), 64)  # 5 blocks
    with pytest.raises(ValueError):
        ops.dequantize_blockwise(codes, absmax[:4], 64)
    with pytest.raises(ValueError):
        ops.dequantize_blockwise(codes, torch.cat([absmax, absmax[:1]]), 64)
    with pytest.raises(ValueError):
        ops.dequantize_blockwise(codes, absmax, 128)  # 3 blocks of 128 expected
    with pytest.raises(TypeError):
        ops.dequantize_blockwise(codes.to(torch.int32), absmax, 64)
    with pytest.raises(TypeError):
        ops.dequantize_blockwise(codes, absmax.double(), 64)


# --------------------------------------------------------------------------------------------------------
# Non-finite values (found in review)
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_quantize_stores_infinity_as_zero_and_keeps_it_out_of_the_scale(signed):
    """±inf is stored as 0 and takes no part in its block's absmax: the other elements keep the codes they would
    have with 0 in its place (a scale of inf, or of FLT_MAX, would decode them all as NaN, or as 0)."""
    gen = make_generator(12)
    x = heavy_tailed(512, gen, signed)
    x[3], x[300], x[301] = float("inf"), float("-inf"), float("nan")
    codes, absmax = assert_quantize_matches_reference(x, 256, signed, f"infinities signed={signed}")
    zeroed = torch.where(torch.isfinite(x), x, torch.zeros_like(x))
    codes0, absmax0 = ops.quantize_blockwise(zeroed, 256, signed)
    assert_bitwise_equal(absmax, absmax0, "absmax with ±inf vs with 0 in its place")
    assert_bitwise_equal(codes, codes0, "codes with ±inf vs with 0 in its place")
    y = ops.dequantize_blockwise(codes, absmax, 256, signed)
    assert bool(torch.isfinite(y).all()) and float(y[3]) == float(y[300]) == float(y[301]) == 0.0
