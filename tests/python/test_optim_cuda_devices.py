"""graphsafe's optimizers with tensors on two devices (skipped without a GPU and graphsafe's CUDA backend):
state_dict between CUDA and the CPU (bf16 parameters within 2 ulps afterwards: a rounding that differs in one
step persists, optim_cuda_helpers explains the measure), a gradient left on the CPU rejected, a group moved to
the CPU by hand stepped there.
"""

from __future__ import annotations

import pytest
import torch

import graphsafe.optim as go
from conftest import (
    assert_bitwise_equal,
    assert_rel_close,
    assert_within_ulps,
    make_generator,
    make_optimizer,
    make_params,
    random_grad,
    requires_cuda,
    stable_seed,
    state_tensors,
)
from optim_cuda_helpers import CUDA, TOL, LargestMagnitude, attach_grads, copy_into, draw_grads

pytestmark = requires_cuda


@pytest.mark.parametrize("direction", ["cuda_to_cpu", "cpu_to_cuda"])
@pytest.mark.parametrize("case", ["Adam", "LAMB", "AdEMAMix"])
def test_state_dict_moves_between_devices(case, direction):
    src_dev, dst_dev = (CUDA, "cpu") if direction == "cuda_to_cpu" else ("cpu", CUDA)
    seed = stable_seed("sd", case, direction)
    params = make_params([(37,), (4096 + 5,)], torch.bfloat16, make_generator(seed), device=src_dev)
    grads = attach_grads(params)
    opt = make_optimizer(case, params)
    gen = make_generator(seed + 1)
    for _ in range(3):
        copy_into(grads, draw_grads(params, torch.bfloat16, gen))
        opt.step()
    opt.param_groups[0]["lr"].fill_(0.0125)
    moved = [torch.nn.Parameter(p.detach().to(dst_dev, copy=True)) for p in params]
    loaded = make_optimizer(case, moved)
    loaded.load_state_dict(opt.state_dict())
    lr = loaded.param_groups[0]["lr"]
    assert lr.device.type == torch.device(dst_dev).type and float(lr) == float(opt.param_groups[0]["lr"])
    for p, q in zip(params, moved):
        for k, v in state_tensors(loaded, q).items():
            assert v.device.type == torch.device(dst_dev).type and v.dtype == torch.float32
            assert_bitwise_equal(v, state_tensors(opt, p)[k], f"loaded {k}")
    moved_grads = attach_grads(moved)
    largest = LargestMagnitude([p.cpu() for p in params])
    for _ in range(3):
        values = draw_grads(params, torch.bfloat16, gen)
        copy_into(grads, values)
        copy_into(moved_grads, values)
        opt.step()
        loaded.step()
        largest.update([p.cpu() for p in params])
    torch.cuda.synchronize()
    for i, (p, q) in enumerate(zip(params, moved)):
        for k, v in state_tensors(loaded, q).items():
            if k != "step":
                assert_rel_close(v, state_tensors(opt, p)[k], TOL, f"{case} {direction} param {i} state {k}")
        # bf16 parameters: a rounding that differs in one step persists (see the module docstring)
        assert_within_ulps(q.detach().cpu(), p.detach().cpu(), 2, f"{case} {direction} param {i}",
                           scale=largest.values[i])


def _sgd_stepped_twice_on_cuda(count, gen):
    """count parameters of 300 elements on CUDA and an SGD with momentum that has stepped them twice (the second
    step took the path the next one will: at once for 2 or more, with its checks remembered)."""
    params = make_params([(300,)] * count, torch.float32, gen, device=CUDA)
    opt = go.SGD(params, lr=0.1, momentum=0.9)
    for _ in range(2):
        for p in params:
            p.grad = random_grad((300,), torch.float32, gen).to(CUDA)
        opt.step()
    return params, opt


@pytest.mark.parametrize("count", [1, 5], ids=["alone", "at-once group"])
def test_a_gradient_left_on_the_cpu_is_rejected(count):
    """A gradient left on the CPU while its parameter went back to CUDA (p.data = ..., as Module._apply does):
    the step raises its ValueError and changes nothing, on both gathering paths (the at-once path compares CUDA
    device indices, Tensor.get_device)."""
    gen = make_generator(55)
    params, opt = _sgd_stepped_twice_on_cuda(count, gen)
    victim = params[-1]
    victim.data = victim.data.cpu()
    victim.grad = random_grad((300,), torch.float32, gen)  # on the CPU, as its parameter is now
    victim.data = victim.data.to(CUDA)
    assert victim.is_cuda and not victim.grad.is_cuda
    before = [p.detach().cpu().clone() for p in params]
    states = [{k: v.cpu().clone() for k, v in opt.state[p].items()} for p in params]
    with pytest.raises(ValueError, match="gradient on cpu"):
        opt.step()
    for p, b, saved in zip(params, before, states):
        assert_bitwise_equal(p.detach().cpu(), b, "parameter after a rejected step")
        for key, value in saved.items():
            assert_bitwise_equal(opt.state[p][key].cpu(), value, f"state {key} after a rejected step")


@pytest.mark.parametrize("count", [1, 5], ids=["alone", "at-once group"])
def test_a_group_moved_to_the_cpu_by_hand_steps_on_the_cpu(count):
    """Parameters, gradients and states all moved to the CPU by hand between two steps (p.data = ..., the
    state entries replaced): the step runs on the CPU, as a CPU optimizer with those states would. The at-once
    path reads a parameter's device again when its address changed: a device remembered from the CUDA steps
    would hand CPU addresses to a CUDA kernel."""
    gen = make_generator(58)
    params, opt = _sgd_stepped_twice_on_cuda(count, gen)
    grads = [random_grad((300,), torch.float32, gen) for _ in params]
    for p, g in zip(params, grads):
        p.data = p.data.cpu()
        p.grad = g
        opt.state[p] = {k: v.cpu() for k, v in opt.state[p].items()}
    reference = go.SGD([torch.nn.Parameter(p.detach().clone()) for p in params], lr=0.1, momentum=0.9)
    for q, p, g in zip(reference.param_groups[0]["params"], params, grads):
        q.grad = g.clone()
        reference.state[q] = {k: v.clone() for k, v in opt.state[p].items()}
    opt.step()
    reference.step()
    for q, p in zip(reference.param_groups[0]["params"], params):
        assert not p.is_cuda
        assert_bitwise_equal(p.detach(), q.detach(), "parameter stepped on the CPU")
        assert_bitwise_equal(opt.state[p]["momentum_buffer"], reference.state[q]["momentum_buffer"], "momentum")
