"""CUDA tests of graphsafe's optimizers (skipped without a GPU and graphsafe's CUDA backend).

* CUDA vs the CPU backend, for every algorithm (conftest.optim_cases(): weight decay and every optional
  state on), fp32 and bf16 parameters, skip_zeros off and on, tensors whose sizes are not multiples of the
  vector width, that span several 4096-element chunks, and whose pointers are not 16-byte aligned (scalar
  path). fp32: ||cuda - cpu|| / ||cpu|| <= 1e-5 per tensor after 10 steps (LAMB/LARS norms are reduced in
  a different order on each backend, a relative ~1e-7 on the trust ratio; everything else is the same
  fp32 code built without FMA contraction on both). bf16 parameters: after every step within 2 bf16 ulps
  of the CPU's, the ulp taken at the largest magnitude the element has had so far (a value within rounding
  error of a bf16 midpoint may round the other way; that 1-ulp difference then persists while the element
  may shrink towards zero, and where p + delta cancels, a ~1e-7 relative difference in LAMB/LARS's trust
  ratio is a few fp32 ulps of |p|, not of the result), rarely different at all; the fp32 states within
  1e-5 norm-wise.
* 100 parameters of assorted sizes (more than the 39 to 66 tensors of one launch, so several launches; one empty
  parameter) vs the CPU backend.
* The whole optimizer.step() captured in a torch.cuda.CUDAGraph (3 warm-up steps on a side stream first,
  as torch's whole-network capture example does; gradients are static tensors that new values are copied
  into) and replayed 10 times with an lr scheduler stepping between replays (outside the graph): bitwise
  equal to the same 10 eager steps on a copy, so the graph reads lr and step from device memory; a step
  captured before any eager one (states loaded, no finish counter yet) equals eager steps too.
* 8-bit states (state_bits=8): CUDA vs CPU (codes within one map step, absmax and params to tolerance) for
  every algorithm and three block sizes, each step from the same start (CUDA's FastMath, rules.h); with an eps
  above 1e30 (the IEEE fallback kernels) 10 uninterrupted steps; the captured step == eager bitwise;
  quantize/dequantize ops CUDA == CPU bitwise.
* skip_zeros bit-identity (scattered zeros and whole zero rows, +0.0 and -0.0, vector and scalar paths),
  NaN not skipped, skip_zeros on without zeros == off; bitwise repeatability; state_dict between devices.
* A NaN or +inf gradient element with 8-bit states (general and whole-chunk loops): never more non-finite
  parameters than with fp32 states, and the other elements' parameters, codes and every block's absmax bitwise
  those of a run in which its gradient was 0 (docs/optim.md, "Non-finite values").
* A NaN or negative lr written into the lr tensor: the step (eager, or a replayed graph) changes no parameter,
  state or step count, and graphsafe.check_errors() raises a ValueError; the next step with a usable lr counts
  its steps again (the finish counter stayed consistent).
"""

from __future__ import annotations

import zlib

import pytest
import torch

import graphsafe
import graphsafe.optim as go
from conftest import (
    assert_same_run,
    snapshot_states,
    OPTIM_CASE_NAMES,
    assert_bitwise_equal,
    assert_rel_close,
    assert_within_ulps,
    make_generator,
    make_optimizer,
    make_params,
    optim_cases,
    random_grad,
    requires_cuda,
    state_tensors,
)

pytestmark = requires_cuda

CUDA = "cuda"
CASES = optim_cases()
TOL = 1e-5

# Sizes not multiple of 4, one chunk exactly, chunk + 5, several chunks, two aligned whole chunks (the 8-bit
# whole-chunk loop); offsets > 0 make the parameter (and its gradient) start off a 16-byte boundary, which
# forces the kernels' scalar path.
SHAPES = [(1,), (3,), (37,), (16, 33), (4096,), (4096 + 5,), (3 * 4096 + 1,), (64, 40), (2, 4096)]
OFFSETS = [0, 1, 1, 0, 0, 2, 3, 0, 0]

BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def stable_seed(*parts) -> int:
    """A seed from test parameters that is the same in every process (unlike hash() of strings)."""
    return zlib.crc32(repr(parts).encode())


# Regression: LARS with fp32 parameters once left lanes of a partly filled chunk un-updated on the H200. The
# cause was an uninitialised state slot (s[1], LAMB's) read by a branch the compiler hoisted, which split the
# warp on leftover register values; every state slot is now initialised (src/optim/cuda/). The tests below
# cover that case (300- and 5000-element fp32 LARS tensors) like every other.


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
            assert sc[k].device.type == "cuda" and sc[k].dtype == torch.float32
            if k == "step":
                assert float(sc[k]) == float(sh[k])
            else:
                assert_rel_close(sc[k], sh[k], TOL, f"{what} param {i} state {k}")


# --------------------------------------------------------------------------------------------------------
# CUDA vs CPU
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("skip_zeros", [False, True], ids=["skip_zeros_off", "skip_zeros_on"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", OPTIM_CASE_NAMES)
def test_cuda_matches_cpu(case, dtype, skip_zeros):
    seed = stable_seed("cuda-vs-cpu", case, str(dtype), skip_zeros)
    params_cpu = make_params(SHAPES, dtype, make_generator(seed), offsets=OFFSETS)
    params_cuda = make_params(SHAPES, dtype, make_generator(seed), device=CUDA, offsets=OFFSETS)
    grads_cpu, grads_cuda = attach_grads(params_cpu, OFFSETS), attach_grads(params_cuda, OFFSETS)
    assert params_cuda[1].data_ptr() % 16 != 0 and grads_cuda[1].data_ptr() % 16 != 0  # scalar path taken
    opt_cpu = make_optimizer(case, params_cpu, skip_zeros=skip_zeros)
    opt_cuda = make_optimizer(case, params_cuda, skip_zeros=skip_zeros)
    gen = make_generator(seed + 1)
    differing = total = 0
    largest = LargestMagnitude(params_cpu)
    for step in range(10):
        values = draw_grads(params_cpu, dtype, gen, zero_fraction=0.2)
        copy_into(grads_cpu, values)
        copy_into(grads_cuda, values)
        opt_cpu.step()
        opt_cuda.step()
        if dtype != torch.float32:
            for i, (c, h) in enumerate(zip(params_cuda, params_cpu)):
                c_host = c.detach().cpu()
                what = f"{case} {dtype} step {step + 1} param {i}"
                assert_within_ulps(c_host, h, 2, what, scale=largest.values[i])
                differing += int((c_host != h.detach()).sum())
                total += h.numel()
            largest.update(params_cpu)
    torch.cuda.synchronize()
    assert differing <= 0.01 * max(total, 1), f"{differing} of {total} bf16 element-steps differ"
    assert_cuda_close_to_cpu(opt_cuda, params_cuda, opt_cpu, params_cpu, f"{case} {dtype}")


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


def assorted_shapes(gen, count=100):
    """`count` shapes: mostly small odd sizes, some 2-D, a few over one or several 4096-element chunks,
    one empty parameter."""
    sizes = torch.randint(1, 3000, (count,), generator=gen).tolist()
    shapes = []
    for i, n in enumerate(sizes):
        if i == 5:
            shapes.append((0,))
        elif i % 17 == 3:
            shapes.append((4096 * (1 + i % 3) + n % 7,))
        elif i % 5 == 0:
            shapes.append((max(1, n // 13), 13))
        else:
            shapes.append((n,))
    return shapes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", OPTIM_CASE_NAMES)
def test_many_tensors_cuda_matches_cpu(case, dtype):
    """Over 66 tensors per step: several launches, and LAMB/LARS chunk and factor indices that run across
    launches. bf16 parameters within 2 ulps after every step (see the module docstring), states and fp32
    parameters within 1e-5 after 5 steps."""
    seed = stable_seed("many", case, str(dtype))
    shapes = assorted_shapes(make_generator(seed))
    offsets = [i % 3 for i in range(len(shapes))]
    params_cpu = make_params(shapes, dtype, make_generator(seed), offsets=offsets)
    params_cuda = make_params(shapes, dtype, make_generator(seed), device=CUDA, offsets=offsets)
    grads_cpu, grads_cuda = attach_grads(params_cpu), attach_grads(params_cuda)
    opt_cpu = make_optimizer(case, params_cpu, skip_zeros=True)
    opt_cuda = make_optimizer(case, params_cuda, skip_zeros=True)
    gen = make_generator(seed + 1)
    largest = LargestMagnitude(params_cpu)
    before = None
    for step in range(5):
        before = [p.detach().clone() for p in params_cpu]
        values = draw_grads(params_cpu, dtype, gen, zero_fraction=0.1)
        copy_into(grads_cpu, values)
        copy_into(grads_cuda, values)
        opt_cpu.step()
        opt_cuda.step()
        if dtype != torch.float32:
            for i, (c, h) in enumerate(zip(params_cuda, params_cpu)):
                assert_within_ulps(c.detach().cpu(), h, 2, f"{case} {dtype} step {step + 1} param {i}",
                                   scale=largest.values[i])
            largest.update(params_cpu)
    torch.cuda.synchronize()
    assert_cuda_close_to_cpu(opt_cuda, params_cuda, opt_cpu, params_cpu, f"{case} {dtype} (100 tensors)")
    moved = sum(int((c.detach().cpu() != b).any()) for c, b in zip(params_cuda, before) if b.numel() > 0)
    assert moved >= 90, f"only {moved} of the parameters moved in the last step"


# --------------------------------------------------------------------------------------------------------
# CUDA graph capture
# --------------------------------------------------------------------------------------------------------


def lr_factor(epoch: int) -> float:
    """A schedule that goes down and up again (a graph that baked in the lr could not follow it)."""
    return 0.8**epoch * (1 + epoch % 3)


# 8-bit with blocks of 64 takes the general element loop; with 256 the aligned whole chunks take the whole-chunk loop.
@pytest.mark.parametrize("state_bits,block_size", [(32, None), (8, 64), (8, 256)], ids=["32", "8-64", "8-256"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", OPTIM_CASE_NAMES)
def test_captured_step_with_lr_scheduler_equals_eager(case, dtype, state_bits, block_size):
    seed = stable_seed("graph", case, str(dtype), state_bits, block_size)
    params = make_params(SHAPES, dtype, make_generator(seed), device=CUDA, offsets=OFFSETS)
    eager_params = make_params(SHAPES, dtype, make_generator(seed), device=CUDA, offsets=OFFSETS)
    static_grads, eager_grads = attach_grads(params, OFFSETS), attach_grads(eager_params, OFFSETS)
    bits = dict(state_bits=state_bits, min_8bit_size=0, block_size=block_size) if state_bits == 8 else {}
    opt = make_optimizer(case, params, skip_zeros=True, **bits)
    eager = make_optimizer(case, eager_params, skip_zeros=True, **bits)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    eager_sched = torch.optim.lr_scheduler.LambdaLR(eager, lr_factor)
    gen = make_generator(seed + 1)

    # Warm up on a side stream (creates the states outside the capture), then capture one whole step.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    warmup_values = [draw_grads(params, dtype, gen, zero_fraction=0.1) for _ in range(3)]
    with torch.cuda.stream(side):
        for values in warmup_values:
            copy_into(static_grads, values)
            opt.step()
    torch.cuda.current_stream().wait_stream(side)
    for values in warmup_values:
        copy_into(eager_grads, values)
        eager.step()
    torch.cuda.synchronize()
    assert_same_run(opt, params, eager, eager_params, f"{case} {dtype} warm-up (side stream vs default)")

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    torch.cuda.synchronize()
    assert all(float(opt.state[p]["step"]) == 3 for p in params), "capturing must not run the step"

    lrs = []
    for step in range(10):
        values = draw_grads(params, dtype, gen, zero_fraction=0.1)
        copy_into(static_grads, values)
        graph.replay()
        copy_into(eager_grads, values)
        eager.step()
        sched.step()
        eager_sched.step()
        lrs.append(float(opt.param_groups[0]["lr"]))
        torch.cuda.synchronize()
        assert_same_run(opt, params, eager, eager_params, f"{case} {dtype} replay {step + 1} vs eager")
    assert_bitwise_equal(opt.param_groups[0]["lr"], eager.param_groups[0]["lr"], "lr")
    assert len(set(lrs)) >= 5, f"the schedule did not change the lr: {lrs}"
    assert all(float(opt.state[p]["step"]) == 13 for p in params)


@pytest.mark.parametrize("case", ["AdamW", "SGD", "LAMB"])
def test_step_captured_before_any_eager_step_counts_its_steps(case):
    """An optimizer whose first CUDA step is captured (its states loaded from a checkpoint, no warm-up) has no
    finish counter yet and makes none inside the capture (its zeroing would only run at the first replay): the
    graph counts the steps with a launch ahead. Replays and the eager steps after them (which make the counter)
    equal an optimizer stepped eagerly throughout, bitwise."""
    seed = stable_seed("first step captured", case)
    params = make_params(SHAPES, torch.float32, make_generator(seed), device=CUDA, offsets=OFFSETS)
    eager_params = make_params(SHAPES, torch.float32, make_generator(seed), device=CUDA, offsets=OFFSETS)
    static_grads, eager_grads = attach_grads(params, OFFSETS), attach_grads(eager_params, OFFSETS)
    eager = make_optimizer(case, eager_params)
    gen = make_generator(seed + 1)
    for _ in range(2):
        copy_into(eager_grads, draw_grads(eager_params, torch.float32, gen))
        eager.step()
    with torch.no_grad():
        for p, q in zip(params, eager_params):
            p.copy_(q)
    opt = make_optimizer(case, params)
    opt.load_state_dict(eager.state_dict())
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    assert not opt.__dict__.get("_finish_counters"), "a finish counter was made inside the capture"
    for step in range(4):
        values = draw_grads(params, torch.float32, gen)
        copy_into(static_grads, values)
        if step < 2:
            graph.replay()
        else:
            opt.step()  # eager: makes the counter
        copy_into(eager_grads, values)
        eager.step()
        torch.cuda.synchronize()
        assert_same_run(opt, params, eager, eager_params, f"{case} {'replay' if step < 2 else 'eager'} {step + 1}")
    assert opt.__dict__.get("_finish_counters"), "the eager steps after the capture made no finish counter"
    assert all(float(opt.state[p]["step"]) == 6 for p in params)


def test_captured_step_follows_lr_filled_between_replays():
    """lr.fill_ between replays (what every scheduler does) changes the next replay's update size."""
    (p,) = make_params([(1000,)], torch.float32, make_generator(5), device=CUDA)
    (g,) = attach_grads([p])
    g.fill_(1.0)
    opt = go.SGD([p], lr=0.1)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            opt.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    for lr in (0.5, 0.0, 2.0):
        opt.param_groups[0]["lr"].fill_(lr)
        before = p.detach().clone()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.allclose(before - p.detach(), torch.full_like(before, lr), rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------------------------------------
# skip_zeros, repeatability, state_dict across devices
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", OPTIM_CASE_NAMES)
def test_skip_zeros_bit_identity_on_cuda(case, dtype):
    seed = stable_seed("skip", case, str(dtype))
    params = make_params(SHAPES, dtype, make_generator(seed), device=CUDA, offsets=OFFSETS)
    grads = attach_grads(params, OFFSETS)
    opt = make_optimizer(case, params, skip_zeros=True)
    gen = make_generator(seed + 1)
    initial = {"sum": CASES[case][1].get("initial_accumulator_value", 0.0)}
    for step in range(5):
        before = snapshot_states(opt, params)
        values = draw_grads(params, dtype, gen, zero_fraction=0.3)
        copy_into(grads, values)
        opt.step()
        torch.cuda.synchronize()
        for i, (p, v) in enumerate(zip(params, values)):
            mask = v == 0
            what = f"{case} {dtype} step {step + 1} param {i}"
            old_p, old_states = before[i]
            assert torch.equal(bits_at(p, mask), bits_at(old_p, mask)), f"{what}: a skipped element changed"
            if (~mask).sum() >= 8:
                assert bool((p.detach() != old_p)[(~mask).to(CUDA)].any()), f"{what}: nothing moved"
            for k, s in state_tensors(opt, p).items():
                if k == "step":
                    continue
                old = old_states.get(k, torch.full_like(s, initial.get(k, 0.0)))
                assert torch.equal(bits_at(s, mask), bits_at(old, mask)), f"{what}: skipped elements of {k} changed"


@pytest.mark.parametrize("case", OPTIM_CASE_NAMES)
def test_skip_zeros_does_not_skip_nan_on_cuda(case):
    params = make_params([(300,), (12, 10)], torch.float32, make_generator(8), device=CUDA)
    grads = attach_grads(params)
    opt = make_optimizer(case, params, skip_zeros=True)
    gen = make_generator(9)
    values = draw_grads(params, torch.float32, gen, zero_fraction=0.3)
    nan_masks = []
    for v in values:
        nan = torch.zeros(v.shape, dtype=torch.bool)
        nan.view(-1)[3::41] = True
        nan &= v != 0
        v[nan] = float("nan")
        nan_masks.append(nan.to(CUDA))
    copy_into(grads, values)
    opt.step()
    torch.cuda.synchronize()
    for p, nan in zip(params, nan_masks):
        assert bool(torch.isnan(p.detach()[nan]).all()), f"{case}: a NaN gradient element was skipped"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", OPTIM_CASE_NAMES)
def test_skip_zeros_without_zeros_is_bit_identical_to_off_on_cuda(case, dtype):
    seed = stable_seed("on-off", case, str(dtype))
    runs = []
    for skip in (True, False):
        params = make_params(SHAPES, dtype, make_generator(seed), device=CUDA, offsets=OFFSETS)
        grads = attach_grads(params, OFFSETS)
        opt = make_optimizer(case, params, skip_zeros=skip)
        gen = make_generator(seed + 1)
        for _ in range(4):
            copy_into(grads, draw_grads(params, dtype, gen))
            opt.step()
        runs.append((opt, params))
    torch.cuda.synchronize()
    assert_same_run(*runs[0], *runs[1], f"{case} {dtype} skip_zeros on vs off")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", OPTIM_CASE_NAMES)
def test_repeatable_on_cuda(case, dtype):
    """Two identical runs give the same bits, with a tensor of 256 chunks (LAMB/LARS: 256 block partials)."""
    shapes = SHAPES + [(256 * 4096 + 3,)]
    offsets = OFFSETS + [0]
    seed = stable_seed("repeat", case, str(dtype))
    runs = []
    for _ in range(2):
        params = make_params(shapes, dtype, make_generator(seed), device=CUDA, offsets=offsets)
        grads = attach_grads(params, offsets)
        opt = make_optimizer(case, params, skip_zeros=True)
        gen = make_generator(seed + 1)
        for _ in range(4):
            copy_into(grads, draw_grads(params, dtype, gen, zero_fraction=0.1))
            opt.step()
        runs.append((opt, params))
    torch.cuda.synchronize()
    assert_same_run(*runs[0], *runs[1], f"{case} {dtype} run A vs run B")


@pytest.mark.parametrize("direction", ["cuda_to_cpu", "cpu_to_cuda"])
@pytest.mark.parametrize("case", ["Adam", "LAMB", "AdEMAMix"])
def test_state_dict_moves_between_devices(case, direction):
    src_dev, dst_dev = (CUDA, "cpu") if direction == "cuda_to_cpu" else ("cpu", CUDA)
    seed = stable_seed("sd", case, direction)
    params = make_params([(37,), (4096 + 5,)], torch.bfloat16, make_generator(seed), device=src_dev)
    grads = attach_grads(params)
    opt = make_optimizer(case, params)
    gen = make_generator(seed + 1)
    for _ in range(3):
        copy_into(grads, draw_grads(params, torch.bfloat16, gen))
        opt.step()
    opt.param_groups[0]["lr"].fill_(0.0125)
    moved = [torch.nn.Parameter(p.detach().to(dst_dev, copy=True)) for p in params]
    loaded = make_optimizer(case, moved)
    loaded.load_state_dict(opt.state_dict())
    lr = loaded.param_groups[0]["lr"]
    assert lr.device.type == torch.device(dst_dev).type and float(lr) == float(opt.param_groups[0]["lr"])
    for p, q in zip(params, moved):
        for k, v in state_tensors(loaded, q).items():
            assert v.device.type == torch.device(dst_dev).type and v.dtype == torch.float32
            assert_bitwise_equal(v, state_tensors(opt, p)[k], f"loaded {k}")
    moved_grads = attach_grads(moved)
    largest = LargestMagnitude([p.cpu() for p in params])
    for _ in range(3):
        values = draw_grads(params, torch.bfloat16, gen)
        copy_into(grads, values)
        copy_into(moved_grads, values)
        opt.step()
        loaded.step()
        largest.update([p.cpu() for p in params])
    torch.cuda.synchronize()
    for i, (p, q) in enumerate(zip(params, moved)):
        for k, v in state_tensors(loaded, q).items():
            if k != "step":
                assert_rel_close(v, state_tensors(opt, p)[k], TOL, f"{case} {direction} param {i} state {k}")
        # bf16 parameters: a rounding that differs in one step persists (see the module docstring)
        assert_within_ulps(q.detach().cpu(), p.detach().cpu(), 2, f"{case} {direction} param {i}",
                           scale=largest.values[i])


def _sgd_stepped_twice_on_cuda(count, gen):
    """count parameters of 300 elements on CUDA and an SGD with momentum that has stepped them twice (the second
    step took the path the next one will: at once for 2 or more, with its checks remembered)."""
    params = make_params([(300,)] * count, torch.float32, gen, device=CUDA)
    opt = go.SGD(params, lr=0.1, momentum=0.9)
    for _ in range(2):
        for p in params:
            p.grad = random_grad((300,), torch.float32, gen).to(CUDA)
        opt.step()
    return params, opt


@pytest.mark.parametrize("count", [1, 5], ids=["alone", "at-once group"])
def test_a_gradient_left_on_the_cpu_is_rejected(count):
    """A gradient left on the CPU while its parameter went back to CUDA (p.data = ..., as Module._apply does):
    the step raises its ValueError and changes nothing, on both gathering paths (the at-once path compares CUDA
    device indices, Tensor.get_device)."""
    gen = make_generator(55)
    params, opt = _sgd_stepped_twice_on_cuda(count, gen)
    victim = params[-1]
    victim.data = victim.data.cpu()
    victim.grad = random_grad((300,), torch.float32, gen)  # on the CPU, as its parameter is now
    victim.data = victim.data.to(CUDA)
    assert victim.is_cuda and not victim.grad.is_cuda
    before = [p.detach().cpu().clone() for p in params]
    states = [{k: v.cpu().clone() for k, v in opt.state[p].items()} for p in params]
    with pytest.raises(ValueError, match="gradient on cpu"):
        opt.step()
    for p, b, saved in zip(params, before, states):
        assert_bitwise_equal(p.detach().cpu(), b, "parameter after a rejected step")
        for key, value in saved.items():
            assert_bitwise_equal(opt.state[p][key].cpu(), value, f"state {key} after a rejected step")


@pytest.mark.parametrize("count", [1, 5], ids=["alone", "at-once group"])
def test_a_group_moved_to_the_cpu_by_hand_steps_on_the_cpu(count):
    """Parameters, gradients and states all moved to the CPU by hand between two steps (p.data = ..., the
    state entries replaced): the step runs on the CPU, as a CPU optimizer with those states would. The at-once
    path reads a parameter's device again when its address changed: a device remembered from the CUDA steps
    would hand CPU addresses to a CUDA kernel."""
    gen = make_generator(58)
    params, opt = _sgd_stepped_twice_on_cuda(count, gen)
    grads = [random_grad((300,), torch.float32, gen) for _ in params]
    for p, g in zip(params, grads):
        p.data = p.data.cpu()
        p.grad = g
        opt.state[p] = {k: v.cpu() for k, v in opt.state[p].items()}
    reference = go.SGD([torch.nn.Parameter(p.detach().clone()) for p in params], lr=0.1, momentum=0.9)
    for q, p, g in zip(reference.param_groups[0]["params"], params, grads):
        q.grad = g.clone()
        reference.state[q] = {k: v.clone() for k, v in opt.state[p].items()}
    opt.step()
    reference.step()
    for q, p in zip(reference.param_groups[0]["params"], params):
        assert not p.is_cuda
        assert_bitwise_equal(p.detach(), q.detach(), "parameter stepped on the CPU")
        assert_bitwise_equal(opt.state[p]["momentum_buffer"], reference.state[q]["momentum_buffer"], "momentum")


# --------------------------------------------------------------------------------------------------------
# Non-finite gradient elements with 8-bit states; an invalid lr in the lr tensor
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


def _stepped_once_on_cuda(case, state_bits, seed):
    gen = make_generator(seed)
    params = make_params(SHAPES, torch.float32, gen, device=CUDA, offsets=OFFSETS)
    grads = attach_grads(params, OFFSETS)
    opt = make_optimizer(case, params, state_bits=state_bits, min_8bit_size=0)
    copy_into(grads, draw_grads(params, torch.float32, gen))
    opt.step()
    copy_into(grads, draw_grads(params, torch.float32, gen))
    torch.cuda.synchronize()
    return opt, params, grads, gen


def _assert_unchanged(opt, params, before, what):
    for i, (p, (p_before, states_before)) in enumerate(zip(params, before)):
        assert_bitwise_equal(p.detach(), p_before, f"{what}: param {i}")
        for k, v in state_tensors(opt, p).items():
            assert_bitwise_equal(v, states_before[k], f"{what}: param {i} state {k}")


@pytest.mark.parametrize("state_bits", [32, 16, 8])
@pytest.mark.parametrize("bad", [float("nan"), -1.0], ids=["nan", "-1"])
@pytest.mark.parametrize("case", OPTIM_CASE_NAMES)
def test_invalid_lr_in_the_lr_tensor_on_cuda_writes_nothing_and_is_reported(case, bad, state_bits):
    graphsafe.check_errors()  # nothing pending from before
    opt, params, _, _ = _stepped_once_on_cuda(case, state_bits, stable_seed("invalid lr", case, state_bits))
    before = snapshot_states(opt, params)
    lr = opt.param_groups[0]["lr"]
    lr.fill_(bad)
    opt.step()  # no host read of lr: nothing can be raised here
    with pytest.raises(ValueError, match="invalid learning rate") as info:
        graphsafe.check_errors()
    assert not isinstance(info.value, IndexError)
    graphsafe.check_errors()  # reported once
    _assert_unchanged(opt, params, before, f"{case} {state_bits}-bit, lr {bad}")
    lr.fill_(0.01)
    opt.step()
    torch.cuda.synchronize()
    graphsafe.check_errors()
    assert all(float(opt.state[p]["step"]) == 2 for p in params), "the step after the refused one did not count"


@pytest.mark.parametrize("state_bits", [32, 8])
@pytest.mark.parametrize("case", ["AdamW", "SGD", "Lion", "LAMB", "LARS"])
def test_invalid_lr_filled_between_replays_of_a_captured_step_writes_nothing(case, state_bits):
    graphsafe.check_errors()
    opt, params, _, _ = _stepped_once_on_cuda(case, state_bits, stable_seed("invalid lr graph", case, state_bits))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            opt.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    torch.cuda.synchronize()
    lr = opt.param_groups[0]["lr"]
    for replay, value in enumerate([0.01, float("nan"), -0.5, 0.02]):
        lr.fill_(value)
        before = snapshot_states(opt, params)
        graph.replay()
        torch.cuda.synchronize()
        if value >= 0:
            graphsafe.check_errors()
            assert not torch.equal(params[-1].detach(), before[-1][0]), f"replay {replay + 1} with lr {value} did not step"
        else:
            with pytest.raises(ValueError, match="invalid learning rate"):
                graphsafe.check_errors()
            _assert_unchanged(opt, params, before, f"{case} {state_bits}-bit replay {replay + 1}, lr {value}")
    assert all(float(opt.state[p]["step"]) == 5 for p in params)
