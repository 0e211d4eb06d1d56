"""Bad-input matrix for the nine graphsafe.optim optimizers, checkpoints (issue 18, item 2): corrupted, foreign
and torch.optim state_dicts given to load_state_dict. Each refusal is checked as in test_bad_inputs_optim.py:
exception type, a message naming what is wrong, then nothing changed and the optimizer still works.
"""

from __future__ import annotations

import copy

import pytest
import torch

import graphsafe.optim as go
from conftest import make_params
from bad_inputs import META, handled_or_refused
from test_bad_inputs_optim import (ALGOS, ARG_WORDS, SHAPES, Setup, assert_same, grads_for, refused_unchanged, saved,
                                   snapshot)

# --------------------------------------------------------------------------------------------------------
# load_state_dict: corrupted and foreign checkpoints
# --------------------------------------------------------------------------------------------------------

STATE_NAMES = {"Adam": ["exp_avg", "exp_avg_sq", "max_exp_avg_sq"], "AdamW": ["exp_avg", "exp_avg_sq"],
               "SGD": ["momentum_buffer"], "RMSprop": ["square_avg", "grad_avg", "momentum_buffer"],
               "Adagrad": ["sum"], "Lion": ["exp_avg"], "LAMB": ["exp_avg", "exp_avg_sq"], "LARS": ["momentum_buffer"],
               "AdEMAMix": ["exp_avg", "exp_avg_slow", "exp_avg_sq"], "AdamWScheduleFree": ["z", "exp_avg_sq"]}


def _first(algo):
    return STATE_NAMES[algo][0]


def _spoil_state(key, value_fn):
    def spoil(sd, algo):
        sd["state"][0][key(algo) if callable(key) else key] = value_fn(sd["state"][0], algo)
    return spoil


def _drop(key):
    def spoil(sd, algo):
        del sd["state"][0][key(algo) if callable(key) else key]
    return spoil


MALFORMED = (ValueError, KeyError, TypeError)  # a checkpoint that is not shaped like a state_dict
CORRUPT = {
    "state-wrong-shape": (_spoil_state(_first, lambda st, a: torch.zeros(3)), ValueError, r"shape"),
    "state-transposed-shape": (_spoil_state(_first, lambda st, a: torch.zeros(40, 4)), ValueError, r"shape"),
    "state-missing": (_drop(_first), ValueError, r"exp_avg|momentum_buffer|square_avg|sum"),
    "state-int64": (_spoil_state(_first, lambda st, a: torch.zeros(4, 40, dtype=torch.int64)), (TypeError, ValueError),
                    r"dtype|int64|floating"),
    "state-bool": (_spoil_state(_first, lambda st, a: torch.zeros(4, 40, dtype=torch.bool)), (TypeError, ValueError),
                   r"dtype|bool|floating"),
    "state-complex": (_spoil_state(_first, lambda st, a: torch.zeros(4, 40, dtype=torch.complex64)),
                      (TypeError, ValueError), r"dtype|complex|floating"),
    "state-meta": (_spoil_state(_first, lambda st, a: torch.zeros(4, 40, device=META)),
                   (TypeError, ValueError, NotImplementedError), r"meta"),
    "state-not-a-tensor": (_spoil_state(_first, lambda st, a: [0.0] * 160), ValueError, r"tensor"),
    "step-string": (_spoil_state("step", lambda st, a: "3"), (TypeError, ValueError), r"step"),
    "step-two-elements": (_spoil_state("step", lambda st, a: torch.tensor([1.0, 2.0])), (TypeError, ValueError),
                          r"step"),
    "group-lr-two-elements": (lambda sd, a: sd["param_groups"][0].update(lr=torch.tensor([0.1, 0.2])), ValueError,
                              r"\blr\b"),
    "group-extra-param": (lambda sd, a: sd["param_groups"][0]["params"].append(99), ValueError,
                          r"size|match|param"),
    "group-missing-param": (lambda sd, a: sd["param_groups"][0]["params"].pop(), ValueError, r"size|match|param"),
    "group-no-params-key": (lambda sd, a: sd["param_groups"][0].pop("params"), MALFORMED, r"params"),
    "two-groups": (lambda sd, a: sd["param_groups"].append(copy.deepcopy(sd["param_groups"][0])), ValueError,
                   r"group"),
    "no-state-key": (lambda sd, a: sd.pop("state"), MALFORMED, r"state"),
    "no-param_groups-key": (lambda sd, a: sd.pop("param_groups"), MALFORMED, r"param_groups"),
}


@pytest.mark.filterwarnings("ignore:Casting complex values")
@pytest.mark.parametrize("case", CORRUPT)
@pytest.mark.parametrize("algo", ALGOS)
def test_load_state_dict_refuses_a_corrupted_checkpoint(algo, case):
    s = Setup(algo)
    sd = saved(s.opt)
    spoil, types, pattern = CORRUPT[case]
    spoil(sd, algo)
    refused_unchanged(s, lambda: s.opt.load_state_dict(sd), types, pattern, f"{algo}.load_state_dict[{case}]")


@pytest.mark.parametrize("algo", [a for a in ALGOS if a != "SGD"])
def test_load_state_dict_refuses_a_missing_step(algo):
    """DESIGN.md: a missing step is an error, not a restart (every algorithm but SGD reads the step count)."""
    s = Setup(algo)
    sd = saved(s.opt)
    del sd["state"][1]["step"]
    refused_unchanged(s, lambda: s.opt.load_state_dict(sd), ValueError, r"'step'|\bstep\b")


@pytest.mark.parametrize("bad", [None, [], "state"], ids=repr)
def test_load_state_dict_refuses_what_is_not_a_state_dict(bad):
    s = Setup("Adam")
    refused_unchanged(s, lambda: s.opt.load_state_dict(bad), (TypeError, ValueError), r"state|dict")


@pytest.mark.parametrize("algo", ALGOS)
def test_load_state_dict_takes_float64_states_and_integer_steps(algo):
    s = Setup(algo)
    sd = saved(s.opt)
    for st in sd["state"].values():
        for k in STATE_NAMES[algo]:
            if k in st:
                st[k] = st[k].double()
        st["step"] = int(st["step"])
    twin, _ = s.twin()
    twin.load_state_dict(sd)
    assert_same(snapshot(twin), snapshot(s.opt), f"{algo}: float64 states and int steps loaded", ids=False)


def _strided_copy(t):
    """A view with t's values whose strides are not contiguous (every other element of a larger buffer)."""
    buf = torch.stack([t, torch.full_like(t, 123.0)], dim=-1)
    return buf[..., 0]


@pytest.mark.parametrize("bits", [32, 8])
@pytest.mark.parametrize("algo", ALGOS)
def test_load_state_dict_takes_non_contiguous_and_zero_stride_states(algo, bits):
    s = Setup(algo, bits)
    sd_views, sd_plain = saved(s.opt), saved(s.opt)
    for views, plain in zip(sd_views["state"].values(), sd_plain["state"].values()):
        for k, v in list(views.items()):
            if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.dtype != torch.uint8 and not k.endswith("_qmap"):
                if v.dim() == 1 and not k.endswith("_absmax"):  # 1-D states: zero-stride, of one value
                    views[k] = v[:1].expand_as(v)
                    plain[k] = v[:1].expand_as(v).clone()
                else:
                    views[k] = _strided_copy(v)
    assert any(not v.is_contiguous() for st in sd_views["state"].values() for v in st.values()
               if isinstance(v, torch.Tensor))
    a, _ = s.twin()
    b, _ = s.twin()
    a.load_state_dict(sd_views)
    b.load_state_dict(sd_plain)
    assert_same(snapshot(a), snapshot(b), f"{algo}: non-contiguous / zero-stride states loaded", ids=False)
    for v in (v for st in a.state.values() for v in st.values() if isinstance(v, torch.Tensor)):
        assert v.is_contiguous()


FOREIGN = [("Adam", "SGD"), ("SGD", "Adam"), ("Lion", "Adam"), ("Adam", "RMSprop"), ("Adagrad", "LARS"),
           ("LARS", "AdEMAMix"), ("AdamW", "Adagrad"), ("LAMB", "RMSprop"), ("RMSprop", "Lion")]


@pytest.mark.parametrize("source,loader", FOREIGN, ids=[f"{a}-into-{b}" for a, b in FOREIGN])
def test_load_state_dict_refuses_another_algorithms_state(source, loader):
    sd = saved(Setup(source).opt)
    s = Setup(loader)
    missing = [n for n in STATE_NAMES[loader] if n not in STATE_NAMES[source]]
    refused_unchanged(s, lambda: s.opt.load_state_dict(sd), ValueError, "|".join(missing))


BAD_8BIT = {
    "absmax-short": lambda st, n: st.update({f"{n}_absmax": st[f"{n}_absmax"][:-1]}),
    "absmax-long": lambda st, n: st.update({f"{n}_absmax": torch.cat([st[f"{n}_absmax"], st[f"{n}_absmax"]])}),
    "absmax-missing": lambda st, n: st.pop(f"{n}_absmax"),
    "qmap-short": lambda st, n: st.update({f"{n}_qmap": st[f"{n}_qmap"][:255]}),
    "block_size-missing": lambda st, n: st.pop("block_size"),
    "block_size-zero": lambda st, n: st.update(block_size=0),
    "codes-wrong-shape": lambda st, n: st.update({n: st[n].reshape(-1)[:100].clone()}),
}


@pytest.mark.parametrize("loader_bits", [8, 32])
@pytest.mark.parametrize("case", BAD_8BIT)
@pytest.mark.parametrize("algo", ALGOS)
def test_load_state_dict_refuses_a_broken_8bit_state(algo, case, loader_bits):
    sd = saved(Setup(algo, 8).opt)
    BAD_8BIT[case](sd["state"][0], _first(algo))
    s = Setup(algo, loader_bits)
    refused_unchanged(s, lambda: s.opt.load_state_dict(sd), ValueError, r"absmax|qmap|map|block_size|fit|shape",
                      f"{algo}(state_bits={loader_bits}).load_state_dict[8-bit {case}]")


def test_load_state_dict_without_a_saved_lr_keeps_or_refuses():
    """Unsure: a group without 'lr' either keeps this optimizer's lr (graphsafe's rule for options a saved group
    lacks) or is refused naming lr; never a half-loaded optimizer."""
    s = Setup("Adam")
    sd = saved(s.opt)
    del sd["param_groups"][0]["lr"]
    twin, _ = s.twin()
    handled_or_refused(lambda: twin.load_state_dict(sd),
                       lambda _: assert_same(snapshot(twin), snapshot(s.opt), "loaded", ids=False),
                       ValueError, ARG_WORDS["lr"])


# --------------------------------------------------------------------------------------------------------
# torch.optim checkpoints: Adam with and without step, SGD (which never saves a step)
# --------------------------------------------------------------------------------------------------------


def _torch_run(cls, kw, steps):
    params = make_params(SHAPES, torch.float32, torch.Generator().manual_seed(7))
    opt = cls(params, **kw)
    for step in range(steps):
        for p, g in zip(params, grads_for(step)):
            p.grad = g
        opt.step()
    return opt, params


def _continue_both(torch_opt, torch_params, ours, our_params, first, steps):
    for step in range(first, first + steps):
        for ps in (torch_params, our_params):
            for p, g in zip(ps, grads_for(step)):
                p.grad = g
        torch_opt.step()
        ours.step()
    for a, b in zip(our_params, torch_params):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)


def test_torch_adam_checkpoint_without_step_is_refused_and_with_step_continues():
    kw = dict(lr=0.01, weight_decay=0.1)
    topt, tparams = _torch_run(torch.optim.Adam, kw, 2)
    sd = copy.deepcopy(topt.state_dict())
    del sd["state"][0]["step"]
    s = Setup("Adam", weight_decay=0.1, amsgrad=False, lr=0.01)
    refused_unchanged(s, lambda: s.opt.load_state_dict(sd), ValueError, r"'step'|\bstep\b")
    params = [torch.nn.Parameter(p.detach().clone()) for p in tparams]
    ours = go.Adam(params, **kw)
    ours.load_state_dict(topt.state_dict())
    _continue_both(topt, tparams, ours, params, 2, 2)


@pytest.mark.parametrize("kw", [dict(lr=0.05, momentum=0.9), dict(lr=0.05, momentum=0.9, dampening=0.3),
                                dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.1), dict(lr=0.05)],
                         ids=["momentum", "dampening", "nesterov", "plain"])
def test_torch_sgd_checkpoint_without_step_continues_like_torch(kw):
    """torch.optim.SGD saves no step: its momentum_buffer must be continued (not restarted from the next
    gradient, which the first-step rule would do), exactly as torch.optim.SGD continues from it."""
    topt, tparams = _torch_run(torch.optim.SGD, kw, 2)
    assert all("step" not in st for st in topt.state_dict()["state"].values())
    params = [torch.nn.Parameter(p.detach().clone()) for p in tparams]
    ours = go.SGD(params, **kw)
    ours.load_state_dict(copy.deepcopy(topt.state_dict()))
    _continue_both(topt, tparams, ours, params, 2, 3)


def test_torch_sgd_checkpoint_for_a_parameter_never_stepped_starts_its_buffer_like_torch():
    kw = dict(lr=0.05, momentum=0.9, dampening=0.3)
    topt, tparams = _torch_run(torch.optim.SGD, kw, 0)
    tparams[0].grad = grads_for(0)[0]  # only parameter 0 has stepped: parameter 1 has no buffer
    topt.step()
    params = [torch.nn.Parameter(p.detach().clone()) for p in tparams]
    ours = go.SGD(params, **kw)
    ours.load_state_dict(copy.deepcopy(topt.state_dict()))
    _continue_both(topt, tparams, ours, params, 1, 2)
