"""8-bit blockwise optimizer states (state_bits=8) and the quantisation ops, on the CPU.

What is checked, and against what:

* The maps: graphsafe.ops.quantization_map is rebuilt here from the formula in src/optim/blockwise.h and
  docs/optim.md (a sign, a decade 10^-d for d = 0..6, equal steps inside a decade, midpoints), so the test
  does not trust the library's own table; plus the basic shape (256 strictly increasing values, exact
  -1/0/1 in the signed map, 0/1 and nothing negative in the unsigned one).
* quantize_blockwise / dequantize_blockwise against an independent reference written here: absmax per
  block over its finite values only, x / absmax formed in fp32 (as the library documents) and then the
  nearest map value found by brute force over all 256 values in float64, exact ties going to the value
  nearer zero; NaN and ±inf get the code of 0 (docs/optim.md, "Non-finite values"). Codes and absmax must be *equal*, not close. The round-trip error bound is derived from the
  rounding rule alone: |dequant(quant(x)) - x| <= (half the gap between the two map values around
  x / absmax) * absmax + 4 fp32 ulps of absmax (one rounding of x / absmax, one of map[code] * absmax,
  doubled for margin). Nothing in it is fitted to the implementation.
* Argument checking of the ops and of the optimizer options.
* Every one of the nine algorithms with 8-bit states against the same algorithm with fp32 states. There is
  no exact reference for a quantised optimizer, so these bounds are *empirical* (measured on the CPU with
  the fixed seeds below, then given about 2x margin): after 60 steps on 20000 N(0, 0.5^2) weights with
  N(0, 1) gradients, ||update_8bit - update_32bit|| / ||update_32bit|| is about 0.5-2.2% for all but Lion
  (about 6%: Lion's update is sign(.), so every momentum element whose sign flips under rounding moves a
  full lr). The bounds are 5% and 12%. Dequantised states are within about 1.5-2.5% of the fp32 states,
  except the slow EMAs (beta >= 0.99: Lion's exp_avg, RMSprop's grad_avg, AdEMAMix's exp_avg_slow), where
  an increment (1 - beta) * g is below the local quantisation step and rounding errors accumulate: about
  5.4-6%; bounds 5% and 12%. The bounds guard against a broken 8-bit path (a wrong map, a stale absmax, the
  update using the requantised instead of the fresh state, a state never written back...), which shows up
  as errors of tens of percent or more, not against the inherent loss of 8-bit rounding.
* skip_zeros with 8-bit states, on an embedding-like table whose rows are quantisation blocks: rows with an
  all-zero gradient keep their parameters, codes and absmax bit-identical (with weight_decay > 0, so they
  would move otherwise); in partly skipped blocks a skipped element's state moves only by requantisation,
  i.e. by at most half the local gap between neighbouring map values times the block's new absmax (the
  docs allow one full gap; nearest rounding gives half); without zeros skip_zeros=True is bit-identical
  to skip_zeros=False.
* AdEMAMix's three states with an element count that is not a multiple of the block size.
* min_8bit_size, state_dict round trips and 32 <-> 8-bit conversions, state_bytes, bitwise repeatability
  (also across OpenMP thread counts).
* A NaN or ±inf gradient element, for all nine algorithms: never more non-finite parameters than with fp32
  states, and (element-wise algorithms, and LAMB's states) every other element's parameter, codes and every
  block's absmax bitwise equal to a run where that element's gradient was 0 (the bad element's states are
  stored as 0, and a zero gradient on a zero parameter keeps them 0).
"""

from __future__ import annotations

import io
import math

import pytest
import torch

import graphsafe.ops as ops
import graphsafe.optim as go
from conftest import assert_bitwise_equal, assert_same_run, libgomp, make_generator, rel_err, state_tensors

# --------------------------------------------------------------------------------------------------------
# The nine algorithms, with every optional state switched on and weight_decay > 0
# --------------------------------------------------------------------------------------------------------

CASES = {
    "Adam": (go.Adam, dict(lr=1e-3, weight_decay=0.01, amsgrad=True)),
    "AdamW": (go.AdamW, dict(lr=1e-3, weight_decay=0.01)),
    "SGD": (go.SGD, dict(lr=1e-3, momentum=0.9, nesterov=True, weight_decay=0.01)),
    "RMSprop": (go.RMSprop, dict(lr=1e-3, alpha=0.99, momentum=0.5, centered=True, weight_decay=0.01)),
    "Adagrad": (go.Adagrad, dict(lr=1e-3, lr_decay=0.01, initial_accumulator_value=0.1, weight_decay=0.01)),
    "Lion": (go.Lion, dict(lr=1e-3, weight_decay=0.01)),
    "LAMB": (go.LAMB, dict(lr=1e-3, weight_decay=0.01)),
    "LARS": (go.LARS, dict(lr=0.1, momentum=0.9, weight_decay=0.01)),
    "AdEMAMix": (go.AdEMAMix, dict(lr=1e-3, weight_decay=0.01)),
}
CASE_NAMES = tuple(CASES)

# The states of each case (with the options above) and which map each uses, as documented in
# docs/optim.md "8-bit states": first moments / momentum / grad_avg / the slow EMA are signed, second
# moments, Adagrad's sum and RMSprop's square_avg unsigned.
STATE_NAMES = {
    "Adam": ["exp_avg", "exp_avg_sq", "max_exp_avg_sq"],
    "AdamW": ["exp_avg", "exp_avg_sq"],
    "SGD": ["momentum_buffer"],
    "RMSprop": ["square_avg", "grad_avg", "momentum_buffer"],
    "Adagrad": ["sum"],
    "Lion": ["exp_avg"],
    "LAMB": ["exp_avg", "exp_avg_sq"],
    "LARS": ["momentum_buffer"],
    "AdEMAMix": ["exp_avg", "exp_avg_slow", "exp_avg_sq"],
}
SIGNED = {
    "exp_avg": True, "exp_avg_slow": True, "grad_avg": True, "momentum_buffer": True,
    "exp_avg_sq": False, "max_exp_avg_sq": False, "square_avg": False, "sum": False,
}


def make_opt(case, params, **extra):
    cls, kw = CASES[case]
    return cls(params, **dict(kw, **extra))


def initial_state_value(case, name):
    return CASES[case][1].get("initial_accumulator_value", 0.0) if name == "sum" else 0.0


def dequantized_state(opt, p, name) -> torch.Tensor:
    """An 8-bit state's fp32 values, decoded with the documented map of that state (not the stored one)."""
    s = opt.state[p]
    return ops.dequantize_blockwise(s[name], s[f"{name}_absmax"], s["block_size"], SIGNED[name])


def nonzero_randn(shape, gen, scale=1.0):
    g = torch.randn(shape, generator=gen) * scale
    return torch.where(g == 0, torch.ones_like(g), g)


# --------------------------------------------------------------------------------------------------------
# An independent model of the maps and of the quantiser
# --------------------------------------------------------------------------------------------------------


def documented_map(signed: bool) -> torch.Tensor:
    """The map from its description: in each decade [0.1, 1] * 10^-d (d = 0..6), 2^(7-d) (unsigned) or
    2^(6-d) (signed) levels at the midpoints of equal steps, formed in double and rounded to fp32 once;
    unsigned = 0, levels, 1; signed = -1, the negated levels without the smallest, 0, levels, 1."""
    positive = []
    for d in range(6, -1, -1):
        scale = 1.0
        for _ in range(d):
            scale /= 10.0
        n = 2 ** ((6 if signed else 7) - d)
        positive += [scale * (0.1 + 0.9 * (i + 0.5) / n) for i in range(n)]
    positive = torch.tensor(positive, dtype=torch.float64).to(torch.float32)
    parts = [torch.tensor([0.0]), positive, torch.tensor([1.0])]
    if signed:
        parts = [torch.tensor([-1.0]), -positive[1:].flip(0)] + parts
    return torch.cat(parts).to(torch.float32)


MAPS = {True: documented_map(True), False: documented_map(False)}


def reference_quantize(x: torch.Tensor, block_size: int, signed: bool):
    """(codes, absmax) of x by the documented rule, brute force: a block's absmax is the largest |value| among
    its finite values (0 if none), and a non-finite value (NaN, ±inf) gets the code of 0, so the block is
    quantised as if 0 stood in its place."""
    flat = x.detach().to(torch.float32).reshape(-1)
    finite = torch.isfinite(flat)
    flat = torch.where(finite, flat, torch.zeros_like(flat))
    n = flat.numel()
    blocks = -(-n // block_size)
    padded = torch.zeros(blocks * block_size, dtype=torch.float32)
    padded[:n] = flat
    per_block = padded.view(blocks, block_size)
    absmax = per_block.abs().amax(dim=1)
    scale = absmax.repeat_interleave(block_size)[:n]
    # as documented: value * fp32(1 / absmax); value and absmax first times 2^24 when absmax is subnormal
    prescale = torch.where(scale < torch.finfo(torch.float32).tiny, 2.0**24, 1.0).to(torch.float32)
    inverse = torch.where(scale > 0, 1.0 / (scale * prescale), torch.zeros_like(scale))
    normalized = (flat * prescale) * inverse
    qmap = MAPS[signed].to(torch.float64)
    dist = (qmap[None, :] - normalized.to(torch.float64)[:, None]).abs()
    nearest = dist == dist.min(dim=1, keepdim=True).values
    # among equally near map values (an exact tie), the one nearer zero
    codes = torch.where(nearest, qmap.abs()[None, :], torch.full_like(dist, math.inf)).argmin(dim=1)
    codes[~finite] = 127 if signed else 0  # the code of 0
    return codes.to(torch.uint8).reshape(x.shape), absmax


def local_half_gap(ratio: torch.Tensor, signed: bool) -> torch.Tensor:
    """Half the gap between the two map values around each ratio (float64, |ratio| <= 1)."""
    qmap = MAPS[signed].to(torch.float64)
    lower = (torch.searchsorted(qmap, ratio.to(torch.float64).contiguous(), right=True) - 1).clamp(0, 254)
    return (qmap[lower + 1] - qmap[lower]) / 2


FP32_ULP = 2.0**-23


def assert_within_requantization_bound(new, old, new_absmax_per_elem, signed, what):
    """|new - old| <= half the local map gap around old / new_absmax, times new_absmax, + 4 ulps of it."""
    new64, old64, scale = new.double(), old.double(), new_absmax_per_elem.double()
    ratio = torch.where(scale > 0, old64 / scale, torch.zeros_like(old64))
    bound = local_half_gap(ratio, signed) * scale + 4 * FP32_ULP * scale
    err = (new64 - old64).abs()
    bad = ~(err <= bound)
    assert not bool(bad.any()), (
        f"{what}: {int(bad.sum())} element(s) moved by more than the requantisation bound; first: "
        f"err {float(err[bad][0]):.4g} bound {float(bound[bad][0]):.4g}"
    )


# --------------------------------------------------------------------------------------------------------
# 1. Maps
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
# 2. quantize_blockwise / dequantize_blockwise
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
# 3. Bad input to the ops
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
# 4. 8-bit vs 32-bit, every algorithm
# --------------------------------------------------------------------------------------------------------

# Empirical bounds (see the module docstring): measured 0.5-2.2% (Lion ~6%) for the update; states 1.5-2.5%,
# slow EMAs 5.4-6%.
UPDATE_BOUND = {name: 0.05 for name in CASE_NAMES} | {"Lion": 0.12}
SLOW_EMAS = {("Lion", "exp_avg"), ("RMSprop", "grad_avg"), ("AdEMAMix", "exp_avg_slow")}


def state_bound(case, name):
    return 0.12 if (case, name) in SLOW_EMAS else 0.05


def run_8_vs_32(case, numel, steps, seed, **extra):
    gen = make_generator(seed)
    p0 = torch.randn(numel, generator=gen) * 0.5
    p8, p32 = torch.nn.Parameter(p0.clone()), torch.nn.Parameter(p0.clone())
    opt8 = make_opt(case, [p8], state_bits=8, **extra)
    opt32 = make_opt(case, [p32], **extra)
    for _ in range(steps):
        g = torch.randn(numel, generator=gen)
        p8.grad, p32.grad = g, g.clone()
        opt8.step()
        opt32.step()
    return p0, (p8, opt8), (p32, opt32)


@pytest.mark.parametrize("case", CASE_NAMES)
def test_8bit_update_close_to_32bit(case):
    p0, (p8, opt8), (p32, opt32) = run_8_vs_32(case, 20000, 60, seed=200)
    update8, update32 = p8.detach() - p0, p32.detach() - p0
    assert float(update32.norm()) > 0
    err = rel_err(update8, update32)
    assert err <= UPDATE_BOUND[case], f"{case}: 8-bit update off by {err:.4f} (bound {UPDATE_BOUND[case]})"
    state8 = opt8.state[p8]
    assert float(state8["step"]) == 60 and state8["block_size"] == 256
    for name in STATE_NAMES[case]:
        assert state8[name].dtype == torch.uint8 and state8[name].shape == p8.shape
        assert state8[f"{name}_absmax"].shape == (math.ceil(20000 / 256),)
        s_err = rel_err(dequantized_state(opt8, p8, name), opt32.state[p32][name])
        assert s_err <= state_bound(case, name), f"{case} {name}: dequantised state off by {s_err:.4f}"


@pytest.mark.parametrize("case", CASE_NAMES)
def test_each_state_uses_the_documented_map(case):
    gen = make_generator(201)
    p = torch.nn.Parameter(torch.randn(5000, generator=gen))
    opt = make_opt(case, [p], state_bits=8)
    p.grad = torch.randn(5000, generator=gen)
    opt.step()
    state = opt.state[p]
    expected_keys = {"step", "block_size"} | {f"{n}{s}" for n in STATE_NAMES[case] for s in ("", "_absmax", "_qmap")}
    assert set(state) == expected_keys
    for name in STATE_NAMES[case]:
        assert_bitwise_equal(state[f"{name}_qmap"], MAPS[SIGNED[name]], f"{case} {name}: map")
        if not SIGNED[name]:
            assert bool((dequantized_state(opt, p, name) >= 0).all())


# --------------------------------------------------------------------------------------------------------
# 5. skip_zeros with 8-bit states
# --------------------------------------------------------------------------------------------------------

ROWS, DIM = 200, 256  # with block_size=256 a row is one quantisation block
NEVER = 20  # rows 0..19 never get a gradient


def table_grads(gen, steps):
    """Per step: rows < NEVER all zero; of the others, ~30% all zero this step (fully skipped blocks) and the
    rest with ~20% zero elements (partly skipped blocks), half of the zeros -0.0."""
    out = []
    for _ in range(steps):
        g = nonzero_randn((ROWS, DIM), gen)
        idle = torch.rand(ROWS, generator=gen) < 0.3
        idle[:NEVER] = True
        zero = (torch.rand(ROWS, DIM, generator=gen) < 0.2) | idle[:, None]
        negative = torch.rand(ROWS, DIM, generator=gen) < 0.5
        g[zero & negative] = -0.0
        g[zero & ~negative] = 0.0
        out.append((g, idle, zero))
    return out


@pytest.mark.parametrize("case", CASE_NAMES)
def test_skip_zeros_8bit_embedding_table(case):
    gen = make_generator(300)
    initial = torch.randn(ROWS, DIM, generator=gen) * 0.5
    table = torch.nn.Parameter(initial.clone())
    opt = make_opt(case, [table], state_bits=8, block_size=256, min_8bit_size=0, skip_zeros=True)
    steps = table_grads(gen, 8)
    names = STATE_NAMES[case]
    for step, (g, idle, zero) in enumerate(steps):
        p_before = table.detach().clone()
        if step == 0:  # the states the first step creates: the initial values, quantised
            before = {n: ops.quantize_blockwise(torch.full((ROWS, DIM), initial_state_value(case, n)), 256, SIGNED[n])
                      for n in names}
        else:
            before = {n: (opt.state[table][n].clone(), opt.state[table][f"{n}_absmax"].clone()) for n in names}
        table.grad = g
        opt.step()
        what = f"{case} step {step + 1}"
        state = opt.state[table]
        # the parameter of a skipped element is never written
        assert_bitwise_equal(table.detach()[zero], p_before[zero], f"{what}: skipped parameters")
        partly = ~idle[:, None] & zero  # skipped elements of blocks that were requantised
        assert bool(partly.any())
        for n in names:
            codes_before, absmax_before = before[n]
            codes, absmax = state[n], state[f"{n}_absmax"]
            # all-skipped blocks: codes and absmax bit-identical
            assert torch.equal(codes[idle], codes_before[idle]), f"{what}: codes of {n} in all-zero rows changed"
            assert_bitwise_equal(absmax[idle], absmax_before[idle], f"{what}: absmax of {n} in all-zero rows")
            # partly skipped blocks: the skipped elements move only by requantisation
            old = ops.dequantize_blockwise(codes_before, absmax_before, 256, SIGNED[n])
            new = ops.dequantize_blockwise(codes, absmax, 256, SIGNED[n])
            new_scale = absmax[:, None].expand(ROWS, DIM)
            assert_within_requantization_bound(new[partly], old[partly], new_scale[partly], SIGNED[n],
                                               f"{what}: skipped elements of {n} in partly skipped rows")
    # the never-touched rows: exactly as they started, states included
    assert_bitwise_equal(table.detach()[:NEVER], initial[:NEVER], f"{case}: rows that never had a gradient")
    for n in names:
        codes0, absmax0 = ops.quantize_blockwise(torch.full((ROWS, DIM), initial_state_value(case, n)), 256, SIGNED[n])
        assert torch.equal(opt.state[table][n][:NEVER], codes0[:NEVER]), f"{case}: codes of {n} in untouched rows"
        assert_bitwise_equal(opt.state[table][f"{n}_absmax"][:NEVER], absmax0[:NEVER], f"{case}: absmax of {n}")

    # the premise: without skip_zeros the same gradients move those rows (weight_decay > 0)
    off = torch.nn.Parameter(initial.clone())
    opt_off = make_opt(case, [off], state_bits=8, block_size=256, min_8bit_size=0, skip_zeros=False)
    for g, _, _ in steps:
        off.grad = g
        opt_off.step()
    moved = (off.detach()[:NEVER] != initial[:NEVER]).float().mean()
    assert float(moved) > 0.9, f"{case}: without skip_zeros only {float(moved):.2f} of the idle rows moved"


@pytest.mark.parametrize("case", CASE_NAMES)
def test_skip_zeros_8bit_without_zeros_is_bit_identical_to_off(case):
    gen = make_generator(301)
    initial = [torch.randn(ROWS, DIM, generator=gen), torch.randn(5003, generator=gen)]
    grads = [[nonzero_randn(p.shape, gen) for p in initial] for _ in range(6)]
    runs = []
    for skip in (True, False):
        params = [torch.nn.Parameter(p.clone()) for p in initial]
        opt = make_opt(case, params, state_bits=8, block_size=128, min_8bit_size=0, skip_zeros=skip)
        for step_grads in grads:
            for p, g in zip(params, step_grads):
                p.grad = g.clone()
            opt.step()
        runs.append((opt, params))
    (opt_on, params_on), (opt_off, params_off) = runs
    assert_same_run(opt_on, params_on, opt_off, params_off, f"{case}: skip_zeros on vs off without zeros")


# --------------------------------------------------------------------------------------------------------
# 6. AdEMAMix, element count not a multiple of the block size
# --------------------------------------------------------------------------------------------------------


def test_ademamix_8bit_partial_last_block():
    n = 10007
    p0, (p8, opt8), (p32, opt32) = run_8_vs_32("AdEMAMix", n, 40, seed=400, t_alpha=20, t_beta3=20)
    state = opt8.state[p8]
    for name in ("exp_avg", "exp_avg_slow", "exp_avg_sq"):
        assert state[name].dtype == torch.uint8 and state[name].shape == (n,)
        assert state[f"{name}_absmax"].shape == (math.ceil(n / 256),), name
        assert float(state[f"{name}_absmax"][-1]) > 0, f"{name}: the partial last block was not quantised"
        # the 23 elements of the partial last block hold the right values too (measured 1-4%)
        tail = rel_err(dequantized_state(opt8, p8, name)[-(n % 256):], opt32.state[p32][name][-(n % 256):])
        assert tail <= 0.12, f"{name}: last block off by {tail:.3f}"
    assert torch.isfinite(p8.detach()).all()
    err = rel_err(p8.detach() - p0, p32.detach() - p0)
    assert err <= UPDATE_BOUND["AdEMAMix"], f"AdEMAMix 8-bit update off by {err:.4f}"


# --------------------------------------------------------------------------------------------------------
# 7. min_8bit_size
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASE_NAMES)
def test_min_8bit_size(case):
    gen = make_generator(500)
    sizes = [4095, 4096, 6000]  # default min_8bit_size=4096: fp32, 8-bit, 8-bit
    initial = [torch.randn(n, generator=gen) for n in sizes]
    grads = [[torch.randn(n, generator=gen) for n in sizes] for _ in range(3)]
    params = [torch.nn.Parameter(p.clone()) for p in initial]
    opt = make_opt(case, params, state_bits=8)
    small_alone = torch.nn.Parameter(initial[0].clone())
    opt32 = make_opt(case, [small_alone])
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        small_alone.grad = step_grads[0].clone()
        opt.step()
        opt32.step()
    small, *large = params
    for name in STATE_NAMES[case]:
        s = opt.state[small]
        assert s[name].dtype == torch.float32 and s[name].shape == small.shape
        assert f"{name}_absmax" not in s and f"{name}_qmap" not in s and "block_size" not in s
        for q in large:
            assert opt.state[q][name].dtype == torch.uint8
            assert opt.state[q][f"{name}_absmax"].shape == (math.ceil(q.numel() / 256),)
    # the fp32-state parameter steps exactly as it would in a 32-bit optimizer
    assert_same_run(opt, [small], opt32, [small_alone], f"{case}: small parameter in an 8-bit optimizer")

    tiny = torch.nn.Parameter(torch.randn(99, generator=gen))
    big = torch.nn.Parameter(torch.randn(100, generator=gen))
    opt = make_opt(case, [tiny, big], state_bits=8, min_8bit_size=100, block_size=32)
    tiny.grad, big.grad = torch.randn(99, generator=gen), torch.randn(100, generator=gen)
    opt.step()
    name = STATE_NAMES[case][0]
    assert opt.state[tiny][name].dtype == torch.float32 and f"{name}_absmax" not in opt.state[tiny]
    assert opt.state[big][name].dtype == torch.uint8 and opt.state[big][f"{name}_absmax"].shape == (4,)


# --------------------------------------------------------------------------------------------------------
# 8. state_dict
# --------------------------------------------------------------------------------------------------------

SHAPES = [(40, 130), (37,)]  # 5200 elements (a partial last block) and a small one kept in fp32


def stepped(case, gen, steps, **extra):
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]
    opt = make_opt(case, params, **extra)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return opt, params


def saved(opt):
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def continue_both(opt_a, params_a, opt_b, params_b, gen, steps=3):
    for _ in range(steps):
        for a, b in zip(params_a, params_b):
            g = torch.randn(a.shape, generator=gen)
            a.grad, b.grad = g, g.clone()
        opt_a.step()
        opt_b.step()


@pytest.mark.parametrize("case", CASE_NAMES)
def test_state_dict_round_trip_8bit(case):
    gen = make_generator(600)
    opt, params = stepped(case, gen, 3, state_bits=8, block_size=128)
    sd = saved(opt)
    fresh = [torch.nn.Parameter(p.detach().clone()) for p in params]
    loaded = make_opt(case, fresh, state_bits=8, block_size=128, lr=0.5)
    loaded.load_state_dict(sd)
    assert_same_run(opt, params, loaded, fresh, f"{case}: loaded state")
    assert loaded.state[fresh[0]][STATE_NAMES[case][0]].dtype == torch.uint8
    continue_both(opt, params, loaded, fresh, gen)
    assert_same_run(opt, params, loaded, fresh, f"{case}: continued vs reloaded")


@pytest.mark.parametrize("case", ["AdamW", "SGD", "AdEMAMix"])
def test_load_32bit_state_dict_into_8bit_optimizer_quantises(case):
    gen = make_generator(601)
    opt32, params = stepped(case, gen, 3)
    sd = saved(opt32)
    fresh = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt8 = make_opt(case, fresh, state_bits=8, block_size=128)
    opt8.load_state_dict(sd)
    group = opt8.param_groups[0]
    for name in STATE_NAMES[case]:
        state = opt8.state[fresh[0]]
        assert state[name].dtype == torch.uint8, (
            f"{case} {name}: still {state[name].dtype} after loading into an 8-bit optimizer "
            f"(group state_bits is now {group['state_bits']}, block_size {group['block_size']})")
        codes, absmax = ops.quantize_blockwise(opt32.state[params[0]][name], 128, SIGNED[name])
        assert torch.equal(state[name], codes)
        assert_bitwise_equal(state[f"{name}_absmax"], absmax, f"{case} {name}: absmax")
        assert_bitwise_equal(dequantized_state(opt8, fresh[0], name),
                             ops.dequantize_blockwise(codes, absmax, 128, SIGNED[name]), f"{case} {name}: values")
    assert group["state_bits"] == 8 and group["block_size"] == 128


@pytest.mark.parametrize("case", ["AdamW", "SGD", "AdEMAMix"])
def test_load_8bit_state_dict_into_32bit_optimizer_dequantises(case):
    gen = make_generator(602)
    opt8, params = stepped(case, gen, 3, state_bits=8, block_size=128)
    sd = saved(opt8)
    fresh = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt32 = make_opt(case, fresh)
    opt32.load_state_dict(sd)
    group = opt32.param_groups[0]
    for name in STATE_NAMES[case]:
        state = opt32.state[fresh[0]]
        assert state[name].dtype == torch.float32, (
            f"{case} {name}: still {state[name].dtype} after loading into a 32-bit optimizer "
            f"(group state_bits is now {group['state_bits']})")
        s8 = opt8.state[params[0]]
        expected = ops.dequantize_blockwise(s8[name], s8[f"{name}_absmax"], 128, SIGNED[name])
        assert_bitwise_equal(state[name], expected, f"{case} {name}: dequantised on load")
    assert group["state_bits"] == 32


def strip_storage_options(sd):
    """A state_dict whose groups do not dictate the storage (as from a torch.optim optimizer or a graphsafe
    version before state_bits), so the loading optimizer's own state_bits/block_size apply."""
    for group in sd["param_groups"]:
        for key in ("state_bits", "block_size", "min_8bit_size"):
            group.pop(key)
    return sd


@pytest.mark.parametrize("case", CASE_NAMES)
def test_loaded_fp32_states_are_quantised_for_8bit_parameters(case):
    gen = make_generator(603)
    opt32, params = stepped(case, gen, 3)
    sd = strip_storage_options(saved(opt32))
    fresh = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt8 = make_opt(case, fresh, state_bits=8, block_size=128)
    opt8.load_state_dict(sd)
    big, small = fresh
    state = opt8.state[big]
    assert state["block_size"] == 128
    assert_bitwise_equal(state["step"], opt32.state[params[0]]["step"], f"{case}: step")
    for name in STATE_NAMES[case]:
        fp32 = opt32.state[params[0]][name]
        codes, absmax = ops.quantize_blockwise(fp32, 128, SIGNED[name])
        assert state[name].dtype == torch.uint8 and torch.equal(state[name], codes), f"{case} {name}: codes"
        assert_bitwise_equal(state[f"{name}_absmax"], absmax, f"{case} {name}: absmax")
        assert_bitwise_equal(state[f"{name}_qmap"], MAPS[SIGNED[name]], f"{case} {name}: map")
        assert_bitwise_equal(dequantized_state(opt8, big, name), ops.dequantize_blockwise(codes, absmax, 128, SIGNED[name]),
                             f"{case} {name}: values")
        # the small parameter stays fp32, unchanged
        assert_bitwise_equal(opt8.state[small][name], opt32.state[params[1]][name], f"{case} {name}: small param")
    continue_both(opt32, params, opt8, fresh, gen, steps=1)  # and stepping goes on
    assert float(opt8.state[big]["step"]) == 4


@pytest.mark.parametrize("case", CASE_NAMES)
def test_loaded_8bit_states_are_dequantised_for_fp32_parameters(case):
    gen = make_generator(604)
    opt8, params = stepped(case, gen, 3, state_bits=8, block_size=128)
    sd = strip_storage_options(saved(opt8))
    fresh = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt32 = make_opt(case, fresh)
    opt32.load_state_dict(sd)
    state = opt32.state[fresh[0]]
    assert set(state) == {"step", *STATE_NAMES[case]}
    for name in STATE_NAMES[case]:
        s8 = opt8.state[params[0]]
        expected = ops.dequantize_blockwise(s8[name], s8[f"{name}_absmax"], 128, SIGNED[name])
        assert_bitwise_equal(state[name], expected, f"{case} {name}: dequantised on load")


def test_torch_optim_state_dict_loads_into_8bit_optimizer():
    """A torch.optim.AdamW checkpoint (fp32 states, no graphsafe options) into an 8-bit AdamW: quantised."""
    gen = make_generator(605)
    p_torch = torch.nn.Parameter(torch.randn(5000, generator=gen))
    opt_torch = torch.optim.AdamW([p_torch], lr=1e-3)
    for _ in range(2):
        p_torch.grad = torch.randn(5000, generator=gen)
        opt_torch.step()
    p = torch.nn.Parameter(p_torch.detach().clone())
    opt = go.AdamW([p], lr=1e-3, state_bits=8)
    opt.load_state_dict(opt_torch.state_dict())
    for name in ("exp_avg", "exp_avg_sq"):
        codes, absmax = ops.quantize_blockwise(opt_torch.state[p_torch][name], 256, SIGNED[name])
        assert torch.equal(opt.state[p][name], codes) and torch.equal(opt.state[p][f"{name}_absmax"], absmax)


def test_changing_state_bits_between_steps_converts():
    """Setting a group's state_bits between steps converts the states at the next step."""
    gen = make_generator(606)
    p = torch.nn.Parameter(torch.randn(5000, generator=gen))
    opt = go.AdamW([p], state_bits=8)
    p.grad = torch.randn(5000, generator=gen)
    opt.step()
    opt.param_groups[0]["state_bits"] = 32
    p.grad = torch.randn(5000, generator=gen)
    opt.step()
    assert opt.state[p]["exp_avg"].dtype == torch.float32 and "exp_avg_absmax" not in opt.state[p]
    opt.param_groups[0]["state_bits"] = 8
    opt.param_groups[0]["block_size"] = 64
    p.grad = torch.randn(5000, generator=gen)
    opt.step()
    assert opt.state[p]["exp_avg"].dtype == torch.uint8 and opt.state[p]["exp_avg_absmax"].shape == (math.ceil(5000 / 64),)
    assert opt.state[p]["block_size"] == 64 and float(opt.state[p]["step"]) == 3


def test_state_bytes_8bit_adamw():
    n = 1_000_000
    gen = make_generator(607)
    g = torch.randn(n, generator=gen)
    p8, p32 = torch.nn.Parameter(torch.zeros(n)), torch.nn.Parameter(torch.zeros(n))
    opt8, opt32 = go.AdamW([p8], state_bits=8), go.AdamW([p32])
    p8.grad, p32.grad = g, g.clone()
    opt8.step()
    opt32.step()
    blocks = math.ceil(n / 256)
    # two 1-byte codes per element, two fp32 absmax per block, two 256-value fp32 maps, the fp32 step
    assert go.state_bytes(opt8) == 2 * n + 2 * 4 * blocks + 2 * 256 * 4 + 4
    assert go.state_bytes(opt32) == 8 * n + 4
    assert go.state_bytes(opt8) < 0.3 * go.state_bytes(opt32)


# --------------------------------------------------------------------------------------------------------
# 9. Bitwise repeatability
# --------------------------------------------------------------------------------------------------------


def run_8bit(case, seed, shapes=((40, 130), (10007,)), steps=4):
    gen = make_generator(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    opt = make_opt(case, params, state_bits=8, min_8bit_size=0)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return opt, params


@pytest.mark.parametrize("case", CASE_NAMES)
def test_two_identical_8bit_runs_are_bitwise_equal(case):
    opt_a, params_a = run_8bit(case, 700)
    opt_b, params_b = run_8bit(case, 700)
    assert_same_run(opt_a, params_a, opt_b, params_b, f"{case}: run A vs run B")


@pytest.mark.skipif(libgomp() is None, reason="libgomp (graphsafe's OpenMP runtime) not found")
@pytest.mark.parametrize("case", ["AdamW", "LAMB", "LARS"])
def test_8bit_results_do_not_depend_on_thread_count(case):
    gomp = libgomp()
    default = gomp.omp_get_max_threads()
    shapes = ((3 * 4096 + 17,), (100, 50))  # several norm chunks and many quantisation blocks
    try:
        gomp.omp_set_num_threads(1)
        opt_a, params_a = run_8bit(case, 701, shapes)
        gomp.omp_set_num_threads(3)
        opt_b, params_b = run_8bit(case, 701, shapes)
    finally:
        gomp.omp_set_num_threads(default)
    assert_same_run(opt_a, params_a, opt_b, params_b, f"{case}: 1 thread vs 3 threads")


# --------------------------------------------------------------------------------------------------------
# 10. Invalid options
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASE_NAMES)
@pytest.mark.parametrize("bad", [dict(state_bits=12), dict(state_bits=4), dict(state_bits=True), dict(block_size=100),
                                 dict(block_size=16), dict(block_size=2048), dict(block_size=0),
                                 dict(min_8bit_size=-1), dict(min_8bit_size=1.5)],
                         ids=lambda d: "-".join(f"{k}={v}" for k, v in d.items()))
def test_invalid_8bit_options(case, bad):
    p = torch.nn.Parameter(torch.zeros(10))
    with pytest.raises(ValueError):
        make_opt(case, [p], **bad)


# ---- robustness (found in review) ----


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


@pytest.mark.parametrize("case", ["Adam", "AdamW", "RMSprop", "Adagrad"])
def test_gradient_spike_does_not_turn_a_block_into_nan(case):
    """A gradient whose square overflows makes the second moment inf; with fp32 states that element's update
    is ~0 and nothing turns NaN. 8-bit states must not spread NaN to the other elements of the block."""
    p32, p8 = torch.nn.Parameter(torch.ones(4096)), torch.nn.Parameter(torch.ones(4096))
    opt32, opt8 = make_opt(case, [p32]), make_opt(case, [p8], state_bits=8, block_size=256)
    for step in range(2):
        g = torch.full((4096,), 0.1)
        if step == 0:
            g[7] = 1e20
        p32.grad, p8.grad = g.clone(), g.clone()
        opt32.step()
        opt8.step()
    assert int(torch.isnan(p32.detach()).sum()) == 0
    assert int(torch.isnan(p8.detach()).sum()) == 0, f"{case}: NaN spread through the 8-bit block"


def test_invalid_block_size_set_between_steps_is_rejected_and_changes_nothing():
    p = torch.nn.Parameter(torch.randn(5000))
    opt = go.AdamW([p], lr=1e-3, state_bits=8, block_size=128)
    p.grad = torch.randn(5000)
    opt.step()
    before = {k: v.clone() for k, v in state_tensors(opt, p).items()}
    param_before = p.detach().clone()
    opt.param_groups[0]["block_size"] = 100
    with pytest.raises(ValueError, match="block_size"):
        opt.step()
    assert torch.equal(p.detach(), param_before)
    for k, v in state_tensors(opt, p).items():
        assert torch.equal(v, before[k]), k
    opt.param_groups[0]["state_bits"] = 12
    with pytest.raises(ValueError, match="state_bits"):
        opt.step()


def test_8bit_codes_without_their_scales_are_rejected_on_load():
    p = torch.nn.Parameter(torch.randn(5000))
    opt8 = go.Adam([p], state_bits=8)
    p.grad = torch.randn(5000)
    opt8.step()
    sd = opt8.state_dict()
    del sd["state"][0]["exp_avg_absmax"]
    with pytest.raises(ValueError, match="exp_avg_absmax"):
        go.Adam([torch.nn.Parameter(p.detach().clone())]).load_state_dict(sd)


@pytest.mark.parametrize("state_bits", [32, 8])
def test_a_checkpoint_missing_a_moment_is_rejected_on_load(state_bits):
    """A saved Adam state without exp_avg_sq is an incomplete checkpoint: a clear error, not a restart of the
    second moment from zeros at step 1000."""
    p = torch.nn.Parameter(torch.randn(5000))
    opt = go.Adam([p], state_bits=state_bits)
    p.grad = torch.randn(5000)
    opt.step()
    sd = opt.state_dict()
    for key in [k for k in sd["state"][0] if k.startswith("exp_avg_sq")]:
        del sd["state"][0][key]
    q = torch.nn.Parameter(p.detach().clone())
    fresh = go.Adam([q], lr=0.5, state_bits=state_bits)
    with pytest.raises(ValueError, match="has no 'exp_avg_sq'"):
        fresh.load_state_dict(sd)
    assert not fresh.state and float(fresh.param_groups[0]["lr"]) == 0.5, "a rejected load changed the optimizer"


@pytest.mark.parametrize("state_bits", [32, 8])
def test_changed_options_with_the_same_number_of_states_convert(state_bits):
    """RMSprop centered -> momentum keeps the state count but changes the names: the next step builds the
    missing state instead of failing with a KeyError."""
    p = torch.nn.Parameter(torch.randn(5000))
    opt = go.RMSprop([p], lr=1e-3, centered=True, state_bits=state_bits)
    p.grad = torch.randn(5000)
    opt.step()
    opt.param_groups[0]["centered"] = False
    opt.param_groups[0]["momentum"] = 0.9
    opt.step()
    assert "momentum_buffer" in opt.state[p]


@pytest.mark.parametrize("momentum", [0.0, 0.5])
def test_centered_rmsprop_8bit_stays_finite_and_close_to_32bit(momentum):
    """Centered RMSprop takes the square root of square_avg - grad_avg^2. Rounded to 8 bits one by one, the two
    moments can break square_avg >= grad_avg^2 (small elements of a block with a large absmax lose most of their
    precision), which made the root NaN and then the whole block NaN within two steps. The rule restores the
    invariant on the states it reads: every parameter stays finite. The update stays near the 32-bit
    one (an empirical bound as in section 4: measured 11.7% without momentum and 1.4% with, on this table of
    magnitudes spread over four decades inside each block; bounds about 2x that)."""
    gen = make_generator(11)
    start = torch.randn(3 * 4096 + 1, generator=gen) * torch.logspace(-4, 0, 3 * 4096 + 1)[torch.randperm(3 * 4096 + 1, generator=gen)]
    p32, p8 = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    options = dict(lr=0.01, alpha=0.9, momentum=momentum, centered=True, weight_decay=0.1, skip_zeros=True)
    opt32, opt8 = go.RMSprop([p32], **options), go.RMSprop([p8], state_bits=8, block_size=1024, **options)
    for step in range(20):
        g = torch.randn(start.shape, generator=gen) * torch.logspace(-3, 1, start.numel())
        g[torch.rand(start.shape, generator=gen) < 0.2] = 0.0
        p32.grad, p8.grad = g.clone(), g.clone()
        opt32.step()
        opt8.step()
        assert bool(torch.isfinite(p8.detach()).all()), f"step {step + 1}: non-finite 8-bit parameters"
    assert bool(torch.isfinite(p32.detach()).all())
    err = rel_err(p8.detach() - start, p32.detach() - start)
    assert err <= (0.25 if momentum == 0.0 else 0.03), f"8-bit update off by {err:.4f}"


# --------------------------------------------------------------------------------------------------------
# A non-finite gradient element damages only its own element (docs/optim.md, "Non-finite values")
# --------------------------------------------------------------------------------------------------------

BAD_VALUES = {"nan": float("nan"), "inf": float("inf")}
BLOCK = 256
BAD_AT = 100  # in block 0 of a 2 x BLOCK parameter
ELEMENTWISE = [c for c in CASE_NAMES if c not in ("LAMB", "LARS")]


def run_with_bad_gradient(case, state_bits, bad, later_bad_grad, seed=31):
    """Five steps on a 2 x BLOCK parameter whose element BAD_AT starts at 0: a clean step, one where that
    element's gradient is `bad` (0.0 for the comparison run), then three clean ones in which it is
    `later_bad_grad` (None: a random value like the others). Returns (param, optimizer, state snapshot after
    the bad step)."""
    gen = make_generator(seed)
    start = torch.randn(2 * BLOCK, generator=gen) * 0.5
    start[BAD_AT] = 0.0
    p = torch.nn.Parameter(start)
    opt = make_opt(case, [p], state_bits=state_bits, block_size=BLOCK, min_8bit_size=0)
    after_bad = None
    for step in range(5):
        g = nonzero_randn(2 * BLOCK, gen)
        if step == 0:
            g[BAD_AT] = 0.0
        elif step == 1:
            g[BAD_AT] = bad
        elif later_bad_grad is not None:
            g[BAD_AT] = later_bad_grad
        p.grad = g
        opt.step()
        if step == 1:
            after_bad = {k: v.clone() for k, v in state_tensors(opt, p).items()}
    return p.detach(), opt, after_bad


@pytest.mark.parametrize("bad", list(BAD_VALUES), ids=list(BAD_VALUES))
@pytest.mark.parametrize("case", CASE_NAMES)
def test_non_finite_gradient_damages_no_more_elements_than_with_32bit_states(case, bad):
    """What fp32 states guarantee is the bound: after a NaN or +inf gradient element and three clean steps, no
    more parameters are non-finite with 8-bit states than with fp32 ones (element-wise algorithms: the bad
    element at most; LAMB and LARS: the whole tensor in both, through its norms), and no block's scale is
    non-finite. (A NaN once spread through its whole 8-bit block within a step: 256 NaN parameters.)"""
    p8, opt8, _ = run_with_bad_gradient(case, 8, BAD_VALUES[bad], None)
    p32, _, _ = run_with_bad_gradient(case, 32, BAD_VALUES[bad], None)
    damaged8, damaged32 = int((~torch.isfinite(p8)).sum()), int((~torch.isfinite(p32)).sum())
    assert damaged8 <= damaged32, f"{case}: {damaged8} non-finite parameters with 8-bit states, {damaged32} with fp32"
    if case in ELEMENTWISE:
        assert damaged8 <= 1 and bool(torch.isfinite(p8[torch.arange(2 * BLOCK) != BAD_AT]).all())
    state = opt8.state[opt8.param_groups[0]["params"][0]]
    for name in STATE_NAMES[case]:
        absmax = state[f"{name}_absmax"]
        assert bool(torch.isfinite(absmax).all()), f"{case}: {name}'s scale is not finite"


@pytest.mark.parametrize("bad", list(BAD_VALUES), ids=list(BAD_VALUES))
@pytest.mark.parametrize("case", ELEMENTWISE + ["LAMB"])
def test_non_finite_gradient_leaves_its_neighbours_as_a_zero_gradient_would(case, bad):
    """The exact 8-bit property: a non-finite state value is stored as 0 and takes no part in its block's absmax.
    So with the bad element's parameter and states at 0 before the bad step and its later gradients 0, every
    other element's parameter and codes and every block's absmax are bitwise those of a run in which its
    gradient was 0 throughout (its own states stay 0 there: a zero gradient on a zero parameter, weight decay
    included; Adagrad's sum stays at its initial value, which is below its neighbours'). LAMB's moments do not
    depend on its trust ratio (which the NaN reaches, with fp32 states too), so its codes and scales are
    compared, not its parameters. Right after the bad step, the bad element's codes are the code of 0."""
    p_bad, opt_bad, after_bad = run_with_bad_gradient(case, 8, BAD_VALUES[bad], 0.0)
    p_zero, opt_zero, _ = run_with_bad_gradient(case, 8, 0.0, 0.0)
    others = torch.arange(2 * BLOCK) != BAD_AT
    if case != "LAMB":
        assert_bitwise_equal(p_bad[others], p_zero[others], f"{case}: the other elements' parameters")
    states_bad = state_tensors(opt_bad, opt_bad.param_groups[0]["params"][0])
    states_zero = state_tensors(opt_zero, opt_zero.param_groups[0]["params"][0])
    for name in STATE_NAMES[case]:
        assert_bitwise_equal(states_bad[f"{name}_absmax"], states_zero[f"{name}_absmax"], f"{case}: {name}'s absmax")
        assert_bitwise_equal(states_bad[name][others], states_zero[name][others], f"{case}: {name}'s other codes")
        zero_code = 127 if SIGNED[name] else 0
        assert int(after_bad[name][BAD_AT]) == zero_code, f"{case}: the bad element's {name} is not stored as 0"
