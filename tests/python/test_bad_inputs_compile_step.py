"""Bad input to graphsafe.compile_step (lightly): refused with a clear error, and a compiled step given another batch
form changes nothing (the rest of the bad-input matrix: test_bad_inputs.py)."""

from __future__ import annotations

import pytest
import torch

import graphsafe
from bad_inputs import META, refused

# --------------------------------------------------------------------------------------------------------
# graphsafe.compile_step (lightly)
# --------------------------------------------------------------------------------------------------------


def _model_and_opt():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(6, 4), torch.nn.Flatten(), torch.nn.Linear(8, 1))
    return model, graphsafe.optim.SGD(model.parameters(), lr=0.1)


def _loss(out, y):
    return ((out.squeeze(-1) - y) ** 2).mean()


def _two_device_model():
    model, opt = _model_and_opt()
    model[2].bias = torch.nn.Parameter(torch.zeros(1, device="meta"))
    return model, opt


COMPILE_REFUSED = {
    "bad-mode": (lambda: graphsafe.compile_step(*_model_and_opt()[:1], _loss, _model_and_opt()[1], mode="fast"),
                 ValueError, r"mode.*auto"),
    "not-an-optimizer": (lambda: graphsafe.compile_step(_model_and_opt()[0], _loss, [1, 2]), TypeError,
                         r"optimizer"),
    "warmup-0": (lambda: graphsafe.compile_step(*_model_and_opt()[:1], _loss, _model_and_opt()[1], warmup_steps=0),
                 ValueError, r"warmup_steps"),
    "model-on-cpu-and-meta": (lambda: graphsafe.compile_step(_two_device_model()[0], _loss, _model_and_opt()[1]),
                              ValueError, r"one device"),
    "batch-not-tensors": (lambda: graphsafe.compile_step(*_model_and_opt()[:1], _loss, _model_and_opt()[1])("abc"),
                          TypeError, r"batch"),
    "batch-empty-tuple": (lambda: graphsafe.compile_step(*_model_and_opt()[:1], _loss, _model_and_opt()[1])(()),
                          TypeError, r"batch"),
}


@pytest.mark.parametrize("case", COMPILE_REFUSED)
def test_compile_step_refuses(case):
    fn, types, pattern = COMPILE_REFUSED[case]
    refused(fn, types, pattern, f"compile_step[{case}]")


def test_compiled_step_refuses_another_batch_form_and_changes_nothing():
    model, opt = _model_and_opt()
    step = graphsafe.compile_step(model, _loss, opt)
    x, y = torch.tensor([[0, 1], [2, 5]]), torch.tensor([0.5, -0.5])
    step((x, y))
    before = [p.detach().clone() for p in model.parameters()]
    for bad in [(x[:1], y[:1]), (x.int(), y), (x.to(META), y.to(META)), (x,), (x, y, y)]:
        exc = refused(lambda: step(bad), ValueError, r"batch", "compiled step on another batch form")
        assert type(exc).__name__ == "InputMismatchError", type(exc)
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p.detach(), b)
    step((x, y))  # still steps
    assert any(not torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before))
