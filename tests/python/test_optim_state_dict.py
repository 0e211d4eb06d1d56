"""state_dict of graphsafe's optimizers (CPU): round trips through torch.save/torch.load into a fresh optimizer
over fresh parameters (every algorithm and parameter dtype), each group's hyperparameters kept, torch.optim
checkpoints loaded, states of the wrong shape rejected.
"""

from __future__ import annotations

import io

import pytest
import torch

import graphsafe.optim as go
from conftest import (
    per_tensor_keys,
    assert_same_run,
    OPTIM_CASE_NAMES,
    assert_bitwise_equal,
    clone_params,
    make_generator,
    make_optimizer,
    make_params,
    optim_cases,
    random_grad,
    state_tensors,
)
from optim_property_helpers import SHAPES, grad_with_zeros

CASES = optim_cases()


# --------------------------------------------------------------------------------------------------------
# state_dict
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", OPTIM_CASE_NAMES)
def test_state_dict_round_trip_into_fresh_optimizer(case, dtype):
    gen = make_generator(38)
    params = make_params(SHAPES, dtype, gen)
    opt = make_optimizer(case, params, skip_zeros=True)
    for _ in range(3):
        for p in params:
            p.grad, _ = grad_with_zeros(p.shape, dtype, gen, fraction=0.1)
        opt.step()
    opt.param_groups[0]["lr"].fill_(0.0123)  # as a scheduler would
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)

    fresh = clone_params(params)
    cls, kw = CASES[case]
    loaded = cls(fresh, **dict(kw, lr=0.5, skip_zeros=True))  # a different lr: the saved one must win
    buffer.seek(0)
    loaded.load_state_dict(torch.load(buffer, weights_only=True))

    lr = loaded.param_groups[0]["lr"]
    assert isinstance(lr, torch.Tensor) and lr.dtype == torch.float32 and lr.device == fresh[0].device
    assert_bitwise_equal(lr, opt.param_groups[0]["lr"], "restored lr")
    assert lr.data_ptr() != opt.param_groups[0]["lr"].data_ptr()
    for p, q in zip(params, fresh):
        ours, theirs = state_tensors(opt, p), state_tensors(loaded, q)
        assert ours.keys() == theirs.keys()
        for k in ours:
            expected = torch.float64 if k in per_tensor_keys(opt) - {"step"} else torch.float32  # (schedule values)
            assert theirs[k].dtype == expected, f"{case} {dtype}: loaded state {k} is {theirs[k].dtype}"
            assert theirs[k].data_ptr() != ours[k].data_ptr()
            assert_bitwise_equal(theirs[k], ours[k], f"loaded {k}")

    for _ in range(4):
        for p, q in zip(params, fresh):
            g, _ = grad_with_zeros(p.shape, dtype, gen, fraction=0.1)
            p.grad, q.grad = g, g.clone()
        opt.step()
        loaded.step()
    assert_same_run(opt, params, loaded, fresh, f"{case} {dtype} continued vs reloaded")


def test_state_dict_keeps_hyperparameters_of_each_group():
    gen = make_generator(39)
    params = make_params([(10,), (20,)], torch.float32, gen)
    opt = go.SGD([dict(params=params[:1], momentum=0.9, lr=0.1), dict(params=params[1:], nesterov=True, momentum=0.5)],
                 lr=0.2)
    for p in params:
        p.grad = random_grad(p.shape, torch.float32, gen)
    opt.step()
    fresh = clone_params(params)
    loaded = go.SGD([dict(params=fresh[:1]), dict(params=fresh[1:])], lr=1.0)
    loaded.load_state_dict(opt.state_dict())
    for g_loaded, g_saved in zip(loaded.param_groups, opt.param_groups):
        for k in ("momentum", "nesterov", "dampening", "weight_decay", "skip_zeros"):
            assert g_loaded[k] == g_saved[k]
        assert float(g_loaded["lr"]) == float(g_saved["lr"])
    with pytest.raises(ValueError):
        go.SGD([dict(params=fresh)], lr=1.0).load_state_dict(opt.state_dict())


def test_load_torch_optim_state_dict_widens_half_states():
    """A torch.optim.AdamW state_dict over bf16 parameters (bf16 states, CPU step) loads into
    graphsafe.optim.AdamW: states become fp32 of the parameter's shape, and stepping continues."""
    torch.manual_seed(3)
    p_torch = torch.nn.Parameter(torch.randn(64, dtype=torch.bfloat16))
    opt_torch = torch.optim.AdamW([p_torch], lr=1e-2)
    p_torch.grad = torch.randn(64, dtype=torch.bfloat16)
    opt_torch.step()
    p = torch.nn.Parameter(p_torch.detach().clone())
    opt = go.AdamW([p], lr=1e-2)
    opt.load_state_dict(opt_torch.state_dict())
    state = opt.state[p]
    assert state["exp_avg"].dtype == torch.float32 and state["exp_avg"].shape == p.shape
    assert state["exp_avg_sq"].dtype == torch.float32
    assert state["step"].dtype == torch.float32 and float(state["step"]) == 1.0
    torch.testing.assert_close(state["exp_avg"], opt_torch.state[p_torch]["exp_avg"].float())
    p.grad = torch.randn(64, dtype=torch.bfloat16)
    opt.step()
    assert float(state["step"]) == 2.0


def test_load_state_dict_rejects_a_state_of_the_wrong_shape():
    p = torch.nn.Parameter(torch.randn(8))
    opt = go.Adam([p])
    p.grad = torch.randn(8)
    opt.step()
    saved = opt.state_dict()
    saved["state"][0]["exp_avg"] = torch.zeros(4)
    with pytest.raises(ValueError, match="shape"):
        go.Adam([torch.nn.Parameter(torch.randn(8))]).load_state_dict(saved)
