"""graphsafe.optim.{Lion, LAMB, LARS, AdEMAMix} against float64 reference implementations written here
from the papers' formulas (torch.optim has none of them). Conventions are the ones rules.h and the class
docstrings state:

  Lion (Chen et al. 2023, Alg. 2):  c = b1*m + (1-b1)*g;  p = p - lr*(sign(c) + wd*p);  m = b2*m + (1-b2)*g
  LAMB (You et al. 2019, Alg. 2):   m, v as Adam;  mhat = m/(1-b1^t), vhat = v/(1-b2^t) (bias_correction;
                                    else m, v);  u = mhat/(sqrt(vhat)+eps) + wd*p;
                                    ratio = ||p||/||u|| (1 if either norm is 0);  p = p - lr*ratio*u
  LARS (You et al. 2017):           local_lr = eta*||w||/(||g|| + wd*||w|| + eps) (1 if either norm is 0);
                                    v = momentum*v + lr*local_lr*(g + wd*w);  w = w - v
  AdEMAMix (Pagliardini et al. 2024, Alg. 1):
                                    alpha_t = min(t*alpha/T_alpha, alpha);
                                    beta3_t = min(exp(ln(b1)*ln(b3) / ((1-t/T_b3)*ln(b3) + (t/T_b3)*ln(b1))), b3);
                                    m1 = b1*m1 + (1-b1)*g;  m2 = beta3_t*m2 + (1-beta3_t)*g;  nu = b2*nu + (1-b2)*g^2;
                                    p = p - lr*((m1/(1-b1^t) + alpha_t*m2) / (sqrt(nu/(1-b2^t)) + eps) + wd*p)
  maximize negates g first; with skip_zeros, elements whose raw gradient is 0 keep p and states, and are
  left out of LAMB's ||u|| (and contribute 0 to LARS's ||g|| anyway); ||p|| is over the whole tensor.

Tolerance, fp32 parameters: references and graphsafe run free for 20 steps and are compared norm-wise,
||ours - ref|| / ||ref|| <= 1e-5 per tensor (parameters and states). The reference is exact to ~1e-16;
graphsafe stores parameter and states in fp32 every step (relative 2^-24 each) and computes ~10 fp32
operations per element and step, so its own error grows to a few 1e-7 over 20 steps; LAMB/LARS also sum
thousands of squares in fp32 (a random-walk error of ~sqrt(n)*2^-24 ~ 1e-6 relative on a norm of 8k
elements, which scales every element's update). 1e-5 leaves a margin of ~10 above that, and is still
far below what a wrong constant, sign, bias correction, schedule step or norm convention produces
(observed: at most ~8e-7, LARS's momentum buffer on the 8k-element tensor; most are ~1e-7). Norm-wise rather than elementwise for the same reason as in
test_optim_torch.py: elements near zero after cancellation have meaningless elementwise relative error.
Lion's sign(c) is discontinuous, but with continuous random data no |c| comes within rounding error of 0.

fp16/bf16 parameters: as in test_optim_torch.py, the reference runs in lockstep: before each step its
float64 copy of the parameter is set to graphsafe's parameter, and its result rounded to the dtype must be
within 1 ulp of graphsafe's (rarely different at all); the states (fp32 in graphsafe, float64 here) must
meet the same 1e-5 bound.
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
)

SHAPES = [(37,), (16, 33), (2 * 4096 + 5,)]
STEPS = 20
TOL = 1e-5


def norm(x: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(x))


class Reference:
    """Float64 reference of one algorithm over a list of parameters (states created on first use)."""

    def __init__(self, name: str, params64: list[torch.Tensor], **hp):
        self.name, self.params, self.hp = name, params64, hp
        self.state: list[dict[str, torch.Tensor | int]] = [{} for _ in params64]

    def step(self, grads: list[torch.Tensor]) -> None:
        for i, g in enumerate(grads):
            g = g.to(torch.float64)
            st = self.state[i]
            if not st:
                st["step"] = 0
            st["step"] += 1
            active = (g != 0) if self.hp.get("skip_zeros") else torch.ones_like(g, dtype=torch.bool)
            if self.hp.get("maximize"):
                g = -g
            new_p = getattr(self, self.name)(self.params[i], g, st, active)
            self.params[i] = torch.where(active, new_p, self.params[i])

    def _keep(self, st, name, new, active):
        st[name] = torch.where(active, new, st[name])

    def lion(self, p, g, st, active):
        b1, b2 = self.hp.get("betas", (0.9, 0.99))
        lr, wd = self.hp["lr"], self.hp.get("weight_decay", 0.0)
        m = st.setdefault("exp_avg", torch.zeros_like(p))
        c = b1 * m + (1 - b1) * g
        self._keep(st, "exp_avg", b2 * m + (1 - b2) * g, active)
        return p - lr * (torch.sign(c) + wd * p)

    def lamb(self, p, g, st, active):
        b1, b2 = self.hp.get("betas", (0.9, 0.999))
        lr, wd, eps = self.hp["lr"], self.hp.get("weight_decay", 0.0), self.hp.get("eps", 1e-6)
        t = st["step"]
        m = b1 * st.setdefault("exp_avg", torch.zeros_like(p)) + (1 - b1) * g
        v = b2 * st.setdefault("exp_avg_sq", torch.zeros_like(p)) + (1 - b2) * g * g
        self._keep(st, "exp_avg", m, active)
        self._keep(st, "exp_avg_sq", v, active)
        if self.hp.get("bias_correction", True):
            mhat, vhat = m / (1 - b1**t), v / (1 - b2**t)
        else:
            mhat, vhat = m, v
        u = mhat / (torch.sqrt(vhat) + eps) + wd * p
        p_norm, u_norm = norm(p), norm(u[active])
        ratio = p_norm / u_norm if p_norm > 0 and u_norm > 0 else 1.0
        return p - lr * ratio * u

    def lars(self, w, g, st, active):
        lr, momentum = self.hp["lr"], self.hp.get("momentum", 0.9)
        wd, eta, eps = self.hp.get("weight_decay", 0.0), self.hp.get("trust_coefficient", 0.001), self.hp.get("eps", 1e-8)
        w_norm, g_norm = norm(w), norm(g[active])
        local_lr = eta * w_norm / (g_norm + wd * w_norm + eps) if w_norm > 0 and g_norm > 0 else 1.0
        v = momentum * st.setdefault("momentum_buffer", torch.zeros_like(w)) + lr * local_lr * (g + wd * w)
        self._keep(st, "momentum_buffer", v, active)
        return w - v

    def ademamix(self, p, g, st, active):
        b1, b2, b3 = self.hp.get("betas", (0.9, 0.999, 0.9999))
        lr, wd, eps = self.hp["lr"], self.hp.get("weight_decay", 0.0), self.hp.get("eps", 1e-8)
        alpha, t_alpha, t_beta3 = self.hp.get("alpha", 5.0), self.hp.get("t_alpha"), self.hp.get("t_beta3")
        t = st["step"]
        alpha_t = min(t * alpha / t_alpha, alpha) if t_alpha else alpha
        if t_beta3:
            s = t / t_beta3
            beta3_t = min(math.exp(math.log(b1) * math.log(b3) / ((1 - s) * math.log(b3) + s * math.log(b1))), b3)
        else:
            beta3_t = b3
        m1 = b1 * st.setdefault("exp_avg", torch.zeros_like(p)) + (1 - b1) * g
        m2 = beta3_t * st.setdefault("exp_avg_slow", torch.zeros_like(p)) + (1 - beta3_t) * g
        nu = b2 * st.setdefault("exp_avg_sq", torch.zeros_like(p)) + (1 - b2) * g * g
        self._keep(st, "exp_avg", m1, active)
        self._keep(st, "exp_avg_slow", m2, active)
        self._keep(st, "exp_avg_sq", nu, active)
        m1_hat, nu_hat = m1 / (1 - b1**t), nu / (1 - b2**t)
        return p - lr * ((m1_hat + alpha_t * m2) / (torch.sqrt(nu_hat) + eps) + wd * p)


CLASSES = {"lion": go.Lion, "lamb": go.LAMB, "lars": go.LARS, "ademamix": go.AdEMAMix}

REFERENCE_CASES = [
    ("lion", dict(lr=0.01)),
    ("lion", dict(lr=0.01, betas=(0.8, 0.95), weight_decay=0.5)),
    ("lion", dict(lr=0.01, weight_decay=0.5, maximize=True)),
    ("lamb", dict(lr=0.02)),
    ("lamb", dict(lr=0.02, weight_decay=0.1)),
    ("lamb", dict(lr=0.02, weight_decay=0.1, bias_correction=False, betas=(0.8, 0.9), eps=1e-4)),
    ("lamb", dict(lr=0.02, weight_decay=0.1, maximize=True)),
    ("lars", dict(lr=1.0, trust_coefficient=0.02)),
    ("lars", dict(lr=1.0, trust_coefficient=0.02, weight_decay=0.1, momentum=0.8)),
    ("lars", dict(lr=0.5, trust_coefficient=0.05, weight_decay=0.1, momentum=0.0, eps=1e-3, maximize=True)),
    ("ademamix", dict(lr=0.01)),
    ("ademamix", dict(lr=0.01, weight_decay=0.1, alpha=8.0, betas=(0.8, 0.99, 0.999))),
    ("ademamix", dict(lr=0.01, t_alpha=12, t_beta3=8)),  # both warm-ups, T_beta3 inside the 20 steps
    ("ademamix", dict(lr=0.01, weight_decay=0.1, t_alpha=30, t_beta3=50, maximize=True)),  # still warming up
]


def case_id(case) -> str:
    name, kw = case
    return name + "-" + "-".join(f"{k}={v}" for k, v in kw.items())


def check_states(opt, ref, params, what, tol=TOL):
    for i, p in enumerate(params):
        names = set(opt.state[p]) - {"step"}
        ref_names = set(ref.state[i]) - {"step"}
        assert names == ref_names, f"{what} tensor {i}: state names {sorted(names)} != {sorted(ref_names)}"
        assert float(opt.state[p]["step"]) == ref.state[i]["step"]
        for k in names:
            assert opt.state[p][k].dtype == torch.float32
            assert_rel_close(opt.state[p][k], ref.state[i][k], tol, f"{what} tensor {i} state {k}")


@pytest.mark.parametrize("case", REFERENCE_CASES, ids=case_id)
def test_fp32_matches_float64_reference(case):
    name, kw = case
    gen = make_generator(21)
    params = make_params(SHAPES, torch.float32, gen)
    ref = Reference(name, [p.detach().to(torch.float64) for p in params], **kw)
    opt = CLASSES[name](params, **kw)
    initial = [p.detach().clone() for p in params]
    for _ in range(STEPS):
        grads = [random_grad(p.shape, torch.float32, gen) for p in params]
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
        ref.step(grads)
    for i, p in enumerate(params):
        assert_rel_close(p, ref.params[i], TOL, f"{case_id(case)} tensor {i} param")
        # the update is not negligible next to the tolerance (the test would not see a wrong update)
        assert rel_err_moved(p, initial[i]) > 100 * TOL
    check_states(opt, ref, params, case_id(case))


def rel_err_moved(p, initial) -> float:
    return norm(p.detach().double() - initial.double()) / norm(initial.double())


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
@pytest.mark.parametrize("case", [c for c in REFERENCE_CASES if "weight_decay" in c[1]], ids=case_id)
def test_half_matches_float64_reference_in_lockstep(case, dtype):
    name, kw = case
    kw = dict(kw, lr=kw["lr"] * 2)  # moves by more than half an fp16/bf16 ulp per step
    gen = make_generator(22)
    params = make_params(SHAPES, dtype, gen)
    ref = Reference(name, [p.detach().to(torch.float64) for p in params], **kw)
    opt = CLASSES[name](params, **kw)
    differing = total = 0
    for step in range(STEPS):
        before = [p.detach().clone() for p in params]
        ref.params = [p.detach().to(torch.float64) for p in params]
        grads = [random_grad(p.shape, dtype, gen) for p in params]
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
        ref.step(grads)
        for i, p in enumerate(params):
            expected = ref.params[i].to(dtype)
            assert_within_ulps(p, expected, 1, f"{case_id(case)} {dtype} step {step + 1} tensor {i}", scale=before[i])
            differing += int((p.detach() != expected).sum())
            total += p.numel()
    assert differing <= 0.01 * total, f"{differing} of {total} element-steps rounded differently"
    check_states(opt, ref, params, f"{case_id(case)} {dtype}")


@pytest.mark.parametrize("name", ["lamb", "lars"])
def test_layerwise_skip_zeros_norm_convention(name):
    """With skip_zeros, ||p|| runs over the whole tensor and LAMB's ||u|| over the non-skipped elements
    only; checked against the reference with a third of the gradient zero (whole rows and scattered)."""
    kw = dict(lr=0.02, weight_decay=0.1) if name == "lamb" else dict(lr=1.0, weight_decay=0.1, trust_coefficient=0.02)
    gen = make_generator(23)
    params = make_params([(64, 40), (513,)], torch.float32, gen)
    ref = Reference(name, [p.detach().to(torch.float64) for p in params], skip_zeros=True, **kw)
    opt = CLASSES[name](params, skip_zeros=True, **kw)
    for step in range(12):
        grads = []
        for p in params:
            g = random_grad(p.shape, torch.float32, gen)
            g[torch.rand(p.shape, generator=gen) < 0.3] = 0.0
            if g.dim() == 2:
                g[step % 5 :: 5] = -0.0
            grads.append(g)
            p.grad = g
        opt.step()
        ref.step(grads)
    for i, p in enumerate(params):
        assert_rel_close(p, ref.params[i], TOL, f"{name} tensor {i} param")
    check_states(opt, ref, params, name)


@pytest.mark.parametrize("name", ["lamb", "lars"])
def test_layerwise_trust_ratio_is_one_when_a_norm_is_zero(name):
    """A zero parameter tensor (||p|| = 0), and a zero gradient without skip_zeros (||g|| = 0 for LARS;
    LAMB's ||u|| is then not 0 once the moments are nonzero) use factor 1, as the reference does."""
    kw = dict(lr=0.02, weight_decay=0.1) if name == "lamb" else dict(lr=0.1, weight_decay=0.1, trust_coefficient=0.02)
    gen = make_generator(24)
    zero = torch.nn.Parameter(torch.zeros(300))
    other = make_params([(200,)], torch.float32, gen)[0]
    params = [zero, other]
    ref = Reference(name, [p.detach().to(torch.float64) for p in params], **kw)
    opt = CLASSES[name](params, **kw)
    for step in range(6):
        grads = [random_grad(p.shape, torch.float32, gen) for p in params]
        if step in (2, 3):
            grads[1].zero_()
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
        ref.step(grads)
        for i, p in enumerate(params):
            assert torch.isfinite(p).all()
            assert_rel_close(p, ref.params[i], TOL, f"{name} step {step} tensor {i}")


def test_ademamix_schedules_take_effect():
    """The warm-ups change the result (guards the reference test against schedules that never apply)."""
    gen = make_generator(25)
    results = []
    for kw in (dict(), dict(t_alpha=12), dict(t_beta3=8)):
        gen = make_generator(25)
        params = make_params([(100,)], torch.float32, gen)
        opt = go.AdEMAMix(params, lr=0.01, **kw)
        for _ in range(10):
            params[0].grad = random_grad((100,), torch.float32, gen)
            opt.step()
        results.append(params[0].detach().clone())
    assert not torch.allclose(results[0], results[1], rtol=1e-4, atol=0)
    assert not torch.allclose(results[0], results[2], rtol=1e-4, atol=0)
