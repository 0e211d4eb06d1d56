"""Bad input to graphsafe's optimizers raises a clear error (CPU): sparse or complex gradients, complex
parameters, a gradient dtype that differs from its parameter's, invalid hyperparameters, unsupported
modes (state_bits, differentiable), non-contiguous parameters; and a rejected step changes nothing.
(Changes made by hand between steps: test_optim_errors_between_steps.py; an invalid lr in the lr tensor:
test_optim_errors_lr.py.)"""

from __future__ import annotations

import pytest
import torch

import graphsafe.optim as go
from conftest import (OPTIM_CASE_NAMES, assert_bitwise_equal, make_generator, make_params, optim_cases, random_grad,
                      set_grad_any_dtype)

CASES = optim_cases()
ALL_CLASSES = [go.Adam, go.AdamW, go.SGD, go.RMSprop, go.Adagrad, go.Lion, go.LAMB, go.LARS, go.AdEMAMix]
TORCH_NAMED = [go.Adam, go.AdamW, go.SGD, go.RMSprop, go.Adagrad]


def param(n=8, dtype=torch.float32):
    return torch.nn.Parameter(torch.randn(n).to(dtype))


@pytest.mark.parametrize("case", OPTIM_CASE_NAMES)
def test_sparse_gradient_is_rejected(case):
    cls, kw = CASES[case]
    p = param()
    opt = cls([p], **kw)
    p.grad = torch.randn(8).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()


@pytest.mark.parametrize("cls", ALL_CLASSES, ids=lambda c: c.__name__)
def test_complex_parameter_is_rejected(cls):
    p = torch.nn.Parameter(torch.randn(4, dtype=torch.complex64))
    with pytest.raises(TypeError, match="complex64"):
        cls([p])


@pytest.mark.parametrize("cls", ALL_CLASSES, ids=lambda c: c.__name__)
def test_unsupported_real_dtypes_are_rejected(cls):
    for dtype in (torch.float64, torch.int32):
        p = torch.nn.Parameter(torch.zeros(4, dtype=dtype), requires_grad=dtype.is_floating_point)
        with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
            cls([p])


def test_complex_gradient_is_rejected():
    p = param()
    opt = go.Adam([p])
    set_grad_any_dtype(p, torch.randn(8, dtype=torch.complex64))
    with pytest.raises(RuntimeError, match="complex"):
        opt.step()


@pytest.mark.parametrize("grad_dtype,param_dtype", [(torch.float16, torch.float32), (torch.float32, torch.bfloat16),
                                                    (torch.float64, torch.float32)], ids=str)
def test_grad_dtype_must_match_param_dtype(grad_dtype, param_dtype):
    p = param(dtype=param_dtype)
    initial = p.detach().clone()
    opt = go.AdamW([p])
    set_grad_any_dtype(p, torch.randn(8).to(grad_dtype))
    with pytest.raises(TypeError, match="dtype"):
        opt.step()
    assert_bitwise_equal(p, initial, "parameter after a rejected step")


def test_grad_shape_must_match():
    p = param()
    opt = go.SGD([p], lr=0.1)
    with torch.no_grad():
        p.grad = torch.randn(8)
    p.grad.data = torch.randn(4)  # bypasses torch's own shape check on assignment
    with pytest.raises(ValueError, match="shape"):
        opt.step()


INVALID = [
    (go.Adam, dict(lr=-1e-3), "learning rate"),
    (go.SGD, dict(lr=-0.1), "learning rate"),
    (go.LARS, dict(lr=-0.1), "learning rate"),
    (go.Adam, dict(betas=(1.0, 0.999)), "betas"),
    (go.Adam, dict(betas=(0.9, 1.5)), "betas"),
    (go.AdamW, dict(betas=(-0.1, 0.999)), "betas"),
    (go.Lion, dict(betas=(0.9, 1.0)), "betas"),
    (go.LAMB, dict(betas=(1.2, 0.9)), "betas"),
    (go.AdEMAMix, dict(betas=(0.9, 0.999, 1.0)), "betas"),
    (go.Adam, dict(eps=-1e-8), "eps"),
    (go.RMSprop, dict(eps=-1.0), "eps"),
    (go.Adagrad, dict(eps=-1.0), "eps"),
    (go.LAMB, dict(eps=-1e-6), "eps"),
    (go.Adam, dict(weight_decay=-0.1), "weight_decay"),
    (go.AdamW, dict(weight_decay=-0.1), "weight_decay"),
    (go.SGD, dict(weight_decay=-0.1), "weight_decay"),
    (go.Lion, dict(weight_decay=-1.0), "weight_decay"),
    (go.LARS, dict(weight_decay=-1.0), "weight_decay"),
    (go.AdEMAMix, dict(weight_decay=-1.0), "weight_decay"),
    (go.SGD, dict(momentum=-0.5), "momentum"),
    (go.RMSprop, dict(momentum=-0.5), "momentum"),
    (go.LARS, dict(momentum=-0.5), "momentum"),
    (go.SGD, dict(nesterov=True), "nesterov"),
    (go.SGD, dict(nesterov=True, momentum=0.9, dampening=0.1), "nesterov"),
    (go.RMSprop, dict(alpha=-0.1), "alpha"),
    (go.Adagrad, dict(lr_decay=-0.1), "lr_decay"),
    (go.Adagrad, dict(initial_accumulator_value=-0.1), "initial_accumulator_value"),
    (go.LARS, dict(trust_coefficient=0.0), "trust_coefficient"),
    (go.AdEMAMix, dict(alpha=-1.0), "alpha"),
    (go.AdEMAMix, dict(betas=(0.9, 0.999)), "three betas"),
    (go.Adam, dict(lr=torch.tensor([0.1, 0.2])), "lr"),
    (go.Adam, dict(eps=float("nan")), "eps"),
    (go.Adam, dict(weight_decay=float("inf")), "weight_decay"),
]


@pytest.mark.parametrize("cls,kwargs,match", INVALID, ids=lambda x: x.__name__ if isinstance(x, type) else str(x))
def test_invalid_hyperparameters(cls, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cls([param()], **kwargs)


@pytest.mark.parametrize("cls", ALL_CLASSES, ids=lambda c: c.__name__)
def test_invalid_hyperparameter_in_param_group(cls):
    good, bad = param(), param()
    with pytest.raises(ValueError):
        cls([dict(params=[good]), dict(params=[bad], weight_decay=-1.0)])
    opt = cls([good])
    with pytest.raises(ValueError):
        opt.add_param_group(dict(params=[bad], lr=-1.0))


@pytest.mark.parametrize("cls", ALL_CLASSES, ids=lambda c: c.__name__)
def test_state_bits(cls):
    cls([param()], state_bits=8)  # 8-bit states exist (tests/python/test_optim_8bit_*.py)
    cls([param()], state_bits=16)  # bf16 states (tests/python/test_optim_16bit.py)
    for bits in (12, 4, 0):
        with pytest.raises(ValueError, match="state_bits"):
            cls([param()], state_bits=bits)
    with pytest.raises(ValueError, match="block_size"):
        cls([param()], block_size=0)


@pytest.mark.parametrize("cls", TORCH_NAMED, ids=lambda c: c.__name__)
def test_differentiable_is_not_supported(cls):
    with pytest.raises(NotImplementedError, match="differentiable"):
        cls([param()], differentiable=True)
    cls([param()], differentiable=False)


@pytest.mark.parametrize("cls", ALL_CLASSES, ids=lambda c: c.__name__)
def test_non_contiguous_parameter_is_rejected(cls):
    base = torch.randn(6, 4)
    p = torch.nn.Parameter(base.t())  # a transposed view: not contiguous
    assert not p.is_contiguous()
    with pytest.raises(ValueError, match="contiguous"):
        cls([p])
    with pytest.raises(ValueError, match="contiguous"):
        cls([param()]).add_param_group(dict(params=[torch.nn.Parameter(torch.randn(4, 6)[:, ::2])]))


@pytest.mark.parametrize("cls", ALL_CLASSES, ids=lambda c: c.__name__)
def test_parameter_made_non_contiguous_after_construction_fails_the_step_without_changes(cls):
    """p.data = a transposed view bypasses the constructor's check; the step's own check must catch it
    (the core writes through the raw address as if the elements were contiguous)."""
    gen = make_generator(52)
    (p, other) = make_params([(6, 4), (8,)], torch.float32, gen)
    opt = cls([p, other])
    p.data = torch.randn(4, 6, generator=gen).t()
    assert not p.is_contiguous()
    p.grad = random_grad((6, 4), torch.float32, gen)
    other.grad = random_grad((8,), torch.float32, gen)
    before, other_before = p.detach().clone(), other.detach().clone()
    with pytest.raises(ValueError, match="contiguous"):
        opt.step()
    assert_bitwise_equal(p.detach(), before)
    assert_bitwise_equal(other.detach(), other_before)


@pytest.mark.parametrize("bad", ["non_contiguous", "sparse_grad", "lr"])
def test_a_bad_later_group_fails_the_step_before_any_group_is_stepped(bad):
    """Every (group, device, dtype) bucket is checked before the first is stepped: the first group's parameter
    and its states stay as they were when the second group is rejected."""
    gen = make_generator(53)
    (p, q, r) = make_params([(8,), (6, 4), (5,)], torch.float32, gen)
    opt = go.AdamW([dict(params=[p]), dict(params=[q, r], lr=1e-2)], lr=1e-3)
    for t in (p, q, r):
        t.grad = random_grad(tuple(t.shape), torch.float32, gen)
    opt.step()  # the states exist
    if bad == "non_contiguous":
        q.data = torch.randn(4, 6, generator=gen).t()
    elif bad == "sparse_grad":
        r.grad = r.grad.to_sparse()
    else:
        opt.param_groups[1]["lr"] = -1.0
    before = {name: t.detach().clone() for name, t in [("p", p)] + [(k, v) for k, v in opt.state[p].items()
                                                                     if isinstance(v, torch.Tensor)]}
    with pytest.raises((ValueError, RuntimeError)):
        opt.step()
    assert_bitwise_equal(p.detach(), before.pop("p"))
    for name, value in before.items():
        assert_bitwise_equal(opt.state[p][name], value, name)


def test_hyperparameter_made_invalid_after_construction_fails_the_step_without_changes():
    """Options are validated again on every step (a group dict can be edited); a rejected step must leave
    the parameter untouched."""
    gen = make_generator(51)
    (p,) = make_params([(16,)], torch.float32, gen)
    opt = go.Adam([p], lr=0.01)
    p.grad = random_grad((16,), torch.float32, gen)
    opt.step()
    before = p.detach().clone()
    opt.param_groups[0]["betas"] = (1.5, 0.999)
    with pytest.raises(ValueError, match="betas"):
        opt.step()
    assert_bitwise_equal(p, before, "parameter after a rejected step")


def test_rejected_step_does_not_advance_the_step_counter():
    """A step that raises (here: invalid options set after construction) must not leave the optimizer's
    step counter incremented: otherwise the next successful step uses the wrong bias correction."""
    gen = make_generator(52)
    (p,) = make_params([(16,)], torch.float32, gen)
    opt = go.Adam([p], lr=0.01)
    p.grad = random_grad((16,), torch.float32, gen)
    opt.step()
    opt.param_groups[0]["betas"] = (1.5, 0.999)
    with pytest.raises(ValueError):
        opt.step()
    assert float(opt.state[p]["step"]) == 1


def test_parameters_of_one_group_must_share_a_device():
    if not torch.cuda.is_available():
        pytest.skip("needs a second device")
    with pytest.raises(ValueError, match="one device"):
        go.Adam([param(), torch.nn.Parameter(torch.randn(4, device="cuda"))])
