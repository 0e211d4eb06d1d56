"""graphsafe.graph on the CPU: trace, rewrite, gate, partition, compile_step, and `graphsafe train`.

References are independent of the graph machinery: torch's own eager autograd (to tolerance, since graphsafe
sums embedding gradients in its own documented order), and eager autograd through graphsafe.nn.Embedding
(bitwise: the same kernels in the same order). Gate rules that concern CUDA placement are checked on graphs
traced with fake CUDA tensors (no GPU needed); tests/python/test_graph_cuda.py checks every rule against a
real capture.
"""

from __future__ import annotations

import operator
import time

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch._subclasses.fake_tensor import FakeTensorMode

import graphsafe
from graphsafe.graph import (CaptureError, InputMismatchError, TraceError, capture_gate, partition_for_capture,
                             rewrite_embedding_backward, run_regions, trace_training_step, use_graphsafe_embeddings)
from conftest import assert_bitwise_equal, make_generator

ATEN_EMB_BWD = torch.ops.aten.embedding_dense_backward.default
GS_EMB_BWD = torch.ops.graphsafe.embedding_backward.default
VOCAB, DIM, CLASSES = 257, 16, 11


class EmbeddingModel(torch.nn.Module):
    """Two plain torch embedding tables (one with the options under test) summed, then a linear head."""

    def __init__(self, padding_idx=None, scale_grad_by_freq=False, dtype=torch.float32):
        super().__init__()
        self.tokens = torch.nn.Embedding(VOCAB, DIM, padding_idx=padding_idx, scale_grad_by_freq=scale_grad_by_freq,
                                         dtype=dtype)
        self.positions = torch.nn.Embedding(8, DIM, dtype=dtype)
        self.head = torch.nn.Linear(DIM, CLASSES, dtype=dtype)

    def forward(self, ids):
        pos = torch.arange(ids.shape[1], device=ids.device)
        h = self.tokens(ids) + self.positions(pos)
        return self.head(torch.tanh(h)).float()


def ce_loss(out, target):
    return torch.nn.functional.cross_entropy(out.flatten(0, 1), target.flatten())


def assert_step_equals_eager_loop(loss, model, reference, ref_optimizer, batch, what=""):
    """Takes one step of the plain eager loop on `reference` and asserts that compile_step's `loss` and the
    parameters of `model` equal it bitwise."""
    ref_loss = ce_loss(reference(batch[0]), batch[1])
    ref_loss.backward()
    ref_optimizer.step()
    ref_optimizer.zero_grad()
    assert_bitwise_equal(loss, ref_loss.detach(), f"loss {what}")
    for p, r in zip(model.parameters(), reference.parameters()):
        assert_bitwise_equal(p.detach(), r.detach(), f"parameters {what}")


def make_batch(gen, batch=4, seq=8, index_dtype=torch.int64, padding_idx=None):
    ids = torch.randint(0, VOCAB, (batch, seq), generator=gen)
    ids[:, :3] = ids[0, 0]  # repeated rows, so scale_grad_by_freq and the summation order matter
    if padding_idx is not None:
        ids[:, -1] = padding_idx % VOCAB
    target = torch.randint(0, CLASSES, (batch, seq), generator=gen)
    return ids.to(index_dtype), target


def eager_grads(model, loss_fn, batch):
    """Plain eager autograd: the independent reference."""
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model(batch[0]), *batch[1:])
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()]


def graph_grads(gm, traced, batch):
    with torch.no_grad():
        out = gm(*traced.inputs(batch))
    return out[0], list(out[1:])


def count(gm, target):
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is target)


# ---------------------------------------------------------------------------------------------------------
# rewrite_embedding_backward
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("scale_grad_by_freq", [False, True])
@pytest.mark.parametrize("padding_idx", [None, 5, -1])
def test_rewrite_replaces_every_embedding_backward(padding_idx, scale_grad_by_freq, index_dtype, dtype):
    gen = make_generator(1234)
    torch.manual_seed(0)
    model = EmbeddingModel(padding_idx, scale_grad_by_freq, dtype)
    batch = make_batch(gen, index_dtype=index_dtype, padding_idx=padding_idx)
    traced = trace_training_step(model, ce_loss, batch)
    assert count(traced.graph_module, ATEN_EMB_BWD) == 2  # the traced graph really has aten's backward

    gm, report = rewrite_embedding_backward(traced.graph_module)
    assert count(gm, ATEN_EMB_BWD) == 0
    assert count(gm, GS_EMB_BWD) == 2
    assert len(report.rewritten) == 2 and not report.left_alone
    assert count(traced.graph_module, ATEN_EMB_BWD) == 2  # the pass works on a copy
    expected_padding = -1 if padding_idx is None else padding_idx % VOCAB
    assert f"padding_idx={expected_padding}" in str(report)

    loss, grads = graph_grads(gm, traced, batch)
    # Bitwise: eager autograd through graphsafe.nn.Embedding (same kernels, same order).
    ref_loss, ref_grads = eager_grads(use_graphsafe_embeddings(model), ce_loss, batch)
    assert_bitwise_equal(loss, ref_loss)
    assert len(grads) == len(ref_grads) == 4
    for g, r in zip(grads, ref_grads):
        assert_bitwise_equal(g, r)
    # To tolerance: torch's own eager backward (fp32 only: bf16 torch sums in another order and precision).
    if dtype == torch.float32:
        torch_loss, torch_grads = eager_grads(model, ce_loss, batch)
        torch.testing.assert_close(loss, torch_loss, rtol=0, atol=0)
        for g, r in zip(grads, torch_grads):
            torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-7)
    if padding_idx is not None:
        assert torch.count_nonzero(grads[0][padding_idx % VOCAB]) == 0


def test_rewrite_lists_what_it_leaves_alone():
    def fn(grad, indices):
        return torch.ops.aten.embedding_dense_backward(grad, indices, 10, -1, False)

    gm = make_fx(fn, tracing_mode="fake")(torch.zeros(5, 3, dtype=torch.complex64), torch.zeros(5, dtype=torch.long))
    rewritten, report = rewrite_embedding_backward(gm)
    assert count(rewritten, ATEN_EMB_BWD) == 1
    assert report.rewritten == []
    assert len(report.left_alone) == 1 and "complex64 is not supported" in report.left_alone[0][1]
    assert "left alone" in str(report)


def test_tied_weights_get_one_summed_gradient():
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(VOCAB, DIM, padding_idx=0)

        def forward(self, ids):
            return self.emb(ids) @ self.emb.weight.t()

    def loss_fn(out, target):  # predict a row of the table
        return torch.nn.functional.cross_entropy(out.flatten(0, 1), target.flatten() % VOCAB)

    torch.manual_seed(1)
    model, batch = Tied(), make_batch(make_generator(7))
    traced = trace_training_step(model, loss_fn, batch)
    gm, _ = rewrite_embedding_backward(traced.graph_module)
    _, grads = graph_grads(gm, traced, batch)
    _, ref = eager_grads(use_graphsafe_embeddings(model), loss_fn, batch)
    assert len(grads) == 1
    assert_bitwise_equal(grads[0], ref[0])


# ---------------------------------------------------------------------------------------------------------
# capture_gate
# ---------------------------------------------------------------------------------------------------------


class Planted(EmbeddingModel):
    """EmbeddingModel plus a planted host read (.item()) and a planted data-dependent shape (nonzero)."""

    def forward(self, ids):
        out = super().forward(ids)
        hot = (ids > VOCAB // 2).sum().item()  # host read
        nonzero_rows = torch.nonzero(ids).shape[0]  # data-dependent shape (a host number from its size)
        found = torch.nonzero(ids == ids[0, 0]).float().mean()
        return out * (1.0 + hot / 1000.0) + found * 1e-3 + nonzero_rows * 1e-6


def _findings(report, rule):
    return [f for f in report.unsafe if f.rule == rule]


def test_gate_names_planted_item_and_nonzero():
    torch.manual_seed(2)
    model, batch = Planted(padding_idx=0, scale_grad_by_freq=True), make_batch(make_generator(3))
    gm, _ = rewrite_embedding_backward(trace_training_step(model, ce_loss, batch).graph_module)
    _, report = capture_gate(gm, "cpu")  # a CPU model: the CUDA placement rules do not apply
    assert not report.passed
    host = _findings(report, "host_read")
    assert [f.op for f in host] == ["aten._local_scalar_dense.default"]
    assert "reads a device value on the host" in host[0].reason and ".item()" in host[0].reason
    dynamic = _findings(report, "dynamic_output_shape")
    assert sorted(f.op for f in dynamic) == ["aten.nonzero.default"] * 2
    assert "output size depends on the data" in dynamic[0].reason
    # Consumers of the host number run eagerly too (a capture would freeze it).
    assert _findings(report, "device_scalar")
    assert "_local_scalar_dense" in str(report) and "nonzero" in str(report)
    # Nothing else is flagged: the embedding backward (rewritten) and the dense math are capturable.
    flagged_ops = {f.op for f in report.unsafe}
    assert not any("embedding" in op or "mm" in op for op in flagged_ops)


def test_gate_passes_a_clean_model():
    torch.manual_seed(2)
    model, batch = EmbeddingModel(padding_idx=1, scale_grad_by_freq=True), make_batch(make_generator(3))
    gm, _ = rewrite_embedding_backward(trace_training_step(model, ce_loss, batch).graph_module)
    _, report = capture_gate(gm, "cpu")  # a CPU model: the CUDA placement rules do not apply
    assert report.passed, str(report)
    assert "all capturable" in str(report)


def _fake_cuda_graph(fn, *specs):
    """fn traced on fake CUDA tensors (no GPU needed): (shape, dtype, device) per input."""
    mode = FakeTensorMode(shape_env=ShapeEnv())
    with mode:
        args = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype, device in specs]
        return make_fx(fn)(*args)


CUDA_F = ((4, 3), torch.float32, "cuda")


@pytest.mark.parametrize(
    "name, fn, specs, rule, op",
    [
        ("item", lambda a: a * a.sum().item(), [CUDA_F], "host_read", "_local_scalar_dense"),
        ("nonzero", lambda a: torch.nonzero(a).sum(), [CUDA_F], "dynamic_output_shape", "nonzero"),
        ("unique", lambda a: torch.unique(a).sum(), [CUDA_F], "dynamic_output_shape", "unique"),
        ("masked_select", lambda a: torch.masked_select(a, a > 0).sum(), [CUDA_F], "dynamic_output_shape",
         "masked_select"),
        ("repeat_interleave", lambda a: torch.repeat_interleave((a > 0).long().flatten()).sum(), [CUDA_F],
         "dynamic_output_shape", "repeat_interleave"),
        ("bool_mask", lambda a: a[a > 0].sum(), [CUDA_F], "bool_mask_index", "index"),
        ("to_cpu", lambda a: a.cpu() * 2, [CUDA_F], "device_to_host_copy", "_to_copy"),
        ("to_cuda", lambda a, b: a + b.to("cuda"), [CUDA_F, ((3,), torch.float32, "cpu")], "host_to_device_copy",
         "_to_copy"),
        ("cpu_op", lambda a: a + torch.arange(3, device="cpu").float().to("cuda"), [CUDA_F], "cpu_op", "arange"),
    ],
)
def test_gate_rules_on_fake_cuda_graphs(name, fn, specs, rule, op):
    _, report = capture_gate(_fake_cuda_graph(fn, *specs), "cuda")
    hits = [f for f in report.unsafe if f.rule == rule and op in f.op]
    assert hits, f"{name}: expected rule {rule} on {op}\n{report}"
    rule_reason = next(r.reason for r in graphsafe.graph.RULES if r.name == rule)
    assert hits[0].reason == rule_reason


@pytest.mark.parametrize(
    "name, fn",
    [
        ("nonzero_static", lambda a: torch.nonzero_static(a, size=12).sum()),
        ("repeat_interleave_sized", lambda a: torch.repeat_interleave(torch.ones(3, dtype=torch.long, device=a.device),
                                                                      output_size=3).sum() + a),
        ("where", lambda a: torch.where(a > 0, a, 0.0).sum()),
        ("cpu_scalar", lambda a: a * torch.tensor(2.0)),
        ("int_index", lambda a: a[torch.arange(2, device=a.device) * 2]),
    ],
)
def test_gate_leaves_capturable_ops_alone(name, fn):
    _, report = capture_gate(_fake_cuda_graph(fn, CUDA_F), "cuda")
    assert report.passed, f"{name}:\n{report}"


def test_gate_notes_rng_without_flagging_it():
    _, report = capture_gate(_fake_cuda_graph(lambda a: torch.nn.functional.dropout(a, 0.5) + torch.rand_like(a), CUDA_F),
                             "cuda")
    assert report.passed
    assert {f.rule for f in report.notes} == {"rng"} and len(report.notes) == 2


def test_gate_ignores_placement_rules_on_cpu_steps():
    fn = lambda a: a.cpu() * 2  # noqa: E731
    assert not capture_gate(_fake_cuda_graph(fn, CUDA_F), "cuda")[1].passed
    assert capture_gate(_fake_cuda_graph(fn, CUDA_F), "cpu")[1].passed


def test_every_rule_is_documented():
    doc = (__import__("pathlib").Path(__file__).parents[2] / "docs" / "graph.md").read_text()
    for rule in (*graphsafe.graph.RULES, *graphsafe.graph.NOTES):
        assert f"`{rule.name}`" in doc, f"rule {rule.name} missing from docs/graph.md"


# ---------------------------------------------------------------------------------------------------------
# partition_for_capture
# ---------------------------------------------------------------------------------------------------------


def test_piecewise_equals_whole_graph_equals_eager_bitwise():
    torch.manual_seed(4)
    model = Planted(padding_idx=0, scale_grad_by_freq=True)
    batch = make_batch(make_generator(5), padding_idx=0)
    traced = trace_training_step(model, ce_loss, batch)
    gm, _ = rewrite_embedding_backward(traced.graph_module)
    _, gate = capture_gate(gm, "cpu")
    split, report = partition_for_capture(gm, gate)
    regions = split.regions

    # Eager regions hold exactly the unsafe nodes; together the regions hold every op node, in order.
    op_nodes = [n.name for n in gm.graph.nodes if n.op == "call_function"]
    assert [name for r in regions for name in r.nodes] == op_nodes
    assert {name for r in regions if not r.capturable for name in r.nodes} == gate.unsafe_nodes()
    assert report.num_eager >= 2 and report.num_capturable >= 2
    assert all(r.capturable != regions[i + 1].capturable for i, r in enumerate(regions[:-1]))
    # Captured regions only see static shapes and no host numbers read from the device.
    values = {n.name: n.meta.get("val") for n in gm.graph.nodes}
    for region in regions:
        if region.capturable:
            for name in region.inputs:
                value = values[name]
                assert not isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)), name
                assert all(isinstance(s, int) for s in getattr(value, "shape", ())), (name, value.shape)

    inputs = traced.inputs(batch)
    with torch.no_grad():
        whole = gm(*inputs)
        pieces = run_regions(regions, gm, inputs)
        split_outputs = split(*inputs)  # the split GraphModule calls the regions in order
    ref_loss, ref_grads = eager_grads(use_graphsafe_embeddings(model), ce_loss, batch)
    assert len(whole) == len(pieces) == len(split_outputs) == 1 + len(ref_grads)
    for w, p, s, r in zip(whole, pieces, split_outputs, [ref_loss, *ref_grads]):
        assert_bitwise_equal(w, p)
        assert_bitwise_equal(w, s)
        assert_bitwise_equal(w, r)
    assert [n.target for n in split.graph.nodes if n.op == "call_module"] == [f"region_{r.index}" for r in regions]


def test_partition_of_a_clean_graph_is_one_region():
    torch.manual_seed(4)
    model, batch = EmbeddingModel(), make_batch(make_generator(5))
    gm, _ = rewrite_embedding_backward(trace_training_step(model, ce_loss, batch).graph_module)
    split, report = partition_for_capture(gm, device="cpu")
    assert len(split.regions) == 1 and split.regions[0].capturable
    assert "1 regions (1 capturable, 0 eager)" in str(report)


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


# ---------------------------------------------------------------------------------------------------------
# graphsafe train
# ---------------------------------------------------------------------------------------------------------


def _losses(text):
    return [float(line.split("loss")[1].split()[0]) for line in text.splitlines() if line.startswith("step ")]


def test_train_cli_on_cpu_loss_falls(capsys):
    from graphsafe.cli import main

    start = time.perf_counter()
    assert main(["train", "--steps", "20", "--device", "cpu"]) == 0
    elapsed = time.perf_counter() - start
    out = capsys.readouterr().out
    losses = _losses(out)
    assert len(losses) == 20
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.5, losses
    assert "mode used" in out and "rewrites" in out and "optimizer state" in out
    assert elapsed < 60


@pytest.mark.parametrize("args", [["--moe", "--optimizer", "lion", "--skip-zeros"],
                                  ["--model", "recsys", "--optimizer", "adagrad", "--state-bits", "8"]])
def test_train_cli_variants_with_determinism_check(capsys, args):
    from graphsafe.cli import main

    assert main(["train", "--steps", "4", "--device", "cpu", "--check-determinism", "--compare-torch",
                 "--vocab", "32768", *args]) == 0
    out = capsys.readouterr().out
    assert "determinism" in out and "bitwise equal" in out
    assert len(_losses(out)) >= 4


def test_train_matmul_precision_is_scoped_to_cuda_runs():
    """--matmul sets CUDA's fp32 matmul precision for the run only, keeps torch's precision queries readable
    meanwhile, and never touches a CPU run."""
    from graphsafe.trainer import default_config
    from graphsafe.trainer.run import matmul_precision

    matmul = torch.backends.cuda.matmul
    before = matmul.allow_tf32
    assert default_config("cuda").matmul == "tf32" and default_config("cpu").matmul == "ieee"
    with matmul_precision(default_config("cuda:0", matmul="tf32")):
        assert matmul.allow_tf32 and matmul.fp32_precision == "tf32"
        assert torch.get_float32_matmul_precision() == "high"
    assert matmul.allow_tf32 == before
    with pytest.raises(RuntimeError), matmul_precision(default_config("cuda", matmul="ieee")):
        assert not matmul.allow_tf32 and matmul.fp32_precision == "ieee"
        raise RuntimeError("a failed run still restores the setting")
    assert matmul.allow_tf32 == before
    with matmul_precision(default_config("cpu", matmul="tf32")):
        assert matmul.allow_tf32 == before
    with pytest.raises(SystemExit, match="unknown matmul precision"), matmul_precision(default_config("cuda", matmul="bf16")):
        pass


def test_compile_step_refuses_a_model_without_parameters():
    """A model without parameters has nothing to train: say so, instead of "one device, got []"."""
    optimizer = graphsafe.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(ValueError, match=r"compile_step: the model has no parameters \(nothing to train\)"):
        graphsafe.compile_step(torch.nn.ReLU(), lambda out, y: (out - y).pow(2).sum(), optimizer)
