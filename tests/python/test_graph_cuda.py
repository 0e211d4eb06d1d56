"""graphsafe.graph on a GPU: captured steps against eager, and every capture-gate rule against a real capture.

Each gate rule is a claim about CUDA graph capture ("this op fails or syncs under capture", "this one is
fine"); the rule tests below check the claim with torch.cuda.graph directly, and check that the gate flags
(or passes) the same function traced with make_fx. Skipped without a GPU and graphsafe's CUDA backend.
"""

from __future__ import annotations

import logging
import statistics
import time

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import graphsafe
from graphsafe.graph import CaptureError, InputMismatchError, capture_gate, use_graphsafe_embeddings
from conftest import assert_bitwise_equal, make_generator, requires_cuda
from graph_helpers import ce_loss

pytestmark = requires_cuda

VOCAB, DIM, CLASSES = 4099, 64, 37


class EmbeddingModel(torch.nn.Module):
    def __init__(self, depth=1, padding_idx=3, scale_grad_by_freq=True):
        super().__init__()
        self.tokens = torch.nn.Embedding(VOCAB, DIM, padding_idx=padding_idx, scale_grad_by_freq=scale_grad_by_freq)
        self.extra = torch.nn.Embedding(VOCAB // 2, DIM)  # plain options too
        self.layers = torch.nn.ModuleList(torch.nn.Linear(DIM, DIM) for _ in range(depth))
        self.head = torch.nn.Linear(DIM, CLASSES)

    def forward(self, ids):
        h = self.tokens(ids) + self.extra(ids % (VOCAB // 2))
        for layer in self.layers:
            h = h + torch.tanh(layer(h))
        return self.head(h)


class PlantedHostRead(EmbeddingModel):
    def forward(self, ids):
        out = super().forward(ids)
        hot = (ids < 64).sum().item()  # a host read: the step cannot be captured whole
        return out * (1.0 + hot / 10000.0)


def make_batch(gen, batch=8, seq=32, padding_idx=3):
    ids = torch.randint(0, VOCAB, (batch, seq), generator=gen)
    ids[:, :4] = ids[0, 0]
    ids[:, -2:] = padding_idx
    return ids.cuda(), torch.randint(0, CLASSES, (batch, seq), generator=gen).cuda()


def eager_step(model, optimizer, batch):
    loss = ce_loss(model(batch[0]), batch[1])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


OPTIMIZERS = [
    ("AdamW", dict(lr=1e-2, weight_decay=0.1)),
    ("AdamW", dict(lr=1e-2, skip_zeros=True, state_bits=8, min_8bit_size=0)),
    ("SGD", dict(lr=0.1, momentum=0.9)),
    ("LAMB", dict(lr=1e-2, skip_zeros=True)),
    ("Lion", dict(lr=1e-3)),
]


@pytest.mark.parametrize("name, options", OPTIMIZERS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(OPTIMIZERS)])
def test_full_capture_equals_eager_bitwise(name, options, caplog):
    torch.manual_seed(0)
    model = EmbeddingModel().cuda()
    reference = use_graphsafe_embeddings(model)
    opt_cls = getattr(graphsafe.optim, name)
    optimizer, ref_optimizer = opt_cls(model.parameters(), **options), opt_cls(reference.parameters(), **options)
    caplog.set_level(logging.INFO, logger="graphsafe.graph")
    step = graphsafe.compile_step(model, ce_loss, optimizer)
    gen = make_generator(1)
    for i in range(10):
        batch = make_batch(gen)
        loss = step(batch)
        ref_loss = eager_step(reference, ref_optimizer, batch)
        assert_bitwise_equal(loss, ref_loss, f"loss at step {i}")
        for (n, p), r in zip(model.named_parameters(), reference.parameters()):
            assert_bitwise_equal(p, r, f"{n} after step {i}")
    assert step.mode == "full" and step.captured
    assert [r.getMessage() for r in caplog.records if "mode=" in r.getMessage()] == [
        f"graphsafe.graph: mode=full ({step.report.decision})"]
    for p, r in zip(model.parameters(), reference.parameters()):
        for key, value in optimizer.state[p].items():
            if isinstance(value, torch.Tensor):
                assert_bitwise_equal(value, ref_optimizer.state[r][key], f"state {key}")
    graphsafe.check_errors()


def _median_step_ms(fn, batches):
    times = []
    for batch in batches:
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn(batch)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def test_piecewise_host_read_equals_eager_and_is_faster():
    torch.manual_seed(1)
    model = PlantedHostRead(depth=12).cuda()
    reference = use_graphsafe_embeddings(model)
    optimizer = graphsafe.optim.AdamW(model.parameters(), lr=1e-3)
    ref_optimizer = graphsafe.optim.AdamW(reference.parameters(), lr=1e-3)
    step = graphsafe.compile_step(model, ce_loss, optimizer)
    gen = make_generator(2)
    for i in range(10):
        batch = make_batch(gen)
        assert_bitwise_equal(step(batch), eager_step(reference, ref_optimizer, batch), f"loss at step {i}")
        for p, r in zip(model.parameters(), reference.parameters()):
            assert_bitwise_equal(p, r, f"params after step {i}")
    assert step.mode == "piecewise" and step.captured
    assert {f.rule for f in step.report.gate.unsafe} >= {"host_read"}

    batches = [make_batch(gen) for _ in range(30)]
    piecewise_ms = _median_step_ms(step, batches)
    eager_ms = _median_step_ms(lambda b: eager_step(reference, ref_optimizer, b), batches)
    print(f"\npiecewise-captured step {piecewise_ms:.3f} ms, eager PyTorch step {eager_ms:.3f} ms "
          f"({eager_ms / piecewise_ms:.2f}x)")
    # Not strict: a launch-bound model (12 small layers) must simply not be slower when captured.
    assert piecewise_ms < eager_ms


def test_full_mode_with_unsafe_nodes_is_refused():
    model = PlantedHostRead().cuda()
    step = graphsafe.compile_step(model, ce_loss, graphsafe.optim.SGD(model.parameters(), lr=0.1), mode="full")
    with pytest.raises(CaptureError, match="needs a graph without unsafe nodes.*host_read"):
        step(make_batch(make_generator(3)))


def test_captured_step_rejects_a_new_shape():
    model = EmbeddingModel().cuda()
    step = graphsafe.compile_step(model, ce_loss, graphsafe.optim.SGD(model.parameters(), lr=0.1))
    gen = make_generator(4)
    for _ in range(4):
        step(make_batch(gen))
    assert step.captured
    with pytest.raises(InputMismatchError, match=r"shape \[4, 32\].*traced and captured for shape \[8, 32\]"):
        step(make_batch(gen, batch=4))
    with pytest.raises(InputMismatchError, match="on cpu"):
        step(tuple(t.cpu() for t in make_batch(gen)))


def test_train_cli_on_cuda_is_captured_and_deterministic(capsys):
    from graphsafe.cli import main

    assert main(["train", "--device", "cuda", "--steps", "30", "--moe", "--skip-zeros", "--check-determinism",
                 "--compare-torch"]) == 0
    out = capsys.readouterr().out
    print(out)
    assert "(captured)" in out and "bitwise equal" in out
    assert main(["train", "--device", "cuda", "--steps", "20", "--model", "recsys", "--state-bits", "8",
                 "--check-determinism"]) == 0
    out = capsys.readouterr().out
    print(out)
    assert "(captured)" in out and "bitwise equal" in out


# ---------------------------------------------------------------------------------------------------------
# Gate rules against real captures
# ---------------------------------------------------------------------------------------------------------


def _warm_up(fn, *args):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(*args)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()


def capture(fn, *args):
    """(graph, output) of fn captured after a warm-up, or raises what the capture raised (device left usable)."""
    _warm_up(fn, *args)
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.current_stream()
    try:
        with torch.cuda.graph(graph):
            out = fn(*args)
    except Exception:
        torch.cuda.set_stream(stream)  # torch.cuda.graph may leave its capture stream current
        try:
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001 - the capture error is what the test looks at
            pass
        raise
    return graph, out


def gate_rules(fn, *args):
    _, report = capture_gate(make_fx(fn, tracing_mode="fake")(*args), "cuda")
    return {f.rule for f in report.unsafe}


def _a():
    return torch.randn(4, 3, device="cuda", generator=torch.Generator("cuda").manual_seed(0)) + 0.5


FAILING = {
    "host_read": lambda a: a * a.sum().item(),
    "nonzero": lambda a: torch.nonzero(a > 0).float().sum(),
    "unique": lambda a: torch.unique(a.round()).sum(),
    "masked_select": lambda a: torch.masked_select(a, a > 0).sum(),
    "repeat_interleave": lambda a: torch.repeat_interleave((a > 0).long().flatten()).sum(),
    "bool_mask_index": lambda a: a[a > 0].sum(),
    "device_to_host_copy": lambda a: a.cpu().sum(),
    "host_to_device_copy": lambda a: a + torch.ones(3).to("cuda"),
}
EXPECTED_RULE = {"nonzero": "dynamic_output_shape", "unique": "dynamic_output_shape",
                 "masked_select": "dynamic_output_shape", "repeat_interleave": "dynamic_output_shape"}


@pytest.mark.parametrize("name", sorted(FAILING))
def test_flagged_op_fails_under_capture(name):
    fn = FAILING[name]
    assert EXPECTED_RULE.get(name, name) in gate_rules(fn, _a())
    _warm_up(fn, _a())  # runs eagerly: only the capture below may raise
    with pytest.raises(Exception):
        capture(fn, _a())
    # The device is still usable after the failed capture.
    torch.cuda.synchronize()
    assert torch.equal(torch.ones(2, device="cuda").sum().cpu(), torch.tensor(2.0))


def test_cpu_op_is_flagged_and_not_replayed():
    calls = torch.zeros(1)  # a CPU tensor the step updates: CPU work, which a CUDA graph does not record

    def fn(a):
        calls.add_(1)
        return a * 2

    assert "cpu_op" in gate_rules(fn, _a())
    calls.zero_()
    graph, _ = capture(fn, _a())
    after_capture = calls.item()  # warm-up + capture ran it
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    assert calls.item() == after_capture  # replays did not run the CPU op


def test_pinned_host_to_device_copy_captures_and_rereads_the_same_buffer():
    # The rule's second claim: even a pinned, non-blocking copy re-reads the host buffer given at capture.
    host = torch.ones(3).pin_memory()
    graph, out = capture(lambda a: a[0] + host.to("cuda", non_blocking=True), _a())
    host.fill_(5.0)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), (_a()[0] + 5.0).cpu())


def test_device_scalar_is_frozen_at_capture():
    a, b = _a(), torch.ones(3, device="cuda")
    scale = float(b.sum())  # read outside the capture (inside it would fail: the host_read rule)
    graph, out = capture(lambda x: x * scale, a)
    b.fill_(2.0)  # the value a re-traced step would read now
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, a * 3.0)  # still the captured 3.0, not 6.0


PASSING = {
    "nonzero_static": lambda a: torch.nonzero_static(a > 0, size=12).float().sum(),
    "repeat_interleave_output_size": lambda a: torch.repeat_interleave(
        torch.full((3,), 2, dtype=torch.long, device="cuda"), output_size=6).float().sum() + a,
    "where": lambda a: torch.where(a > 0, a, 0.0).sum(),
    "cpu_scalar": lambda a: a * torch.tensor(2.0),
    "int_index": lambda a: a[torch.arange(2, device="cuda") * 2],
    "graphsafe_embedding_backward": lambda a: torch.ops.graphsafe.embedding_backward(
        a.contiguous(), (torch.arange(4, device="cuda") % 2).contiguous(), 5, 1, True),
}


@pytest.mark.parametrize("name", sorted(PASSING))
def test_unflagged_op_captures_and_replays_like_eager(name):
    fn = PASSING[name]
    assert gate_rules(fn, _a()) == set()
    a = _a()
    graph, out = capture(fn, a)
    a.mul_(-1.5)  # new data in the static input
    graph.replay()
    torch.cuda.synchronize()
    assert_bitwise_equal(out, fn(a), name)


def test_rng_captures_and_draws_new_numbers_per_replay():
    gm = make_fx(lambda a: torch.nn.functional.dropout(a, 0.5) + torch.rand_like(a), tracing_mode="fake")(_a())
    _, report = capture_gate(gm, "cuda")
    assert report.passed and {f.rule for f in report.notes} == {"rng"}
    graph, out = capture(lambda a: torch.rand(1000, device="cuda") + a.sum() * 0, _a())
    graph.replay()
    first = out.clone()
    graph.replay()
    torch.cuda.synchronize()
    assert not torch.equal(first, out)
