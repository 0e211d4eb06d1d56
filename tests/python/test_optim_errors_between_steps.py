"""Parameters, gradients, states and options changed by hand between steps of graphsafe's optimizers (CPU): bad
input in a group the at-once gathering would take, parameters and states replaced or changed in place (another
dtype, size, layout or address), a block_size edited in group and state, storage changes (old states freed,
state_bits given as a float), an lr set by hand in another form. A rejected step raises a clear error and
changes nothing, on both gathering paths (one parameter: per parameter; several: at once)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import graphsafe.optim as go
from conftest import assert_bitwise_equal, make_generator, make_params, random_grad, set_grad_any_dtype


def _bad_sparse(p):
    p.grad = torch.randn(8).to_sparse()


def _bad_dtype(p):
    set_grad_any_dtype(p, torch.randn(8, dtype=torch.float64))


def _bad_complex(p):
    set_grad_any_dtype(p, torch.randn(8, dtype=torch.complex64))


def _bad_shape(p):
    p.grad.data = torch.randn(4)  # bypasses torch's own shape check on assignment


def _bad_same_numel_shape(p):
    p.grad.data = torch.randn(2, 4)  # the same number of elements, another shape


def _non_contiguous_param(p):
    p.data = torch.randn(8, 2)[:, 0]  # the step updates parameters in place: they must be contiguous


def assert_step_rejected(opt, params, error, match, what="a rejected step"):
    """opt.step() raises `error` matching `match` and changes nothing: every parameter and every state tensor keep
    their bits."""
    before = [p.detach().clone() for p in params]
    states = [{k: v.clone() for k, v in opt.state[p].items() if isinstance(v, torch.Tensor)} for p in params]
    with pytest.raises(error, match=match):
        opt.step()
    for p, b, saved in zip(params, before, states):
        assert_bitwise_equal(p, b, f"parameter after {what}")
        for key, value in saved.items():
            assert_bitwise_equal(opt.state[p][key], value, f"state {key} after {what}")


@pytest.mark.parametrize("spoil,error,match", [
    (_bad_sparse, RuntimeError, "sparse"), (_bad_dtype, TypeError, "dtype"), (_bad_complex, RuntimeError, "complex"),
    (_bad_shape, ValueError, "shape"), (_bad_same_numel_shape, ValueError, "shape"),
    (_non_contiguous_param, ValueError, "contiguous"),
], ids=lambda v: v.__name__.strip("_") if callable(v) else None)
@pytest.mark.parametrize("state_bits", [32, 8])
def test_bad_input_in_a_group_the_at_once_path_would_take(spoil, error, match, state_bits):
    """Groups of 2 or more parameters take the step's at-once gathering (test_optim_repeatability.py) when all is
    well; one bad gradient or parameter among them is not let through: the step raises the clear error and
    changes nothing, as it does for a parameter alone."""
    gen = make_generator(48)
    params = make_params([(8,)] * 5, torch.float32, gen)
    opt = go.AdamW(params, lr=0.1, state_bits=state_bits, min_8bit_size=0, block_size=32)
    for p in params:
        p.grad = random_grad((8,), torch.float32, gen)
    opt.step()  # states created: the next step would take the at-once path
    assert opt._prepare_group_at_once(opt.param_groups[0]) is not None
    spoil(params[3])
    assert_step_rejected(opt, params, error, match)


@pytest.mark.parametrize("change", ["transposed", "another dtype", "another address"])
def test_a_parameter_changed_in_place_after_at_once_steps_is_checked_again(change):
    """The at-once path reads its parameters' device again only when a parameter's dtype, shape or address
    changed (_params_checked_once); everything else it checks at every step. p.data = p.data.t() on a square
    matrix keeps the address, shape and dtype: still caught as non-contiguous. A parameter given another dtype or
    memory steps as a fresh optimizer of the same states would."""
    gen = make_generator(54)
    params = make_params([(6, 6), (6, 6), (10,)], torch.float32, gen)
    opt = go.SGD(params, lr=0.1, momentum=0.9)
    for _ in range(2):
        for p in params:
            p.grad = random_grad(tuple(p.shape), torch.float32, gen)
        opt.step()
    assert opt._prepare_group_at_once(opt.param_groups[0]) is not None  # the at-once path, its checks remembered
    victim = params[1]
    if change == "transposed":
        victim.data = victim.data.t()
        assert not victim.is_contiguous() and victim.data_ptr() == params[1].data_ptr()
        assert_step_rejected(opt, params, ValueError, "contiguous")
        return
    if change == "another dtype":
        victim.data = victim.data.to(torch.bfloat16)
    else:
        victim.data = victim.data.clone()
    victim.grad = random_grad((6, 6), victim.dtype, gen)
    reference = go.SGD([torch.nn.Parameter(victim.detach().clone())], lr=0.1, momentum=0.9)
    reference.param_groups[0]["params"][0].grad = victim.grad.clone()
    reference.load_state_dict({"state": {0: {k: v.clone() for k, v in opt.state[victim].items()}},
                               "param_groups": [dict(reference.state_dict()["param_groups"][0])]})
    opt.step()
    reference.step()
    assert_bitwise_equal(victim.detach(), reference.param_groups[0]["params"][0].detach(), change)


def test_a_parameter_replaced_by_a_smaller_one_with_fresh_states_steps_as_alone():
    """p.data replaced by a smaller tensor and its state dropped (so that the next step makes states of the new
    size): the at-once path must pass the new element count, not the one it read before (a cache keyed by the
    parameter object alone passed 1M elements for 1000: out of bounds)."""
    gen = make_generator(56)
    params = make_params([(1 << 20,), (300,), (300,)], torch.float32, gen)
    opt = go.SGD(params, lr=0.1, momentum=0.9)
    for p in params:
        p.grad = random_grad(tuple(p.shape), torch.float32, gen)
    opt.step()
    opt.step()  # the at-once path, its parameters' checks remembered
    victim = params[0]
    victim.data = random_grad((1000,), torch.float32, gen)
    victim.grad = random_grad((1000,), torch.float32, gen)
    del opt.state[victim]
    alone = go.SGD([torch.nn.Parameter(victim.detach().clone())], lr=0.1, momentum=0.9)
    alone.param_groups[0]["params"][0].grad = victim.grad.clone()
    for _ in range(2):
        opt.step()
        alone.step()
    assert_bitwise_equal(victim.detach(), alone.param_groups[0]["params"][0].detach(), "the replaced parameter")
    assert opt.state[victim]["momentum_buffer"].shape == (1000,)


@pytest.mark.parametrize("count", [1, 5], ids=["alone", "at-once group"])
@pytest.mark.parametrize("state_bits", [32, 16])
def test_a_state_viewed_in_place_as_another_dtype_is_rejected(count, state_bits):
    """A state's .data replaced by a view of its own bytes as another dtype keeps the tensor object and its
    address (all the state check's cache compares): the step still sees the other dtype and shape, and raises
    the state's ValueError, changing nothing, on both gathering paths."""
    gen = make_generator(57)
    params = make_params([(64,)] * count, torch.float32, gen)
    opt = go.AdamW(params, lr=0.1, state_bits=state_bits)
    for _ in range(2):
        for p in params:
            p.grad = random_grad((64,), torch.float32, gen)
        opt.step()
    state = opt.state[params[-1]]
    other = torch.bfloat16 if state_bits == 32 else torch.float32
    address = state["exp_avg"].data_ptr()
    state["exp_avg"].data = state["exp_avg"].data.view(other)
    assert state["exp_avg"].data_ptr() == address
    assert_step_rejected(opt, params, ValueError, "exp_avg")


@pytest.mark.parametrize("count", [1, 5], ids=["alone", "at-once group"])
@pytest.mark.parametrize("state_bits", [32, 16, 8])
def test_a_state_replaced_by_hand_in_another_form_is_rejected(count, state_bits):
    """The core writes states through raw addresses: a state tensor replaced by hand with another dtype, size
    or layout (or not a tensor) would be read and written out of bounds. The step raises a ValueError naming
    the state and changes nothing; once a tensor of the right form is back, it steps again. Checked on both
    gathering paths (one parameter: per parameter; five: at once, which checks again only replaced tensors)."""
    gen = make_generator(49)
    params = make_params([(40,)] * count, torch.float32, gen)
    opt = go.AdamW(params, lr=0.1, state_bits=state_bits, min_8bit_size=0, block_size=32)
    for _ in range(2):
        for p in params:
            p.grad = random_grad((40,), torch.float32, gen)
        opt.step()
    victim = opt.state[params[-1]]
    codes = {8: torch.uint8, 16: torch.bfloat16, 32: torch.float32}[state_bits]
    bad = {
        # (a bf16 exp_avg under state_bits=32 is the other storage's form: converted, test_optim_16bit.py)
        "exp_avg": [torch.zeros(40, dtype=torch.float16), torch.zeros(39, dtype=codes),
                    torch.zeros(80, dtype=codes)[::2], 0.0],
        "step": [torch.zeros(1), torch.zeros((), dtype=torch.float64), 3],
    }
    if state_bits == 8:
        bad["exp_avg_sq_absmax"] = [torch.zeros(1), torch.zeros(2, dtype=torch.float64)]
    for key, values in bad.items():
        good = victim[key]
        for value in values:
            victim[key] = value
            assert_step_rejected(opt, params, ValueError, f"state '{key}'", f"a step rejected for {key}")
        victim[key] = good.clone()  # the right form, a new tensor: accepted
        opt.step()
    assert float(opt.state[params[0]]["step"]) == 2 + len(bad)


@pytest.mark.parametrize("count", [1, 5], ids=["alone", "at-once group"])
@pytest.mark.parametrize("state_bits", [32, 16, 8])
def test_a_parameter_replaced_by_one_of_another_size_is_rejected(count, state_bits):
    """A parameter's .data replaced by a larger tensor (and a gradient to match) after its states were made:
    the old states are too small for it, and a step would write past their end (the at-once path, whose state
    check is skipped while the state tensors are the ones checked before, did: a segmentation fault). The step
    raises the state's ValueError and changes nothing, on both gathering paths."""
    gen = make_generator(50)
    params = make_params([(300,)] * count, torch.float32, gen)
    opt = go.SGD(params, lr=0.1, momentum=0.9, state_bits=state_bits, min_8bit_size=0, block_size=32)
    for _ in range(2):
        for p in params:
            p.grad = random_grad((300,), torch.float32, gen)
        opt.step()
    victim = params[-1]
    victim.data = random_grad((1 << 16,), torch.float32, gen)
    victim.grad = random_grad((1 << 16,), torch.float32, gen)
    assert_step_rejected(opt, params, ValueError, "state 'momentum_buffer'")


@pytest.mark.parametrize("count", [1, 5], ids=["alone", "at-once group"])
@pytest.mark.parametrize("change", ["data", "resize"])
def test_a_state_changed_in_place_to_another_size_is_rejected(count, change):
    """A state tensor changed in place (`.data = ...`, a growing `resize_`, here via a smaller size first) is the
    same object: the state check's cache also compares each tensor's address, which such a change moves, so the
    step sees it and raises instead of writing 100000 elements into 10 (a heap corruption once, for a
    one-parameter group)."""
    gen = make_generator(51)
    params = make_params([(100000,)] * count, torch.float32, gen)
    opt = go.SGD(params, lr=0.1, momentum=0.9)
    for _ in range(2):
        for p in params:
            p.grad = random_grad((100000,), torch.float32, gen)
        opt.step()
    buffer = opt.state[params[-1]]["momentum_buffer"]
    if change == "data":
        buffer.data = torch.zeros(10)
    else:  # shrinking keeps the memory; set_ to a small storage, then grown: new memory, still too small
        buffer.set_(torch.zeros(4))
        buffer.resize_(10)
    assert_step_rejected(opt, params, ValueError, "state 'momentum_buffer'")


def test_a_block_size_edited_by_hand_in_group_and_state_is_rejected():
    """block_size set by hand in the group and in every 8-bit state (so that no conversion is asked for): the
    absmax tensors hold the old block count, too few for the new size; the step raises instead of writing
    past them (the state check's cache compares the block size too)."""
    gen = make_generator(52)
    params = make_params([(5000,)] * 3, torch.float32, gen)
    opt = go.AdamW(params, lr=0.1, state_bits=8, block_size=512)
    for p in params:
        p.grad = random_grad((5000,), torch.float32, gen)
    opt.step()
    opt.param_groups[0]["block_size"] = 256
    for p in params:
        opt.state[p]["block_size"] = 256
    with pytest.raises(ValueError, match="absmax"):
        opt.step()


@pytest.mark.parametrize("count", [1, 5], ids=["alone", "at-once group"])
@pytest.mark.parametrize("before,after", [(32, 16), (32, 8), (16, 32)])
def test_converted_states_are_freed(count, before, after):
    """After a storage change (state_bits set between steps), the old state tensors are not kept alive (the state
    check's cache held them once, undoing the memory a smaller storage saves)."""
    gen = make_generator(53)
    params = make_params([(5000,)] * count, torch.float32, gen)
    opt = go.AdamW(params, lr=0.1, state_bits=before, min_8bit_size=0)
    for _ in range(2):
        for p in params:
            p.grad = random_grad((5000,), torch.float32, gen)
        opt.step()
    old = [weakref.ref(opt.state[p]["exp_avg"]) for p in params]
    opt.param_groups[0]["state_bits"] = after
    opt.step()
    opt.step()
    gc.collect()
    assert all(ref() is None for ref in old), "old states still alive"


def test_state_bits_given_as_a_float_steps_as_its_int():
    gen = make_generator(54)
    for bits in (32.0, 16.0):
        params = make_params([(300,)] * 2, torch.float32, gen)
        opt = go.AdamW(params, lr=0.1, state_bits=bits)
        for p in params:
            p.grad = random_grad((300,), torch.float32, gen)
        opt.step()
        opt.step()
        assert float(opt.state[params[0]]["step"]) == 2.0


@pytest.mark.parametrize("lr", [torch.tensor(0.1, dtype=torch.float64), torch.tensor(0.1, dtype=torch.bfloat16),
                                torch.tensor([0.1]), 0.1], ids=["fp64", "bf16", "shape (1,)", "float"])
def test_an_lr_set_by_hand_in_another_form_steps_as_its_value(lr):
    """The core reads one float32 at lr's address: an lr put into the group by hand as a float, or as a tensor
    of another dtype (a float64 one was read as 0, a bfloat16 one as -1.9e22), steps as its value would, and
    the group's lr is a float32 tensor of one element again (a float32 one of shape (1,) is kept: it is read
    in place, so its own fill_s keep working)."""
    gen = make_generator(50)
    (p,) = make_params([(16,)], torch.float32, gen)
    (q,) = make_params([(16,)], torch.float32, make_generator(50))
    g = random_grad((16,), torch.float32, gen)
    by_hand, reference = go.SGD([p], lr=1.0), go.SGD([q], lr=float(torch.as_tensor(lr).float()))
    by_hand.param_groups[0]["lr"] = lr
    p.grad, q.grad = g.clone(), g.clone()
    by_hand.step()
    reference.step()
    assert_bitwise_equal(p, q, "parameter")
    new_lr = by_hand.param_groups[0]["lr"]
    assert new_lr.dtype == torch.float32 and new_lr.numel() == 1
    if isinstance(lr, torch.Tensor) and lr.dtype == torch.float32:
        assert new_lr is lr
