"""Bitwise repeatability of graphsafe's optimizers, for every algorithm (CPU): two identical runs, 1 vs 3
OpenMP threads (LAMB/LARS norms have a fixed reduction order), and the step's two ways of gathering a group (all
parameters at once, or one by one) give the same bits.
"""

from __future__ import annotations

import pytest
import torch

import graphsafe.optim as go
from conftest import (
    skip_unless_storable,
    assert_same_run,
    OPTIM_CASE_NAMES,
    clone_params,
    libgomp,
    make_generator,
    make_optimizer,
    make_params,
    random_grad,
)
from optim_property_helpers import SHAPES, run_steps


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
    _assert_same_bits_on_1_and_3_threads(case, 37, [(3 * 4096 + 17,), (4096,), (100, 50)])


def _assert_same_bits_on_1_and_3_threads(case, seed, shapes):
    gomp = libgomp()
    default = gomp.omp_get_max_threads()
    try:
        gomp.omp_set_num_threads(1)
        opt_a, params_a = run_case(case, torch.float32, seed, shapes=shapes)
        gomp.omp_set_num_threads(3)
        opt_b, params_b = run_case(case, torch.float32, seed, shapes=shapes)
    finally:
        gomp.omp_set_num_threads(default)
    assert_same_run(opt_a, params_a, opt_b, params_b, f"{case}: {len(shapes)} tensors, 1 thread vs 3 threads")


@pytest.mark.skipif(libgomp() is None, reason="libgomp (graphsafe's OpenMP runtime) not found")
@pytest.mark.parametrize("case", OPTIM_CASE_NAMES)
def test_many_small_tensors_spread_over_threads_give_the_same_bits(case):
    """A step of many tensors below the size that splits a tensor's elements over threads spreads the tensors over
    the threads instead (src/optim/cpu.cpp, run): 1 and 3 threads give the same bits, layer-wise norms included
    (each tensor's chunks keep their workspace place)."""
    shapes = [(700 + 13 * i,) for i in range(120)] + [(5000,)]  # 120 small tensors, ~130K elements in all
    _assert_same_bits_on_1_and_3_threads(case, 41, shapes)


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
    skip_unless_storable(case, state_bits)
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
