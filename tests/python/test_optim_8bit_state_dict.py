"""8-bit optimizer states (state_bits=8) in checkpoints and conversions, on the CPU: state_dict round trips,
32 <-> 8-bit conversions (on load, and when state_bits or the options change between steps), state_bytes, and
incomplete checkpoints rejected on load.
"""

from __future__ import annotations

import io
import math

import pytest
import torch

import graphsafe.ops as ops
import graphsafe.optim as go
from conftest import assert_bitwise_equal, assert_same_run, make_generator
from optim_8bit_helpers import CASE_NAMES, MAPS, SIGNED, STATE_NAMES, dequantized_state, make_opt


# --------------------------------------------------------------------------------------------------------
# state_dict
# --------------------------------------------------------------------------------------------------------

SHAPES = [(40, 130), (37,)]  # 5200 elements (a partial last block) and a small one kept in fp32


def stepped(case, gen, steps, **extra):
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]
    opt = make_opt(case, params, **extra)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return opt, params


def saved(opt):
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def continue_both(opt_a, params_a, opt_b, params_b, gen, steps=3):
    for _ in range(steps):
        for a, b in zip(params_a, params_b):
            g = torch.randn(a.shape, generator=gen)
            a.grad, b.grad = g, g.clone()
        opt_a.step()
        opt_b.step()


@pytest.mark.parametrize("case", CASE_NAMES)
def test_state_dict_round_trip_8bit(case):
    gen = make_generator(600)
    opt, params = stepped(case, gen, 3, state_bits=8, block_size=128)
    sd = saved(opt)
    fresh = [torch.nn.Parameter(p.detach().clone()) for p in params]
    loaded = make_opt(case, fresh, state_bits=8, block_size=128, lr=0.5)
    loaded.load_state_dict(sd)
    assert_same_run(opt, params, loaded, fresh, f"{case}: loaded state")
    assert loaded.state[fresh[0]][STATE_NAMES[case][0]].dtype == torch.uint8
    continue_both(opt, params, loaded, fresh, gen)
    assert_same_run(opt, params, loaded, fresh, f"{case}: continued vs reloaded")


@pytest.mark.parametrize("case", ["AdamW", "SGD", "AdEMAMix"])
def test_load_32bit_state_dict_into_8bit_optimizer_quantises(case):
    gen = make_generator(601)
    opt32, params = stepped(case, gen, 3)
    sd = saved(opt32)
    fresh = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt8 = make_opt(case, fresh, state_bits=8, block_size=128)
    opt8.load_state_dict(sd)
    group = opt8.param_groups[0]
    for name in STATE_NAMES[case]:
        state = opt8.state[fresh[0]]
        assert state[name].dtype == torch.uint8, (
            f"{case} {name}: still {state[name].dtype} after loading into an 8-bit optimizer "
            f"(group state_bits is now {group['state_bits']}, block_size {group['block_size']})")
        codes, absmax = ops.quantize_blockwise(opt32.state[params[0]][name], 128, SIGNED[name])
        assert torch.equal(state[name], codes)
        assert_bitwise_equal(state[f"{name}_absmax"], absmax, f"{case} {name}: absmax")
        assert_bitwise_equal(dequantized_state(opt8, fresh[0], name),
                             ops.dequantize_blockwise(codes, absmax, 128, SIGNED[name]), f"{case} {name}: values")
    assert group["state_bits"] == 8 and group["block_size"] == 128


@pytest.mark.parametrize("case", ["AdamW", "SGD", "AdEMAMix"])
def test_load_8bit_state_dict_into_32bit_optimizer_dequantises(case):
    gen = make_generator(602)
    opt8, params = stepped(case, gen, 3, state_bits=8, block_size=128)
    sd = saved(opt8)
    fresh = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt32 = make_opt(case, fresh)
    opt32.load_state_dict(sd)
    group = opt32.param_groups[0]
    for name in STATE_NAMES[case]:
        state = opt32.state[fresh[0]]
        assert state[name].dtype == torch.float32, (
            f"{case} {name}: still {state[name].dtype} after loading into a 32-bit optimizer "
            f"(group state_bits is now {group['state_bits']})")
        s8 = opt8.state[params[0]]
        expected = ops.dequantize_blockwise(s8[name], s8[f"{name}_absmax"], 128, SIGNED[name])
        assert_bitwise_equal(state[name], expected, f"{case} {name}: dequantised on load")
    assert group["state_bits"] == 32


def strip_storage_options(sd):
    """A state_dict whose groups do not dictate the storage (as from a torch.optim optimizer or a graphsafe
    version before state_bits), so the loading optimizer's own state_bits/block_size apply."""
    for group in sd["param_groups"]:
        for key in ("state_bits", "block_size", "min_8bit_size"):
            group.pop(key)
    return sd


@pytest.mark.parametrize("case", CASE_NAMES)
def test_loaded_fp32_states_are_quantised_for_8bit_parameters(case):
    gen = make_generator(603)
    opt32, params = stepped(case, gen, 3)
    sd = strip_storage_options(saved(opt32))
    fresh = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt8 = make_opt(case, fresh, state_bits=8, block_size=128)
    opt8.load_state_dict(sd)
    big, small = fresh
    state = opt8.state[big]
    assert state["block_size"] == 128
    assert_bitwise_equal(state["step"], opt32.state[params[0]]["step"], f"{case}: step")
    for name in STATE_NAMES[case]:
        fp32 = opt32.state[params[0]][name]
        codes, absmax = ops.quantize_blockwise(fp32, 128, SIGNED[name])
        assert state[name].dtype == torch.uint8 and torch.equal(state[name], codes), f"{case} {name}: codes"
        assert_bitwise_equal(state[f"{name}_absmax"], absmax, f"{case} {name}: absmax")
        assert_bitwise_equal(state[f"{name}_qmap"], MAPS[SIGNED[name]], f"{case} {name}: map")
        assert_bitwise_equal(dequantized_state(opt8, big, name), ops.dequantize_blockwise(codes, absmax, 128, SIGNED[name]),
                             f"{case} {name}: values")
        # the small parameter stays fp32, unchanged
        assert_bitwise_equal(opt8.state[small][name], opt32.state[params[1]][name], f"{case} {name}: small param")
    continue_both(opt32, params, opt8, fresh, gen, steps=1)  # and stepping goes on
    assert float(opt8.state[big]["step"]) == 4


@pytest.mark.parametrize("case", CASE_NAMES)
def test_loaded_8bit_states_are_dequantised_for_fp32_parameters(case):
    gen = make_generator(604)
    opt8, params = stepped(case, gen, 3, state_bits=8, block_size=128)
    sd = strip_storage_options(saved(opt8))
    fresh = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt32 = make_opt(case, fresh)
    opt32.load_state_dict(sd)
    state = opt32.state[fresh[0]]
    assert set(state) == {"step", *STATE_NAMES[case]}
    for name in STATE_NAMES[case]:
        s8 = opt8.state[params[0]]
        expected = ops.dequantize_blockwise(s8[name], s8[f"{name}_absmax"], 128, SIGNED[name])
        assert_bitwise_equal(state[name], expected, f"{case} {name}: dequantised on load")


def test_torch_optim_state_dict_loads_into_8bit_optimizer():
    """A torch.optim.AdamW checkpoint (fp32 states, no graphsafe options) into an 8-bit AdamW: quantised."""
    gen = make_generator(605)
    p_torch = torch.nn.Parameter(torch.randn(5000, generator=gen))
    opt_torch = torch.optim.AdamW([p_torch], lr=1e-3)
    for _ in range(2):
        p_torch.grad = torch.randn(5000, generator=gen)
        opt_torch.step()
    p = torch.nn.Parameter(p_torch.detach().clone())
    opt = go.AdamW([p], lr=1e-3, state_bits=8)
    opt.load_state_dict(opt_torch.state_dict())
    for name in ("exp_avg", "exp_avg_sq"):
        codes, absmax = ops.quantize_blockwise(opt_torch.state[p_torch][name], 256, SIGNED[name])
        assert torch.equal(opt.state[p][name], codes) and torch.equal(opt.state[p][f"{name}_absmax"], absmax)


def test_changing_state_bits_between_steps_converts():
    """Setting a group's state_bits between steps converts the states at the next step."""
    gen = make_generator(606)
    p = torch.nn.Parameter(torch.randn(5000, generator=gen))
    opt = go.AdamW([p], state_bits=8)
    p.grad = torch.randn(5000, generator=gen)
    opt.step()
    opt.param_groups[0]["state_bits"] = 32
    p.grad = torch.randn(5000, generator=gen)
    opt.step()
    assert opt.state[p]["exp_avg"].dtype == torch.float32 and "exp_avg_absmax" not in opt.state[p]
    opt.param_groups[0]["state_bits"] = 8
    opt.param_groups[0]["block_size"] = 64
    p.grad = torch.randn(5000, generator=gen)
    opt.step()
    assert opt.state[p]["exp_avg"].dtype == torch.uint8 and opt.state[p]["exp_avg_absmax"].shape == (math.ceil(5000 / 64),)
    assert opt.state[p]["block_size"] == 64 and float(opt.state[p]["step"]) == 3


def test_state_bytes_8bit_adamw():
    n = 1_000_000
    gen = make_generator(607)
    g = torch.randn(n, generator=gen)
    p8, p32 = torch.nn.Parameter(torch.zeros(n)), torch.nn.Parameter(torch.zeros(n))
    opt8, opt32 = go.AdamW([p8], state_bits=8), go.AdamW([p32])
    p8.grad, p32.grad = g, g.clone()
    opt8.step()
    opt32.step()
    blocks = math.ceil(n / 256)
    # two 1-byte codes per element, two fp32 absmax per block, two 256-value fp32 maps, the fp32 step
    assert go.state_bytes(opt8) == 2 * n + 2 * 4 * blocks + 2 * 256 * 4 + 4
    assert go.state_bytes(opt32) == 8 * n + 4
    assert go.state_bytes(opt8) < 0.3 * go.state_bytes(opt32)


# --------------------------------------------------------------------------------------------------------
# Checkpoints rejected on load, options changed between steps (found in review)
# --------------------------------------------------------------------------------------------------------


def test_8bit_codes_without_their_scales_are_rejected_on_load():
    p = torch.nn.Parameter(torch.randn(5000))
    opt8 = go.Adam([p], state_bits=8)
    p.grad = torch.randn(5000)
    opt8.step()
    sd = opt8.state_dict()
    del sd["state"][0]["exp_avg_absmax"]
    with pytest.raises(ValueError, match="exp_avg_absmax"):
        go.Adam([torch.nn.Parameter(p.detach().clone())]).load_state_dict(sd)


@pytest.mark.parametrize("state_bits", [32, 8])
def test_a_checkpoint_missing_a_moment_is_rejected_on_load(state_bits):
    """A saved Adam state without exp_avg_sq is an incomplete checkpoint: a clear error, not a restart of the
    second moment from zeros at step 1000."""
    p = torch.nn.Parameter(torch.randn(5000))
    opt = go.Adam([p], state_bits=state_bits)
    p.grad = torch.randn(5000)
    opt.step()
    sd = opt.state_dict()
    for key in [k for k in sd["state"][0] if k.startswith("exp_avg_sq")]:
        del sd["state"][0][key]
    q = torch.nn.Parameter(p.detach().clone())
    fresh = go.Adam([q], lr=0.5, state_bits=state_bits)
    with pytest.raises(ValueError, match="has no 'exp_avg_sq'"):
        fresh.load_state_dict(sd)
    assert not fresh.state and float(fresh.param_groups[0]["lr"]) == 0.5, "a rejected load changed the optimizer"


@pytest.mark.parametrize("state_bits", [32, 8])
def test_changed_options_with_the_same_number_of_states_convert(state_bits):
    """RMSprop centered -> momentum keeps the state count but changes the names: the next step builds the
    missing state instead of failing with a KeyError."""
    p = torch.nn.Parameter(torch.randn(5000))
    opt = go.RMSprop([p], lr=1e-3, centered=True, state_bits=state_bits)
    p.grad = torch.randn(5000)
    opt.step()
    opt.param_groups[0]["centered"] = False
    opt.param_groups[0]["momentum"] = 0.9
    opt.step()
    assert "momentum_buffer" in opt.state[p]
