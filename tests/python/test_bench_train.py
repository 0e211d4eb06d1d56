"""The train suite's cases at quick sizes on the CPU: each model trains under each method the suite times, the
Hugging Face Llama included, and the targets (CUDA's) are left unjudged. torch.compile's method is left to the GPU
run (its compile takes minutes on two cores); the others are what the suite's records and targets are made of."""

import pytest
import torch

from graphsafe.bench.harness import BenchContext
from graphsafe.bench.timing import TimerConfig
from graphsafe.bench.train import WORKLOADS, evaluate_targets, measure

METHODS = ("graphsafe captured", "graphsafe eager", "torch eager")


@pytest.fixture(scope="module")
def records():
    ctx = BenchContext(device=torch.device("cpu"), quick=True, timer=TimerConfig(warmup=0, repeats=1),
                       copy_bandwidth=None, emit=lambda record: None)
    out = []
    for name, make in WORKLOADS.items():
        if name == "llama":
            pytest.importorskip("transformers")
        workload = make(ctx)
        out += [measure(ctx, workload, method) for method in METHODS if method in workload.methods]
    return out, ctx


def test_every_case_trains_under_every_method(records):
    records, _ = records
    timed = {(r["case"], r["method"]) for r in records if "error" not in r and r["wall_ms"] > 0}
    assert timed == {(case, method) for case in WORKLOADS for method in METHODS}, [r.get("error") for r in records]


def test_targets_are_for_cuda(records):
    records, ctx = records
    targets = evaluate_targets(records, ctx)
    assert {t.status for t in targets} == {"SKIP"} and len(targets) == 3
