"""bf16 optimizer states (state_bits=16), on every algorithm.

The 16-bit step is the 32-bit step (checked against torch.optim and the papers' formulas in test_optim_*.py)
with its states stored in bf16: each state is widened to fp32, updated by the same rule, and rounded to
nearest even once. So the references here are:
* the 32-bit step itself, run on the 16-bit optimizer's states widened, its new states rounded by torch's
  .to(torch.bfloat16): bitwise equal, 20 steps, every algorithm (conftest.optim_cases()), fp32 and bf16
  parameters, sizes that are not multiples of the vector width and unaligned pointers, scattered zeros with
  skip_zeros on;
* torch's fused AdamW, Adam, SGD and Adagrad, which keep bf16 parameters' states in bf16 and compute in fp32:
  within 2 bf16 ulps of the operands' magnitude (SGD on CUDA only: torch's fused CPU SGD is off on
  bf16; Adagrad on the CPU only: torch has no fused CUDA Adagrad);
* skip_zeros: skipped elements keep the parameter and every state bit-identical (raw bits: a NaN state's
  payload too), with weight decay on;
* storage changes: state_bits set from 32 to 16 between steps rounds the states, from 16 to 32 widens them
  (as load_state_dict into an optimizer of the new storage does), load_state_dict converts 16 <-> 8 <-> 32, and
  a 16-bit state_dict round-trips exactly; state_bytes halves.
* CUDA (skipped without a GPU): each of 10 steps from the same start within 1 bf16 ulp of the CPU (LAMB/LARS
  sum their norms in another order), and the captured step == eager bitwise.
"""

from __future__ import annotations

import pytest
import torch

import graphsafe.optim as go
from conftest import (
    per_tensor_keys,
    OPTIM_CASE_NAMES,
    assert_bitwise_equal,
    make_generator,
    make_optimizer,
    make_params,
    random_grad,
    requires_cuda,
    state_tensors,
)

SHAPES = [(1,), (3,), (37,), (16, 33), (4096 + 5,), (2, 4096)]
OFFSETS = [0, 1, 1, 0, 2, 0]


def unquantized_states(opt, p):
    return {k: v for k, v in state_tensors(opt, p).items() if k not in per_tensor_keys(opt)}


def grads_with_zeros(params, gen, zero_fraction=0.2):
    out = []
    for p in params:
        g = random_grad(p.shape, p.dtype, gen)
        g[torch.rand(p.shape, generator=gen) < zero_fraction] = 0.0
        out.append(g.to(p.device))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", OPTIM_CASE_NAMES)
def test_16bit_step_is_the_32bit_step_with_states_rounded_to_bf16(case, dtype):
    gen = make_generator(1600)
    params16 = make_params(SHAPES, dtype, gen, offsets=OFFSETS)
    params32 = [torch.nn.Parameter(p.detach().clone()) for p in params16]
    opt16 = make_optimizer(case, params16, state_bits=16, skip_zeros=True)
    opt32 = make_optimizer(case, params32, skip_zeros=True)
    # A first step of zero gradients (all skipped) makes the states; the reference then starts from the 16-bit
    # ones widened (Adagrad's initial_accumulator_value 0.1 is not a bf16 value: rounded once, at creation).
    for p16, p32 in zip(params16, params32):
        p16.grad, p32.grad = torch.zeros_like(p16), torch.zeros_like(p32)
    opt16.step()
    opt32.step()
    for p16, p32 in zip(params16, params32):
        for name, value in unquantized_states(opt16, p16).items():
            assert_bitwise_equal(value, opt32.state[p32][name].to(torch.bfloat16), f"{case} initial {name}")
            opt32.state[p32][name].copy_(value)
    for step in range(1, 21):
        for p16, p32, g in zip(params16, params32, grads_with_zeros(params16, gen)):
            p16.grad, p32.grad = g, g.clone()
        opt16.step()
        opt32.step()
        for i, (p16, p32) in enumerate(zip(params16, params32)):
            what = f"{case} {dtype} step {step + 1} param {i}"
            assert_bitwise_equal(p16, p32, what)
            s16, s32 = unquantized_states(opt16, p16), unquantized_states(opt32, p32)
            assert s16.keys() == s32.keys() and s16, what
            for name in s16:
                assert s16[name].dtype == torch.bfloat16 and s32[name].dtype == torch.float32
                assert_bitwise_equal(s16[name], s32[name].to(torch.bfloat16), f"{what} {name}")
                s32[name].copy_(s16[name])  # the reference's next step starts from the stored bf16 values
            assert float(opt16.state[p16]["step"]) == step + 1


TORCH_FUSED = {
    "AdamW": (torch.optim.AdamW, go.AdamW, dict(lr=0.02, weight_decay=0.1)),
    "Adam": (torch.optim.Adam, go.Adam, dict(lr=0.02, weight_decay=0.1)),
    "SGD": (torch.optim.SGD, go.SGD, dict(lr=0.05, momentum=0.9, weight_decay=0.1)),
    "Adagrad": (torch.optim.Adagrad, go.Adagrad, dict(lr=0.05, weight_decay=0.1)),
}


def within_ulps(ours: torch.Tensor, theirs: torch.Tensor, scale: torch.Tensor, ulps: int = 2) -> bool:
    """|ours - theirs| <= `ulps` bf16 ulps (relative eps) of `scale`, per element."""
    eps = torch.finfo(torch.bfloat16).eps
    return bool(((ours.float() - theirs.float()).abs() <= ulps * eps * scale.float().abs()).all())


def largest(*tensors: torch.Tensor) -> torch.Tensor:
    out = tensors[0].detach().float().abs()
    for t in tensors[1:]:
        out = torch.maximum(out, t.detach().float().abs())
    return out


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_cuda)])
@pytest.mark.parametrize("name", list(TORCH_FUSED))
def test_16bit_states_match_torch_fused_on_bf16_parameters(name, device):
    """torch's fused steps keep a bf16 parameter's states in bf16, computed in fp32: the same storage. 10 steps,
    each from the same start (ours takes torch's parameter and states after each step): parameters and states
    within 2 bf16 ulps of the largest magnitude among the operands (the value before and after, and the
    gradient), where the two arithmetic forms round differently: torch's lerp for Adam's first moment against
    ours where it cancels to ~0; torch's fused CPU Adagrad rounds the decayed gradient to bf16 before squaring
    it (2 ulps of the sum on the first step). Compounded over steps, one such rounding moves the trajectory."""
    if device == "cpu" and name == "SGD":
        # torch 2.11's fused CPU SGD on bf16 parameters is 0.63 away from an fp64 reference of the same steps
        # rounded to bf16 after each step (3 steps, momentum 0.9, weight decay 0.1), where its single-tensor SGD
        # and ours are within 0.016 (one bf16 rounding): not a reference. CUDA's fused SGD is (the case below).
        pytest.skip("torch's fused CPU SGD disagrees with its own single-tensor SGD on bf16 parameters")
    if device == "cuda" and name == "Adagrad":  # its step raises: fused=True is for the CPU only
        pytest.skip("torch 2.11 has no fused Adagrad on CUDA")
    torch_cls, ours_cls, kw = TORCH_FUSED[name]
    gen = make_generator(1601)
    ours = make_params([(3000,)], torch.bfloat16, gen, device=device)
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    torch_opt = torch_cls(theirs, fused=True, **kw)
    our_opt = ours_cls(ours, state_bits=16, **kw)
    for step in range(10):
        g = random_grad((3000,), torch.bfloat16, gen).to(device)
        ours[0].grad, theirs[0].grad = g, g.clone()
        before = theirs[0].detach().clone()
        states_before = {k: v.clone() for k, v in torch_opt.state[theirs[0]].items() if k != "step"}
        our_opt.step()
        torch_opt.step()
        what = f"{name} on {device}, step {step + 1}"
        assert within_ulps(ours[0], theirs[0], largest(before, theirs[0], g)), what
        ours_states = unquantized_states(our_opt, ours[0])
        for key, value in torch_opt.state[theirs[0]].items():
            if key == "step":
                continue
            assert value.dtype == torch.bfloat16 and ours_states[key].dtype == torch.bfloat16, key
            scale = largest(value, states_before.get(key, value), g)
            assert within_ulps(ours_states[key], value, scale), f"{what} {key}"
            ours_states[key].copy_(value)  # the next step from the same start
        with torch.no_grad():
            ours[0].copy_(theirs[0])


NAN_PAYLOAD = 0x7F81  # a signalling-NaN bf16 pattern that any arithmetic would turn into another NaN


@pytest.mark.parametrize("count", [1, 3], ids=["alone", "at-once group"])
@pytest.mark.parametrize("case", OPTIM_CASE_NAMES)
def test_16bit_skipped_elements_keep_parameter_and_states_bit_identical(case, count):
    gen = make_generator(1602)
    params = make_params([(64, 40)] * count, torch.bfloat16, gen)
    opt = make_optimizer(case, params, state_bits=16, skip_zeros=True)
    for p in params:
        p.grad = random_grad((64, 40), torch.bfloat16, gen)
    opt.step()
    for p in params:
        for value in unquantized_states(opt, p).values():
            value.view(torch.int16)[5, 7] = NAN_PAYLOAD  # a skipped element's state: its raw bits must survive
    g = random_grad((64, 40), torch.bfloat16, gen)
    g[5] = 0.0
    g[::9] = -0.0
    g[:, 3] = 0.0
    skipped = g == 0
    before = [p.detach().clone() for p in params]
    states_before = [{k: v.clone() for k, v in unquantized_states(opt, p).items()} for p in params]
    for p in params:
        p.grad = g.clone()
    opt.step()
    for p, b, sb in zip(params, before, states_before):
        assert_bitwise_equal(p.detach()[skipped], b[skipped], f"{case} skipped params")
        assert (p.detach()[~skipped] != b[~skipped]).any(), f"{case}: nothing was updated"
        for key, value in unquantized_states(opt, p).items():
            assert_bitwise_equal(value[skipped], sb[key][skipped], f"{case} skipped {key}")
            assert int(value.view(torch.int16)[5, 7]) == NAN_PAYLOAD


@pytest.mark.parametrize("before,after", [(32, 16), (16, 32)])
def test_state_bits_changed_between_steps_converts_the_states(before, after):
    """A group's state_bits set between steps: the next step converts the states (rounded to bf16, or widened)
    and steps them, as an optimizer of the new storage that loaded the states (load_state_dict converts) does."""
    gen = make_generator(1603)
    params = make_params([(300,), (5000,)], torch.float32, gen)
    opt = go.AdamW(params, lr=0.01, state_bits=before)
    for _ in range(2):
        for p in params:
            p.grad = random_grad(p.shape, torch.float32, gen)
        opt.step()
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    reference = go.AdamW(copies, lr=0.01, state_bits=after)
    reference.load_state_dict(opt.state_dict())
    opt.param_groups[0]["state_bits"] = after
    for p, q in zip(params, copies):
        p.grad = random_grad(p.shape, torch.float32, gen)
        q.grad = p.grad.clone()
    opt.step()
    reference.step()
    for p, q in zip(params, copies):
        assert_bitwise_equal(p, q, "param")
        a, b = state_tensors(opt, p), state_tensors(reference, q)
        assert a.keys() == b.keys()
        for key in a:
            if key in per_tensor_keys(opt):  # step fp32, schedule values float64, whatever the storage
                assert a[key].dtype == (torch.float32 if key == "step" else torch.float64)
            else:
                assert a[key].dtype == (torch.bfloat16 if after == 16 else torch.float32)
            assert_bitwise_equal(a[key], b[key], key)


@pytest.mark.parametrize("other_bits", [32, 8])
def test_16bit_state_dict_round_trips_and_converts(other_bits):
    gen = make_generator(1604)
    params = make_params([(300,), (5000,)], torch.float32, gen)
    opt16 = go.Adam(params, state_bits=16, lr=0.01)
    for _ in range(3):
        for p in params:
            p.grad = random_grad(p.shape, torch.float32, gen)
        opt16.step()
    saved = opt16.state_dict()
    fresh = go.Adam([torch.nn.Parameter(p.detach().clone()) for p in params], state_bits=16, lr=0.01)
    fresh.load_state_dict(saved)
    for p, q in zip(params, fresh.param_groups[0]["params"]):
        a, b = state_tensors(opt16, p), state_tensors(fresh, q)
        assert a.keys() == b.keys()
        for key in a:
            assert_bitwise_equal(a[key], b[key], key)
    other = go.Adam([torch.nn.Parameter(p.detach().clone()) for p in params], state_bits=other_bits, lr=0.01,
                    min_8bit_size=0)
    other.load_state_dict(saved)
    back = go.Adam([torch.nn.Parameter(p.detach().clone()) for p in params], state_bits=16, lr=0.01)
    back.load_state_dict(other.state_dict())
    for p, q in zip(params, back.param_groups[0]["params"]):
        for key, value in unquantized_states(opt16, p).items():
            converted = back.state[q][key]
            assert converted.dtype == torch.bfloat16
            if other_bits == 32:  # bf16 -> fp32 -> bf16 is exact
                assert_bitwise_equal(converted, value, key)
            else:  # through the 8-bit map: within its error (a few percent of the block's largest value)
                assert (converted.float() - value.float()).abs().max() <= 0.05 * value.float().abs().max()


def test_16bit_states_take_half_the_memory():
    gen = make_generator(1605)
    params = make_params([(4096,)], torch.float32, gen)
    sizes = {}
    for bits in (32, 16):
        opt = go.AdamW([torch.nn.Parameter(p.detach().clone()) for p in params], state_bits=bits)
        for p in opt.param_groups[0]["params"]:
            p.grad = torch.ones_like(p)
        opt.step()
        sizes[bits] = go.state_bytes(opt) - 4  # less the fp32 step
    assert sizes[16] * 2 == sizes[32] == 2 * 4 * 4096


# ---- CUDA ----


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", OPTIM_CASE_NAMES)
def test_16bit_cuda_matches_cpu(case, dtype):
    """10 steps, each from the same start (the CPU takes CUDA's params and states after each): params and
    states within 1 bf16 ulp (fp32 params 1e-5 relative), at most 1 in 100 elements different. The element-wise
    arithmetic is the same fp32 code on both; LAMB/LARS sum their norms in another order."""
    gen = make_generator(1606)
    params_cpu = make_params(SHAPES, dtype, gen, offsets=OFFSETS)
    params_cuda = make_params(SHAPES, dtype, make_generator(1606), device="cuda", offsets=OFFSETS)
    opt_cpu = make_optimizer(case, params_cpu, state_bits=16, skip_zeros=True)
    opt_cuda = make_optimizer(case, params_cuda, state_bits=16, skip_zeros=True)
    for step in range(10):
        for c, h, g in zip(params_cuda, params_cpu, grads_with_zeros(params_cpu, gen)):
            h.grad, c.grad = g, g.cuda()
        opt_cpu.step()
        opt_cuda.step()
        torch.cuda.synchronize()
        for i, (c, h) in enumerate(zip(params_cuda, params_cpu)):
            what = f"{case} {dtype} step {step + 1} param {i}"
            pairs = [(c.detach().cpu(), h.detach())]
            pairs += [(opt_cuda.state[c][k].cpu(), v) for k, v in unquantized_states(opt_cpu, h).items()]
            for j, (a, b) in enumerate(pairs):
                a, b = a.float(), b.float()
                # fp32 params: 1e-5 relative; bf16 params and states: 1 ulp
                tol = 1e-5 if j == 0 and dtype == torch.float32 else torch.finfo(torch.bfloat16).eps
                assert ((a - b).abs() <= tol * b.abs().clamp_min(1e-30)).all(), what
                assert int((a != b).sum()) <= max(1, b.numel() // 100), what
            assert float(opt_cuda.state[c]["step"]) == step + 1
            with torch.no_grad():  # the next step starts from CUDA's values on both backends
                h.copy_(c.cpu())
            for k, v in unquantized_states(opt_cpu, h).items():
                v.copy_(opt_cuda.state[c][k].cpu())


@requires_cuda
@pytest.mark.parametrize("case", OPTIM_CASE_NAMES)
def test_16bit_captured_step_equals_eager(case):
    """The whole step captured in a CUDA graph and replayed 5 times == 5 eager steps on a copy, bitwise."""
    gen = make_generator(1607)
    params = make_params(SHAPES, torch.bfloat16, gen, device="cuda", offsets=OFFSETS)
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    grads = [g.cuda() for g in grads_with_zeros(params, gen)]
    for p, q, g in zip(params, copies, grads):
        p.grad, q.grad = g, g.clone()
    graphed = make_optimizer(case, params, state_bits=16, skip_zeros=True)
    eager = make_optimizer(case, copies, state_bits=16, skip_zeros=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            graphed.step()
            eager.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed.step()
    for _ in range(5):
        graph.replay()
        eager.step()
    torch.cuda.synchronize()
    for p, q in zip(params, copies):
        assert_bitwise_equal(p, q, f"{case} captured vs eager")
        a, b = state_tensors(graphed, p), state_tensors(eager, q)
        for key in a:
            assert_bitwise_equal(a[key], b[key], f"{case} captured vs eager {key}")
    assert float(graphed.state[params[0]]["step"]) == 3 + 5  # the warm-up steps and the replays
