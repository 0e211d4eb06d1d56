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
from conftest import make_params, optim_cases, skip_unless_storable, storable
from bad_inputs import (META, NESTED_REFUSAL, Sub, Wrapper, check_isolated, handled_or_refused, isolated_fixture,
                             refused)

NAN, INF = float("nan"), float("inf")
CASES = optim_cases()
ALGOS = ["Adam", "AdamW", "SGD", "RMSprop", "Adagrad", "Lion", "LAMB", "LARS", "AdEMAMix", "AdamWScheduleFree"]
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
        skip_unless_storable(algo, bits)
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
             "t_alpha": r"t_alpha|warm", "t_beta3": r"t_beta3|warm", "warmup_steps": r"warmup_steps",
             "r": r"\br\b", "weight_lr_power": r"weight_lr_power"}
NUMERIC_ARGS = {
    "Adam": ["eps", "weight_decay"], "AdamW": ["eps", "weight_decay"],
    "SGD": ["momentum", "dampening", "weight_decay"],
    "RMSprop": ["alpha", "eps", "weight_decay", "momentum"],
    "Adagrad": ["lr_decay", "weight_decay", "initial_accumulator_value", "eps"],
    "Lion": ["weight_decay"], "LAMB": ["eps", "weight_decay"],
    "LARS": ["momentum", "weight_decay", "trust_coefficient", "eps"],
    "AdEMAMix": ["alpha", "t_alpha", "t_beta3", "eps", "weight_decay"],
    "AdamWScheduleFree": ["eps", "weight_decay", "warmup_steps", "r", "weight_lr_power"],
}
BETAS_COUNT = {"Adam": 2, "AdamW": 2, "Lion": 2, "LAMB": 2, "AdEMAMix": 3, "AdamWScheduleFree": 2}
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
                    arg in ("alpha", "lr_decay", "t_alpha", "t_beta3", "trust_coefficient", "warmup_steps",
                            "weight_lr_power") and not v >= 0) or (arg == "r" and not math.isfinite(v))
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
    skip_unless_storable(algo, bits)
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
        if k == "parameter 0" or k.startswith("parameter 0 state") and v.dim() > 0:  # (not step, schedule values)
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
       for algo in ALGOS for bits in BITS for kind in ("sub", "wrapper") if storable(algo, bits)},
    **{f"{algo}-{bits}bit-wrapper-grad": _refused_case(_wrapper_grad_on_plain(algo, bits))
       for algo in ALGOS for bits in (32, 8) if storable(algo, bits)},
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
