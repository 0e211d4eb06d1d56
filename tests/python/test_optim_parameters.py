"""What graphsafe's optimizers step, for every algorithm (CPU): state_bytes; parameters without grads (and one
whose first grad comes late); several dtypes in one param group; empty and 0-d parameters; non-contiguous
gradients; which algorithms need a workspace; options validated again between steps.
"""

from __future__ import annotations

import pytest
import torch

import graphsafe.optim as go
from conftest import (
    per_tensor_keys,
    assert_same_run,
    OPTIM_CASE_NAMES,
    assert_bitwise_equal,
    assert_rel_close,
    clone_params,
    make_generator,
    make_optimizer,
    make_params,
    random_grad,
    state_tensors,
)
from optim_property_helpers import SHAPES, run_steps


# Number of fp32 state buffers each case keeps per parameter (include/graphsafe/optim.h), "step" aside.
STATE_COUNTS = {
    "Adam": 3, "Adam-decoupled": 3, "AdamW": 3, "SGD": 1, "SGD-nesterov": 1, "RMSprop": 3, "Adagrad": 1,
    "Lion": 1, "LAMB": 2, "LARS": 1, "AdEMAMix": 3, "AdamWScheduleFree": 2,
}


# --------------------------------------------------------------------------------------------------------
# state_bytes, params without grads, mixed dtypes, non-contiguous grads
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", OPTIM_CASE_NAMES)
def test_state_bytes(case, dtype):
    gen = make_generator(40)
    params = make_params(SHAPES, dtype, gen)
    opt = make_optimizer(case, params)
    assert go.state_bytes(opt) == 0
    for p in params:
        p.grad = random_grad(p.shape, dtype, gen)
    opt.step()
    # fp32 states whatever the parameter dtype, plus a 4-byte fp32 step counter and an 8-byte float64 per schedule
    # value per parameter
    schedule = len(per_tensor_keys(opt)) - 1
    expected = sum(4 * (STATE_COUNTS[case] * p.numel() + 1) + 8 * schedule for p in params)
    assert go.state_bytes(opt) == expected
    assert expected == sum(v.numel() * v.element_size() for p in params for v in state_tensors(opt, p).values())


def test_state_bytes_of_torch_optimizers_and_stateless_sgd():
    p = torch.nn.Parameter(torch.randn(100))
    p.grad = torch.randn(100)
    opt = torch.optim.Adam([p])
    opt.step()
    assert go.state_bytes(opt) == 2 * 100 * 4 + 4
    sgd = go.SGD([p], lr=0.1)
    sgd.step()
    assert go.state_bytes(sgd) == 4 and set(sgd.state[p]) == {"step"}


@pytest.mark.parametrize("case", OPTIM_CASE_NAMES)
def test_params_without_grads_are_skipped(case):
    gen = make_generator(41)
    with_grad, without = make_params([(30,), (20,)], torch.float32, gen)
    initial = without.detach().clone()
    opt = make_optimizer(case, [with_grad, without])
    for _ in range(3):
        with_grad.grad = random_grad(with_grad.shape, torch.float32, gen)
        opt.step()
    assert_bitwise_equal(without, initial, "parameter without grad")
    assert without not in opt.state or not opt.state[without], "state created for a parameter without grad"
    assert float(opt.state[with_grad]["step"]) == 3
    opt.zero_grad(set_to_none=True)
    opt.step()  # nothing has a grad: nothing changes
    assert float(opt.state[with_grad]["step"]) == 3
    without.grad = random_grad(without.shape, torch.float32, gen)
    opt.step()
    assert float(opt.state[without]["step"]) == 1  # its own step count starts now


def test_late_grad_param_matches_torch():
    """A parameter that gets its first grad at step 4 is bias-corrected from its own step 1, like torch."""
    gen = make_generator(42)
    params = make_params([(30,), (20,)], torch.float32, gen)
    refs = clone_params(params)
    opt = go.Adam(params, lr=0.05, weight_decay=0.1)
    ref = torch.optim.Adam(refs, lr=0.05, weight_decay=0.1)
    for step in range(8):
        for i, (p, r) in enumerate(zip(params, refs)):
            if i == 1 and step < 3:
                p.grad = r.grad = None
                continue
            g = random_grad(p.shape, torch.float32, gen)
            p.grad, r.grad = g, g.clone()
        opt.step()
        ref.step()
    for p, r in zip(params, refs):
        assert_rel_close(p, r, 1e-6, "param")


@pytest.mark.parametrize("case", OPTIM_CASE_NAMES)
def test_mixed_dtypes_in_one_group(case):
    """fp32, bf16 and fp16 parameters in one group give the same bits as one optimizer per parameter."""
    gen = make_generator(43)
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.float32, torch.bfloat16]
    shapes = [(37,), (5, 9), (64,), (4096 + 3,), (11,)]
    params = [make_params([s], d, gen)[0] for s, d in zip(shapes, dtypes)]
    grads = [[random_grad(p.shape, p.dtype, gen) for p in params] for _ in range(4)]
    together = clone_params(params)
    opt = run_steps(case, together, grads)
    for i, p in enumerate(params):
        alone = clone_params([p])
        opt_alone = run_steps(case, alone, [[g[i]] for g in grads])
        assert together[i].dtype == dtypes[i]
        assert_same_run(opt, together[i : i + 1], opt_alone, alone, f"{case} param {i} ({dtypes[i]})")


@pytest.mark.parametrize("case", OPTIM_CASE_NAMES)
def test_empty_and_scalar_parameters(case):
    """0-d and empty parameters step like the others; an empty one changes nothing around it."""
    gen = make_generator(45)
    shapes = [(), (0,), (5,), (0, 3), (4097,)]
    params = make_params(shapes, torch.float32, gen)
    grads = [[random_grad(p.shape, torch.float32, gen) for p in params] for _ in range(3)]
    together = clone_params(params)
    opt = run_steps(case, together, grads)
    for i, p in enumerate(params):
        alone = clone_params([p])
        opt_alone = run_steps(case, alone, [[g[i]] for g in grads])
        assert_same_run(opt, together[i : i + 1], opt_alone, alone, f"{case} param {i} {tuple(p.shape)}")
    assert not torch.equal(together[0].detach(), params[0].detach()), "the 0-d parameter did not move"


@pytest.mark.parametrize("case", ["Adam", "LAMB", "SGD"])
def test_non_contiguous_grad_gives_same_bits(case):
    gen = make_generator(44)
    (p,) = make_params([(24, 17)], torch.float32, gen)
    grads = [random_grad((24, 17), torch.float32, gen) for _ in range(3)]
    a, b = clone_params([p]), clone_params([p])
    opt_a = run_steps(case, a, [[g] for g in grads])
    opt_b = run_steps(case, b, [[g.t().contiguous().t()] for g in grads])  # same values, column-major
    assert not grads[0].t().contiguous().t().is_contiguous()
    assert_same_run(opt_a, a, opt_b, b, f"{case} contiguous vs strided grad")


def test_python_knows_which_algorithms_need_a_workspace():
    """The step asks the core for workspace bytes only for these; the core must agree (else a layer-wise
    step would run without its scratch memory)."""
    from graphsafe import _C
    from graphsafe.optim._base import _NEEDS_WORKSPACE

    for cls in (go.Adam, go.AdamW, go.SGD, go.RMSprop, go.Adagrad, go.Lion, go.LAMB, go.LARS, go.AdEMAMix):
        opt = cls([torch.nn.Parameter(torch.zeros(3))], lr=0.1)
        group = opt.param_groups[0]
        for device_type in ("cpu", "cuda"):
            needed = _C.optim_workspace_bytes(device_type, opt.algorithm, opt._core_options(group), [10000, 3])
            assert (needed > 0) == (opt.algorithm in _NEEDS_WORKSPACE), (cls.__name__, device_type)


def test_options_changed_between_steps_are_validated_again():
    p = torch.nn.Parameter(torch.ones(4))
    opt = go.AdamW([p], lr=0.1)
    p.grad = torch.ones(4)
    opt.step()
    opt.param_groups[0]["betas"] = (1.5, 0.999)
    before = p.detach().clone()
    with pytest.raises(ValueError):
        opt.step()
    assert torch.equal(p.detach(), before)
