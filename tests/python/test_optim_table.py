"""The algorithm table (include/graphsafe/optim_algorithms.h), as the core exposes it, against the Python
classes: every class's algorithm is in the table, the options it sends are the table's for that algorithm, and
the states it keeps (read from the table, not restated) under every combination of the options that add or
remove states are those the table's presence rules give, in order.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import graphsafe.optim as go
from graphsafe import _C

TABLE = _C.optim_algorithms()
CLASSES = [go.Adam, go.AdamW, go.SGD, go.RMSprop, go.Adagrad, go.Lion, go.LAMB, go.LARS, go.AdEMAMix,
           go.AdamWScheduleFree]
# The constructor options that decide which states exist, with values that turn them off and on.
PRESENCE_OPTIONS = {go.Adam: dict(amsgrad=(False, True)), go.AdamW: dict(amsgrad=(False, True)),
                    go.SGD: dict(momentum=(0.0, 0.9)), go.RMSprop: dict(centered=(False, True), momentum=(0.0, 0.5))}


def _variants(cls):
    choices = PRESENCE_OPTIONS.get(cls, {})
    for values in itertools.product(*choices.values()):
        yield dict(zip(choices, values))


def test_every_class_is_in_the_table_and_the_table_has_no_other():
    algorithms = {cls(params=[torch.zeros(1, requires_grad=True)]).algorithm for cls in CLASSES}
    assert algorithms == set(TABLE)


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_class_options_and_states_are_the_tables(cls):
    for kwargs in _variants(cls):
        opt = cls([torch.zeros(3, requires_grad=True)], **kwargs)
        group = opt.param_groups[0]
        entry = TABLE[opt.algorithm]
        sent = set(opt._core_options(group)) - {"maximize", "skip_zeros"}
        assert sent == set(entry["options"]), f"{cls.__name__}{kwargs}: options sent {sorted(sent)}"
        assert "_state_names" not in vars(cls), f"{cls.__name__} restates its states instead of reading the table"
        names = opt._state_names(group)
        # the states the table's presence rules give, read by hand
        on = {"always": True, "amsgrad": bool(group.get("amsgrad")), "centered": bool(group.get("centered")),
              "momentum != 0": group.get("momentum", 0) != 0, "momentum > 0": group.get("momentum", 0) > 0}
        assert names == [s["name"] for s in entry["states"] if on[s["present_when"]]], f"{cls.__name__}{kwargs}"


def test_signedness_is_the_tables():
    for name, entry in TABLE.items():
        everything = {"amsgrad": 1.0, "centered": 1.0, "momentum": 0.5}
        options = {k: v for k, v in everything.items() if k in entry["options"]}
        for j, state in enumerate(_C.optim_state_names(name, options)):
            spec = next(s for s in entry["states"] if s["name"] == state)
            assert _C.optim_state_is_signed(name, options, j) == spec["signed"], f"{name} {state}"


def test_an_option_of_another_algorithm_is_refused():
    with pytest.raises(ValueError, match="unknown optimizer option 'beta1' for sgd"):
        _C.optim_state_names("sgd", {"beta1": 0.9})
    with pytest.raises(ValueError, match="unknown optimizer algorithm"):
        _C.optim_state_names("adamax", {})


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_new_states_and_schedule_values_are_the_tables(cls):
    """A new state starts as the table says (a copy of the parameter, or the class's initial value), and every
    schedule value the table names is kept per parameter, a 0-d float64 tensor beside 'step'."""
    p = torch.nn.Parameter(torch.randn(5))
    opt = cls([p])
    group, entry = opt.param_groups[0], TABLE[opt.algorithm]
    for state in entry["states"]:
        made = opt._initial_state(group, p, state["name"])
        if state["init"] == "param":
            assert torch.equal(made, p.detach()) and made.data_ptr() != p.data_ptr()
        else:
            assert torch.equal(made, torch.full_like(p, opt._initial_state_value(group, state["name"])))
    if hasattr(opt, "train"):  # (AdamWScheduleFree steps in train mode only)
        opt.train()
    p.grad = torch.ones(5)
    opt.step()
    assert set(entry["schedule"]) <= set(opt.state[p])
    for key in entry["schedule"]:
        assert opt.state[p][key].dtype == torch.float64 and opt.state[p][key].shape == ()
