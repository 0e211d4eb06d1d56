"""Bad-input matrix for the nine graphsafe.optim optimizers (issue 18, item 2): constructor, add_param_group,
step, state_dict / load_state_dict, over every algorithm and state storage (32, 16 and 8 bits).

Every refusal is checked for its exception type and a message fragment naming the argument, and then for
"nothing changed": parameters, every state tensor and every param_groups entry bit for bit (snapshot), after
which the optimizer must still step, and its state_dict must still load into a fresh optimizer that then
steps to the same bits (nothing lost, nothing half-applied). Hyperparameters are refused at least where
torch.optim refuses them (and where docs/optim.md's validation rules say so). Tensor subclasses, sparse and
nested tensors run in a child Python (a crash there fails one test, not pytest).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

import graphsafe.optim as go
from conftest import make_params, optim_cases
from test_bad_inputs import (META, NESTED_REFUSAL, Sub, Wrapper, check_isolated, handled_or_refused, isolated_fixture,
                             refused)

NAN, INF = float("nan"), float("inf")
CASES = optim_cases()
ALGOS = ["Adam", "AdamW", "SGD", "RMSprop", "Adagrad", "Lion", "LAMB", "LARS", "AdEMAMix"]
TORCH_ALGOS = {"Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW, "SGD": torch.optim.SGD,
               "RMSprop": torch.optim.RMSprop, "Adagrad": torch.optim.Adagrad}
SHAPES = [(4, 40), (70,)]  # 160 and 70 elements: several 32-element 8-bit blocks and a partial one
STORAGE = {32: {}, 16: dict(state_bits=16), 8: dict(state_bits=8, block_size=32, min_8bit_size=0)}
NO_CHANGE = "(after the refusal)"

# --------------------------------------------------------------------------------------------------------
# Setup, snapshot and the "nothing changed, still works" checks
# --------------------------------------------------------------------------------------------------------


def grads_for(step: int, shapes=SHAPES, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(s, generator=g).to(dtype) for s in shapes]


class Setup:
    """An optimizer of `algo` over two parameters, stepped `steps` times, and the means to build its twin."""

    def __init__(self, algo: str, bits: int = 32, steps: int = 2, **extra):
        cls, kw = CASES[algo]
        self.algo, self.cls, self.kw = algo, cls, dict(kw, **STORAGE[bits], **extra)
        self.params = make_params(SHAPES, torch.float32, torch.Generator().manual_seed(7))
        self.opt = cls(self.params, **self.kw)
        self.steps = 0
        for _ in range(steps):
            self.step()

    def step(self, opt=None, params=None):
        opt, params = opt or self.opt, params or self.params
        for p, g in zip(params, grads_for(self.steps)):
            p.grad = g
        opt.step()
        self.steps += 1

    def twin(self):
        """A fresh optimizer with the same options over copies of the current parameters (no state)."""
        params = [torch.nn.Parameter(p.detach().clone()) for p in self.params]
        return self.cls(params, **self.kw), params


def saved(opt) -> dict:
    """A checkpoint to spoil: state_dict() shares the live state dicts, so a deep copy."""
    return copy.deepcopy(opt.state_dict())


def _clone(v):
    return v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)


def snapshot(opt) -> dict:
    """Everything an optimizer holds, flat ({what: value}, by position): every param_groups entry (params as
    object ids), every parameter's value and every entry of its state."""
    flat = {"number of states": len(opt.state)}
    for i, group in enumerate(opt.param_groups):
        for k, v in group.items():
            flat[f"group {i} {k!r}"] = [id(p) for p in v] if k == "params" else _clone(v)
    for i, p in enumerate(p for g in opt.param_groups for p in g["params"]):
        flat[f"parameter {i}"] = _clone(p)
        for k, v in (opt.state[p].items() if p in opt.state else ()):
            flat[f"parameter {i} state {k!r}"] = _clone(v)
    return flat


def _same_value(a, b, what: str) -> None:
    """Same type and, for tensors, dtype, shape, device and bytes (NaN payloads and -0.0 count)."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        assert (type(a), a.dtype, a.shape, a.device) == (type(b), b.dtype, b.shape, b.device), \
            f"{what}: {a.dtype}{tuple(a.shape)} on {a.device} vs {b.dtype}{tuple(b.shape)} on {b.device}"
        as_bytes = lambda t: t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)  # noqa: E731
        assert a.device.type == "meta" or torch.equal(as_bytes(a), as_bytes(b)), f"{what}: values differ bitwise"
    elif isinstance(a, (tuple, list)) and type(a) is type(b) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            _same_value(x, y, f"{what}[{i}]")
    else:
        nan = isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)
        assert type(a) is type(b) and (nan or a == b), f"{what}: {a!r} vs {b!r}"


def assert_same(a: dict, b: dict, what: str, ids: bool = True) -> None:
    """a == b entry by entry; ids=False: another optimizer (other parameter objects, states counted apart)."""
    keep = (lambda k: True) if ids else (lambda k: not k.endswith("'params'") and k != "number of states")
    keys_a, keys_b = set(filter(keep, a)), set(filter(keep, b))
    assert keys_a == keys_b, f"{what}: entries on one side only: {sorted(keys_a ^ keys_b)}"
    for k in sorted(keys_a):
        _same_value(a[k], b[k], f"{what}: {k}")


def assert_unchanged_and_working(setup: Setup, before: dict) -> None:
    """Nothing changed since `before`; the optimizer still steps; its state_dict loads into a fresh optimizer
    that holds the same and steps to the same bits."""
    assert_same(snapshot(setup.opt), before, f"{setup.algo} {NO_CHANGE}")
    twin, twin_params = setup.twin()
    twin.load_state_dict(setup.opt.state_dict())
    assert_same(snapshot(twin), snapshot(setup.opt), f"{setup.algo}: fresh optimizer after load_state_dict", ids=False)
    steps = setup.steps
    setup.step()
    setup.steps = steps
    setup.step(twin, twin_params)
    assert_same(snapshot(twin), snapshot(setup.opt), f"{setup.algo}: a step after the refusal vs its fresh twin",
                ids=False)
    assert all(torch.isfinite(p).all() for p in setup.params), f"{setup.algo}: non-finite parameters"


def refused_unchanged(setup: Setup, fn, types, pattern: str, what: str = ""):
    before = snapshot(setup.opt)
    exc = refused(fn, types, pattern, what or setup.algo)
    assert_unchanged_and_working(setup, before)
    return exc


# --------------------------------------------------------------------------------------------------------
# Hyperparameters: refused at least where torch.optim and docs/optim.md's validation refuse them
# --------------------------------------------------------------------------------------------------------

ARG_WORDS = {"lr": r"learning rate|\blr\b", "betas": r"beta", "eps": r"eps", "weight_decay": r"weight_decay",
             "momentum": r"momentum", "alpha": r"alpha", "lr_decay": r"lr_decay", "dampening": r"dampening",
             "initial_accumulator_value": r"initial_accumulator_value", "trust_coefficient": r"trust_coefficient",
             "t_alpha": r"t_alpha|warm", "t_beta3": r"t_beta3|warm"}
NUMERIC_ARGS = {
    "Adam": ["eps", "weight_decay"], "AdamW": ["eps", "weight_decay"],
    "SGD": ["momentum", "dampening", "weight_decay"],
    "RMSprop": ["alpha", "eps", "weight_decay", "momentum"],
    "Adagrad": ["lr_decay", "weight_decay", "initial_accumulator_value", "eps"],
    "Lion": ["weight_decay"], "LAMB": ["eps", "weight_decay"],
    "LARS": ["momentum", "weight_decay", "trust_coefficient", "eps"],
    "AdEMAMix": ["alpha", "t_alpha", "t_beta3", "eps", "weight_decay"],
}
BETAS_COUNT = {"Adam": 2, "AdamW": 2, "Lion": 2, "LAMB": 2, "AdEMAMix": 3}
# docs/optim.md, Validation: lr >= 0; eps, weight_decay and momentum finite and >= 0; betas in [0, 1); RMSprop
# alpha >= 0; Adagrad lr_decay >= 0; AdEMAMix alpha >= 0 and warm-up lengths >= 0. (NaN fails every ">=".)
MUST_BE_FINITE = {"eps", "weight_decay", "momentum"}


def _bad_betas(count: int):
    ok = (0.9, 0.999, 0.9999)[:count]
    cases = []
    for i in range(count):
        for v in (1.0, 1.5, -0.1, NAN):
            cases.append(tuple(v if j == i else ok[j] for j in range(count)))
    return cases + [ok[:count - 1], ok + (0.5,)]  # wrong lengths


def hyper_cases():
    """(algo, arg, value, why) for every value graphsafe must refuse."""
    cases = []
    for algo in ALGOS:
        for v in (NAN, -1.0, -1e-12):
            cases.append((algo, "lr", v, "docs/torch"))
        for arg in NUMERIC_ARGS[algo]:
            for v in (-1.0, NAN, INF):
                docs = (arg in MUST_BE_FINITE and not (v >= 0 and math.isfinite(v))) or (
                    arg in ("alpha", "lr_decay", "t_alpha", "t_beta3", "trust_coefficient") and not v >= 0)
                torch_refuses = algo in TORCH_ALGOS and _torch_refuses(algo, arg, v)
                if docs or torch_refuses:
                    cases.append((algo, arg, v, "docs" if docs else "torch"))
        for betas in _bad_betas(BETAS_COUNT[algo]) if algo in BETAS_COUNT else ():
            cases.append((algo, "betas", betas, "docs"))
    return cases


def _torch_refuses(algo: str, arg: str, value) -> bool:
    try:
        TORCH_ALGOS[algo]([torch.nn.Parameter(torch.zeros(2))], **{arg: value})
    except ValueError:
        return True
    except TypeError:  # not an option of torch's class
        return False
    return False


HYPER = hyper_cases()
HYPER_IDS = [f"{a}-{arg}={v!r}" for a, arg, v, _ in HYPER]


def test_at_least_what_torch_refuses_is_in_the_matrix():
    listed = {(a, arg, repr(v)) for a, arg, v, _ in HYPER}
    for algo in TORCH_ALGOS:
        for arg in ["lr"] + NUMERIC_ARGS[algo]:
            for v in (NAN, -1.0, INF):
                if _torch_refuses(algo, arg, v):
                    assert (algo, arg, repr(v)) in listed, (algo, arg, v)


def _refuse_hyper(entry, algo, arg, value, types=ValueError, pattern=None):
    """Gives `arg` the invalid `value` through one entry point; a refusal naming arg, and nothing changed."""
    cls, kw = CASES[algo]
    pattern, what = pattern or ARG_WORDS[arg], f"{algo} {entry} {arg}={value!r}"
    p, q = torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(4))
    if entry == "constructor":
        return refused(lambda: cls([p], **dict(kw, **{arg: value})), types, pattern, what)
    if entry == "second-group":
        return refused(lambda: cls([dict(params=[p]), dict(params=[q], **{arg: value})], **kw), types, pattern, what)
    s = Setup(algo)
    if entry == "add_param_group":
        return refused_unchanged(s, lambda: s.opt.add_param_group(dict(params=[q], **{arg: value})), types, pattern,
                                 what)
    if entry == "load_state_dict":
        sd = saved(s.opt)
        sd["param_groups"][0][arg] = value
        return refused_unchanged(s, lambda: s.opt.load_state_dict(sd), types, pattern, what)
    good, s.opt.param_groups[0][arg] = s.opt.param_groups[0][arg], value  # set by hand, then a step
    for p, g in zip(s.params, grads_for(9)):
        p.grad = g
    before = snapshot(s.opt)
    refused(s.opt.step, types, pattern, what)
    assert_same(snapshot(s.opt), before, f"{what} {NO_CHANGE}")
    s.opt.param_groups[0][arg] = good
    assert_unchanged_and_working(s, snapshot(s.opt))


ENTRIES = ["constructor", "second-group", "add_param_group", "load_state_dict", "set-by-hand"]


@pytest.mark.parametrize("algo,arg,value,why", HYPER, ids=HYPER_IDS)
@pytest.mark.parametrize("entry", ENTRIES)
def test_invalid_hyperparameter_is_refused(entry, algo, arg, value, why):
    _refuse_hyper(entry, algo, arg, value)


@pytest.mark.parametrize("lr", [torch.tensor(NAN), torch.tensor(-1.0), torch.tensor([0.1, 0.2]),
                                torch.tensor(0.1, device=META)], ids=["nan", "negative", "two-elements", "meta"])
@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("entry", ENTRIES)
def test_invalid_tensor_lr_is_refused(entry, algo, lr):
    _refuse_hyper(entry, algo, "lr", lr, (TypeError, ValueError) if lr.is_meta else ValueError)


# --------------------------------------------------------------------------------------------------------
# Parameters: constructor and add_param_group
# --------------------------------------------------------------------------------------------------------

BAD_PARAMS = {
    **{f"dtype-{d}": (lambda d=d: [torch.zeros(4, dtype=d)], TypeError, r"float32, float16 or bfloat16|complex")
       for d in (torch.int32, torch.int64, torch.float64, torch.complex64, torch.bool)},
    "meta": (lambda: [torch.nn.Parameter(torch.zeros(4, device=META))], (TypeError, ValueError), r"meta"),
    "cpu-and-meta": (lambda: [torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(4, device=META))],
                     (TypeError, ValueError), r"meta"),
    "meta-past-int32": (lambda: [torch.nn.Parameter(torch.empty(2**31 + 1, device=META))], (TypeError, ValueError),
                        r"meta"),
    "transposed": (lambda: [torch.nn.Parameter(torch.zeros(4, 3).t())], ValueError, r"contiguous"),
    "expanded-stride0": (lambda: [torch.nn.Parameter(torch.zeros(1, 3).expand(4, 3))], ValueError, r"contiguous"),
    "sparse": (lambda: [torch.nn.Parameter(torch.zeros(4, 3).to_sparse())], (TypeError, ValueError), r"sparse"),
    "not-a-tensor": (lambda: [1.0], TypeError, r"Tensor"),
}


@pytest.mark.parametrize("case", BAD_PARAMS)
@pytest.mark.parametrize("algo", ALGOS)
def test_constructor_refuses_bad_parameters(algo, case):
    cls, kw = CASES[algo]
    make, types, pattern = BAD_PARAMS[case]
    refused(lambda: cls(make(), **kw), types, pattern, f"{algo}([{case}])")


@pytest.mark.parametrize("algo", ALGOS)
def test_constructor_refuses_no_parameters_and_a_bare_tensor(algo):
    cls, kw = CASES[algo]
    refused(lambda: cls([], **kw), ValueError, r"empty")
    refused(lambda: cls(torch.nn.Parameter(torch.zeros(3)), **kw), TypeError, r"iterable")


ADD_GROUP_BAD = {
    **{k: v for k, v in BAD_PARAMS.items() if k != "not-a-tensor"},
    "already-in-a-group": (None, ValueError, r"more than one parameter group"),
    "no-params-key": ("no-params", (KeyError, ValueError, TypeError), r"params"),
    "lr-string": ("lr-string", (TypeError, ValueError), r"lr|learning rate"),
}


@pytest.mark.parametrize("case", ADD_GROUP_BAD)
@pytest.mark.parametrize("algo", ALGOS)
def test_add_param_group_refuses_and_keeps_nothing(algo, case):
    s = Setup(algo)
    make, types, pattern = ADD_GROUP_BAD[case]
    if make is None:
        group = dict(params=[s.params[0]])
    elif make == "no-params":
        group = dict(lr=0.1)
    elif make == "lr-string":
        group = dict(params=[torch.nn.Parameter(torch.randn(3))], lr="fast")
    else:
        group = dict(params=make())
    refused_unchanged(s, lambda: s.opt.add_param_group(group), types, pattern, f"{algo}.add_param_group[{case}]")
    s.opt.add_param_group(dict(params=[torch.nn.Parameter(torch.randn(3))]))  # a good group is still taken
    assert len(s.opt.param_groups) == 2


# --------------------------------------------------------------------------------------------------------
# Steps: gradients, views, empty tensors, non-finite values
# --------------------------------------------------------------------------------------------------------

BITS = [32, 16, 8]


def _set_any_grad(p, g):
    p.grad_dtype = None  # lets a gradient of another dtype be attached
    p.grad = g


def _wrong_shape(p):
    p.grad = torch.zeros_like(p)
    p.grad.data = torch.zeros(3)


BAD_GRADS = {
    "sparse": (lambda p: setattr(p, "grad", torch.zeros_like(p).to_sparse()), RuntimeError, r"sparse"),
    "float64": (lambda p: _set_any_grad(p, torch.zeros(p.shape, dtype=torch.float64)), TypeError, r"dtype"),
    "bfloat16": (lambda p: _set_any_grad(p, torch.zeros(p.shape, dtype=torch.bfloat16)), TypeError, r"dtype"),
    "complex64": (lambda p: _set_any_grad(p, torch.zeros(p.shape, dtype=torch.complex64)), (TypeError, RuntimeError),
                  r"complex"),
    "wrong-shape": (_wrong_shape, ValueError, r"shape"),
}


@pytest.mark.parametrize("case", BAD_GRADS)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("algo", ALGOS)
def test_step_refuses_bad_gradient_and_changes_nothing(algo, bits, case):
    s = Setup(algo, bits)
    spoil, types, pattern = BAD_GRADS[case]
    for p, g in zip(s.params, grads_for(99)):
        p.grad = g
    spoil(s.params[1])  # the second parameter only: the first must not be stepped either
    refused_unchanged(s, s.opt.step, types, pattern, f"{algo} step with a {case} gradient")


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("algo", ALGOS)
def test_step_takes_non_contiguous_and_zero_stride_gradients_as_their_values(algo, bits):
    a, b = Setup(algo, bits), Setup(algo, bits)
    values = grads_for(50)
    views = [values[0].t().contiguous().t(), values[1][:1].expand(70)]
    for p, v in zip(a.params, views):
        p.grad = v
    for p, v in zip(b.params, views):
        p.grad = v.contiguous()
    assert not a.params[0].grad.is_contiguous() and a.params[1].grad.stride() == (0,)
    a.opt.step()
    b.opt.step()
    assert_same(snapshot(a.opt), snapshot(b.opt), f"{algo}: non-contiguous vs contiguous gradients", ids=False)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("algo", ALGOS)
def test_empty_and_0d_parameters_step(algo, bits):
    cls, kw = CASES[algo]
    params = [torch.nn.Parameter(torch.zeros(0)), torch.nn.Parameter(torch.zeros(3, 0)),
              torch.nn.Parameter(torch.tensor(0.5)), torch.nn.Parameter(torch.randn(40))]
    opt = cls(params, **dict(kw, **STORAGE[bits]))
    for step in range(2):
        for p in params:
            p.grad = torch.full_like(p, 0.25 - step)
        opt.step()
    assert params[0].shape == (0,) and params[1].shape == (3, 0)
    assert torch.isfinite(params[2]) and params[2].item() != 0.5 and torch.isfinite(params[3]).all()
    for p in params:
        assert float(opt.state[p]["step"]) == 2.0
    fresh = cls([torch.nn.Parameter(p.detach().clone()) for p in params], **dict(kw, **STORAGE[bits]))
    fresh.load_state_dict(opt.state_dict())


@pytest.mark.parametrize("algo", ALGOS)
def test_closure_that_raises_changes_nothing(algo):
    s = Setup(algo)

    def closure():
        raise ArithmeticError("loss blew up")

    refused_unchanged(s, lambda: s.opt.step(closure), ArithmeticError, r"loss blew up")


NORM_COUPLED = {"LAMB", "LARS"}  # a per-tensor norm reads every element


@pytest.mark.parametrize("bad", [NAN, INF, -INF], ids=repr)
@pytest.mark.parametrize("bits", [32, 16])
@pytest.mark.parametrize("algo", ALGOS)
def test_non_finite_gradient_element_damages_only_its_own_element(algo, bits, bad):
    """DESIGN.md: a non-finite gradient element damages only its own element (element-wise rules: every other
    element and state bit-identical to a step where that element's gradient was finite). LAMB/LARS read it in
    their per-tensor norms: there only finiteness of the other elements is asserted (unsure what else holds)."""
    a, b = Setup(algo, bits), Setup(algo, bits)
    where = (1, 17)  # parameter 0, row 1, column 17
    for s, value in ((a, bad), (b, 0.5)):
        grads = grads_for(40)
        grads[0][where] = value
        for p, g in zip(s.params, grads):
            p.grad = g
        s.opt.step()
    others = torch.ones(SHAPES[0], dtype=torch.bool)
    others[where] = False
    if algo in NORM_COUPLED:
        assert torch.isfinite(a.params[0][others]).all() and torch.isfinite(a.params[1]).all()
        return
    sa, sb = snapshot(a.opt), snapshot(b.opt)
    _same_value(sa["parameter 1"], sb["parameter 1"], f"{algo}: the other parameter")
    for k, v in sa.items():
        if k == "parameter 0" or k.startswith("parameter 0 state") and "step" not in k:
            _same_value(v[others], sb[k][others], f"{algo}: {k}, other elements")


@pytest.mark.parametrize("bad", [NAN, INF], ids=repr)
@pytest.mark.parametrize("algo", [a for a in ALGOS if a not in NORM_COUPLED])
def test_non_finite_gradient_element_8bit_keeps_its_block_usable(algo, bad):
    """DESIGN.md: 8-bit states: a non-finite gradient element never damages its block's scale or its
    neighbours' codes. Checked as: every absmax stays finite and, after one more step with finite gradients,
    every other element's parameter and dequantised states are finite."""
    s = Setup(algo, 8)
    grads = grads_for(40)
    grads[0][1, 17] = bad
    for p, g in zip(s.params, grads):
        p.grad = g
    s.opt.step()
    state = s.opt.state[s.params[0]]
    for k, v in state.items():
        if k.endswith("_absmax"):
            assert torch.isfinite(v).all(), f"{algo}: {k} became non-finite: {v.tolist()}"
    s.step()
    others = torch.ones(SHAPES[0], dtype=torch.bool)
    others[1, 17] = False
    assert torch.isfinite(s.params[0][others]).all(), f"{algo}: neighbours of the bad element became non-finite"


# --------------------------------------------------------------------------------------------------------
# load_state_dict: corrupted and foreign checkpoints
# --------------------------------------------------------------------------------------------------------

STATE_NAMES = {"Adam": ["exp_avg", "exp_avg_sq", "max_exp_avg_sq"], "AdamW": ["exp_avg", "exp_avg_sq"],
               "SGD": ["momentum_buffer"], "RMSprop": ["square_avg", "grad_avg", "momentum_buffer"],
               "Adagrad": ["sum"], "Lion": ["exp_avg"], "LAMB": ["exp_avg", "exp_avg_sq"], "LARS": ["momentum_buffer"],
               "AdEMAMix": ["exp_avg", "exp_avg_slow", "exp_avg_sq"]}


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


# --------------------------------------------------------------------------------------------------------
# Tensor subclasses, sparse and nested tensors (child Python: a crash fails one case)
# --------------------------------------------------------------------------------------------------------


def _sub_param_case(algo, bits, kind):
    """A parameter of a tensor subclass, stepped: a plain subclass (its memory is its data) may step like a
    plain tensor or be refused clearly; a wrapper subclass (DTensor-like) must be refused clearly."""
    def case():
        cls, kw = CASES[algo]
        kw = dict(kw, **STORAGE[bits])
        base = torch.randn(4, 40, generator=torch.Generator().manual_seed(3))
        grad = torch.randn(4, 40, generator=torch.Generator().manual_seed(4))
        if kind == "sub":
            p = torch.Tensor._make_subclass(Sub, base.clone(), True)
            g = grad
        else:
            p, g = Wrapper(base.clone()), Wrapper(grad.clone())

        def run():
            opt = cls([p], **kw)
            for _ in range(2):
                p.grad = g
                opt.step()
            return opt

        def check(opt):
            ref_p = torch.nn.Parameter(base.clone())
            ref = cls([ref_p], **kw)
            for _ in range(2):
                ref_p.grad = grad
                ref.step()
            assert torch.equal(p.detach().as_subclass(torch.Tensor), ref_p.detach()), "subclass stepped differently"

        handled_or_refused(run, check, (TypeError, ValueError), r"subclass|Sub|Wrapper")
    return case


def _refused_case(fn, types=(TypeError, ValueError), pattern=r"sparse|strided|nested|layout|dense|subclass|Wrapper"):
    return lambda: refused(fn, types, pattern)


def _wrapper_grad_on_plain(algo, bits):
    def run():
        cls, kw = CASES[algo]
        p = torch.nn.Parameter(torch.randn(4, 40))
        opt = cls([p], **dict(kw, **STORAGE[bits]))
        p.grad = Wrapper(torch.randn(4, 40))
        opt.step()
    return run


def _state_replaced_by(make, key="exp_avg_absmax", count=1, **kw):
    """A state entry replaced by hand between two steps (count parameters: 2 or more take the at-once path)."""
    def run():
        params = [torch.nn.Parameter(torch.randn(4, 40)) for _ in range(count)]
        opt = go.Adam(params, **(kw or dict(state_bits=8, block_size=32, min_8bit_size=0)))
        for _ in range(2):
            for p in params:
                p.grad = torch.randn(4, 40)
            opt.step()
        opt.state[params[0]][key] = make(opt.state[params[0]][key])
        opt.step()
    return run


def _load_with_state(make):
    def run():
        p = torch.nn.Parameter(torch.randn(4, 40))
        opt = go.AdamW([p])
        p.grad = torch.randn(4, 40)
        opt.step()
        sd = saved(opt)
        sd["state"][0]["exp_avg"] = make(sd["state"][0]["exp_avg"])
        loader = go.AdamW([torch.nn.Parameter(torch.randn(4, 40))])
        loader.load_state_dict(sd)
        return loader
    return run


def _plain_states_and_steps(opt):
    (p,) = opt.param_groups[0]["params"]
    assert all(type(v) is torch.Tensor for v in opt.state[p].values()), "a loaded state kept its subclass"
    p.grad = torch.randn(4, 40)
    opt.step()


ISOLATED_OPTIM = {
    **{f"{algo}-{bits}bit-{kind}-param": _sub_param_case(algo, bits, kind)
       for algo in ALGOS for bits in BITS for kind in ("sub", "wrapper")},
    **{f"{algo}-{bits}bit-wrapper-grad": _refused_case(_wrapper_grad_on_plain(algo, bits))
       for algo in ALGOS for bits in (32, 8)},
    "sparse-csr-param": _refused_case(lambda: go.Adam([torch.nn.Parameter(torch.randn(4, 4).to_sparse_csr())])),
    "nested-param": _refused_case(lambda: go.Adam([torch.nested.nested_tensor([torch.randn(2), torch.randn(3)])]),
                                  NESTED_REFUSAL),
    "wrapper-lr": _refused_case(lambda: go.Adam([torch.nn.Parameter(torch.randn(3))], lr=Wrapper(torch.tensor(0.1))),
                                pattern=r"lr|Wrapper|subclass"),
    "8bit-absmax-replaced-by-wrapper": _refused_case(_state_replaced_by(Wrapper), pattern=r"absmax|Wrapper|subclass"),
    "8bit-absmax-replaced-by-sparse": _refused_case(_state_replaced_by(lambda t: t.to_sparse()),
                                                    pattern=r"absmax|sparse|strided"),
    "8bit-absmax-replaced-by-meta": _refused_case(_state_replaced_by(lambda t: t.to(META)),
                                                  pattern=r"absmax|meta"),
    # Refused at load, or loaded as a plain tensor that the next step can use.
    "32bit-exp_avg-replaced-by-wrapper-at-once": _refused_case(_state_replaced_by(Wrapper, "exp_avg", 2, lr=0.1),
                                                               pattern=r"exp_avg|Wrapper|subclass"),
    "32bit-step-replaced-by-wrapper-at-once": _refused_case(_state_replaced_by(Wrapper, "step", 2, lr=0.1),
                                                            pattern=r"step|Wrapper|subclass"),
    "32bit-exp_avg-replaced-by-nested": _refused_case(
        _state_replaced_by(lambda t: torch.nested.nested_tensor(list(t)), "exp_avg", 1, lr=0.1), NESTED_REFUSAL,
        r"exp_avg|nested"),
    "load-wrapper-state": lambda: handled_or_refused(_load_with_state(Wrapper), _plain_states_and_steps,
                                                     (TypeError, ValueError), r"exp_avg|Wrapper|subclass"),
    "load-sparse-state": _refused_case(_load_with_state(lambda t: t.to_sparse()), pattern=r"exp_avg|sparse|strided"),
    "load-nested-state": _refused_case(_load_with_state(lambda t: torch.nested.nested_tensor(list(t))),
                                       NESTED_REFUSAL, r"exp_avg|nested"),
}

_start_isolated_optim, isolated_optim_results = isolated_fixture(__name__, "ISOLATED_OPTIM")


@pytest.mark.parametrize("case", ISOLATED_OPTIM)
def test_optimizers_refuse_unreadable_tensors_without_crashing(isolated_optim_results, case):
    check_isolated(isolated_optim_results, case)


# --------------------------------------------------------------------------------------------------------
# CUDA mixing (skipped without a GPU)
# --------------------------------------------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("algo", ALGOS)
def test_cuda_and_cpu_mixed(algo):
    cls, kw = CASES[algo]
    cpu, cuda = torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(4, device="cuda"))
    refused(lambda: cls([cpu, cuda], **kw), ValueError, r"one device|cuda")
    s = Setup(algo)
    cuda_opt = cls([torch.nn.Parameter(p.detach().cuda()) for p in s.params], **kw)
    for p, g in zip(cuda_opt.param_groups[0]["params"], grads_for(0)):
        p.grad = g.cuda()
    cuda_opt.step()
    twin, _ = s.twin()
    twin.load_state_dict(cuda_opt.state_dict())  # a CUDA checkpoint loads into a CPU optimizer
    assert all(v.device.type == "cpu" for st in twin.state.values() for v in st.values() if torch.is_tensor(v))
