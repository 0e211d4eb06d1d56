"""skip_zeros of graphsafe's optimizers, for every algorithm (CPU).

Where the raw gradient element is exactly zero (+0.0 or -0.0) the parameter and every state keep their bit
patterns (DESIGN.md "Optimizers"; compared as integers, so -0.0 vs +0.0 or a changed NaN payload would count);
NaN gradient elements are not skipped; with no zero in the gradient the result is bit-identical to
skip_zeros=False; embedding-like tables keep untouched rows exact over many steps. Every case of
conftest.optim_cases() has weight_decay > 0 (so a skipped element would move if the skip failed) and every
optional state enabled.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import (
    initial_state,
    per_tensor_keys,
    assert_same_run,
    snapshot_states,
    OPTIM_CASE_NAMES,
    PARAM_DTYPES,
    clone_params,
    make_generator,
    make_optimizer,
    make_params,
    optim_cases,
    state_tensors,
)
from optim_property_helpers import SHAPES, grad_with_zeros, nonzero_grad, run_steps

CASES = optim_cases()
ELEMENTWISE = [n for n in OPTIM_CASE_NAMES if n not in ("LAMB", "LARS")]


def initial_state_value(case: str, name: str) -> float:
    return CASES[case][1].get("initial_accumulator_value", 0.0) if name == "sum" else 0.0


def bits_at(t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    view = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}[t.dtype]
    return t.detach().contiguous().view(view)[mask]


# --------------------------------------------------------------------------------------------------------
# skip_zeros
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", PARAM_DTYPES, ids=str)
@pytest.mark.parametrize("case", OPTIM_CASE_NAMES)
def test_skip_zeros_keeps_zero_grad_elements_bit_identical(case, dtype):
    gen = make_generator(31)
    params = make_params(SHAPES, dtype, gen)
    opt = make_optimizer(case, params, skip_zeros=True)
    for step in range(6):
        before = snapshot_states(opt, params)
        masks = []
        for p in params:
            p.grad, mask = grad_with_zeros(p.shape, dtype, gen)
            masks.append(mask)
        opt.step()
        for i, (p, mask) in enumerate(zip(params, masks)):
            what = f"{case} {dtype} step {step + 1} tensor {i}"
            old_p, old_states = before[i]
            assert torch.equal(bits_at(p, mask), bits_at(old_p, mask)), f"{what}: a skipped parameter changed"
            moved = (p.detach() != old_p)[~mask].float().mean()
            assert moved > 0.5, f"{what}: only {float(moved):.2f} of the updated elements moved"
            states = state_tensors(opt, p)
            assert set(states) - {"step"}, f"{what}: no states"
            for k, v in states.items():
                if k in per_tensor_keys(opt):
                    if k == "step":
                        assert float(v) == step + 1  # the step counts per tensor, skipped elements or not
                    continue
                assert v.dtype == torch.float32
                old = old_states[k] if k in old_states else initial_state(opt, k, old_p, initial_state_value(case, k))
                assert torch.equal(bits_at(v, mask), bits_at(old, mask)), f"{what}: skipped elements of {k} changed"
                assert bool((v != old)[~mask].any()), f"{what}: state {k} never changed"


@pytest.mark.parametrize("case", OPTIM_CASE_NAMES)
def test_skip_zeros_does_not_skip_nan(case):
    """A NaN gradient element is not zero: it is stepped (parameter and every state become NaN, as in
    torch), while the zero elements of the same tensor are still skipped."""
    gen = make_generator(32)
    params = make_params([(300,), (12, 10)], torch.float32, gen)
    opt = make_optimizer(case, params, skip_zeros=True)
    for step in range(3):
        before = snapshot_states(opt, params)
        nan_masks, zero_masks = [], []
        for p in params:
            g, zero = grad_with_zeros(p.shape, torch.float32, gen)
            nan = torch.zeros(p.shape, dtype=torch.bool)
            nan.view(-1)[step * 7 :: 41] = True
            nan &= ~zero
            g[nan] = float("nan")
            p.grad = g
            nan_masks.append(nan)
            zero_masks.append(zero)
        opt.step()
        for i, p in enumerate(params):
            what = f"{case} step {step + 1} tensor {i}"
            assert bool(torch.isnan(p.detach()[nan_masks[i]]).all()), f"{what}: NaN-gradient elements were skipped"
            assert torch.equal(bits_at(p, zero_masks[i]), bits_at(before[i][0], zero_masks[i])), what
            for k, v in state_tensors(opt, p).items():
                if k not in per_tensor_keys(opt):
                    assert bool(torch.isnan(v[nan_masks[i]]).all()), f"{what}: state {k} skipped a NaN gradient"
                    old = before[i][1].get(k) if k in before[i][1] else initial_state(
                        opt, k, before[i][0], initial_state_value(case, k))
                    assert torch.equal(bits_at(v, zero_masks[i]), bits_at(old, zero_masks[i])), f"{what}: {k}"
            if case in ELEMENTWISE:  # no norm couples the elements: the others stay finite
                fresh = ~nan_masks[i] & ~torch.isnan(before[i][0])
                assert bool(torch.isfinite(p.detach()[fresh]).all()), what


@pytest.mark.parametrize("dtype", PARAM_DTYPES, ids=str)
@pytest.mark.parametrize("case", OPTIM_CASE_NAMES)
def test_skip_zeros_without_zeros_is_bit_identical_to_off(case, dtype):
    gen = make_generator(33)
    params = make_params(SHAPES, dtype, gen)
    grads = [[nonzero_grad(p.shape, dtype, gen) for p in params] for _ in range(5)]
    params_on, params_off = clone_params(params), clone_params(params)
    opt_on = run_steps(case, params_on, grads, skip_zeros=True)
    opt_off = run_steps(case, params_off, grads, skip_zeros=False)
    assert_same_run(opt_on, params_on, opt_off, params_off, f"{case} {dtype} skip_zeros on vs off")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", OPTIM_CASE_NAMES)
def test_skip_zeros_embedding_table_untouched_rows_stay_exact(case, dtype):
    """A [rows, dim] table whose gradient is zero in whole rows (rows no token looked up): rows 0..9 never
    get a gradient in 10 steps and must keep their exact bits (and their states the initial value); the
    other rows get a gradient in some steps and must move."""
    gen = make_generator(34)
    rows, dim = 50, 24
    (table,) = make_params([(rows, dim)], dtype, gen)
    initial = table.detach().clone()
    opt = make_optimizer(case, [table], skip_zeros=True)
    never = torch.zeros(rows, dtype=torch.bool)
    never[:10] = True
    for step in range(10):
        g = nonzero_grad((rows, dim), dtype, gen)
        seen = torch.rand(rows, generator=gen) < 0.4
        seen[10 + step] = True  # every other row is seen at least once... rows 10..19 for sure
        seen[never] = False
        g[~seen] = 0.0
        g[~seen & (torch.arange(rows) % 2 == 0)] = -0.0
        table.grad = g
        opt.step()
    untouched = never.unsqueeze(1).expand(rows, dim)
    assert torch.equal(bits_at(table, untouched), bits_at(initial, untouched)), f"{case}: untouched rows changed"
    for k, v in state_tensors(opt, table).items():
        if k not in per_tensor_keys(opt):
            expected = initial_state(opt, k, initial, initial_state_value(case, k))
            assert torch.equal(bits_at(v, untouched), bits_at(expected, untouched)), f"{case}: state {k} of untouched rows"
    changed_rows = (table.detach() != initial).any(dim=1)
    assert bool(changed_rows[10:20].all()), f"{case}: rows with gradients did not move"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    case=st.sampled_from(OPTIM_CASE_NAMES),
    dtype=st.sampled_from(PARAM_DTYPES),
    numel=st.integers(1, 9000),
    zero_fraction=st.sampled_from([0.0, 0.01, 0.5, 0.99, 1.0]),
    steps=st.integers(1, 3),
    seed=st.integers(0, 2**31 - 1),
)
def test_skip_zeros_property(case, dtype, numel, zero_fraction, steps, seed):
    """Any size, any share of zeros (none, all): zero-gradient elements keep parameter and state bits."""
    gen = make_generator(seed)
    (p,) = make_params([(numel,)], dtype, gen)
    opt = make_optimizer(case, [p], skip_zeros=True)
    for _ in range(steps):
        (old_p, old_states), = snapshot_states(opt, [p])
        p.grad, mask = grad_with_zeros(p.shape, dtype, gen, fraction=zero_fraction)
        opt.step()
        assert torch.equal(bits_at(p, mask), bits_at(old_p, mask))
        for k, v in state_tensors(opt, p).items():
            if k not in per_tensor_keys(opt):
                old = old_states[k] if k in old_states else initial_state(opt, k, old_p, initial_state_value(case, k))
                assert torch.equal(bits_at(v, mask), bits_at(old, mask)), k


@pytest.mark.parametrize("case", ELEMENTWISE)
def test_skip_zeros_leaves_other_elements_as_without_it(case):
    """Element-wise algorithms: elements with a nonzero gradient in every step evolve exactly as with
    skip_zeros off; elements with a zero gradient move with skip_zeros off (weight decay), not with it on."""
    gen = make_generator(35)
    params = make_params([(40, 8), (333,)], torch.float32, gen)
    masks = [torch.rand(p.shape, generator=gen) < 0.3 for p in params]
    grads = []
    for _ in range(5):
        step_grads = []
        for p, mask in zip(params, masks):
            g = nonzero_grad(p.shape, torch.float32, gen)
            g[mask] = 0.0
            step_grads.append(g)
        grads.append(step_grads)
    params_on, params_off = clone_params(params), clone_params(params)
    opt_on = run_steps(case, params_on, grads, skip_zeros=True)
    opt_off = run_steps(case, params_off, grads, skip_zeros=False)
    for i, mask in enumerate(masks):
        assert torch.equal(bits_at(params_on[i], ~mask), bits_at(params_off[i], ~mask)), f"{case} tensor {i}"
        for k, v in state_tensors(opt_on, params_on[i]).items():
            if k not in per_tensor_keys(opt_on):
                assert torch.equal(bits_at(v, ~mask), bits_at(opt_off.state[params_off[i]][k], ~mask)), f"{case} {k}"
        assert torch.equal(bits_at(params_on[i], mask), bits_at(params[i], mask))
        assert bool((params_off[i].detach() != params[i].detach())[mask].all()), f"{case}: skip_zeros off did not decay"
