"""The capture runners' bookkeeping on the CPU, with torch.cuda's graph API replaced by an emulation.

What is emulated: torch.cuda.graph records every aten op dispatched inside it (a TorchDispatchMode) together
with its argument and result tensors; CUDAGraph.replay() re-runs the recorded ops on the same tensors and
writes each result into the tensor recorded at capture. Like a real CUDA graph, a replay re-runs no Python:
addresses, shapes and Python numbers are those of the capture, and only the recorded ops run. Unlike a real
capture, the emulated capture also executes the ops once, so the first replay after a capture is skipped.
graphsafe's optimizer update is a raw-pointer C++ call that the dispatcher does not see, so optimizer.step()
is recorded as a whole, and so is each fused table's sparse_step (optimizer._sparse_step).

This checks what the runners do around the graphs (static batch buffers, region inputs/outputs, static
copies of eager-region results, param.grad installation, replay order), bitwise against the eager loop. It
says nothing about CUDA itself: tests/python/test_graph_cuda.py does that on a GPU.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import graphsafe
from graphsafe.graph import use_graphsafe_embeddings
from graphsafe.graph.capture import FullCaptureRunner, PiecewiseCaptureRunner
from conftest import make_generator
from graph_helpers import EmbeddingModel, Planted, assert_step_equals_eager_loop, ce_loss, make_batch


class EmulatedGraph:
    def __init__(self) -> None:
        self.ops: list = []
        self.captured_just_now = True

    @torch.no_grad()
    def replay(self) -> None:
        if self.captured_just_now:  # the emulated capture already ran the ops once
            self.captured_just_now = False
            return
        for entry in self.ops:
            if callable(entry):
                entry()
                continue
            func, args, kwargs, recorded = entry
            fresh = func(*args, **kwargs)
            for old, new in zip(tree_flatten(recorded)[0], tree_flatten(fresh)[0]):
                if isinstance(old, torch.Tensor) and old is not new:
                    old.copy_(new)


class _Recorder(TorchDispatchMode):
    def __init__(self, graph: EmulatedGraph) -> None:
        super().__init__()
        self.graph = graph

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:
            raise RuntimeError("emulated capture: host read while capturing")  # what CUDA refuses too
        out = func(*args, **kwargs)
        self.graph.ops.append((func, args, kwargs, out))
        return out


_RECORDING: list[EmulatedGraph] = []


@contextlib.contextmanager
def _emulated_capture(graph: EmulatedGraph, pool=None):
    _RECORDING.append(graph)
    try:
        with _Recorder(graph):
            yield
    finally:
        _RECORDING.pop()


class _Stream:
    cuda_stream = 0

    def wait_stream(self, other) -> None:
        pass


@pytest.fixture
def emulated_cuda_graphs(monkeypatch):
    monkeypatch.setattr(torch.cuda, "CUDAGraph", EmulatedGraph)
    monkeypatch.setattr(torch.cuda, "graph", _emulated_capture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: _Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: _Stream())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "set_stream", lambda s: None)


def _record_optimizer_steps(optimizer) -> None:
    step = optimizer.step

    def recorded_step(*args, **kwargs):
        if _RECORDING:
            _RECORDING[-1].ops.append(step)
        return step(*args, **kwargs)

    optimizer.step = recorded_step
    sparse_step = optimizer._sparse_step  # what graphsafe.optim.sparse_step calls: fused tables (sparse_update.py)

    def recorded_sparse_step(*args):
        if _RECORDING:
            _RECORDING[-1].ops.append(lambda: sparse_step(*args))
        return sparse_step(*args)

    optimizer._sparse_step = recorded_sparse_step


@pytest.mark.parametrize("runner", ["full", "piecewise"])
@pytest.mark.parametrize("name, options", [("AdamW", dict(lr=1e-2)), ("LAMB", dict(lr=1e-2, skip_zeros=True)),
                                           ("SGD", dict(lr=0.1, momentum=0.9)),
                                           # skip_zeros: both tables are fused (row-sparse gradient + sparse_step)
                                           ("AdamW", dict(lr=1e-2, skip_zeros=True, state_bits=8, min_8bit_size=0))])
def test_emulated_capture_equals_the_eager_loop(emulated_cuda_graphs, runner, name, options):
    torch.manual_seed(0)
    model = (EmbeddingModel if runner == "full" else Planted)(padding_idx=2, scale_grad_by_freq=True)
    reference = use_graphsafe_embeddings(model)
    optimizer = getattr(graphsafe.optim, name)(model.parameters(), **options)
    ref_optimizer = getattr(graphsafe.optim, name)(reference.parameters(), **options)
    _record_optimizer_steps(optimizer)
    gen = make_generator(3)
    batches = [make_batch(gen, padding_idx=2) for _ in range(8)]
    step = graphsafe.compile_step(model, ce_loss, optimizer, mode=runner, example_batch=batches[0])
    # compile_step only captures on CUDA; the model is on the CPU, so install the capture runner by hand.
    if runner == "full":
        step._runner = FullCaptureRunner(step.traced, step.graph_module, optimizer, 2, layout=step.layout)
    else:
        step._runner = PiecewiseCaptureRunner(step.traced, step.graph_module, optimizer, 2, step.regions, step.layout)
        assert step.report.partition.num_eager >= 2
    for i, batch in enumerate(batches):  # 2 warm-up steps, 1 capture, 5 replays
        assert_step_equals_eager_loop(step(batch), model, reference, ref_optimizer, batch, f"after step {i}")
    assert step.captured
    assert all(p.grad is g for p, g in zip(step.layout.dense_params, step._runner.static_grads))
    fused = step.report.sparse_update.fused
    assert len(fused) == (2 if options.get("skip_zeros") and name != "LAMB" else 0)
    assert all(p.grad is None for p in step.layout.sparse_params) and len(step._runner.static_sparse) == len(fused)


def _auto_step_on_a_full_runner(model, seed):
    """(compile_step in auto mode, reference model, its optimizer, 5 batches), with the full-capture runner
    that CUDA would use had the gate missed the model's .item(): its emulated capture fails, as a real one would."""
    reference = use_graphsafe_embeddings(model)
    optimizer = graphsafe.optim.AdamW(model.parameters(), lr=1e-2)
    ref_optimizer = graphsafe.optim.AdamW(reference.parameters(), lr=1e-2)
    _record_optimizer_steps(optimizer)
    gen = make_generator(seed)
    batches = [make_batch(gen, padding_idx=2) for _ in range(5)]
    step = graphsafe.compile_step(model, ce_loss, optimizer, example_batch=batches[0])
    assert step.requested_mode == "auto"
    step._runner = FullCaptureRunner(step.traced, step.graph_module, optimizer, 2)
    step.report.mode = "full"
    return step, reference, ref_optimizer, batches


def test_auto_falls_back_when_a_capture_fails_and_takes_the_step_once(emulated_cuda_graphs, caplog):
    torch.manual_seed(1)
    model = Planted(padding_idx=2)
    step, reference, ref_optimizer, batches = _auto_step_on_a_full_runner(model, 5)
    with caplog.at_level("WARNING", logger="graphsafe.graph"):
        for i, batch in enumerate(batches):
            assert_step_equals_eager_loop(step(batch), model, reference, ref_optimizer, batch, f"after step {i}")
    assert len(step.report.fallbacks) == 1 and step.report.fallbacks[0].startswith("full -> piecewise")
    assert "host read while capturing" in step.report.fallbacks[0]
    assert step.mode == "piecewise"
    assert any("capture failed, falling back to piecewise" in r.getMessage() for r in caplog.records)


class PlantedWithStatistics(Planted):
    """Planted plus a running statistic updated in place before the host read, as BatchNorm's are."""

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self.register_buffer("running_mean", torch.zeros(()))
        self.register_buffer("batches_seen", torch.zeros((), dtype=torch.long))

    def forward(self, ids):
        h = self.tokens(ids)
        self.running_mean.mul_(0.9).add_(h.detach().mean() * 0.1)
        self.batches_seen.add_(1)
        return super().forward(ids) + 0.0 * self.running_mean


def test_failed_capture_does_not_apply_buffer_updates_twice(emulated_cuda_graphs):
    # The emulated full capture runs the ops before the .item() once (a real piecewise capture runs its eager
    # regions), then fails; the fallback takes the step. The buffers must end as after one eager step each.
    torch.manual_seed(3)
    model = PlantedWithStatistics(padding_idx=2)
    step, reference, ref_optimizer, batches = _auto_step_on_a_full_runner(model, 6)
    for i, batch in enumerate(batches):
        assert_step_equals_eager_loop(step(batch), model, reference, ref_optimizer, batch, f"after step {i}")
        assert int(model.batches_seen) == int(reference.batches_seen) == i + 1, f"after step {i}"
        assert torch.equal(model.running_mean, reference.running_mean), f"after step {i}"
    assert len(step.report.fallbacks) == 1


def test_written_buffers_are_the_ones_the_graph_updates_in_place():
    """Only what the graph writes is copied before a capture: BatchNorm's statistics, not a frozen weight or
    a read-only buffer."""
    from graphsafe.graph.capture import written_buffers
    from graphsafe.graph.trace import trace_training_step
    from graph_helpers import CLASSES, DIM, VOCAB

    class WithBatchNorm(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tokens = torch.nn.Embedding(VOCAB, DIM)
            self.norm = torch.nn.BatchNorm1d(DIM)
            self.frozen = torch.nn.Linear(DIM, DIM)
            self.frozen.requires_grad_(False)
            self.register_buffer("scale", torch.ones(DIM))
            self.register_buffer("seen", torch.zeros(2))
            self.head = torch.nn.Linear(DIM, CLASSES)

        def forward(self, ids):
            h = self.tokens(ids)
            h = self.norm(h.flatten(0, 1)).view_as(h)
            torch._foreach_add_([self.seen[:1]], 1.0)  # a list argument, through a view
            return self.head(self.frozen(h) * self.scale)

    torch.manual_seed(4)
    model = WithBatchNorm()
    traced = trace_training_step(model, ce_loss, make_batch(make_generator(7)))
    found = written_buffers(traced, traced.graph_module)
    expected = [model.norm.running_mean, model.norm.running_var, model.norm.num_batches_tracked, model.seen]
    assert sorted(map(id, found)) == sorted(map(id, expected))
