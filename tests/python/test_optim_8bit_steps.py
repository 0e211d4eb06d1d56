"""Stepping with 8-bit optimizer states (state_bits=8), on the CPU.

* skip_zeros with 8-bit states, on an embedding-like table whose rows are quantisation blocks: rows with an
  all-zero gradient keep their parameters, codes and absmax bit-identical (with weight_decay > 0, so they
  would move otherwise); in partly skipped blocks a skipped element's state moves only by requantisation,
  i.e. by at most half the local gap between neighbouring map values times the block's new absmax (the
  docs allow one full gap; nearest rounding gives half); without zeros skip_zeros=True is bit-identical
  to skip_zeros=False.
* Bitwise repeatability (also across OpenMP thread counts).
* Argument checking of the optimizer options, also when set between steps.
"""

from __future__ import annotations

import pytest
import torch

import graphsafe.ops as ops
import graphsafe.optim as go
from conftest import assert_bitwise_equal, assert_same_run, libgomp, make_generator, state_tensors
from optim_8bit_helpers import (CASE_NAMES, SIGNED, STATE_NAMES, assert_within_requantization_bound,
                                initial_state_value, make_opt, nonzero_randn)


# --------------------------------------------------------------------------------------------------------
# skip_zeros with 8-bit states
# --------------------------------------------------------------------------------------------------------

ROWS, DIM = 200, 256  # with block_size=256 a row is one quantisation block
NEVER = 20  # rows 0..19 never get a gradient


def table_grads(gen, steps):
    """Per step: rows < NEVER all zero; of the others, ~30% all zero this step (fully skipped blocks) and the
    rest with ~20% zero elements (partly skipped blocks), half of the zeros -0.0."""
    out = []
    for _ in range(steps):
        g = nonzero_randn((ROWS, DIM), gen)
        idle = torch.rand(ROWS, generator=gen) < 0.3
        idle[:NEVER] = True
        zero = (torch.rand(ROWS, DIM, generator=gen) < 0.2) | idle[:, None]
        negative = torch.rand(ROWS, DIM, generator=gen) < 0.5
        g[zero & negative] = -0.0
        g[zero & ~negative] = 0.0
        out.append((g, idle, zero))
    return out


@pytest.mark.parametrize("case", CASE_NAMES)
def test_skip_zeros_8bit_embedding_table(case):
    gen = make_generator(300)
    initial = torch.randn(ROWS, DIM, generator=gen) * 0.5
    table = torch.nn.Parameter(initial.clone())
    opt = make_opt(case, [table], state_bits=8, block_size=256, min_8bit_size=0, skip_zeros=True)
    steps = table_grads(gen, 8)
    names = STATE_NAMES[case]
    for step, (g, idle, zero) in enumerate(steps):
        p_before = table.detach().clone()
        if step == 0:  # the states the first step creates: the initial values, quantised
            before = {n: ops.quantize_blockwise(torch.full((ROWS, DIM), initial_state_value(case, n)), 256, SIGNED[n])
                      for n in names}
        else:
            before = {n: (opt.state[table][n].clone(), opt.state[table][f"{n}_absmax"].clone()) for n in names}
        table.grad = g
        opt.step()
        what = f"{case} step {step + 1}"
        state = opt.state[table]
        # the parameter of a skipped element is never written
        assert_bitwise_equal(table.detach()[zero], p_before[zero], f"{what}: skipped parameters")
        partly = ~idle[:, None] & zero  # skipped elements of blocks that were requantised
        assert bool(partly.any())
        for n in names:
            codes_before, absmax_before = before[n]
            codes, absmax = state[n], state[f"{n}_absmax"]
            # all-skipped blocks: codes and absmax bit-identical
            assert torch.equal(codes[idle], codes_before[idle]), f"{what}: codes of {n} in all-zero rows changed"
            assert_bitwise_equal(absmax[idle], absmax_before[idle], f"{what}: absmax of {n} in all-zero rows")
            # partly skipped blocks: the skipped elements move only by requantisation
            old = ops.dequantize_blockwise(codes_before, absmax_before, 256, SIGNED[n])
            new = ops.dequantize_blockwise(codes, absmax, 256, SIGNED[n])
            new_scale = absmax[:, None].expand(ROWS, DIM)
            assert_within_requantization_bound(new[partly], old[partly], new_scale[partly], SIGNED[n],
                                               f"{what}: skipped elements of {n} in partly skipped rows")
    # the never-touched rows: exactly as they started, states included
    assert_bitwise_equal(table.detach()[:NEVER], initial[:NEVER], f"{case}: rows that never had a gradient")
    for n in names:
        codes0, absmax0 = ops.quantize_blockwise(torch.full((ROWS, DIM), initial_state_value(case, n)), 256, SIGNED[n])
        assert torch.equal(opt.state[table][n][:NEVER], codes0[:NEVER]), f"{case}: codes of {n} in untouched rows"
        assert_bitwise_equal(opt.state[table][f"{n}_absmax"][:NEVER], absmax0[:NEVER], f"{case}: absmax of {n}")

    # the premise: without skip_zeros the same gradients move those rows (weight_decay > 0)
    off = torch.nn.Parameter(initial.clone())
    opt_off = make_opt(case, [off], state_bits=8, block_size=256, min_8bit_size=0, skip_zeros=False)
    for g, _, _ in steps:
        off.grad = g
        opt_off.step()
    moved = (off.detach()[:NEVER] != initial[:NEVER]).float().mean()
    assert float(moved) > 0.9, f"{case}: without skip_zeros only {float(moved):.2f} of the idle rows moved"


@pytest.mark.parametrize("case", CASE_NAMES)
def test_skip_zeros_8bit_without_zeros_is_bit_identical_to_off(case):
    gen = make_generator(301)
    initial = [torch.randn(ROWS, DIM, generator=gen), torch.randn(5003, generator=gen)]
    grads = [[nonzero_randn(p.shape, gen) for p in initial] for _ in range(6)]
    runs = []
    for skip in (True, False):
        params = [torch.nn.Parameter(p.clone()) for p in initial]
        opt = make_opt(case, params, state_bits=8, block_size=128, min_8bit_size=0, skip_zeros=skip)
        for step_grads in grads:
            for p, g in zip(params, step_grads):
                p.grad = g.clone()
            opt.step()
        runs.append((opt, params))
    (opt_on, params_on), (opt_off, params_off) = runs
    assert_same_run(opt_on, params_on, opt_off, params_off, f"{case}: skip_zeros on vs off without zeros")


# --------------------------------------------------------------------------------------------------------
# Bitwise repeatability
# --------------------------------------------------------------------------------------------------------


def run_8bit(case, seed, shapes=((40, 130), (10007,)), steps=4):
    gen = make_generator(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    opt = make_opt(case, params, state_bits=8, min_8bit_size=0)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return opt, params


@pytest.mark.parametrize("case", CASE_NAMES)
def test_two_identical_8bit_runs_are_bitwise_equal(case):
    opt_a, params_a = run_8bit(case, 700)
    opt_b, params_b = run_8bit(case, 700)
    assert_same_run(opt_a, params_a, opt_b, params_b, f"{case}: run A vs run B")


@pytest.mark.skipif(libgomp() is None, reason="libgomp (graphsafe's OpenMP runtime) not found")
@pytest.mark.parametrize("case", ["AdamW", "LAMB", "LARS"])
def test_8bit_results_do_not_depend_on_thread_count(case):
    gomp = libgomp()
    default = gomp.omp_get_max_threads()
    shapes = ((3 * 4096 + 17,), (100, 50))  # several norm chunks and many quantisation blocks
    try:
        gomp.omp_set_num_threads(1)
        opt_a, params_a = run_8bit(case, 701, shapes)
        gomp.omp_set_num_threads(3)
        opt_b, params_b = run_8bit(case, 701, shapes)
    finally:
        gomp.omp_set_num_threads(default)
    assert_same_run(opt_a, params_a, opt_b, params_b, f"{case}: 1 thread vs 3 threads")


# --------------------------------------------------------------------------------------------------------
# Invalid options
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASE_NAMES)
@pytest.mark.parametrize("bad", [dict(state_bits=12), dict(state_bits=4), dict(state_bits=True), dict(block_size=100),
                                 dict(block_size=16), dict(block_size=2048), dict(block_size=0),
                                 dict(min_8bit_size=-1), dict(min_8bit_size=1.5)],
                         ids=lambda d: "-".join(f"{k}={v}" for k, v in d.items()))
def test_invalid_8bit_options(case, bad):
    p = torch.nn.Parameter(torch.zeros(10))
    with pytest.raises(ValueError):
        make_opt(case, [p], **bad)


def test_invalid_block_size_set_between_steps_is_rejected_and_changes_nothing():
    p = torch.nn.Parameter(torch.randn(5000))
    opt = go.AdamW([p], lr=1e-3, state_bits=8, block_size=128)
    p.grad = torch.randn(5000)
    opt.step()
    before = {k: v.clone() for k, v in state_tensors(opt, p).items()}
    param_before = p.detach().clone()
    opt.param_groups[0]["block_size"] = 100
    with pytest.raises(ValueError, match="block_size"):
        opt.step()
    assert torch.equal(p.detach(), param_before)
    for k, v in state_tensors(opt, p).items():
        assert torch.equal(v, before[k]), k
    opt.param_groups[0]["state_bits"] = 12
    with pytest.raises(ValueError, match="state_bits"):
        opt.step()
