"""Helpers of the CPU tests of properties that every graphsafe optimizer has (test_optim_skip_zeros.py,
test_optim_repeatability.py, test_optim_state_dict.py, test_optim_parameters.py): the shapes they step, gradients
with and without exact zeros, and a run of steps over given gradients.
"""

from __future__ import annotations

import torch

from conftest import make_optimizer, random_grad

SHAPES = [(37,), (16, 33), (4096 + 100,)]  # the last one spans two norm chunks (LAMB/LARS)


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


def run_steps(case, params, grads_per_step, **extra):
    opt = make_optimizer(case, params, **extra)
    for grads in grads_per_step:
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
    return opt
