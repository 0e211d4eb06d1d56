"""Helpers of the CUDA optimizer tests (test_optim_cuda_*.py): the shapes and pointer offsets every test steps,
gradients held in tensors of their own (so that a captured step reads new values copied into them), and the
comparison of a CUDA optimizer with a CPU one.

How CUDA results are compared with the CPU backend's: fp32 parameters and every fp32 state within
||cuda - cpu|| / ||cpu|| <= TOL = 1e-5 (LAMB/LARS norms are reduced in a different order on each backend, a
relative ~1e-7 on the trust ratio; everything else is the same fp32 code built without FMA contraction on both).
bf16 parameters: after every step within 2 bf16 ulps of the CPU's, the ulp taken at the largest magnitude the
element has had so far (LargestMagnitude: a value within rounding error of a bf16 midpoint may round the other
way; that 1-ulp difference then persists while the element may shrink towards zero, and where p + delta
cancels, a ~1e-7 relative difference in LAMB/LARS's trust ratio is a few fp32 ulps of |p|, not of the result).
"""

from __future__ import annotations

import torch

from conftest import assert_rel_close, optim_cases, random_grad, state_tensors


CUDA = "cuda"
CASES = optim_cases()
TOL = 1e-5

# Sizes not multiple of 4, one chunk exactly, chunk + 5, several chunks, two aligned whole chunks (the 8-bit
# whole-chunk loop); offsets > 0 make the parameter (and its gradient) start off a 16-byte boundary, which
# forces the kernels' scalar path.
SHAPES = [(1,), (3,), (37,), (16, 33), (4096,), (4096 + 5,), (3 * 4096 + 1,), (64, 40), (2, 4096)]
OFFSETS = [0, 1, 1, 0, 0, 2, 3, 0, 0]

BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


# Regression: LARS with fp32 parameters once left lanes of a partly filled chunk un-updated on the H200. The
# cause was an uninitialised state slot (s[1], LAMB's) read by a branch the compiler hoisted, which split the
# warp on leftover register values; every state slot is now initialised (src/optim/cuda/). The tests of
# test_optim_cuda_*.py cover that case (300- and 5000-element fp32 LARS tensors) like every other.


def attach_grads(params, offsets=None):
    """Give every parameter a gradient tensor of its own (at the given element offset inside a larger
    buffer, like the parameter) and return them; later steps copy new values into these same tensors."""
    grads = []
    for i, p in enumerate(params):
        off = 0 if offsets is None else offsets[i]
        buf = torch.zeros(p.numel() + off, dtype=p.dtype, device=p.device)
        g = buf[off:].view(p.shape)
        p.grad = g
        grads.append(g)
    return grads


def draw_grads(params, dtype, gen, zero_fraction=0.0):
    """New CPU gradient values for each parameter: standard normal, with `zero_fraction` of the elements
    exactly zero (half of them -0.0) and every 7th row of 2-D parameters entirely zero."""
    out = []
    for p in params:
        g = random_grad(p.shape, dtype, gen)
        g = torch.where(g == 0, torch.ones_like(g), g)
        if zero_fraction > 0:
            zero = torch.rand(p.shape, generator=gen) < zero_fraction
            negative = torch.rand(p.shape, generator=gen) < 0.5
            g[zero & negative] = -0.0
            g[zero & ~negative] = 0.0
            if g.dim() == 2:
                g[::7] = -0.0
        out.append(g)
    return out


def copy_into(grads, values):
    for g, v in zip(grads, values):
        g.copy_(v)


class LargestMagnitude:
    """Per element, the largest |value| a CPU parameter has had so far: the scale at which a rounding
    difference that arose in an earlier step is measured (see the module docstring)."""

    def __init__(self, params):
        self.values = [p.detach().abs().double() for p in params]

    def update(self, params):
        self.values = [torch.maximum(v, p.detach().abs().double()) for v, p in zip(self.values, params)]


def bits_at(t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(BITS[t.dtype])[mask.to(t.device)].cpu()


def assert_cuda_close_to_cpu(opt_cuda, params_cuda, opt_cpu, params_cpu, what):
    for i, (c, h) in enumerate(zip(params_cuda, params_cpu)):
        assert c.device.type == "cuda" and h.device.type == "cpu"
        if h.dtype == torch.float32:
            assert_rel_close(c, h, TOL, f"{what} param {i}")
        sc, sh = state_tensors(opt_cuda, c), state_tensors(opt_cpu, h)
        assert sc.keys() == sh.keys(), f"{what} param {i}: state names differ"
        for k in sh:
            assert sc[k].device.type == "cuda" and sc[k].dtype == sh[k].dtype  # (schedule values: float64)
            if k == "step":
                assert float(sc[k]) == float(sh[k])
            else:
                assert_rel_close(sc[k], sh[k], TOL, f"{what} param {i} state {k}")
