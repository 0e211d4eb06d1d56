"""CUDA graph capture of graphsafe's optimizer step, and the lr tensor it reads (skipped without a GPU and
graphsafe's CUDA backend).

* The whole optimizer.step() captured in a torch.cuda.CUDAGraph (3 warm-up steps on a side stream first,
  as torch's whole-network capture example does; gradients are static tensors that new values are copied
  into) and replayed 10 times with an lr scheduler stepping between replays (outside the graph): bitwise
  equal to the same 10 eager steps on a copy, so the graph reads lr and step from device memory (32-bit and
  8-bit states); a step captured before any eager one (states loaded, no finish counter yet) equals eager
  steps too.
* A NaN or negative lr written into the lr tensor: the step (eager, or a replayed graph) changes no parameter,
  state or step count, and graphsafe.check_errors() raises a ValueError; the next step with a usable lr counts
  its steps again (the finish counter stayed consistent).
"""

from __future__ import annotations

import pytest
import torch

import graphsafe
import graphsafe.optim as go
from conftest import (
    skip_unless_storable,
    assert_same_run,
    snapshot_states,
    OPTIM_CASE_NAMES,
    assert_bitwise_equal,
    make_generator,
    make_optimizer,
    make_params,
    requires_cuda,
    stable_seed,
    state_tensors,
)
from optim_cuda_helpers import CUDA, OFFSETS, SHAPES, attach_grads, copy_into, draw_grads

pytestmark = requires_cuda


# --------------------------------------------------------------------------------------------------------
# CUDA graph capture
# --------------------------------------------------------------------------------------------------------


def lr_factor(epoch: int) -> float:
    """A schedule that goes down and up again (a graph that baked in the lr could not follow it)."""
    return 0.8**epoch * (1 + epoch % 3)


# 8-bit with blocks of 64 takes the general element loop; with 256 the aligned whole chunks take the whole-chunk loop.
@pytest.mark.parametrize("state_bits,block_size", [(32, None), (8, 64), (8, 256)], ids=["32", "8-64", "8-256"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", OPTIM_CASE_NAMES)
def test_captured_step_with_lr_scheduler_equals_eager(case, dtype, state_bits, block_size):
    skip_unless_storable(case, state_bits)
    seed = stable_seed("graph", case, str(dtype), state_bits, block_size)
    params = make_params(SHAPES, dtype, make_generator(seed), device=CUDA, offsets=OFFSETS)
    eager_params = make_params(SHAPES, dtype, make_generator(seed), device=CUDA, offsets=OFFSETS)
    static_grads, eager_grads = attach_grads(params, OFFSETS), attach_grads(eager_params, OFFSETS)
    bits = dict(state_bits=state_bits, min_8bit_size=0, block_size=block_size) if state_bits == 8 else {}
    opt = make_optimizer(case, params, skip_zeros=True, **bits)
    eager = make_optimizer(case, eager_params, skip_zeros=True, **bits)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    eager_sched = torch.optim.lr_scheduler.LambdaLR(eager, lr_factor)
    gen = make_generator(seed + 1)

    # Warm up on a side stream (creates the states outside the capture), then capture one whole step.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    warmup_values = [draw_grads(params, dtype, gen, zero_fraction=0.1) for _ in range(3)]
    with torch.cuda.stream(side):
        for values in warmup_values:
            copy_into(static_grads, values)
            opt.step()
    torch.cuda.current_stream().wait_stream(side)
    for values in warmup_values:
        copy_into(eager_grads, values)
        eager.step()
    torch.cuda.synchronize()
    assert_same_run(opt, params, eager, eager_params, f"{case} {dtype} warm-up (side stream vs default)")

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    torch.cuda.synchronize()
    assert all(float(opt.state[p]["step"]) == 3 for p in params), "capturing must not run the step"

    lrs = []
    for step in range(10):
        values = draw_grads(params, dtype, gen, zero_fraction=0.1)
        copy_into(static_grads, values)
        graph.replay()
        copy_into(eager_grads, values)
        eager.step()
        sched.step()
        eager_sched.step()
        lrs.append(float(opt.param_groups[0]["lr"]))
        torch.cuda.synchronize()
        assert_same_run(opt, params, eager, eager_params, f"{case} {dtype} replay {step + 1} vs eager")
    assert_bitwise_equal(opt.param_groups[0]["lr"], eager.param_groups[0]["lr"], "lr")
    assert len(set(lrs)) >= 5, f"the schedule did not change the lr: {lrs}"
    assert all(float(opt.state[p]["step"]) == 13 for p in params)


@pytest.mark.parametrize("case", ["AdamW", "SGD", "LAMB"])
def test_step_captured_before_any_eager_step_counts_its_steps(case):
    """An optimizer whose first CUDA step is captured (its states loaded from a checkpoint, no warm-up) has no
    finish counter yet and makes none inside the capture (its zeroing would only run at the first replay): the
    graph counts the steps with a launch ahead. Replays and the eager steps after them (which make the counter)
    equal an optimizer stepped eagerly throughout, bitwise."""
    seed = stable_seed("first step captured", case)
    params = make_params(SHAPES, torch.float32, make_generator(seed), device=CUDA, offsets=OFFSETS)
    eager_params = make_params(SHAPES, torch.float32, make_generator(seed), device=CUDA, offsets=OFFSETS)
    static_grads, eager_grads = attach_grads(params, OFFSETS), attach_grads(eager_params, OFFSETS)
    eager = make_optimizer(case, eager_params)
    gen = make_generator(seed + 1)
    for _ in range(2):
        copy_into(eager_grads, draw_grads(eager_params, torch.float32, gen))
        eager.step()
    with torch.no_grad():
        for p, q in zip(params, eager_params):
            p.copy_(q)
    opt = make_optimizer(case, params)
    opt.load_state_dict(eager.state_dict())
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    assert not opt.__dict__.get("_finish_counters"), "a finish counter was made inside the capture"
    for step in range(4):
        values = draw_grads(params, torch.float32, gen)
        copy_into(static_grads, values)
        if step < 2:
            graph.replay()
        else:
            opt.step()  # eager: makes the counter
        copy_into(eager_grads, values)
        eager.step()
        torch.cuda.synchronize()
        assert_same_run(opt, params, eager, eager_params, f"{case} {'replay' if step < 2 else 'eager'} {step + 1}")
    assert opt.__dict__.get("_finish_counters"), "the eager steps after the capture made no finish counter"
    assert all(float(opt.state[p]["step"]) == 6 for p in params)


def test_captured_step_follows_lr_filled_between_replays():
    """lr.fill_ between replays (what every scheduler does) changes the next replay's update size."""
    (p,) = make_params([(1000,)], torch.float32, make_generator(5), device=CUDA)
    (g,) = attach_grads([p])
    g.fill_(1.0)
    opt = go.SGD([p], lr=0.1)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            opt.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    for lr in (0.5, 0.0, 2.0):
        opt.param_groups[0]["lr"].fill_(lr)
        before = p.detach().clone()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.allclose(before - p.detach(), torch.full_like(before, lr), rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------------------------------------
# An invalid lr in the lr tensor
# --------------------------------------------------------------------------------------------------------


def _stepped_once_on_cuda(case, state_bits, seed):
    gen = make_generator(seed)
    params = make_params(SHAPES, torch.float32, gen, device=CUDA, offsets=OFFSETS)
    grads = attach_grads(params, OFFSETS)
    opt = make_optimizer(case, params, state_bits=state_bits, min_8bit_size=0)
    copy_into(grads, draw_grads(params, torch.float32, gen))
    opt.step()
    copy_into(grads, draw_grads(params, torch.float32, gen))
    torch.cuda.synchronize()
    return opt, params, grads, gen


def _assert_unchanged(opt, params, before, what):
    for i, (p, (p_before, states_before)) in enumerate(zip(params, before)):
        assert_bitwise_equal(p.detach(), p_before, f"{what}: param {i}")
        for k, v in state_tensors(opt, p).items():
            assert_bitwise_equal(v, states_before[k], f"{what}: param {i} state {k}")


@pytest.mark.parametrize("state_bits", [32, 16, 8])
@pytest.mark.parametrize("bad", [float("nan"), -1.0], ids=["nan", "-1"])
@pytest.mark.parametrize("case", OPTIM_CASE_NAMES)
def test_invalid_lr_in_the_lr_tensor_on_cuda_writes_nothing_and_is_reported(case, bad, state_bits):
    skip_unless_storable(case, state_bits)
    graphsafe.check_errors()  # nothing pending from before
    opt, params, _, _ = _stepped_once_on_cuda(case, state_bits, stable_seed("invalid lr", case, state_bits))
    before = snapshot_states(opt, params)
    lr = opt.param_groups[0]["lr"]
    lr.fill_(bad)
    opt.step()  # no host read of lr: nothing can be raised here
    with pytest.raises(ValueError, match="invalid learning rate") as info:
        graphsafe.check_errors()
    assert not isinstance(info.value, IndexError)
    graphsafe.check_errors()  # reported once
    _assert_unchanged(opt, params, before, f"{case} {state_bits}-bit, lr {bad}")
    lr.fill_(0.01)
    opt.step()
    torch.cuda.synchronize()
    graphsafe.check_errors()
    assert all(float(opt.state[p]["step"]) == 2 for p in params), "the step after the refused one did not count"


@pytest.mark.parametrize("state_bits", [32, 8])
@pytest.mark.parametrize("case", ["AdamW", "SGD", "Lion", "LAMB", "LARS"])
def test_invalid_lr_filled_between_replays_of_a_captured_step_writes_nothing(case, state_bits):
    graphsafe.check_errors()
    opt, params, _, _ = _stepped_once_on_cuda(case, state_bits, stable_seed("invalid lr graph", case, state_bits))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            opt.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    torch.cuda.synchronize()
    lr = opt.param_groups[0]["lr"]
    for replay, value in enumerate([0.01, float("nan"), -0.5, 0.02]):
        lr.fill_(value)
        before = snapshot_states(opt, params)
        graph.replay()
        torch.cuda.synchronize()
        if value >= 0:
            graphsafe.check_errors()
            assert not torch.equal(params[-1].detach(), before[-1][0]), f"replay {replay + 1} with lr {value} did not step"
        else:
            with pytest.raises(ValueError, match="invalid learning rate"):
                graphsafe.check_errors()
            _assert_unchanged(opt, params, before, f"{case} {state_bits}-bit replay {replay + 1}, lr {value}")
    assert all(float(opt.state[p]["step"]) == 5 for p in params)
