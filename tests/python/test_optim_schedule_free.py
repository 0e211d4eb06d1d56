"""graphsafe.optim.AdamWScheduleFree against the schedulefree package's AdamWScheduleFree (the reference, run
with foreach=False on the CPU), its train()/eval() switching, storage widths, checkpoints and skip_zeros; on a
GPU, CUDA against the CPU and a captured step against eager steps."""

from __future__ import annotations

import copy

import pytest
import torch

import graphsafe
from conftest import assert_bitwise_equal, requires_cuda

schedulefree = pytest.importorskip("schedulefree", reason="the reference package (requirements-dev.txt)")

SF = graphsafe.optim.AdamWScheduleFree

# (warmup_steps, r, weight_lr_power, weight_decay): the package's defaults, then its other paths: a warm-up
# (lr_max grows), polynomial weights, unweighted averaging, weight decay taken at y.
OPTIONS = [(0, 0.0, 2.0, 0.0), (7, 0.5, 2.0, 0.01), (3, 0.0, 0.0, 0.1), (12, 1.0, 1.0, 0.0)]


def model(seed: int, dtype=torch.float32) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)).to(dtype)


def train_steps(net, opt, steps: int, seed: int, switch_every: int = 10, record=None):
    """`steps` steps of a small regression, with an eval() / train() round trip every `switch_every` steps;
    record (a list) gets the parameters as eval() left them (x) at each switch."""
    gen = torch.Generator().manual_seed(seed)
    dtype = next(net.parameters()).dtype
    opt.train()
    for step in range(steps):
        x = torch.randn(8, 12, generator=gen).to(dtype)
        y = torch.randn(8, 3, generator=gen).to(dtype)
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()
        if record is not None and (step + 1) % switch_every == 0:
            opt.eval()
            record.append([p.detach().clone() for p in net.parameters()])
            opt.train()


@pytest.mark.parametrize("warmup_steps,r,weight_lr_power,weight_decay", OPTIONS)
def test_matches_the_reference_package_over_50_steps_with_train_eval_switches(warmup_steps, r, weight_lr_power,
                                                                              weight_decay):
    options = dict(lr=0.01, betas=(0.9, 0.99), warmup_steps=warmup_steps, r=r, weight_lr_power=weight_lr_power,
                   weight_decay=weight_decay)
    net, ref = model(1), model(1)
    ours, theirs = [], []
    opt = SF(net.parameters(), **options)
    ref_opt = schedulefree.AdamWScheduleFree(ref.parameters(), foreach=False, **options)
    train_steps(net, opt, 50, seed=2, record=ours)
    train_steps(ref, ref_opt, 50, seed=2, record=theirs)
    assert len(ours) == 5
    # x (after eval) at every switch, and y at the end: the same arithmetic but for lr's fp32 rounding and the
    # package's fused lerp; 50 steps keep them within a few ulps of the parameters' scale.
    for x_ours, x_theirs in zip(ours, theirs):
        for a, b in zip(x_ours, x_theirs):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(opt.state[p]["z"], ref_opt.state[q]["z"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(opt.state[p]["exp_avg_sq"], ref_opt.state[q]["exp_avg_sq"], rtol=1e-5, atol=1e-9)
        # The package's group sums (Python floats, with lr in double) against ours (per parameter, on the device,
        # from lr's fp32 value).
        group = ref_opt.param_groups[0]
        assert float(opt.state[p]["weight_sum"]) == pytest.approx(group["weight_sum"], rel=1e-6)
        assert float(opt.state[p]["lr_max"]) == pytest.approx(group["lr_max"], rel=1e-6)
        assert float(opt.state[p]["step"]) == group["k"]


def test_param_groups_with_their_own_options_match_the_reference():
    net, ref = model(3), model(3)

    def groups(m):
        return [{"params": m[0].parameters(), "lr": 0.02, "warmup_steps": 4},
                {"params": m[2].parameters(), "weight_decay": 0.05, "betas": (0.8, 0.999)}]

    opt = SF(groups(net), lr=0.005)
    ref_opt = schedulefree.AdamWScheduleFree(groups(ref), lr=0.005, foreach=False)
    train_steps(net, opt, 20, seed=4)
    train_steps(ref, ref_opt, 20, seed=4)
    opt.eval()
    ref_opt.eval()
    for a, b in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_bf16_parameters_and_16_bit_states_follow_the_reference():
    """bf16 parameters with bf16 states (state_bits=16, the package keeps states in the parameter's dtype) and
    fp32 parameters with bf16 states: to bf16's precision."""
    for dtype, state_bits in ((torch.bfloat16, 16), (torch.float32, 16)):
        net, ref = model(5, dtype), model(5, dtype)
        opt = SF(net.parameters(), lr=0.01, state_bits=state_bits)
        ref_opt = schedulefree.AdamWScheduleFree(ref.parameters(), lr=0.01, foreach=False)
        train_steps(net, opt, 20, seed=6)
        train_steps(ref, ref_opt, 20, seed=6)
        for p in net.parameters():
            assert opt.state[p]["z"].dtype == torch.bfloat16
        for a, b in zip(net.parameters(), ref.parameters()):
            torch.testing.assert_close(a.float(), b.float(), rtol=0.03, atol=0.02)


def test_train_and_eval_move_the_parameters_as_the_reference_does():
    net = model(7)
    opt = SF(net.parameters(), lr=0.01)
    train_steps(net, opt, 5, seed=8)
    y = [p.detach().clone() for p in net.parameters()]
    opt.train()  # already in train mode: nothing moves
    for a, b in zip(net.parameters(), y):
        assert_bitwise_equal(a, b)
    opt.eval()
    for p, y_p in zip(net.parameters(), y):
        z = opt.state[p]["z"]
        # x = lerp(y, z, 1 - 1/beta1), torch's formula for |weight| < 0.5, each operation rounded once
        expected = y_p + (z - y_p) * (1.0 - 1.0 / 0.9)
        assert_bitwise_equal(p.detach(), expected)
    opt.eval()  # already in eval mode: nothing moves
    opt.train()
    for a, b in zip(net.parameters(), y):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)  # y back, to rounding


def test_a_step_in_eval_mode_raises_and_changes_nothing():
    net = model(9)
    opt = SF(net.parameters())
    net(torch.randn(2, 12)).sum().backward()
    before = [p.detach().clone() for p in net.parameters()]
    with pytest.raises(RuntimeError, match=r"eval mode.*optimizer\.train\(\)"):
        opt.step()  # constructed in eval mode, as the package is
    for a, b in zip(net.parameters(), before):
        assert_bitwise_equal(a, b)
    assert not opt.state
    opt.train()
    opt.step()
    opt.eval()
    with pytest.raises(RuntimeError, match="eval mode"):
        opt.step()


def test_8_bit_states_are_refused_with_the_reason():
    with pytest.raises(ValueError, match=r"state_bits=8 .*'z' can be stored in 32 or 16 bits only"):
        SF(model(0).parameters(), state_bits=8)
    opt = SF(model(0)[0].parameters())
    with pytest.raises(ValueError, match="state_bits=8"):
        opt.add_param_group({"params": model(1)[2].parameters(), "state_bits": 8})
    assert len(opt.param_groups) == 1
    # set on a group by hand: refused at the step, before anything changes
    net = model(2)
    opt = SF(net.parameters())
    opt.train()
    net(torch.randn(2, 12)).sum().backward()
    opt.param_groups[0]["state_bits"] = 8
    with pytest.raises(ValueError, match="state_bits=8"):
        opt.step()
    assert not opt.state


def test_invalid_options_are_refused():
    params = list(model(0).parameters())
    for kwargs, pattern in [({"warmup_steps": -1}, "warmup_steps"), ({"r": float("nan")}, r"\br\b"),
                            ({"weight_lr_power": -2.0}, "weight_lr_power"), ({"betas": (0.0, 0.999)}, r"betas\[0\]"),
                            ({"betas": (0.9, 1.0)}, r"betas\[1\]"), ({"eps": -1e-8}, "eps")]:
        with pytest.raises(ValueError, match=pattern):
            SF(params, **kwargs)


def test_checkpoint_resume_continues_bitwise():
    """Saved in eval mode (as the package recommends) and loaded into a new optimizer, training continues
    exactly as without the interruption."""
    net, other = model(11), model(11)
    opt = SF(net.parameters(), lr=0.01, warmup_steps=5)
    train_steps(net, opt, 8, seed=12)
    opt.eval()
    saved_model, saved_opt = copy.deepcopy(net.state_dict()), copy.deepcopy(opt.state_dict())
    assert {"z", "exp_avg_sq", "weight_sum", "lr_max", "step"} <= set(saved_opt["state"][0])
    opt.train()
    train_steps(net, opt, 6, seed=13)

    other.load_state_dict(saved_model)
    resumed = SF(other.parameters(), lr=0.01, warmup_steps=5)
    resumed.load_state_dict(saved_opt)
    assert resumed.param_groups[0]["train_mode"] is False
    train_steps(other, resumed, 6, seed=13)  # (train() first)
    for a, b in zip(net.parameters(), other.parameters()):
        assert_bitwise_equal(a, b)


def test_a_checkpoint_without_the_schedule_is_refused():
    net = model(0)
    opt = SF(net.parameters())
    train_steps(net, opt, 1, seed=0)
    saved = opt.state_dict()
    del saved["state"][0]["weight_sum"]
    fresh = SF(model(0).parameters())
    with pytest.raises(ValueError, match="has no 'weight_sum'"):
        fresh.load_state_dict(saved)
    assert not fresh.state


def test_skip_zeros_leaves_zero_gradient_elements_bit_identical():
    w = torch.nn.Parameter(torch.randn(64, 32))
    opt = SF([w], lr=0.01, weight_decay=0.1, skip_zeros=True)
    opt.train()
    gen = torch.Generator().manual_seed(3)
    w.grad = torch.randn(64, 32, generator=gen)
    opt.step()  # every element has a state now
    rows = torch.arange(64) % 3 == 0
    kept = w.detach().clone()
    states = {k: v.clone() for k, v in opt.state[w].items() if k in ("z", "exp_avg_sq")}
    for _ in range(3):
        grad = torch.randn(64, 32, generator=gen)
        grad[rows] = 0.0
        w.grad = grad
        opt.step()
    assert_bitwise_equal(w.detach()[rows], kept[rows])
    for key, value in states.items():
        assert_bitwise_equal(opt.state[w][key][rows], value[rows])
    assert not torch.equal(w.detach()[~rows], kept[~rows])


# --------------------------------------------------------------------------------------------------------
# CUDA
# --------------------------------------------------------------------------------------------------------


@requires_cuda
@pytest.mark.parametrize("state_bits", [32, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_matches_the_cpu(dtype, state_bits):
    """The same rule on both backends (no contraction, IEEE square root and division); the weight sums' double
    powers may differ in a last bit between the GPU's and the host's libm, so to tolerance."""
    nets = {device: model(21, dtype).to(device) for device in ("cpu", "cuda")}
    opts = {device: SF(net.parameters(), lr=0.01, warmup_steps=4, r=0.5, weight_decay=0.01, state_bits=state_bits)
            for device, net in nets.items()}
    gen = torch.Generator().manual_seed(22)
    for device in nets:
        opts[device].train()
    for step in range(12):
        x, y = torch.randn(8, 12, generator=gen).to(dtype), torch.randn(8, 3, generator=gen).to(dtype)
        for device, net in nets.items():
            opts[device].zero_grad()
            torch.nn.functional.mse_loss(net(x.to(device)), y.to(device)).backward()
            opts[device].step()
        if step % 5 == 4:
            for device in nets:
                opts[device].eval()
            for a, b in zip(nets["cpu"].parameters(), nets["cuda"].parameters()):
                torch.testing.assert_close(a, b.cpu(), rtol=1e-5, atol=1e-6)
            for device in nets:
                opts[device].train()
    for a, b in zip(nets["cpu"].parameters(), nets["cuda"].parameters()):
        torch.testing.assert_close(a, b.cpu(), rtol=1e-5, atol=1e-6)


@requires_cuda
def test_cuda_captured_step_equals_eager_bitwise():
    """One step captured after three warm-up steps (which make the states) and replayed ten times, with a
    scheduler changing lr between steps (the weight sums advance on the device at every replay), against eager
    steps on the same gradients: the same bits, then eval() on both."""
    gen = torch.Generator().manual_seed(32)
    shapes = [(300, 7), (4099,), (1,)]
    start = [torch.randn(shape, generator=gen) for shape in shapes]
    params = [torch.nn.Parameter(t.cuda()) for t in start]
    eager_params = [torch.nn.Parameter(t.cuda()) for t in start]
    opt, eager = (SF(ps, lr=0.01, warmup_steps=5, r=0.5, weight_decay=0.01) for ps in (params, eager_params))
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5) for o in (opt, eager)]
    for p in params + eager_params:
        p.grad = torch.zeros_like(p)
    opt.train()
    eager.train()

    def draw():
        return [torch.randn(shape, generator=gen).cuda() for shape in shapes]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    warmup = [draw() for _ in range(3)]
    with torch.cuda.stream(side):
        for grads in warmup:
            for p, g in zip(params, grads):
                p.grad.copy_(g)
            opt.step()
    torch.cuda.current_stream().wait_stream(side)
    for grads in warmup:
        for p, g in zip(eager_params, grads):
            p.grad.copy_(g)
        eager.step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    torch.cuda.synchronize()
    assert all(float(opt.state[p]["step"]) == 3 for p in params), "capturing must not run the step"
    for _ in range(10):
        grads = draw()
        for p, q, g in zip(params, eager_params, grads):
            p.grad.copy_(g)
            q.grad.copy_(g)
        graph.replay()
        eager.step()
        for sched in scheds:
            sched.step()
    torch.cuda.synchronize()
    for p, q in zip(params, eager_params):
        assert_bitwise_equal(p, q)
        for key in ("z", "exp_avg_sq", "weight_sum", "lr_max", "step"):
            assert_bitwise_equal(opt.state[p][key], eager.state[q][key])
    assert float(opt.state[params[0]]["step"]) == 13
    opt.eval()
    eager.eval()
    for p, q in zip(params, eager_params):
        assert_bitwise_equal(p, q)
