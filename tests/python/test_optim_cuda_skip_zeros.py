"""skip_zeros and bitwise repeatability of graphsafe's optimizers on CUDA (skipped without a GPU and graphsafe's
CUDA backend): skip_zeros bit-identity (scattered zeros and whole zero rows, +0.0 and -0.0, vector and scalar
paths), NaN not skipped, skip_zeros on without zeros == off; two identical runs give the same bits.
"""

from __future__ import annotations

import pytest
import torch

from conftest import (
    initial_state,
    per_tensor_keys,
    assert_same_run,
    snapshot_states,
    OPTIM_CASE_NAMES,
    make_generator,
    make_optimizer,
    make_params,
    requires_cuda,
    stable_seed,
    state_tensors,
)
from optim_cuda_helpers import CASES, CUDA, OFFSETS, SHAPES, attach_grads, bits_at, copy_into, draw_grads

pytestmark = requires_cuda


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
                if k in per_tensor_keys(opt):
                    continue
                old = old_states[k] if k in old_states else initial_state(opt, k, old_p, initial.get(k, 0.0))
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
