"""CUDA tests of graphsafe's optimizers against the CPU backend (skipped without a GPU and graphsafe's CUDA
backend).

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
* 100 parameters of assorted sizes (more than the 43 to 76 tensors of one launch, so several launches; one empty
  parameter) vs the CPU backend.
"""

from __future__ import annotations

import pytest
import torch

from conftest import (
    OPTIM_CASE_NAMES,
    assert_within_ulps,
    make_generator,
    make_optimizer,
    make_params,
    requires_cuda,
    stable_seed,
)
from optim_cuda_helpers import (CUDA, OFFSETS, SHAPES, LargestMagnitude, assert_cuda_close_to_cpu, attach_grads,
                                copy_into, draw_grads)

pytestmark = requires_cuda


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
    """Over 76 tensors per step: several launches, and LAMB/LARS chunk and factor indices that run across
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
