"""What an eager step remembers between steps is never stale (CPU).

The at-once gathering (_prepare_group_at_once) reads some things once and reuses them while they stay as read: the
parameters' form (_ParamsSeen: read again when a parameter is another object, has moved, or fails its TensorGuards
check), the gradients' form (one TensorGuards call while they are alike the last ones found to fit), and the list of
the parameters' state dicts (reused while the optimizer's state mapping, a counting _StateMap, has not changed).
Each way a user can change what those caches stand for is made here between steps, on an optimizer that serves its
steps at once and on a twin that takes the per-parameter path at every step (no cache but the state check's). Both
must then step to the same bits, or raise the same error having changed nothing; and where the change leaves the
group in the at-once path's common case, the at-once twin must have served the step, so that its caches were used.
Every case runs with TensorGuards and with the reads that stand in for it where torch has none.
"""

from __future__ import annotations

import copy
import io
import pickle
from collections import defaultdict

import pytest
import torch

import graphsafe.optim as go
from graphsafe.optim import _base, _fast_path
from conftest import assert_bitwise_equal, clone_params, make_generator, make_optimizer, make_params, random_grad

SHAPES = [(6, 6), (6, 6), (10,), (4, 5)]  # squares (transposable in place) and a 2-D gradient to make strided
CONFIGS = {
    "SGD": ("SGD", {}),
    "AdamW": ("AdamW", {}),
    "AdamW-8bit": ("AdamW", dict(state_bits=8, min_8bit_size=0, block_size=32)),
    # 8-bit states for the 36- and 20-element parameters, fp32 for the 10-element one: two core calls a step
    "AdamW-8bit-mixed": ("AdamW", dict(state_bits=8, min_8bit_size=20, block_size=32)),
}


def _new_grads(params, gen):
    return [random_grad(tuple(p.shape), p.dtype, gen) for p in params]


def _doubled(state):
    """A new state dict of the same form with other values (8-bit codes and maps kept, so that it stays in the
    step's form)."""
    return {k: (v.clone() if v.dtype == torch.uint8 or k.endswith("_qmap") else v * 2)
            if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def _set_grad_any_dtype(p, g):
    p.grad_dtype = None  # (torch refuses a gradient of another dtype unless this is cleared)
    p.grad = g


def _same_count_mapping(opt):
    """A new state mapping whose count is the old one's: only its identity tells the step it must look up again."""
    new = type(opt.state)(dict, {p: _doubled(s) for p, s in opt.state.items()})
    new.version = opt.state.version
    opt.state = new


def _alias_in_group(opt, ps, gen):
    """The group's second parameter replaced by a new one over the same memory (same address, dtype and shape): only
    its identity tells the step that its state is another (none yet)."""
    alias = torch.nn.Parameter(ps[1].data)
    alias.grad = random_grad(tuple(alias.shape), alias.dtype, gen)
    opt.param_groups[0]["params"][1] = alias


# Each change: (what it does to an optimizer and its parameters after two steps, once the step's gradients are set;
# whether the next step is served at once: True, or None where the general path has something to do first).
# The error cases leave the group to the general path, which raises; both twins must raise alike.
CHANGES = {
    # the state mapping and the state dicts in it
    "state dict replaced": (lambda opt, ps, gen: opt.state.__setitem__(ps[1], _doubled(opt.state[ps[1]])), True),
    "state dict deleted": (lambda opt, ps, gen: opt.state.__delitem__(ps[1]), None),
    "state dict popped": (lambda opt, ps, gen: opt.state.pop(ps[2]), None),
    "last state popitem": (lambda opt, ps, gen: opt.state.popitem(), None),
    "states cleared": (lambda opt, ps, gen: opt.state.clear(), None),
    "state dict updated": (lambda opt, ps, gen: opt.state.update({ps[0]: _doubled(opt.state[ps[0]])}), True),
    "state dict or-ed in": (lambda opt, ps, gen: opt.state.__ior__({ps[3]: _doubled(opt.state[ps[3]])}), True),
    "state dict set by setdefault": (
        lambda opt, ps, gen: (opt.state.pop(ps[1]), opt.state.setdefault(ps[1], {})), None),
    "state entry replaced in place": (
        lambda opt, ps, gen: opt.state[ps[1]].__setitem__("step", opt.state[ps[1]]["step"] * 3), True),
    "state mapping replaced": (
        lambda opt, ps, gen: setattr(opt, "state", type(opt.state)(dict, {p: _doubled(s) for p, s in
                                                                          opt.state.items()})), True),
    "state mapping replaced by one at the same count": (lambda opt, ps, gen: _same_count_mapping(opt), True),
    "state mapping replaced by a plain defaultdict": (
        lambda opt, ps, gen: setattr(opt, "state", defaultdict(dict, {p: _doubled(s) for p, s in opt.state.items()})),
        True),
    "load_state_dict": (lambda opt, ps, gen: opt.load_state_dict(
        {"state": {i: _doubled(s) for i, s in opt.state_dict()["state"].items()},
         "param_groups": opt.state_dict()["param_groups"]}), True),
    # the parameters
    "param replaced by another shape, its state dropped": (
        lambda opt, ps, gen: (setattr(ps[2], "data", random_grad((7,), torch.float32, gen)),
                              setattr(ps[2], "grad", random_grad((7,), torch.float32, gen)),
                              opt.state.__delitem__(ps[2])), None),
    "param replaced by another shape": (
        lambda opt, ps, gen: (setattr(ps[2], "data", random_grad((5, 2), torch.float32, gen)),
                              setattr(ps[2], "grad", random_grad((5, 2), torch.float32, gen))), None),
    "param viewed as another shape in place": (
        lambda opt, ps, gen: (setattr(ps[3], "data", ps[3].data.view(5, 4)),
                              setattr(ps[3], "grad", random_grad((5, 4), torch.float32, gen))), None),
    "param replaced by another dtype": (
        lambda opt, ps, gen: (setattr(ps[0], "data", ps[0].data.to(torch.bfloat16)),
                              setattr(ps[0], "grad", random_grad((6, 6), torch.bfloat16, gen))), True),
    "param replaced by new memory": (lambda opt, ps, gen: setattr(ps[1], "data", ps[1].data.clone()), True),
    "param transposed at its address": (lambda opt, ps, gen: setattr(ps[0], "data", ps[0].data.t()), None),
    "param made non-contiguous": (
        lambda opt, ps, gen: setattr(ps[2], "data", torch.zeros(10, 2)[:, 0].copy_(ps[2].data)), None),
    "param no longer requiring grad": (lambda opt, ps, gen: ps[1].requires_grad_(False), True),
    "group's parameters reordered": (lambda opt, ps, gen: opt.param_groups[0]["params"].reverse(), True),
    "group's parameter replaced by an alias": (lambda opt, ps, gen: _alias_in_group(opt, ps, gen), None),
    "group's parameter replaced": (
        lambda opt, ps, gen: opt.param_groups[0]["params"].__setitem__(
            1, torch.nn.Parameter(ps[1].detach().clone()).requires_grad_()), None),
    # the gradients
    # the storage options (_ParamsSeen.kinds: the split into core calls is kept per option values); the states
    # are converted by the next step, the one after is served at once
    "min_8bit_size raised": (lambda opt, ps, gen: opt.param_groups[0].__setitem__("min_8bit_size", 40), False),
    "min_8bit_size lowered": (lambda opt, ps, gen: opt.param_groups[0].__setitem__("min_8bit_size", 0), False),
    "state_bits set to 16": (lambda opt, ps, gen: opt.param_groups[0].__setitem__("state_bits", 16), False),
    "grad set to None": (lambda opt, ps, gen: setattr(ps[1], "grad", None), True),
    "grad made non-contiguous": (
        lambda opt, ps, gen: setattr(ps[3], "grad", ps[3].grad.t().contiguous().t()), None),
    "grad of another dtype": (lambda opt, ps, gen: _set_grad_any_dtype(ps[2], ps[2].grad.to(torch.bfloat16)), None),
    "grad viewed as another shape in place": (
        lambda opt, ps, gen: setattr(ps[3].grad, "data", ps[3].grad.data.view(5, 4)), None),
    "grad sparse": (lambda opt, ps, gen: setattr(ps[2], "grad", ps[2].grad.to_sparse()), None),
    "grad shared by two parameters": (lambda opt, ps, gen: setattr(ps[1], "grad", ps[0].grad), True),
    "grads kept and changed in place": (
        lambda opt, ps, gen: [p.grad.copy_(random_grad(tuple(p.shape), p.dtype, gen)) for p in ps], True),
}


def _outcome(opt, params):
    """None if the step ran, else (error type, message); a rejected step must change nothing."""
    before = [p.detach().clone() for p in params]
    try:
        opt.step()
    except Exception as error:  # noqa: BLE001 (compared with the twin's)
        for p, b in zip(params, before):
            assert_bitwise_equal(p.detach(), b, "a parameter after a rejected step")
        return type(error), str(error)
    return None


def _assert_same_state(a, a_params, b, b_params, what):
    for i, (p, q) in enumerate(zip(a_params, b_params)):
        assert_bitwise_equal(p.detach(), q.detach(), f"{what}: param {i}")
        sa, sb = a.state.get(p, {}), b.state.get(q, {})
        assert sa.keys() == sb.keys(), f"{what}: param {i} state names {sorted(sa)} vs {sorted(sb)}"
        for k, v in sa.items():
            if isinstance(v, torch.Tensor):
                assert_bitwise_equal(v, sb[k], f"{what}: param {i} state {k}")


def _run(config, change, guards, monkeypatch):
    """Both twins: two steps, the change, two more steps; returns per twin the outcomes after the change and
    whether the at-once twin's steps were served at once."""
    monkeypatch.setattr(_fast_path, "_TENSOR_GUARDS_SERVE", guards and _fast_path._TENSOR_GUARDS_SERVE)
    case, extra = CONFIGS[config]
    initial = make_params(SHAPES, torch.float32, make_generator(70))
    runs = []
    for at_once in (True, False):
        params = clone_params(initial)
        opt = make_optimizer(case, params, **extra)
        served = []
        if at_once:
            original = opt._prepare_group_at_once

            def recording(group, original=original, served=served):
                issues = original(group)
                served.append(issues is not None)
                return issues

            opt._prepare_group_at_once = recording
        else:
            opt._prepare_group_at_once = lambda group: None  # the per-parameter path at every step
        gen = make_generator(71)
        for _ in range(2):
            for p, g in zip(params, _new_grads(params, gen)):
                p.grad = g
            opt.step()
        for p, g in zip(params, _new_grads(params, gen)):
            p.grad = g
        CHANGES[change][0](opt, params, gen)
        outcomes = [_outcome(opt, params)]
        keep_grads = change == "grads kept and changed in place"
        if keep_grads:
            CHANGES[change][0](opt, params, gen)
        else:
            for p, g in zip(params, _new_grads(params, gen)):
                if p.grad is not None or change != "grad set to None":
                    p.grad = g if p.grad is None or p.grad.dtype == p.dtype else g.to(p.grad.dtype)
        outcomes.append(_outcome(opt, params))
        runs.append((opt, params, outcomes, served))
    return runs


@pytest.mark.parametrize("guards", [True, False], ids=["TensorGuards", "reads"])
@pytest.mark.parametrize("change", list(CHANGES))
@pytest.mark.parametrize("config", list(CONFIGS))
def test_a_change_between_steps_steps_as_the_per_parameter_path(config, change, guards, monkeypatch):
    (a, a_params, a_outcomes, served), (b, b_params, b_outcomes, _) = _run(config, change, guards, monkeypatch)
    assert served[:2] == [False, True], served  # the first step makes the states; the second is served at once
    assert a_outcomes == b_outcomes, f"{change}: at once {a_outcomes} vs per parameter {b_outcomes}"
    _assert_same_state(a, a_params, b, b_params, change)
    if CHANGES[change][1] and a_outcomes[0] is None:
        assert served[2], f"{change}: the step after the change was not served at once"
    if a_outcomes[-1] is None and CHANGES[change][1] is not None:
        assert served[-1], f"{change}: the last step was not served at once"


def test_error_cases_are_rejected_on_both_paths(monkeypatch):
    """(The cases above that must raise do: a step the at-once path let through would show as equal outcomes
    only if both paths let it through.)"""
    for change, error in [("param transposed at its address", ValueError), ("param made non-contiguous", ValueError),
                          ("param replaced by another shape", ValueError), ("grad sparse", RuntimeError),
                          ("grad of another dtype", TypeError), ("grad viewed as another shape in place", ValueError),
                          ("param viewed as another shape in place", ValueError)]:
        (_, _, outcomes, _), _ = _run("SGD", change, True, monkeypatch)
        assert outcomes[0] is not None and issubclass(outcomes[0][0], error), (change, outcomes)


# --------------------------------------------------------------------------------------------------------
# The state mapping (_StateMap)
# --------------------------------------------------------------------------------------------------------


def test_state_mapping_counts_every_change():
    state = _base._StateMap(dict)
    keys = [torch.zeros(1) for _ in range(3)]
    changes = [
        lambda: state[keys[0]],  # made on first use
        lambda: state.__setitem__(keys[1], {"a": 1}),
        lambda: state.update({keys[2]: {}}),
        lambda: state.setdefault(keys[2], {}),
        lambda: state.__ior__({keys[0]: {}}),
        lambda: state.pop(keys[2]),
        lambda: state.__delitem__(keys[1]),
        lambda: state.popitem(),
        lambda: state.clear(),
        lambda: state.__init__(dict),  # (never back to an earlier count)
    ]
    counts = [state.version]
    for change in changes:
        change()
        counts.append(state.version)
    assert all(b > a for a, b in zip(counts, counts[1:])), counts
    state[keys[0]] = {"a": 1}
    before = state.version
    state.get(keys[0]), state[keys[0]], keys[0] in state, list(state.items())  # reads count nothing
    state[keys[0]]["b"] = 2  # nor a state dict changed in place (the step reads those at every step)
    assert state.version == before


def test_optimizer_state_is_a_state_mapping_through_construction_load_and_copies():
    gen = make_generator(72)
    params = make_params([(8,), (3, 4)], torch.float32, gen)
    opt = go.AdamW(params, lr=0.1)
    assert type(opt.state) is _base._StateMap and isinstance(opt.state, defaultdict)
    for p in params:
        p.grad = random_grad(tuple(p.shape), torch.float32, gen)
    opt.step()
    saved = opt.state_dict()
    assert all(type(s) is dict for s in saved["state"].values()) and type(saved["state"]) is dict
    buffer = io.BytesIO()
    torch.save(saved, buffer)  # a state_dict holds no graphsafe class: it loads with weights_only
    buffer.seek(0)
    torch.load(buffer, weights_only=True)
    fresh = go.AdamW(clone_params(params), lr=0.1)
    fresh.load_state_dict(saved)
    assert type(fresh.state) is _base._StateMap
    for copied in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
        assert type(copied.state) is _base._StateMap
        for p, q in zip(opt.param_groups[0]["params"], copied.param_groups[0]["params"]):
            for k, v in opt.state[p].items():
                assert_bitwise_equal(copied.state[q][k], v, f"copied state {k}")
        for q in copied.param_groups[0]["params"]:
            q.grad = torch.ones_like(q)
        copied.step()  # steps with its own states
    assert type(copy.copy(opt.state)) is _base._StateMap
    # an optimizer pickled with torch's plain defaultdict (before _StateMap) gets one back
    old = opt.__getstate__()
    old["state"] = defaultdict(dict, old["state"])
    restored = go.AdamW.__new__(go.AdamW)
    restored.__setstate__(old)
    assert type(restored.state) is _base._StateMap


def test_tensor_guards_serve_where_torch_has_them():
    """graphsafe checks this torch's TensorGuards (a private API) once at import; where torch has it, it must pass,
    or the at-once path silently loses most of its speed."""
    if _fast_path._TensorGuards is None:
        pytest.skip("this torch has no torch._C._dynamo.guards.TensorGuards")
    assert _fast_path._TENSOR_GUARDS_SERVE and _fast_path._tensor_guards_serve()
    gen = make_generator(73)
    params = make_params([(8,), (8,)], torch.float32, gen)
    opt = go.SGD(params, lr=0.1, momentum=0.9)
    for _ in range(2):
        for p in params:
            p.grad = random_grad((8,), torch.float32, gen)
        opt.step()
    seen = opt._checked_params[id(opt.param_groups[0])][1]["params"]
    assert seen.guard is not None and seen.grad_guard is not None
