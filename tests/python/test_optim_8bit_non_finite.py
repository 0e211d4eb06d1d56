"""Non-finite values with 8-bit optimizer states (state_bits=8), on the CPU.

* A gradient whose square overflows: NaN does not spread through an 8-bit block.
* A NaN or ±inf gradient element, for all nine algorithms: never more non-finite parameters than with fp32
  states, and (element-wise algorithms, and LAMB's states) every other element's parameter, codes and every
  block's absmax bitwise equal to a run where that element's gradient was 0 (the bad element's states are
  stored as 0, and a zero gradient on a zero parameter keeps them 0).
"""

from __future__ import annotations

import pytest
import torch

from conftest import assert_bitwise_equal, make_generator, state_tensors
from optim_8bit_helpers import CASE_NAMES, SIGNED, STATE_NAMES, make_opt, nonzero_randn


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
