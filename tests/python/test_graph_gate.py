"""graphsafe.graph on the CPU: capture_gate. The gate names planted host reads and data-dependent shapes and passes
a clean model; rules that concern CUDA placement are checked on graphs traced with fake CUDA tensors (no GPU
needed); tests/python/test_graph_cuda.py checks every rule against a real capture.
"""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch._subclasses.fake_tensor import FakeTensorMode

import graphsafe
from graphsafe.graph import capture_gate, rewrite_embedding_backward, trace_training_step
from conftest import make_generator
from graph_helpers import EmbeddingModel, Planted, ce_loss, make_batch


# ---------------------------------------------------------------------------------------------------------
# capture_gate
# ---------------------------------------------------------------------------------------------------------


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
