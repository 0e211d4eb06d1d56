"""What an eager step remembers between steps is never stale (CPU).

The at-once gathering (_prepare_group_at_once) reads some things once and reuses them while they stay as read: the
parameters' form (_ParamsSeen: read again when a parameter is another object, has moved, or fails its TensorGuards
check), the gradients' form (one TensorGuards call while they are alike the last ones found to fit), and the list of
the parameters' state dicts (reused while the optimizer's state mapping, a counting _StateMap, has not changed), and
per core call the state tensors gathered from those dicts with their addresses (_StatesGathered: reused while each
state dict keeps its dict_version and each tensor its address and, fp32/bf16 states, its dtype).
Each way a user can change what those caches stand for is made here between steps, on an optimizer that serves its
steps at once and on a twin that takes the per-parameter path at every step (no cache but the state check's). Both
must then step to the same bits, or raise the same error having changed nothing; and where the change leaves the
group in the at-once path's common case, the at-once twin must have served the step, so that its caches were used.
Every case runs with all caches, without TensorGuards (the reads that stand in for it where torch has none),
without dict versions (the state entries read key by key at every step, where torch has no dict_version), and
without torch's address reader (the addresses read through Tensor.data_ptr, where it does not serve).
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
    "SGD-8bit": ("SGD", dict(state_bits=8, min_8bit_size=0, block_size=32)),  # one state (codes and absmax)
    "AdamWScheduleFree": ("AdamWScheduleFree", {}),  # schedule values beside the states
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


def _written_keys(state):
    """The entries of a state dict that the core writes through their addresses: the states (fp32, bf16, or 8-bit
    codes), 8-bit absmax, schedule values and step (not the 8-bit maps, nor block_size)."""
    return [k for k, v in state.items() if isinstance(v, torch.Tensor) and not k.endswith("_qmap")]


def _moved(t):
    """`.data` reassigned: the same tensor object, at new memory of the same form."""
    t.data = t.data.clone()


def _view_unquantized_state(opt, ps, dtype):
    """The first fp32 state (not an 8-bit one, not a step or absmax) of the first parameter that has one viewed in
    place as `dtype` (`.data = t.data.view(dtype)`: the same object at the same address); nothing where every
    parameter keeps 8-bit states (whose codes and absmax the at-once path reads as bytes and floats, as before)."""
    for p in ps:
        for k, v in opt.state[p].items():
            if isinstance(v, torch.Tensor) and v.dtype == torch.float32 and v.shape == p.shape:
                v.data = v.data.view(dtype)
                return


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
    # the state tensors in a state dict (_StatesGathered)
    "state tensor replaced by a copy": (
        lambda opt, ps, gen: [opt.state[ps[1]].__setitem__(k, opt.state[ps[1]][k].clone())
                              for k in _written_keys(opt.state[ps[1]])[:1]], True),
    "state tensor replaced by dict.__setitem__": (  # (C: no Python method of the dict sees it)
        lambda opt, ps, gen: [dict.__setitem__(opt.state[ps[0]], k, opt.state[ps[0]][k] * 2)
                              for k in _written_keys(opt.state[ps[0]])[-2:]], True),
    "state tensors' .data reassigned": (
        lambda opt, ps, gen: [_moved(opt.state[ps[0]][k]) for k in _written_keys(opt.state[ps[0]])], True),
    "last state tensor's .data reassigned": (
        lambda opt, ps, gen: _moved(opt.state[ps[3]][_written_keys(opt.state[ps[3]])[-1]]), True),
    "step's .data reassigned": (lambda opt, ps, gen: _moved(opt.state[ps[2]]["step"]), True),
    "last state tensor moved by set_": (
        lambda opt, ps, gen: (lambda t: t.set_(t.clone()))(opt.state[ps[1]][_written_keys(opt.state[ps[1]])[-1]]),
        True),
    "state tensor grown by resize_": (
        lambda opt, ps, gen: opt.state[ps[1]][_written_keys(opt.state[ps[1]])[0]].resize_(4096).zero_(), None),
    "fp32 state viewed as int32 in place": (lambda opt, ps, gen: _view_unquantized_state(opt, ps, torch.int32), None),
    "fp32 state viewed as bf16 in place": (
        lambda opt, ps, gen: _view_unquantized_state(opt, ps, torch.bfloat16), None),
    "state dict emptied and refilled": (
        lambda opt, ps, gen: (lambda s: (lambda saved: (s.clear(), s.update(saved)))(dict(s)))(opt.state[ps[2]]),
        True),
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


CACHES = ["all", "no TensorGuards", "no dict versions", "no address reader"]


def _run(config, change, caches, monkeypatch):
    """Both twins: two steps, the change, two more steps; returns per twin the outcomes after the change and
    whether the at-once twin's steps were served at once. caches: which of CACHES (TensorGuards and dict versions
    as this torch has them, or one left out)."""
    monkeypatch.setattr(_fast_path, "_TENSOR_GUARDS_SERVE",
                        caches != "no TensorGuards" and _fast_path._TENSOR_GUARDS_SERVE)
    monkeypatch.setattr(_fast_path, "_DICT_VERSIONS_SERVE",
                        caches != "no dict versions" and _fast_path._DICT_VERSIONS_SERVE)
    if caches == "no address reader":
        monkeypatch.setattr(_fast_path, "_TENSOR_ADDRESS_READER", None)
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


@pytest.mark.parametrize("caches", CACHES)
@pytest.mark.parametrize("change", list(CHANGES))
@pytest.mark.parametrize("config", list(CONFIGS))
def test_a_change_between_steps_steps_as_the_per_parameter_path(config, change, caches, monkeypatch):
    (a, a_params, a_outcomes, served), (b, b_params, b_outcomes, _) = _run(config, change, caches, monkeypatch)
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
        (_, _, outcomes, _), _ = _run("SGD", change, "all", monkeypatch)
        assert outcomes[0] is not None and issubclass(outcomes[0][0], error), (change, outcomes)
    # (an fp32 state viewed as int32 is not: the state check's cache, which both paths share, compares identities
    # and addresses; the at-once path reads fp32 and bf16 states' dtypes to tell the states to convert)
    for config in ("AdamW", "AdamW-8bit-mixed"):  # (where a parameter keeps fp32 states)
        for change in ("fp32 state viewed as bf16 in place", "state tensor grown by resize_"):
            (_, _, outcomes, _), _ = _run(config, change, "all", monkeypatch)
            assert outcomes[0] is not None and issubclass(outcomes[0][0], ValueError), (config, change, outcomes)


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


# --------------------------------------------------------------------------------------------------------
# The state tensors gathered per core call (_StatesGathered)
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("config", ["AdamW", "AdamW-8bit", "AdamW-8bit-mixed", "SGD-8bit"])
def test_gathered_states_are_reused_until_something_they_stand_for_changes(config):
    """An at-once step reuses its kinds' gathered state tensors (no _kind_call: no entry of a state dict read, no
    state check) while nothing changed, and gathers them again after each change below, once; the twin on the
    per-parameter path ends bit for bit alike."""
    if not _fast_path._DICT_VERSIONS_SERVE:
        pytest.skip("this torch has no usable dict_version: the state entries are read at every step")
    case, extra = CONFIGS[config]
    initial = make_params(SHAPES, torch.float32, make_generator(74))
    kinds = 2 if config == "AdamW-8bit-mixed" else 1
    twins = []
    for at_once in (True, False):
        params = clone_params(initial)
        opt = make_optimizer(case, params, **extra)
        calls = []
        original = opt._kind_call
        opt._kind_call = lambda *args, original=original, calls=calls: calls.append(1) or original(*args)
        if not at_once:
            opt._prepare_group_at_once = lambda group: None
        gen = make_generator(75)

        def step(change=None, grads=None, params=params, opt=opt, gen=gen, calls=calls):
            for p, g in zip(params, grads or _new_grads(params, gen)):
                p.grad = g
            if change is not None:
                change(opt, params)
            calls.clear()
            opt.step()
            return len(calls)

        counts = [step(), step(), step(), step(lambda o, ps: _moved(o.state[ps[0]]["step"])), step(),
                  step(lambda o, ps: o.state[ps[2]].__setitem__("step", o.state[ps[2]]["step"].clone())), step()]
        # a general-path step over some of the parameters (one without a gradient, one with a strided gradient),
        # which checks their states anew: the next at-once step gathers again, the one after reuses
        strided = _new_grads(params, gen)
        strided[3] = strided[3].t().contiguous().t()
        counts += [step(lambda o, ps: setattr(ps[1], "grad", None), grads=strided), step(), step()]
        twins.append((opt, params, counts))
    (a, a_params, counts), (b, b_params, _) = twins
    # (a change to one parameter's states gathers its kind's alone: one of the mixed group's two)
    assert counts == [kinds, kinds, 0, 1, 0, 1, 0, kinds, kinds, 0], counts
    _assert_same_state(a, a_params, b, b_params, config)


def test_tensor_address_reader_serves_where_torch_has_it():
    """graphsafe checks torch's address reader (a private API) once at import; where torch has it, it must pass, or
    the at-once path reads every state tensor's address through Tensor.data_ptr at every step again. A kind's
    gathered states are then watched in C++, and a tensor moved behind the state dicts' back is seen there."""
    if _fast_path._data_ptr_function is None:
        pytest.skip("this torch has no torch._C._dynamo.guards._torchinductor_pyobject_tensor_data_ptr")
    assert _fast_path._TENSOR_ADDRESS_READER is not None and _fast_path._tensor_address_reader() is not None
    params = make_params([(40,), (40,)], torch.float32, make_generator(76))
    opt = go.AdamW(params, lr=0.1, state_bits=8, min_8bit_size=0, block_size=32)
    gen = make_generator(77)
    for _ in range(2):
        for p in params:
            p.grad = random_grad((40,), torch.float32, gen)
        opt.step()
    memo = opt._checked_states[id(opt.param_groups[0])][1]
    (gathered,) = [v for k, v in memo.items() if isinstance(k, tuple) and k[-1] is _fast_path._StatesGathered]
    assert gathered.addresses is not None and gathered.ptrs is None
    assert gathered.addresses.addresses == [t.data_ptr() for t in gathered.tensors] and gathered.addresses.unchanged()
    _moved(gathered.tensors[-1])
    assert not gathered.addresses.unchanged()


def test_dict_versions_serve_where_torch_has_them():
    """graphsafe checks this torch's dict_version (a private API) once at import; where torch has it, it must pass,
    or the at-once path reads every state entry at every step again."""
    if _fast_path._dict_version is None:
        pytest.skip("this torch has no torch._C._dynamo.guards.dict_version")
    assert _fast_path._DICT_VERSIONS_SERVE and _fast_path._dict_versions_serve()
