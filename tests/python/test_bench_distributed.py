"""The `dist` benchmark suite (graphsafe/bench/distributed.py): its arithmetic against hand-computed values, its
verdicts on made-up records, and one quick CPU run end to end (2 gloo processes spawned by the suite itself)."""

from __future__ import annotations

import json

import pytest
import torch

import graphsafe.bench.distributed as bd
from graphsafe.bench import BenchOptions, run_bench, suites
from graphsafe.bench.harness import BenchContext
from graphsafe.bench.timing import CopyBandwidth, TimerConfig


def record(model: str, method: str, nproc: int, tput: float) -> dict:
    return {"record": "measurement", "suite": "dist", "model": model, "method": method, "nproc": nproc,
            "unit": "tokens" if model == "lm" else "rows", "throughput": tput, "ms_median": 1.0, "comm_ms": 0.1}


def records(captured_1: float, captured_2: float, ddp_1: float, ddp_2: float) -> list[dict]:
    return [record("lm", "graphsafe captured", 1, captured_1), record("lm", "torch DDP", 1, ddp_1),
            record("lm", "graphsafe captured", 2, captured_2), record("lm", "torch DDP", 2, ddp_2)]


def test_throughput_and_efficiency_by_hand():
    # 32 rows x 128 tokens per rank, 2 ranks, 4 ms per step: 8192 tokens per 4 ms = 2,048,000 tokens/s
    assert bd.throughput(32 * 128, 2, 4.0) == pytest.approx(2_048_000.0)
    assert bd.throughput(8192, 1, 2.0) == pytest.approx(4_096_000.0)
    # 1.8M tokens/s on 2 ranks against 1.0M on one: 1.8 / (2 x 1.0) = 0.9
    assert bd.scaling_efficiency(1.8e6, 1.0e6, 2) == pytest.approx(0.9)
    assert bd.scaling_efficiency(3.0e6, 1.0e6, 4) == pytest.approx(0.75)


def test_add_comparisons_fills_efficiency_and_ratio_to_torch_ddp():
    rs = records(captured_1=1000.0, captured_2=1900.0, ddp_1=500.0, ddp_2=800.0)
    bd.add_comparisons(rs)
    by = {(r["method"], r["nproc"]): r for r in rs}
    assert "efficiency" not in by["graphsafe captured", 1]
    assert by["graphsafe captured", 2]["efficiency"] == pytest.approx(1900 / 2000)
    assert by["torch DDP", 2]["efficiency"] == pytest.approx(800 / 1000)
    assert by["graphsafe captured", 2]["vs_torch_ddp"] == pytest.approx(1900 / 800)
    assert by["graphsafe captured", 1]["vs_torch_ddp"] == pytest.approx(2.0)
    assert by["torch DDP", 2]["vs_torch_ddp"] == pytest.approx(1.0)


@pytest.mark.parametrize("captured_2, ddp_2, expected", [
    (1900.0, 1000.0, ("PASS", "PASS")),  # 1.90x DDP; 1900 >= 1.8 x 1000
    (1400.0, 1000.0, ("MISS", "MISS")),  # 1.40x DDP; 1400 < 1800
    (1800.0, 1200.0, ("PASS", "PASS")),  # exactly 1.5x and exactly 1.8x pass
    (1790.0, 1000.0, ("PASS", "MISS")),
])
def test_verdicts_on_cuda_with_two_gpus(captured_2, ddp_2, expected):
    targets = bd.verdicts(records(1000.0, captured_2, 600.0, ddp_2), "cuda", 2, quick=False)
    assert tuple(t.status for t in targets) == expected
    assert targets[0].threshold == "≥ 1.5x" and targets[1].threshold == "≥ 1.8x (0.9 × 2)"
    assert targets[0].value.startswith(f"{captured_2 / ddp_2:.2f}x")
    assert targets[1].value.startswith(f"{captured_2 / 1000.0:.2f}x")


def test_verdicts_skip_on_cpu_and_below_two_gpus_with_the_reason():
    cpu = bd.verdicts(records(1000.0, 1900.0, 600.0, 1000.0), "cpu", 2, quick=True)
    assert [t.status for t in cpu] == ["SKIP", "SKIP"]
    assert all("no verdict" in t.note and t.value for t in cpu)  # reported, no verdict
    one = bd.verdicts([record("lm", "graphsafe captured", 1, 1000.0), record("lm", "torch DDP", 1, 600.0)],
                      "cuda", 1, quick=False)
    assert [t.status for t in one] == ["SKIP", "SKIP"]
    assert all("fewer than 2 GPUs" in t.note for t in one)
    # a failed measurement on 2 GPUs is an ERROR naming the failure, not a PASS or MISS
    failed = records(1000.0, 1900.0, 600.0, 1000.0)
    failed[2] = {k: v for k, v in failed[2].items() if k != "throughput"} | {"error": "rank 1 of 2 exited"}
    assert [t.status for t in bd.verdicts(failed, "cuda", 2, quick=False)] == ["ERROR", "ERROR"]


def test_nproc_from_the_environment(monkeypatch):
    monkeypatch.delenv(bd.NPROC_ENV, raising=False)
    assert bd.nproc_for(torch.device("cpu")) == 2
    monkeypatch.setenv(bd.NPROC_ENV, "3")
    assert bd.nproc_for(torch.device("cpu")) == 3
    for bad in ("0", "two"):
        monkeypatch.setenv(bd.NPROC_ENV, bad)
        with pytest.raises(SystemExit, match=bd.NPROC_ENV):
            bd.nproc_for(torch.device("cpu"))


def test_a_group_past_its_time_limit_is_ended_and_reported():
    ctx = BenchContext(torch.device("cpu"), True, TimerConfig(1, 1), CopyBandwidth(1.0, 1, 1.0), lambda r: None)
    spec = {"device": "cpu", "steps": 1, "warmup": 1, "configs": bd.configs(ctx), "methods": ["torch DDP"],
            "threads_per_rank": 1}
    out = bd.launch_group(1, spec, timeout=0.2)  # the rank cannot even import torch in that time
    assert [(r["model"], r["method"]) for r in out] == [("lm", "torch DDP"), ("recsys", "torch DDP")]
    assert all("ran past the time limit" in r["error"] for r in out)


def test_quick_cpu_run_end_to_end_with_two_processes(monkeypatch, capsys, tmp_path):
    assert "dist" in suites()
    monkeypatch.setenv(bd.NPROC_ENV, "2")
    json_out = tmp_path / "dist.jsonl"
    assert run_bench(BenchOptions(suites=["dist"], device="cpu", quick=True, repeats=3, json_out=str(json_out))) == 0
    out = capsys.readouterr().out
    lines = [json.loads(line) for line in json_out.read_text().splitlines()]
    measurements = [r for r in lines if r["record"] == "measurement"]
    assert {(r["model"], r["method"], r["nproc"]) for r in measurements} == {
        (m, method, n) for m in bd.MODELS for method in bd.METHODS for n in (1, 2)}
    for r in measurements:
        assert "error" not in r, r
        for key in ("mode", "ms_median", "throughput", "comm_ms", "comm_what", "backend", "unit", "loss"):
            assert key in r, (key, r)
        assert r["backend"] == "gloo" and r["ms_median"] > 0 and r["throughput"] > 0 and r["comm_ms"] >= 0
        assert r["steps_timed"] == 3
        assert r["global_batch"] == r["batch_per_rank"] * r["nproc"]
        if r["nproc"] == 2:
            assert r["efficiency"] == pytest.approx(bd.scaling_efficiency(
                r["throughput"], bd._find(measurements, r["model"], r["method"], 1)["throughput"], 2))
    # the same data and seed: the two graphsafe paths and torch DDP train the same model
    for m in bd.MODELS:
        for n in (1, 2):
            losses = [bd._find(measurements, m, method, n)["loss"] for method in bd.METHODS[:3]]
            assert max(losses) - min(losses) < 1e-2 * max(losses), (m, n, losses)
    targets = [r for r in lines if r["record"] == "target"]
    assert [t["status"] for t in targets] == ["SKIP", "SKIP"]
    assert all("cpu" in t["note"] and "no verdict" in t["note"] for t in targets)
    assert "## data parallel" in out and "| model  | method" in out and "scaling eff." in out
    assert out.count("| lm     |") == 8 and out.count("| recsys |") == 8
    assert "SKIP (cpu: gloo, no CUDA graphs; reported, no verdict)" in out
