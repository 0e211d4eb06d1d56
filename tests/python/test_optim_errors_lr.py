"""An invalid learning rate inside the lr tensor of graphsafe's optimizers (CPU): refused at step() before
anything is written; +inf and -0.0 accepted."""

from __future__ import annotations

import pytest
import torch

import graphsafe.optim as go
from conftest import skip_unless_storable, OPTIM_CASE_NAMES, assert_bitwise_equal, make_generator, make_params, optim_cases, random_grad

CASES = optim_cases()


# --------------------------------------------------------------------------------------------------------
# Invalid learning rate inside the lr tensor (issue 18): a NaN or negative value that a user or a scheduler
# writes into the group's lr tensor is refused at step() with a ValueError, before anything is written;
# +inf and -0.0 are accepted, as torch accepts them.
# --------------------------------------------------------------------------------------------------------


def _stepped_once(case, state_bits, gen):
    params = make_params([(300,), (5000,)], torch.float32, gen)
    cls, kw = CASES[case]
    opt = cls(params, **dict(kw, state_bits=state_bits, min_8bit_size=0))
    for p in params:
        p.grad = random_grad(p.shape, torch.float32, gen)
    opt.step()
    for p in params:
        p.grad = random_grad(p.shape, torch.float32, gen)
    return opt, params


def _everything(opt, params):
    return [p.detach().clone() for p in params] + [
        v.clone() for p in params for v in opt.state[p].values() if isinstance(v, torch.Tensor)]


@pytest.mark.parametrize("state_bits", [32, 16, 8])
@pytest.mark.parametrize("bad", [float("nan"), -1.0, -1e-30], ids=["nan", "-1", "tiny-negative"])
@pytest.mark.parametrize("case", OPTIM_CASE_NAMES)
def test_invalid_lr_in_the_lr_tensor_is_refused_and_changes_nothing(case, bad, state_bits):
    skip_unless_storable(case, state_bits)
    opt, params = _stepped_once(case, state_bits, make_generator(60))
    before = _everything(opt, params)
    lr = opt.param_groups[0]["lr"]
    assert isinstance(lr, torch.Tensor)
    lr.fill_(bad)
    with pytest.raises(ValueError, match="invalid learning rate"):
        opt.step()
    after = _everything(opt, params)
    assert len(after) == len(before)
    for i, (a, b) in enumerate(zip(after, before)):
        assert_bitwise_equal(a, b, f"tensor {i} (parameters, then states and steps)")
    lr.fill_(0.01)  # a usable value again: the step runs and counts
    opt.step()
    assert float(opt.state[params[0]]["step"]) == 2.0


@pytest.mark.parametrize("good", [float("inf"), -0.0, 0.0], ids=["inf", "-0", "0"])
@pytest.mark.parametrize("case", ["AdamW", "SGD", "LAMB", "LARS"])
def test_infinite_or_zero_lr_in_the_lr_tensor_is_accepted(case, good):
    opt, params = _stepped_once(case, 32, make_generator(61))
    opt.param_groups[0]["lr"].fill_(good)
    opt.step()
    assert float(opt.state[params[0]]["step"]) == 2.0


@pytest.mark.parametrize("case", ["AdamW", "SGD", "LAMB"])
def test_invalid_lr_in_a_later_group_leaves_every_group_unchanged(case):
    # The step checks every group's lr before issuing any group's update: nothing half-applied.
    gen = make_generator(62)
    first, second = make_params([(300,)], torch.float32, gen), make_params([(70,)], torch.float32, gen)
    cls, kw = CASES[case]
    opt = cls([{"params": first}, {"params": second}], **kw)
    for p in first + second:
        p.grad = random_grad(p.shape, torch.float32, gen)
    opt.step()
    before = _everything(opt, first + second)
    opt.param_groups[1]["lr"].fill_(float("nan"))
    with pytest.raises(ValueError, match="invalid learning rate"):
        opt.step()
    for i, (a, b) in enumerate(zip(_everything(opt, first + second), before)):
        assert_bitwise_equal(a, b, f"tensor {i} (parameters, then states and steps)")


@pytest.mark.parametrize("state_bits", [32, 8])
def test_invalid_lr_refuses_a_first_step_before_any_state_is_made_or_converted(state_bits):
    # A refused step makes no state (first step) and converts none (state_bits changed since the last step).
    gen = make_generator(63)
    first, second = make_params([(300,)], torch.float32, gen), make_params([(5000,)], torch.float32, gen)
    opt = go.AdamW([{"params": first}, {"params": second}], state_bits=state_bits, min_8bit_size=0)
    for p in first + second:
        p.grad = random_grad(p.shape, torch.float32, gen)
    opt.param_groups[1]["lr"].fill_(float("nan"))
    with pytest.raises(ValueError, match="invalid learning rate"):
        opt.step()
    assert len(opt.state) == 0
    opt.param_groups[1]["lr"].fill_(0.01)
    opt.step()
    kinds = {k: (v.dtype, tuple(v.shape)) for k, v in opt.state[second[0]].items() if isinstance(v, torch.Tensor)}
    for group in opt.param_groups:
        group["state_bits"] = 8 if state_bits == 32 else 32
    opt.param_groups[0]["lr"].fill_(-1.0)
    with pytest.raises(ValueError, match="invalid learning rate"):
        opt.step()
    assert {k: (v.dtype, tuple(v.shape)) for k, v in opt.state[second[0]].items()
            if isinstance(v, torch.Tensor)} == kinds
