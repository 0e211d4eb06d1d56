"""CUDA tests of graphsafe's optimizers with 8-bit states (state_bits=8) (skipped without a GPU and graphsafe's
CUDA backend).

* CUDA vs CPU (codes within one map step, absmax and params to tolerance) for every algorithm and three block
  sizes, each step from the same start (CUDA's FastMath, rules.h); with an eps above 1e30 (the IEEE fallback
  kernels) 10 uninterrupted steps; quantize/dequantize ops CUDA == CPU bitwise. (The captured 8-bit step ==
  eager bitwise is in test_optim_cuda_capture.py.)
* A NaN or +inf gradient element with 8-bit states (general and whole-chunk loops): never more non-finite
  parameters than with fp32 states, and the other elements' parameters, codes and every block's absmax bitwise
  those of a run in which its gradient was 0 (docs/optim.md, "Non-finite values").
* Over 200 tensors an 8-bit step launches no more kernels than the fp32 step (torch.profiler's count).
"""

from __future__ import annotations

import pytest
import torch

from conftest import (
    skip_unless_storable,
    OPTIM_CASE_NAMES,
    assert_bitwise_equal,
    assert_rel_close,
    assert_within_ulps,
    make_generator,
    make_optimizer,
    make_params,
    random_grad,
    requires_cuda,
    stable_seed,
    state_tensors,
)
from optim_cuda_helpers import (CUDA, OFFSETS, SHAPES, TOL, LargestMagnitude, attach_grads, copy_into,
                                draw_grads)

pytestmark = requires_cuda


# --------------------------------------------------------------------------------------------------------
# 8-bit states: CUDA vs CPU
# --------------------------------------------------------------------------------------------------------


def assert_8bit_states_close(state_cuda, state_cpu, what):
    """One parameter's 8-bit states on both backends: the same names; codes within one map step and at most
    1 in 100 of them (or one) moved (a few ulps move a code only near a decision point, rarely; an error in
    what CUDA stores, even one below a map step, would move many); absmax within TOL."""
    assert state_cuda.keys() == state_cpu.keys(), what
    for name in [k for k in state_cpu if isinstance(state_cpu[k], torch.Tensor) and state_cpu[k].dtype == torch.uint8]:
        codes_c, codes_h = state_cuda[name].cpu().long(), state_cpu[name].long()
        assert int((codes_c - codes_h).abs().max()) <= 1, f"{what} {name}: codes differ by more than one step"
        differing = int((codes_c != codes_h).sum())
        assert differing <= max(1, codes_h.numel() // 100), f"{what} {name}: {differing} codes differ"
        assert_rel_close(state_cuda[f"{name}_absmax"], state_cpu[f"{name}_absmax"], TOL, f"{what} {name}_absmax")


@pytest.mark.parametrize("block_size", [32, 256, 1024])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", OPTIM_CASE_NAMES)
def test_8bit_cuda_matches_cpu(case, dtype, block_size):
    """8-bit states, every parameter quantised (min_8bit_size=0), sizes that end in partial blocks and
    chunks, unaligned pointers, scattered zeros with skip_zeros on. 10 steps, each compared from the same
    start: after each step codes differ by at most one step of the map (and at most one in a hundred of them,
    or one), absmax within 1e-5, fp32 params within 1e-5, bf16 params within 2 ulps; then the CPU takes the
    CUDA optimizer's params and states for the next step.
    Why each step from the same start: the CUDA element-wise kernels take FastMath (rules.h: approximate square
    root and reciprocal), a few fp32 ulps from the CPU's IEEE arithmetic, which now and then moves a code by one
    step; that element's later updates then differ by up to a map step (a few percent), which over 10 steps
    says nothing about the arithmetic. (LAMB/LARS: their norms are summed in a different order.)"""
    skip_unless_storable(case, 8)
    seed = stable_seed("8bit-cuda-vs-cpu", case, str(dtype), block_size)
    params_cpu = make_params(SHAPES, dtype, make_generator(seed), offsets=OFFSETS)
    params_cuda = make_params(SHAPES, dtype, make_generator(seed), device=CUDA, offsets=OFFSETS)
    grads_cpu, grads_cuda = attach_grads(params_cpu, OFFSETS), attach_grads(params_cuda, OFFSETS)
    extra = dict(skip_zeros=True, state_bits=8, min_8bit_size=0, block_size=block_size)
    opt_cpu, opt_cuda = make_optimizer(case, params_cpu, **extra), make_optimizer(case, params_cuda, **extra)
    gen = make_generator(seed + 1)
    for step in range(10):
        values = draw_grads(params_cpu, dtype, gen, zero_fraction=0.2)
        copy_into(grads_cpu, values)
        copy_into(grads_cuda, values)
        largest = LargestMagnitude(params_cpu)
        opt_cpu.step()
        opt_cuda.step()
        largest.update(params_cpu)
        torch.cuda.synchronize()
        for i, (c, h) in enumerate(zip(params_cuda, params_cpu)):
            what = f"{case} {dtype} block {block_size} step {step + 1} param {i}"
            if dtype == torch.float32:
                assert_rel_close(c, h, TOL, what)
            else:
                assert_within_ulps(c.detach().cpu(), h, 2, what, scale=largest.values[i])
            sc, sh = opt_cuda.state[c], opt_cpu.state[h]
            assert_8bit_states_close(sc, sh, what)
            assert float(sc["step"]) == float(sh["step"]) == step + 1
            # the next step starts from CUDA's values on both backends
            with torch.no_grad():
                h.copy_(c.cpu())
            for name, value in sc.items():
                if isinstance(value, torch.Tensor) and name != "step":
                    sh[name].copy_(value.cpu())


@pytest.mark.parametrize("case", ["Adam", "Adam-decoupled", "AdamW", "RMSprop", "Adagrad", "AdEMAMix"])
def test_8bit_exact_math_fallback_matches_cpu(case):
    """An eps above 1e30 makes the CUDA 8-bit kernels of the algorithms that take roots use ExactMath (rules.h,
    fast_math_applies: FastMath's reciprocal would flush), the CPU's IEEE arithmetic: 10 uninterrupted steps
    then agree with the CPU backend as before FastMath: codes within one map step and at most 1 in 100 of them
    moved (per-tensor constants such as AdEMAMix's warmed-up beta3 come from CUDA's math library), absmax and
    params within 1e-5. With such an eps the updates are tiny; the states carry the check."""
    seed = stable_seed("8bit-exact-fallback", case)
    params_cpu = make_params(SHAPES, torch.float32, make_generator(seed), offsets=OFFSETS)
    params_cuda = make_params(SHAPES, torch.float32, make_generator(seed), device=CUDA, offsets=OFFSETS)
    grads_cpu, grads_cuda = attach_grads(params_cpu, OFFSETS), attach_grads(params_cuda, OFFSETS)
    extra = dict(skip_zeros=True, state_bits=8, min_8bit_size=0, block_size=256, eps=2e30)
    opt_cpu, opt_cuda = make_optimizer(case, params_cpu, **extra), make_optimizer(case, params_cuda, **extra)
    gen = make_generator(seed + 1)
    for _ in range(10):
        values = draw_grads(params_cpu, torch.float32, gen, zero_fraction=0.2)
        copy_into(grads_cpu, values)
        copy_into(grads_cuda, values)
        opt_cpu.step()
        opt_cuda.step()
    torch.cuda.synchronize()
    for i, (c, h) in enumerate(zip(params_cuda, params_cpu)):
        what = f"{case} eps 2e30 param {i}"
        assert_rel_close(c, h, TOL, what)
        assert_8bit_states_close(opt_cuda.state[c], opt_cpu.state[h], what)


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("block_size", [32, 256, 1024])
def test_quantize_blockwise_cuda_equals_cpu_bitwise(block_size, signed):
    from graphsafe import ops

    gen = make_generator(stable_seed("quantize", block_size, signed))
    x = torch.randn(100_003, generator=gen) * torch.logspace(-6, 2, 100_003)
    if not signed:
        x = x.abs()
    x[5000:5000 + block_size] = 0.0  # an all-zero block
    x[20_000] = float("nan")
    x[30_000], x[30_001], x[40_000] = float("inf"), float("-inf"), float("nan")  # stored as 0, out of the absmax
    x[50_000:50_000 + block_size] = float("inf")  # a block without a finite value
    x[60_000] = torch.tensor(0x7F800001, dtype=torch.int32).view(torch.float32)  # a signalling NaN
    codes_cpu, absmax_cpu = ops.quantize_blockwise(x, block_size, signed)
    codes_cuda, absmax_cuda = ops.quantize_blockwise(x.to(CUDA), block_size, signed)
    assert torch.equal(codes_cuda.cpu(), codes_cpu)
    assert_bitwise_equal(absmax_cuda.cpu(), absmax_cpu, "absmax")
    out_cpu = ops.dequantize_blockwise(codes_cpu, absmax_cpu, block_size, signed)
    out_cuda = ops.dequantize_blockwise(codes_cuda, absmax_cuda, block_size, signed)
    # exact values (NaN payloads may differ: the GPU's arithmetic returns its canonical NaN)
    torch.testing.assert_close(out_cuda.cpu(), out_cpu, rtol=0, atol=0, equal_nan=True)


# --------------------------------------------------------------------------------------------------------
# Non-finite gradient elements with 8-bit states
# --------------------------------------------------------------------------------------------------------

BAD_AT = 100
ELEMENTWISE_CASES = [c for c in OPTIM_CASE_NAMES if c not in ("LAMB", "LARS")]


def _run_with_bad_gradient_on_cuda(case, numel, state_bits, bad):
    """Five CUDA steps on one parameter whose element BAD_AT starts at 0 and has gradient 0 in every step but
    the second, where it is `bad`. Returns the parameter and its states, on the CPU."""
    gen = make_generator(stable_seed("non-finite on cuda", case, numel))
    start = torch.randn(numel, generator=gen) * 0.5
    start[BAD_AT] = 0.0
    p = torch.nn.Parameter(start.to(CUDA))
    opt = make_optimizer(case, [p], state_bits=state_bits, block_size=256, min_8bit_size=0)
    for step in range(5):
        g = random_grad((numel,), torch.float32, gen)
        g = torch.where(g == 0, torch.ones_like(g), g)
        g[BAD_AT] = bad if step == 1 else 0.0
        p.grad = g.to(CUDA)
        opt.step()
    torch.cuda.synchronize()
    return p.detach().cpu(), {k: v.cpu() for k, v in state_tensors(opt, p).items()}


# 512 elements: a partial chunk (the general 8-bit loop); 8192: two whole chunks (the whole-chunk loop).
@pytest.mark.parametrize("numel", [512, 8192])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("case", OPTIM_CASE_NAMES)
def test_non_finite_gradient_with_8bit_states_on_cuda_damages_only_its_element(case, bad, numel):
    skip_unless_storable(case, 8)
    p8, states8 = _run_with_bad_gradient_on_cuda(case, numel, 8, bad)
    p32, _ = _run_with_bad_gradient_on_cuda(case, numel, 32, bad)
    damaged8, damaged32 = int((~torch.isfinite(p8)).sum()), int((~torch.isfinite(p32)).sum())
    assert damaged8 <= damaged32, f"{case}: {damaged8} non-finite parameters with 8-bit states, {damaged32} with fp32"
    for name, value in states8.items():
        if name.endswith("_absmax"):
            assert bool(torch.isfinite(value).all()), f"{case}: {name} is not finite"
    if case not in ELEMENTWISE_CASES:
        return  # LAMB/LARS: the trust ratio takes the NaN to every element, with fp32 states too
    p0, states0 = _run_with_bad_gradient_on_cuda(case, numel, 8, 0.0)
    others = torch.arange(numel) != BAD_AT
    assert_bitwise_equal(p8[others], p0[others], f"{case}: the other elements' parameters")
    for name, value in states8.items():
        if name.endswith("_absmax"):
            assert_bitwise_equal(value, states0[name], f"{case}: {name}")
        elif value.dtype == torch.uint8:
            assert_bitwise_equal(value[others], states0[name][others], f"{case}: {name}'s other codes")


# --------------------------------------------------------------------------------------------------------
# 8-bit states: no more launches than fp32 states
# --------------------------------------------------------------------------------------------------------


def _kernels_per_step(optimizer) -> int:
    """The CUDA kernels one step launches, counted under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        optimizer.step()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


@pytest.mark.parametrize("case", OPTIM_CASE_NAMES)
def test_8bit_step_over_many_tensors_launches_no_more_kernels_than_fp32(case):
    """Fewer state bytes never cost more launches (issue 22): over 200 tensors, several launch tables, the 8-bit
    step launches at most as many kernels as the fp32 step on the same parameters (an 8-bit table holds as many
    tensors as its fp32 twin: launch_table.cuh, TensorTable). An eager step over many small tensors is bound by
    the host, and each launch costs it a few microseconds."""
    skip_unless_storable(case, 8)
    counts = {}
    for bits in (32, 8):
        params = make_params([(4096,)] * 200, torch.float32, make_generator(stable_seed("launches", case)), device=CUDA)
        for p in params:
            p.grad = torch.ones_like(p)
        optimizer = make_optimizer(case, params, state_bits=bits, min_8bit_size=0)
        optimizer.step()  # the states exist from here on
        counts[bits] = _kernels_per_step(optimizer)
    assert counts[8] <= counts[32], f"{case}: kernels per step {counts}"
