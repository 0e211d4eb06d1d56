"""Helpers of the 8-bit optimizer-state tests (test_optim_8bit_*.py): the nine algorithms with every optional
state switched on and weight_decay > 0, the states each keeps and the map each uses, and an independent model of
the maps and of the quantiser (docs/optim.md, "8-bit states"), so that the tests do not trust the library's own
tables.
"""

from __future__ import annotations

import math

import torch

import graphsafe.ops as ops
import graphsafe.optim as go


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
