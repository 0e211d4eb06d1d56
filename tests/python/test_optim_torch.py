"""graphsafe.optim.{Adam, AdamW, SGD, RMSprop, Adagrad} against their torch.optim namesakes (CPU).

Contract (DESIGN.md "Optimizers"): constructor options as in torch.optim and the same numerics; states are
fp32 for every parameter dtype; lr and step live in tensors, so torch.optim.lr_scheduler keeps working.

How results are compared, and why:

* fp32 parameters: both optimizers run free for 20 steps on the same gradients, then every parameter and
  every state is compared as ||ours - torch|| / ||torch|| <= 1e-6 over the whole tensor. Not elementwise:
  torch's CPU kernels fuse some multiply-adds (e.g. the vectorised add/addcdiv with alpha use FMA) while
  graphsafe is built with -ffp-contract=off, so single operations round differently. Both results are
  accurate to a few fp32 ulps of the *operands*, but for an element that nearly cancels (p + delta ~ 0)
  that is an arbitrarily large error relative to the element itself; the norm-wise measure is the one that
  the rounding analysis bounds (~20 steps x a few roundings of 2^-24 each; 1e-6 leaves a wide margin,
  observed ~1e-7, while any wrong formula, constant or state is off by orders of magnitude more).
  graphsafe's lr is an fp32 tensor (torch's a Python float): a relative 3e-8, also inside the margin.

* fp16/bf16 parameters: graphsafe loads each parameter element into fp32, computes the step in fp32 with
  fp32 states and rounds the new value to the parameter's dtype. The principled reference is exactly that
  computation done by torch: torch.optim on an fp32 master copy with fp32 states, whose result is rounded
  to the parameter dtype after every step. Two tempting references are not principled:
    - torch.optim directly on the half parameters keeps half *states* (exp_avg_sq in bf16 has 8 bits of
      mantissa) and rounds every intermediate op: it is a different algorithm, any tolerance is a guess;
    - an fp32 copy rounded only at the end never loses the sub-ulp updates that a half parameter loses
      at every step (with lr*update < ulp/2 a bf16 parameter does not move at all): again a different
      algorithm.
  The reference runs in lockstep: before each step its fp32 master copy is set to graphsafe's current
  parameter, so a rare different rounding does not carry over and every step is checked on its own.
  Each new parameter must then be within 1 ulp of the dtype of the reference, measured at the larger of
  the old and new values (a different rounding is only possible when the fp32 value lies within a few
  fp32 ulps of a rounding midpoint; and where p + delta cancels to near zero, FMA or not changes the
  result by a few fp32 ulps of |p|, still below one ulp of the dtype at |p|), such
  differences must be rare (<= 1% of element-steps; a wrong rounding mode, e.g. truncation, would
  differ in about half of them), and the fp32 states, which see identical parameters at every step,
  must meet the same 1e-6 norm-wise bound as in fp32.
"""

from __future__ import annotations

import math

import pytest
import torch

import graphsafe.optim as go
from conftest import (
    HALF_DTYPES,
    assert_rel_close,
    assert_within_ulps,
    make_generator,
    make_params,
    random_grad,
    state_tensors,
)

SHAPES = [(37,), (16, 33), (2 * 4096 + 5,)]  # odd sizes, a 2-D tensor, more than one 4096-element chunk
STEPS = 20
FP32_TOL = 1e-6
LR = {"Adam": 0.02, "AdamW": 0.02, "SGD": 0.05, "RMSprop": 0.01, "Adagrad": 0.05}

TORCH_CASES = [
    ("Adam", {}),
    ("Adam", dict(amsgrad=True)),
    ("Adam", dict(maximize=True)),
    ("Adam", dict(weight_decay=0.1)),
    ("Adam", dict(weight_decay=0.1, decoupled_weight_decay=True)),
    ("Adam", dict(weight_decay=0.1, amsgrad=True, maximize=True, betas=(0.8, 0.95), eps=1e-3)),
    ("Adam", dict(weight_decay=0.1, amsgrad=True, maximize=True, decoupled_weight_decay=True)),
    ("AdamW", {}),
    ("AdamW", dict(weight_decay=0.0)),
    ("AdamW", dict(weight_decay=0.2, amsgrad=True, maximize=True, betas=(0.5, 0.9))),
    ("SGD", {}),
    ("SGD", dict(weight_decay=0.1, maximize=True)),
    ("SGD", dict(momentum=0.9)),
    ("SGD", dict(momentum=0.9, dampening=0.3, weight_decay=0.1)),
    ("SGD", dict(momentum=0.9, nesterov=True)),
    ("SGD", dict(momentum=0.8, nesterov=True, weight_decay=0.1, maximize=True)),
    ("RMSprop", {}),
    ("RMSprop", dict(alpha=0.9, eps=1e-4)),
    ("RMSprop", dict(centered=True)),
    ("RMSprop", dict(momentum=0.7)),
    ("RMSprop", dict(centered=True, momentum=0.5, weight_decay=0.1, maximize=True)),
    ("Adagrad", {}),
    ("Adagrad", dict(lr_decay=0.05)),
    ("Adagrad", dict(initial_accumulator_value=0.3)),
    ("Adagrad", dict(weight_decay=0.1, eps=1e-6)),
    ("Adagrad", dict(lr_decay=0.05, initial_accumulator_value=0.3, weight_decay=0.1, maximize=True)),
]


def case_id(case) -> str:
    name, kw = case
    return name + ("" if not kw else "-" + "-".join(f"{k}={v}" for k, v in kw.items()))


def make_pair(name, kw, params, ref_params):
    ours = getattr(go, name)(params, lr=LR[name], **kw)
    theirs = getattr(torch.optim, name)(ref_params, lr=LR[name], **kw)
    return ours, theirs


def assert_same_state_names(ours, theirs, p, r, what):
    mine = set(ours.state[p]) - {"step"}
    torch_names = {k for k, v in theirs.state[r].items() if isinstance(v, torch.Tensor)} - {"step"}
    assert mine == torch_names, f"{what}: state names {sorted(mine)} != torch's {sorted(torch_names)}"


@pytest.mark.parametrize("case", TORCH_CASES, ids=case_id)
def test_fp32_matches_torch(case):
    name, kw = case
    gen = make_generator(11)
    params = make_params(SHAPES, torch.float32, gen)
    refs = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ours, theirs = make_pair(name, kw, params, refs)
    for _ in range(STEPS):
        for p, r in zip(params, refs):
            g = random_grad(p.shape, torch.float32, gen)
            p.grad, r.grad = g, g.clone()
        ours.step()
        theirs.step()
    for i, (p, r) in enumerate(zip(params, refs)):
        what = f"{case_id(case)} tensor {i}"
        assert p.dtype == torch.float32
        assert_rel_close(p, r, FP32_TOL, f"{what} param")
        assert_same_state_names(ours, theirs, p, r, what)
        for k, v in state_tensors(ours, p).items():
            assert v.dtype == torch.float32, f"{what}: state {k} is {v.dtype}"
            if k == "step":
                assert float(v) == STEPS
                if "step" in theirs.state[r]:
                    assert float(v) == float(theirs.state[r]["step"])
            else:
                assert_rel_close(v, theirs.state[r][k], FP32_TOL, f"{what} state {k}")
        # the parameters really moved: the comparison above is not between two untouched tensors
        assert float((p.detach() - refs[i].detach()).abs().max()) < 1.0


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
@pytest.mark.parametrize("case", TORCH_CASES, ids=case_id)
def test_half_matches_torch_on_fp32_master_rounded_each_step(case, dtype):
    """See the module docstring: torch on an fp32 master copy (fp32 states), set to graphsafe's parameter
    before each step and rounded to `dtype` after it."""
    name, kw = case
    gen = make_generator(12)
    params = make_params(SHAPES, dtype, gen)
    masters = [torch.nn.Parameter(p.detach().float()) for p in params]
    ours, theirs = make_pair(name, kw, params, masters)
    initial = [p.detach().clone() for p in params]
    differing = total = 0
    for step in range(STEPS):
        before = [p.detach().clone() for p in params]
        with torch.no_grad():
            for p, m in zip(params, masters):
                m.copy_(p.float())
        for p, m in zip(params, masters):
            g = random_grad(p.shape, dtype, gen)
            p.grad, m.grad = g, g.float()  # fp16/bf16 values are exact in fp32
        ours.step()
        theirs.step()
        for i, (p, m) in enumerate(zip(params, masters)):
            expected = m.detach().to(dtype)
            assert p.dtype == dtype
            assert_within_ulps(p, expected, 1, f"{case_id(case)} {dtype} step {step + 1} tensor {i}", scale=before[i])
            differing += int((p.detach() != expected).sum())
            total += p.numel()
    assert differing <= 0.01 * total, f"{differing} of {total} element-steps rounded differently"
    for i, (p, m) in enumerate(zip(params, masters)):
        what = f"{case_id(case)} {dtype} tensor {i}"
        assert_same_state_names(ours, theirs, p, m, what)
        for k, v in state_tensors(ours, p).items():
            assert v.dtype == torch.float32, f"{what}: state {k} is {v.dtype} (states are fp32 for half params)"
            if k != "step":
                assert_rel_close(v, theirs.state[m][k], FP32_TOL, f"{what} state {k}")
        assert not torch.equal(p.detach(), initial[i]), f"{what}: parameter never moved"


# --------------------------------------------------------------------------------------------------------
# Param groups, lr as a tensor, schedulers, closures
# --------------------------------------------------------------------------------------------------------


def run_both(make_ours, make_theirs, shapes, steps, gen, per_step=None):
    params = make_params(shapes, torch.float32, gen)
    refs = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ours, theirs = make_ours(params), make_theirs(refs)
    extra = per_step(ours, theirs) if per_step else None
    for _ in range(steps):
        for p, r in zip(params, refs):
            g = random_grad(p.shape, torch.float32, gen)
            p.grad, r.grad = g, g.clone()
        ours.step()
        theirs.step()
        if extra:
            extra()
    return params, refs, ours, theirs


def test_param_groups_with_different_hyperparameters():
    gen = make_generator(13)

    def groups(ps, lr_type):
        return [
            dict(params=ps[:2], lr=lr_type(0.01), betas=(0.8, 0.9), weight_decay=0.0),
            dict(params=ps[2:3], amsgrad=True, weight_decay=0.3),
            dict(params=ps[3:], lr=lr_type(0.1), eps=1e-2, maximize=True),
        ]

    shapes = [(7,), (3, 5), (100,), (4, 4), (33,)]
    params, refs, ours, theirs = run_both(
        lambda ps: go.Adam(groups(ps, float), lr=0.03, weight_decay=0.05),
        lambda ps: torch.optim.Adam(groups(ps, float), lr=0.03, weight_decay=0.05),
        shapes, STEPS, gen,
    )
    for i, (p, r) in enumerate(zip(params, refs)):
        assert_rel_close(p, r, FP32_TOL, f"param {i}")
        for k in ("exp_avg", "exp_avg_sq"):
            assert_rel_close(ours.state[p][k], theirs.state[r][k], FP32_TOL, f"param {i} {k}")
    assert "max_exp_avg_sq" in ours.state[params[2]] and "max_exp_avg_sq" not in ours.state[params[0]]
    for group, expected in zip(ours.param_groups, (0.01, 0.03, 0.1)):
        assert isinstance(group["lr"], torch.Tensor) and group["lr"].dtype == torch.float32
        assert float(group["lr"]) == pytest.approx(expected, rel=1e-7)


def test_add_param_group_after_construction():
    gen = make_generator(14)

    def build(cls):
        def make(ps):
            opt = cls(ps[:1], lr=0.05, momentum=0.9)
            opt.add_param_group(dict(params=ps[1:], lr=0.2, nesterov=True))
            return opt
        return make

    params, refs, ours, theirs = run_both(build(go.SGD), build(torch.optim.SGD), [(9,), (5, 3)], STEPS, gen)
    for i, (p, r) in enumerate(zip(params, refs)):
        assert_rel_close(p, r, FP32_TOL, f"param {i}")
    assert isinstance(ours.param_groups[1]["lr"], torch.Tensor)


def test_lr_given_as_tensor_and_set_by_hand():
    """lr may be a one-element tensor; a float put into group["lr"] by hand is honoured on the next step."""
    gen = make_generator(15)
    shapes = [(50,)]

    def change_lr(ours, theirs):
        count = [0]

        def after_step():
            count[0] += 1
            if count[0] == 5:
                ours.param_groups[0]["lr"] = 0.003  # a plain float, as some user code does
                theirs.param_groups[0]["lr"] = 0.003
            if count[0] == 10:
                ours.param_groups[0]["lr"].fill_(0.05)
                theirs.param_groups[0]["lr"] = 0.05
        return after_step

    params, refs, ours, theirs = run_both(
        lambda ps: go.AdamW(ps, lr=torch.tensor([0.01])), lambda ps: torch.optim.AdamW(ps, lr=0.01), shapes, 15, gen,
        per_step=change_lr,
    )
    assert_rel_close(params[0], refs[0], FP32_TOL, "param")
    assert isinstance(ours.param_groups[0]["lr"], torch.Tensor)


SCHEDULERS = {
    "StepLR": lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5),
    "ExponentialLR": lambda opt: torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.85),
    "LambdaLR": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda e: (1 + e % 3) / (1 + e)),
    "OneCycleLR": lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=25),
}


@pytest.mark.parametrize("sched", SCHEDULERS, ids=str)
@pytest.mark.parametrize("name,kw", [("AdamW", dict(weight_decay=0.1)), ("SGD", dict(momentum=0.9, weight_decay=0.1))],
                         ids=["AdamW", "SGD"])
def test_lr_scheduler_changes_effective_lr(name, kw, sched):
    """The schedulers fill_ graphsafe's lr tensor in place; the steps must follow, as torch's do."""
    gen = make_generator(16)
    scheds = {}

    def attach(ours, theirs):
        scheds["ours"], scheds["theirs"] = SCHEDULERS[sched](ours), SCHEDULERS[sched](theirs)

        def after_step():
            scheds["ours"].step()
            scheds["theirs"].step()
            lr_ours, lr_theirs = ours.param_groups[0]["lr"], theirs.param_groups[0]["lr"]
            assert isinstance(lr_ours, torch.Tensor)
            assert float(lr_ours) == pytest.approx(float(lr_theirs), rel=1e-6, abs=1e-12)
        return after_step

    params, refs, ours, theirs = run_both(
        lambda ps: getattr(go, name)(ps, lr=0.05, **kw), lambda ps: getattr(torch.optim, name)(ps, lr=0.05, **kw),
        [(64,), (8, 9)], STEPS, gen, per_step=attach,
    )
    for i, (p, r) in enumerate(zip(params, refs)):
        assert_rel_close(p, r, FP32_TOL, f"{sched} param {i}")

    # and the schedule mattered: a constant lr gives clearly different parameters
    gen = make_generator(16)
    const_params, *_ = run_both(
        lambda ps: getattr(go, name)(ps, lr=0.05, **kw), lambda ps: getattr(torch.optim, name)(ps, lr=0.05, **kw),
        [(64,), (8, 9)], STEPS, gen,
    )
    assert not torch.allclose(const_params[0], params[0], rtol=1e-4, atol=0)


@pytest.mark.parametrize("name", ["Adam", "SGD", "Adagrad", "Lion", "LAMB"])
def test_step_with_closure(name):
    """step(closure) evaluates the closure with grad enabled, steps on the grads it left, returns its loss."""
    gen = make_generator(17)
    x = torch.randn(32, 6, generator=gen)
    y = torch.randn(32, generator=gen)
    w = torch.nn.Parameter(torch.randn(6, generator=gen))
    b = torch.nn.Parameter(torch.zeros(()))
    kw = dict(lr=0.01, momentum=0.9) if name == "SGD" else dict(lr=0.01)
    opt = getattr(go, name)([w, b], **kw)
    calls = []

    def closure():
        opt.zero_grad()
        loss = ((x @ w + b - y) ** 2).mean()
        loss.backward()
        calls.append(float(loss.detach()))
        return loss

    with torch.no_grad():
        w_expected = w.detach().clone()
    loss = None
    for _ in range(5):
        loss = opt.step(closure)
    assert isinstance(loss, torch.Tensor) and float(loss.detach()) == calls[-1]
    assert len(calls) == 5
    assert calls[-1] < calls[0]  # it optimises
    if name in ("Adam", "SGD", "Adagrad"):
        ref_w = torch.nn.Parameter(w_expected)
        ref_b = torch.nn.Parameter(torch.zeros(()))
        ref = getattr(torch.optim, name)([ref_w, ref_b], **kw)

        def ref_closure():
            ref.zero_grad()
            loss = ((x @ ref_w + ref_b - y) ** 2).mean()
            loss.backward()
            return loss

        for _ in range(5):
            ref.step(ref_closure)
        assert_rel_close(w, ref_w, FP32_TOL, "w")
        assert_rel_close(b.reshape(1), ref_b.reshape(1), FP32_TOL, "b")


def test_accepts_torch_compat_flags():
    """foreach / fused / capturable are accepted (graphsafe's step is always fused and capturable)."""
    p = torch.nn.Parameter(torch.ones(3))
    go.Adam([p], foreach=True, fused=True, capturable=True)
    go.AdamW([p], foreach=False, fused=None, capturable=True)
    go.SGD([p], foreach=True, fused=False)
    go.RMSprop([p], foreach=True, capturable=True)
    go.Adagrad([p], foreach=True, fused=None)
    assert math.isclose(float(go.Adam([p], lr=0.25).param_groups[0]["lr"]), 0.25)


def test_momentum_turned_on_after_first_step_like_torch():
    gen = make_generator(18)
    params, refs, ours, theirs = run_both(lambda ps: go.SGD(ps, lr=0.05), lambda ps: torch.optim.SGD(ps, lr=0.05),
                                          [(20,)], 1, gen)
    ours.param_groups[0]["momentum"] = theirs.param_groups[0]["momentum"] = 0.9
    for _ in range(3):
        g = random_grad((20,), torch.float32, gen)
        params[0].grad, refs[0].grad = g, g.clone()
        ours.step()
        theirs.step()
    assert_rel_close(params[0], refs[0], FP32_TOL, "param")
