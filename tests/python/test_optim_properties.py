"""Properties of graphsafe's optimizers that hold for every algorithm (CPU):

* skip_zeros (DESIGN.md "Optimizers"): where the raw gradient element is exactly zero (+0.0 or -0.0) the
  parameter and every state keep their bit patterns (compared as integers, so -0.0 vs +0.0 or a changed
  NaN payload would count); NaN gradient elements are not skipped; with no zero in the gradient the result
  is bit-identical to skip_zeros=False; embedding-like tables keep untouched rows exact over many steps.
  Every case of conftest.optim_cases() has weight_decay > 0 (so a skipped element would move if the skip
  failed) and every optional state enabled.
* bitwise repeatability, also across OpenMP thread counts (LAMB/LARS norms have a fixed reduction order);
* state_dict round trips through torch.save/torch.load into a fresh optimizer over fresh parameters;
* state_bytes; parameters without grads; several dtypes in one param group; non-contiguous gradients;
* the step's two ways of gathering a group (all parameters at once, or one by one) give the same bits.
"""

from __future__ import annotations

import io

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import graphsafe.optim as go
from conftest import (
    assert_same_run,
    snapshot_states,
    OPTIM_CASE_NAMES,
    PARAM_DTYPES,
    assert_bitwise_equal,
    assert_rel_close,
    clone_params,
    libgomp,
    make_generator,
    make_optimizer,
    make_params,
    optim_cases,
    random_grad,
    state_tensors,
)

CASES = optim_cases()
SHAPES = [(37,), (16, 33), (4096 + 100,)]  # the last one spans two norm chunks (LAMB/LARS)
ELEMENTWISE = [n for n in OPTIM_CASE_NAMES if n not in ("LAMB", "LARS")]

# Number of fp32 state buffers each case keeps per parameter (include/graphsafe/optim.h), "step" aside.
STATE_COUNTS = {
    "Adam": 3, "Adam-decoupled": 3, "AdamW": 3, "SGD": 1, "SGD-nesterov": 1, "RMSprop": 3, "Adagrad": 1,
    "Lion": 1, "LAMB": 2, "LARS": 1, "AdEMAMix": 3,
}


def initial_state_value(case: str, name: str) -> float:
    return CASES[case][1].get("initial_accumulator_value", 0.0) if name == "sum" else 0.0


def nonzero_grad(shape, dtype, gen):
    g = random_grad(shape, dtype, gen)
    return torch.where(g == 0, torch.ones_like(g), g)


def grad_with_zeros(shape, dtype, gen, fraction=0.3):
    """A random gradient with `fraction` of its elements exactly zero, half of them -0.0. Returns (g, mask)."""
    g = nonzero_grad(shape, dtype, gen)
    zero = torch.rand(shape, generator=gen) < fraction
    negative = torch.rand(shape, generator=gen) < 0.5
    g[zero & negative] = -0.0
    g[zero & ~negative] = 0.0
    assert bool((g[zero & negative].view(torch.int16 if dtype != torch.float32 else torch.int32) < 0).all())
    return g, zero


def bits_at(t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    view = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}[t.dtype]
    return t.detach().contiguous().view(view)[mask]


def run_steps(case, params, grads_per_step, **extra):
    opt = make_optimizer(case, params, **extra)
    for grads in grads_per_step:
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
    return opt


# --------------------------------------------------------------------------------------------------------
# skip_zeros
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", PARAM_DTYPES, ids=str)
@pytest.mark.parametrize("case", OPTIM_CASE_NAMES)
def test_skip_zeros_keeps_zero_grad_elements_bit_identical(case, dtype):
    gen = make_generator(31)
    params = make_params(SHAPES, dtype, gen)
    opt = make_optimizer(case, params, skip_zeros=True)
    for step in range(6):
        before = snapshot_states(opt, params)
        masks = []
        for p in params:
            p.grad, mask = grad_with_zeros(p.shape, dtype, gen)
            masks.append(mask)
        opt.step()
        for i, (p, mask) in enumerate(zip(params, masks)):
            what = f"{case} {dtype} step {step + 1} tensor {i}"
            old_p, old_states = before[i]
            assert torch.equal(bits_at(p, mask), bits_at(old_p, mask)), f"{what}: a skipped parameter changed"
            moved = (p.detach() != old_p)[~mask].float().mean()
            assert moved > 0.5, f"{what}: only {float(moved):.2f} of the updated elements moved"
            states = state_tensors(opt, p)
            assert set(states) - {"step"}, f"{what}: no states"
            for k, v in states.items():
                if k == "step":
                    assert float(v) == step + 1  # the step counts per tensor, skipped elements or not
                    continue
                assert v.dtype == torch.float32
                old = old_states[k] if k in old_states else torch.full_like(v, initial_state_value(case, k))
                assert torch.equal(bits_at(v, mask), bits_at(old, mask)), f"{what}: skipped elements of {k} changed"
                assert bool((v != old)[~mask].any()), f"{what}: state {k} never changed"


@pytest.mark.parametrize("case", OPTIM_CASE_NAMES)
def test_skip_zeros_does_not_skip_nan(case):
    """A NaN gradient element is not zero: it is stepped (parameter and every state become NaN, as in
    torch), while the zero elements of the same tensor are still skipped."""
    gen = make_generator(32)
    params = make_params([(300,), (12, 10)], torch.float32, gen)
    opt = make_optimizer(case, params, skip_zeros=True)
    for step in range(3):
        before = snapshot_states(opt, params)
        nan_masks, zero_masks = [], []
        for p in params:
            g, zero = grad_with_zeros(p.shape, torch.float32, gen)
            nan = torch.zeros(p.shape, dtype=torch.bool)
            nan.view(-1)[step * 7 :: 41] = True
            nan &= ~zero
            g[nan] = float("nan")
            p.grad = g
            nan_masks.append(nan)
            zero_masks.append(zero)
        opt.step()
        for i, p in enumerate(params):
            what = f"{case} step {step + 1} tensor {i}"
            assert bool(torch.isnan(p.detach()[nan_masks[i]]).all()), f"{what}: NaN-gradient elements were skipped"
            assert torch.equal(bits_at(p, zero_masks[i]), bits_at(before[i][0], zero_masks[i])), what
            for k, v in state_tensors(opt, p).items():
                if k != "step":
                    assert bool(torch.isnan(v[nan_masks[i]]).all()), f"{what}: state {k} skipped a NaN gradient"
                    old = before[i][1].get(k, torch.full_like(v, initial_state_value(case, k)))
                    assert torch.equal(bits_at(v, zero_masks[i]), bits_at(old, zero_masks[i])), f"{what}: {k}"
            if case in ELEMENTWISE:  # no norm couples the elements: the others stay finite
                fresh = ~nan_masks[i] & ~torch.isnan(before[i][0])
                assert bool(torch.isfinite(p.detach()[fresh]).all()), what


@pytest.mark.parametrize("dtype", PARAM_DTYPES, ids=str)
@pytest.mark.parametrize("case", OPTIM_CASE_NAMES)
def test_skip_zeros_without_zeros_is_bit_identical_to_off(case, dtype):
    gen = make_generator(33)
    params = make_params(SHAPES, dtype, gen)
    grads = [[nonzero_grad(p.shape, dtype, gen) for p in params] for _ in range(5)]
    params_on, params_off = clone_params(params), clone_params(params)
    opt_on = run_steps(case, params_on, grads, skip_zeros=True)
    opt_off = run_steps(case, params_off, grads, skip_zeros=False)
    assert_same_run(opt_on, params_on, opt_off, params_off, f"{case} {dtype} skip_zeros on vs off")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", OPTIM_CASE_NAMES)
def test_skip_zeros_embedding_table_untouched_rows_stay_exact(case, dtype):
    """A [rows, dim] table whose gradient is zero in whole rows (rows no token looked up): rows 0..9 never
    get a gradient in 10 steps and must keep their exact bits (and their states the initial value); the
    other rows get a gradient in some steps and must move."""
    gen = make_generator(34)
    rows, dim = 50, 24
    (table,) = make_params([(rows, dim)], dtype, gen)
    initial = table.detach().clone()
    opt = make_optimizer(case, [table], skip_zeros=True)
    never = torch.zeros(rows, dtype=torch.bool)
    never[:10] = True
    for step in range(10):
        g = nonzero_grad((rows, dim), dtype, gen)
        seen = torch.rand(rows, generator=gen) < 0.4
        seen[10 + step] = True  # every other row is seen at least once... rows 10..19 for sure
        seen[never] = False
        g[~seen] = 0.0
        g[~seen & (torch.arange(rows) % 2 == 0)] = -0.0
        table.grad = g
        opt.step()
    untouched = never.unsqueeze(1).expand(rows, dim)
    assert torch.equal(bits_at(table, untouched), bits_at(initial, untouched)), f"{case}: untouched rows changed"
    for k, v in state_tensors(opt, table).items():
        if k != "step":
            expected = torch.full_like(v, initial_state_value(case, k))
            assert torch.equal(bits_at(v, untouched), bits_at(expected, untouched)), f"{case}: state {k} of untouched rows"
    changed_rows = (table.detach() != initial).any(dim=1)
    assert bool(changed_rows[10:20].all()), f"{case}: rows with gradients did not move"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    case=st.sampled_from(OPTIM_CASE_NAMES),
    dtype=st.sampled_from(PARAM_DTYPES),
    numel=st.integers(1, 9000),
    zero_fraction=st.sampled_from([0.0, 0.01, 0.5, 0.99, 1.0]),
    steps=st.integers(1, 3),
    seed=st.integers(0, 2**31 - 1),
)
def test_skip_zeros_property(case, dtype, numel, zero_fraction, steps, seed):
    """Any size, any share of zeros (none, all): zero-gradient elements keep parameter and state bits."""
    gen = make_generator(seed)
    (p,) = make_params([(numel,)], dtype, gen)
    opt = make_optimizer(case, [p], skip_zeros=True)
    for _ in range(steps):
        (old_p, old_states), = snapshot_states(opt, [p])
        p.grad, mask = grad_with_zeros(p.shape, dtype, gen, fraction=zero_fraction)
        opt.step()
        assert torch.equal(bits_at(p, mask), bits_at(old_p, mask))
        for k, v in state_tensors(opt, p).items():
            if k != "step":
                old = old_states.get(k, torch.full_like(v, initial_state_value(case, k)))
                assert torch.equal(bits_at(v, mask), bits_at(old, mask)), k


@pytest.mark.parametrize("case", ELEMENTWISE)
def test_skip_zeros_leaves_other_elements_as_without_it(case):
    """Element-wise algorithms: elements with a nonzero gradient in every step evolve exactly as with
    skip_zeros off; elements with a zero gradient move with skip_zeros off (weight decay), not with it on."""
    gen = make_generator(35)
    params = make_params([(40, 8), (333,)], torch.float32, gen)
    masks = [torch.rand(p.shape, generator=gen) < 0.3 for p in params]
    grads = []
    for _ in range(5):
        step_grads = []
        for p, mask in zip(params, masks):
            g = nonzero_grad(p.shape, torch.float32, gen)
            g[mask] = 0.0
            step_grads.append(g)
        grads.append(step_grads)
    params_on, params_off = clone_params(params), clone_params(params)
    opt_on = run_steps(case, params_on, grads, skip_zeros=True)
    opt_off = run_steps(case, params_off, grads, skip_zeros=False)
    for i, mask in enumerate(masks):
        assert torch.equal(bits_at(params_on[i], ~mask), bits_at(params_off[i], ~mask)), f"{case} tensor {i}"
        for k, v in state_tensors(opt_on, params_on[i]).items():
            if k != "step":
                assert torch.equal(bits_at(v, ~mask), bits_at(opt_off.state[params_off[i]][k], ~mask)), f"{case} {k}"
        assert torch.equal(bits_at(params_on[i], mask), bits_at(params[i], mask))
        assert bool((params_off[i].detach() != params[i].detach())[mask].all()), f"{case}: skip_zeros off did not decay"


# --------------------------------------------------------------------------------------------------------
# Repeatability
# --------------------------------------------------------------------------------------------------------


def run_case(case, dtype, seed, steps=5, shapes=SHAPES, **extra):
    gen = make_generator(seed)
    params = make_params(shapes, dtype, gen)
    grads = [[random_grad(p.shape, dtype, gen) for p in params] for _ in range(steps)]
    opt = run_steps(case, params, grads, **extra)
    return opt, params


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", OPTIM_CASE_NAMES)
def test_two_identical_runs_are_bitwise_equal(case, dtype):
    opt_a, params_a = run_case(case, dtype, 36)
    opt_b, params_b = run_case(case, dtype, 36)
    assert_same_run(opt_a, params_a, opt_b, params_b, f"{case} {dtype} run A vs run B")


@pytest.mark.skipif(libgomp() is None, reason="libgomp (graphsafe's OpenMP runtime) not found")
@pytest.mark.parametrize("case", ["LAMB", "LARS", "Adam"])
def test_results_do_not_depend_on_thread_count(case):
    """The CPU backend splits work over OpenMP threads; LAMB/LARS norms are summed per fixed chunk and the
    chunks in order, so 1 and 3 threads give the same bits (tensors of several chunks)."""
    gomp = libgomp()
    default = gomp.omp_get_max_threads()
    shapes = [(3 * 4096 + 17,), (4096,), (100, 50)]
    try:
        gomp.omp_set_num_threads(1)
        opt_a, params_a = run_case(case, torch.float32, 37, shapes=shapes)
        gomp.omp_set_num_threads(3)
        opt_b, params_b = run_case(case, torch.float32, 37, shapes=shapes)
    finally:
        gomp.omp_set_num_threads(default)
    assert_same_run(opt_a, params_a, opt_b, params_b, f"{case}: 1 thread vs 3 threads")


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
            assert theirs[k].dtype == torch.float32, f"{case} {dtype}: loaded state {k} is {theirs[k].dtype}"
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
    # fp32 states whatever the parameter dtype, plus a 4-byte fp32 step counter per parameter
    expected = sum(4 * (STATE_COUNTS[case] * p.numel() + 1) for p in params)
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


# --------------------------------------------------------------------------------------------------------
# The step's two ways of gathering a group: at once (the common case) and per parameter (everything else)
# --------------------------------------------------------------------------------------------------------


def _run_recording_paths(case, params, grads_per_step, at_once_enabled, monkeypatch, **extra):
    """run_steps, with the at-once gathering switched off (every group takes the per-parameter path) or
    recorded: returns the optimizer and, per step, whether the at-once path served the group."""
    from graphsafe.optim._base import GraphsafeOptimizer

    original = GraphsafeOptimizer._prepare_group_at_once
    served: list[bool] = []

    def recording(self, group):
        issue = original(self, group) if at_once_enabled else None
        served.append(issue is not None)
        return issue

    monkeypatch.setattr(GraphsafeOptimizer, "_prepare_group_at_once", recording)
    opt = run_steps(case, params, grads_per_step, **extra)
    monkeypatch.setattr(GraphsafeOptimizer, "_prepare_group_at_once", original)
    return opt, served


@pytest.mark.parametrize("state_bits", [32, 8])
@pytest.mark.parametrize("case", OPTIM_CASE_NAMES)
def test_at_once_gathering_gives_the_per_parameter_paths_bits(case, state_bits, monkeypatch):
    """_prepare_group_at_once (every check over all of a group's parameters at once) issues what the
    per-parameter path (_prepare_bucket) issues: the same bits over steps where states are created, a
    parameter has no gradient, and one gets its first; and it serves the steps it is meant for (states all
    there, in the form this step needs), leaving the others to the per-parameter path."""
    gen = make_generator(46)
    shapes = [(37,), (16, 33), (0,), (), (300,)]
    params = make_params(shapes, torch.float32, gen)
    grads = [[random_grad(p.shape, torch.float32, gen) for p in params] for _ in range(5)]
    grads[1][1] = None  # no gradient at step 1: skipped, as torch does
    for step in (0, 1, 2):
        grads[step][4] = None  # the last parameter's first gradient comes at step 3 (its states are created)
    extra = dict(state_bits=state_bits, min_8bit_size=0, block_size=32) if state_bits == 8 else {}
    general, general_served = _run_recording_paths(case, clone_params(params), grads, False, monkeypatch, **extra)
    at_once_params = clone_params(params)
    at_once, served = _run_recording_paths(case, at_once_params, grads, True, monkeypatch, **extra)
    assert not any(general_served)
    # step 0 and step 3 create states (the per-parameter path); steps 1, 2 and 4 find them all in place
    assert served == [False, True, True, False, True], served
    assert_same_run(general, [p for p in general.param_groups[0]["params"]], at_once, at_once_params,
                    f"{case} {state_bits}-bit at once vs per parameter")


def test_at_once_gathering_of_mixed_groups_and_what_it_leaves_to_the_per_parameter_path(monkeypatch):
    """A group of two dtypes, or of 8-bit and fp32 states side by side (sizes on both sides of min_8bit_size,
    as biases and norms are in a real model), is gathered at once with one core call per kind, and steps as
    one optimizer per parameter would. Left to the per-parameter path: a non-contiguous gradient, states from
    other options, a group of one parameter."""
    gen = make_generator(47)
    mixed_dtypes = [make_params([(40,)], dtype, gen)[0] for dtype in [torch.float32, torch.bfloat16] * 2]
    mixed_sizes = make_params([(100,), (5000,)] * 2, torch.float32, gen)
    for params, extra in ((mixed_dtypes, {}), (mixed_sizes, dict(state_bits=8, min_8bit_size=1000))):
        grads = [[random_grad(p.shape, p.dtype, gen) for p in params] for _ in range(3)]
        together = clone_params(params)
        opt, served = _run_recording_paths("AdamW", together, grads, True, monkeypatch, **extra)
        assert served == [False, True, True], served  # the first step creates the states
        assert len(opt._prepare_group_at_once(opt.param_groups[0])) == 2  # one core call per kind
        for i, p in enumerate(params):
            alone = clone_params([p])
            opt_alone = run_steps("AdamW", alone, [[g[i]] for g in grads], **extra)
            assert_same_run(opt, together[i : i + 1], opt_alone, alone, f"param {i}")
    params = make_params([(24, 17)] * 4, torch.float32, gen)
    opt = make_optimizer("SGD", params)
    for p in params:
        p.grad = random_grad((24, 17), torch.float32, gen)
    opt.step()
    group = opt.param_groups[0]
    assert opt._prepare_group_at_once(group) is not None
    params[2].grad = params[2].grad.t().contiguous().t()  # same values, column-major: the per-parameter path copies
    assert opt._prepare_group_at_once(group) is None
    opt.step()  # (test_non_contiguous_grad_gives_same_bits checks its bits)
    adam_params = make_params([(30,)] * 4, torch.float32, gen)
    adam = go.AdamW(adam_params, lr=0.01)
    for q in adam_params:
        q.grad = random_grad((30,), torch.float32, gen)
    adam.step()
    adam.param_groups[0]["amsgrad"] = True  # a state the old options did not keep: created on the next step
    assert adam._prepare_group_at_once(adam.param_groups[0]) is None
    adam.step()
    assert all("max_exp_avg_sq" in adam.state[q] for q in adam_params)
    assert adam._prepare_group_at_once(adam.param_groups[0]) is not None
    small = make_params([(30,)], torch.float32, gen)  # below _AT_ONCE_MIN_PARAMS: the loop is cheaper
    sgd = make_optimizer("SGD", small)
    for q in small:
        q.grad = random_grad((30,), torch.float32, gen)
    sgd.step()
    assert sgd._prepare_group_at_once(sgd.param_groups[0]) is None
