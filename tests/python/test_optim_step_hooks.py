"""graphsafe's optimizers keep torch.optim's step machinery: step hooks, the profiler's step range, lr schedulers,
closures, and a subclass that overrides step.

GraphsafeOptimizer.step leaves out torch's profile_hook_step wrapper while it has nothing to do (no hook, the
profiler off: it cost more host time than the rest of a small eager step) and takes torch's own wrapper
otherwise. These tests compare every observable of that against torch.optim.SGD, which always runs the wrapper.
"""

from __future__ import annotations

import functools
import inspect
import warnings

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

import graphsafe.optim as go
from graphsafe.optim._base import GraphsafeOptimizer


def _sgd_pair():
    """graphsafe's SGD and torch's, over the same start, with gradients."""
    torch.manual_seed(0)
    start = torch.randn(8)
    grad = torch.randn(8)
    optimizers = []
    for cls in (go.SGD, torch.optim.SGD):
        p = torch.nn.Parameter(start.clone())
        p.grad = grad.clone()
        optimizers.append(cls([p], lr=0.1, momentum=0.9))
    return optimizers


def _calls_of_hooks(optimizer, register_pre, register_post):
    calls = []
    handles = [register_pre(lambda opt, args, kwargs: calls.append(("pre", opt, args, kwargs))),
               register_post(lambda opt, args, kwargs: calls.append(("post", opt, args, kwargs)))]
    optimizer.step()
    optimizer.step(closure=None)
    for h in handles:
        h.remove()
    optimizer.step()  # removed: not called again
    return calls


@pytest.mark.parametrize("scope", ["optimizer", "global"])
def test_step_hooks_are_called_as_torch_calls_them(scope):
    ours, theirs = _sgd_pair()
    seen = []
    for opt in (ours, theirs):
        if scope == "optimizer":
            calls = _calls_of_hooks(opt, opt.register_step_pre_hook, opt.register_step_post_hook)
        else:
            calls = _calls_of_hooks(opt, register_optimizer_step_pre_hook,
                                    register_optimizer_step_post_hook)
        assert all(call[1] is opt for call in calls)
        seen.append([(kind, len(args), kwargs) for kind, _, args, kwargs in calls])
    assert seen[0] == seen[1]
    assert [kind for kind, *_ in seen[0]] == ["pre", "post", "pre", "post"]
    # three steps each (torch's SGD agrees with ours to fp32 rounding: tests/python/test_optim_torch.py)
    torch.testing.assert_close(ours.param_groups[0]["params"][0], theirs.param_groups[0]["params"][0],
                               rtol=1e-6, atol=0)


def test_a_pre_hook_can_replace_the_step_arguments():
    ours, _ = _sgd_pair()
    closure_calls = []

    def closure():
        closure_calls.append(1)
        return torch.tensor(3.0)

    ours.register_step_pre_hook(lambda opt, args, kwargs: ((args[0],), {"closure": closure}))
    loss = ours.step()
    assert closure_calls == [1] and float(loss) == 3.0


def test_steps_with_and_without_hooks_give_the_same_bits():
    ours, _ = _sgd_pair()
    twin = go.SGD([torch.nn.Parameter(ours.param_groups[0]["params"][0].detach().clone())], lr=0.1, momentum=0.9)
    twin.param_groups[0]["params"][0].grad = ours.param_groups[0]["params"][0].grad.clone()
    twin.register_step_post_hook(lambda *a: None)
    for _ in range(3):
        ours.step()
        twin.step()
    assert torch.equal(ours.param_groups[0]["params"][0].view(torch.int32),
                       twin.param_groups[0]["params"][0].view(torch.int32))


def test_the_profiler_sees_the_step_as_torch_names_it():
    ours, _ = _sgd_pair()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        ours.step()
    names = [event.name for event in prof.events()]
    assert "Optimizer.step#SGD.step" in names


def test_a_subclass_that_overrides_step_runs_each_hook_once():
    class Counting(go.SGD):
        steps = 0

        def step(self, closure=None):
            Counting.steps += 1
            return super().step(closure)

    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.ones(4)
    opt = Counting([p], lr=0.1)
    calls = []
    opt.register_step_pre_hook(lambda *a: calls.append("pre"))
    opt.register_step_post_hook(lambda *a: calls.append("post"))
    opt.step()
    assert Counting.steps == 1 and calls == ["pre", "post"]
    assert torch.equal(p.detach(), torch.full((4,), 0.9))
    assert type(opt).step is not GraphsafeOptimizer.step  # torch wrapped the override, as for any subclass


def test_lr_scheduler_sees_the_optimizer_step():
    ours, _ = _sgd_pair()
    scheduler = torch.optim.lr_scheduler.StepLR(ours, step_size=1, gamma=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "lr_scheduler.step() before optimizer.step()" would be an error here
        ours.step()
        scheduler.step()
    assert float(ours.param_groups[0]["lr"]) == pytest.approx(0.05)


def test_a_step_decorated_with_functools_wraps_still_runs_the_hooks():
    """functools.wraps copies the mark that tells torch not to wrap a step (hooked): torch leaves such a step
    alone, so graphsafe's step must run the hooks itself."""
    calls = []

    def logged(step):
        @functools.wraps(step)
        def wrapper(self, *args, **kwargs):
            calls.append("logged")
            return step(self, *args, **kwargs)
        return wrapper

    class Logged(go.SGD):
        step = logged(go.SGD.step)

    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.ones(4)
    opt = Logged([p], lr=0.1)
    opt.register_step_pre_hook(lambda *a: calls.append("pre"))
    opt.register_step_post_hook(lambda *a: calls.append("post"))
    opt.step()
    assert calls == ["logged", "pre", "post"]


def test_step_shows_its_closure_argument():
    assert list(inspect.signature(go.AdamW([torch.nn.Parameter(torch.ones(2))]).step).parameters) == ["closure"]
