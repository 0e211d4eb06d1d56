"""graphsafe.graph on the CPU: compile_step against the plain eager loop (bitwise: eager autograd through
graphsafe.nn.Embedding, the same kernels in the same order), buffers, unused and frozen parameters, the report,
and the documented errors (input mismatch, bad arguments, trace errors, a refused mode='full').
"""

from __future__ import annotations

import pytest
import torch

import graphsafe
from graphsafe.graph import (CaptureError, InputMismatchError, TraceError, partition_for_capture,
                             use_graphsafe_embeddings)
from conftest import assert_bitwise_equal, make_generator
from graph_helpers import DIM, EmbeddingModel, Planted, assert_step_equals_eager_loop, ce_loss, make_batch


# ---------------------------------------------------------------------------------------------------------
# compile_step
# ---------------------------------------------------------------------------------------------------------

OPTIMIZERS = [
    ("AdamW", dict(lr=1e-2, weight_decay=0.1), {}),
    ("AdamW", dict(lr=1e-2), dict(skip_zeros=True)),
    ("AdamW", dict(lr=1e-2), dict(state_bits=8, min_8bit_size=0)),
    ("SGD", dict(lr=0.1, momentum=0.9, nesterov=True), {}),
    ("Lion", dict(lr=1e-3), dict(skip_zeros=True)),
    ("LAMB", dict(lr=1e-2), {}),
    ("Adagrad", dict(lr=0.1), {}),
]


@pytest.mark.parametrize("mode", ["auto", "piecewise"])
@pytest.mark.parametrize("name, options, extra", OPTIMIZERS, ids=[f"{o[0]}-{i}" for i, o in enumerate(OPTIMIZERS)])
def test_compile_step_equals_the_eager_loop_bitwise(name, options, extra, mode):
    torch.manual_seed(6)
    model_cls = Planted if mode == "piecewise" else EmbeddingModel
    model = model_cls(padding_idx=2, scale_grad_by_freq=True)
    reference = use_graphsafe_embeddings(model)
    opt_cls = getattr(graphsafe.optim, name)
    optimizer, ref_optimizer = opt_cls(model.parameters(), **options, **extra), opt_cls(reference.parameters(), **options, **extra)
    step = graphsafe.compile_step(model, ce_loss, optimizer, mode=mode)
    gen = make_generator(8)
    for _ in range(4):
        batch = make_batch(gen, padding_idx=2)
        assert_step_equals_eager_loop(step(batch), model, reference, ref_optimizer, batch)
    assert step.mode == ("eager" if mode == "auto" else "piecewise")  # cpu: auto runs without capture
    assert not step.captured
    for p, r in zip(model.parameters(), reference.parameters()):
        s, rs = optimizer.state[p], ref_optimizer.state[r]
        assert s and set(s) == set(rs)
        for key in s:
            if isinstance(s[key], torch.Tensor):
                assert_bitwise_equal(s[key], rs[key])


class WithBatchNorm(EmbeddingModel):
    """Buffers the step updates in place (running statistics), and a layout whose fake strides differ from the
    real ones (CPU batch_norm on a transposed input returns a contiguous result; its meta kernel does not)."""

    def __init__(self):
        super().__init__(padding_idx=0)
        self.norm = torch.nn.BatchNorm1d(DIM)

    def forward(self, ids):
        return self.head(self.norm(self.tokens(ids).transpose(1, 2)).transpose(1, 2))


def test_compile_step_updates_buffers_like_the_eager_loop():
    torch.manual_seed(13)
    model = WithBatchNorm()
    reference = use_graphsafe_embeddings(model)
    step = graphsafe.compile_step(model, ce_loss, graphsafe.optim.AdamW(model.parameters(), lr=1e-2))
    ref_optimizer = graphsafe.optim.AdamW(reference.parameters(), lr=1e-2)
    gen = make_generator(6)
    for i in range(3):
        batch = make_batch(gen)
        assert_step_equals_eager_loop(step(batch), model, reference, ref_optimizer, batch, f"after step {i}")
        for (name, b), r in zip(model.named_buffers(), reference.buffers()):
            assert_bitwise_equal(b, r, f"buffer {name} after step {i}")
    assert int(model.norm.num_batches_tracked) == 3


def test_unused_and_frozen_parameters_are_left_alone():
    class Partial(EmbeddingModel):
        def __init__(self):
            super().__init__()
            self.unused = torch.nn.Linear(DIM, DIM)
            self.positions.weight.requires_grad_(False)

    torch.manual_seed(14)
    model = Partial()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = graphsafe.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.5)
    step = graphsafe.compile_step(model, ce_loss, optimizer)
    for _ in range(2):
        step(make_batch(make_generator(15)))
    assert step.traced.grad_param_names == ["tokens.weight", "head.weight", "head.bias"]
    assert "positions.weight" in step.traced.buffer_names
    for name in ("unused.weight", "unused.bias", "positions.weight"):  # no gradient, so no step (no decay either)
        assert model.get_parameter(name).grad is None
        assert_bitwise_equal(model.get_parameter(name).detach(), before[name], name)
    assert not torch.equal(model.tokens.weight, before["tokens.weight"])


def test_compile_step_tuple_batch_and_report():
    torch.manual_seed(9)
    model = EmbeddingModel()
    step = graphsafe.compile_step(model, ce_loss, graphsafe.optim.SGD(model.parameters(), lr=0.1))
    assert step.report is None and step.mode == "auto"
    loss = step(make_batch(make_generator(1)))
    assert loss.shape == () and not loss.requires_grad
    assert step.mode == "eager" and "auto would choose full" in step.report.decision
    assert "rewrite_embedding_backward: 2 rewritten" in str(step.report)
    assert all(p.grad is not None for p in model.parameters())


def test_compile_step_loss_falls():
    torch.manual_seed(10)
    model = EmbeddingModel()
    step = graphsafe.compile_step(model, ce_loss, graphsafe.optim.AdamW(model.parameters(), lr=3e-2))
    batch = make_batch(make_generator(2))
    losses = [step(batch).item() for _ in range(15)]
    assert losses[-1] < 0.5 * losses[0]


def test_input_change_raises_the_documented_error():
    torch.manual_seed(11)
    model = EmbeddingModel()
    step = graphsafe.compile_step(model, ce_loss, graphsafe.optim.SGD(model.parameters(), lr=0.1))
    gen = make_generator(3)
    step(make_batch(gen, batch=4))
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(InputMismatchError, match=r"batch tensor 0 has shape \[3, 8\].*traced and captured for shape \[4, 8\]"):
        step(make_batch(gen, batch=3))
    with pytest.raises(InputMismatchError, match="int32"):
        step(make_batch(gen, index_dtype=torch.int32))
    with pytest.raises(InputMismatchError, match="batches of 2 tensors, got 1"):
        step(make_batch(gen)[0])
    for p, b in zip(model.parameters(), before):  # a rejected batch changes nothing
        assert_bitwise_equal(p.detach(), b)
    assert isinstance(InputMismatchError("x"), ValueError)


def test_bad_arguments_raise_clear_errors():
    model = EmbeddingModel()
    opt = graphsafe.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="mode must be one of"):
        graphsafe.compile_step(model, ce_loss, opt, mode="fast")
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer"):
        graphsafe.compile_step(model, ce_loss, "adam")
    step = graphsafe.compile_step(model, ce_loss, opt)
    with pytest.raises(TypeError, match="a batch must be a tensor"):
        step([1, 2])
    bad = graphsafe.compile_step(model, lambda out, t: out.sum(-1), opt)
    with pytest.raises(TraceError, match="loss_fn must return a floating-point tensor with one element"):
        bad(make_batch(make_generator(1)))


def test_data_dependent_control_flow_is_a_trace_error():
    class Branchy(EmbeddingModel):
        def forward(self, ids):
            out = super().forward(ids)
            return out * 2 if out.sum() > 0 else out

    model = Branchy()
    step = graphsafe.compile_step(model, ce_loss, graphsafe.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(TraceError, match="branches on"):
        step(make_batch(make_generator(1)))


def test_buffer_reassigned_in_forward_is_a_trace_error():
    # functional_call restores the module's own buffers after the traced forward: a reassignment would be lost.
    class Counting(EmbeddingModel):
        def __init__(self):
            super().__init__()
            self.register_buffer("calls", torch.zeros(()))

        def forward(self, ids):
            self.calls = self.calls + 1
            return super().forward(ids)

    model = Counting()
    step = graphsafe.compile_step(model, ce_loss, graphsafe.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(TraceError, match="assigns a new tensor to buffer.*calls.*in place"):
        step(make_batch(make_generator(1)))


def test_optimizer_capturability_is_known_before_capturing():
    from graphsafe.graph.step import _optimizer_not_capturable

    params = EmbeddingModel().parameters
    assert _optimizer_not_capturable(graphsafe.optim.AdamW(params())) == ""
    assert _optimizer_not_capturable(torch.optim.AdamW(params(), capturable=True)) == ""
    assert "capturable=True" in _optimizer_not_capturable(torch.optim.AdamW(params()))


def test_refused_full_mode_stays_refused(monkeypatch):
    # As on CUDA: the gate finds unsafe nodes and mode="full" is refused. The next call must refuse again with
    # the same clear error, not fail on half-kept state.
    model = Planted()
    step = graphsafe.compile_step(model, ce_loss, graphsafe.optim.SGD(model.parameters(), lr=0.1), mode="full")
    step.device = torch.device("cuda")
    monkeypatch.setattr("graphsafe.graph.step.partition_for_capture",
                        lambda gm, gate, device: partition_for_capture(gm, gate, torch.device("cpu")))
    batch = make_batch(make_generator(1))
    for _ in range(2):
        with pytest.raises(CaptureError, match="mode='full' needs a graph without unsafe nodes"):
            step(batch)
    assert step.traced is None and step._runner is None


def test_full_mode_on_cpu_runs_the_whole_graph():
    torch.manual_seed(12)
    model = Planted()
    reference = use_graphsafe_embeddings(model)
    step = graphsafe.compile_step(model, ce_loss, graphsafe.optim.Adam(model.parameters()), mode="full")
    ref_opt = graphsafe.optim.Adam(reference.parameters())
    batch = make_batch(make_generator(4))
    step(batch)
    ce_loss(reference(batch[0]), batch[1]).backward()
    ref_opt.step()
    assert step.mode == "full" and not step.captured
    for p, r in zip(model.parameters(), reference.parameters()):
        assert_bitwise_equal(p.detach(), r.detach())


def test_compile_step_refuses_a_model_without_parameters():
    """A model without parameters has nothing to train: say so, instead of "one device, got []"."""
    optimizer = graphsafe.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(ValueError, match=r"compile_step: the model has no parameters \(nothing to train\)"):
        graphsafe.compile_step(torch.nn.ReLU(), lambda out, y: (out - y).pow(2).sum(), optimizer)
