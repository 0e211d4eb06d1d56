"""The embedding suite's token sweep (graphsafe/bench/embedding_sweep.py): its records from a quick CPU run, and its
targets from hand-made records."""

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from graphsafe.bench import embedding_sweep
from graphsafe.bench.harness import Target


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bench_embedding")
    out = folder / "embedding.jsonl"
    result = subprocess.run([sys.executable, "-m", "graphsafe", "bench", "--suite", "embedding", "--device", "cpu",
                             "--quick", "--repeats", "1", "--json-out", str(out)], cwd=folder, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in out.read_text().splitlines()], result.stdout


def test_every_sweep_point_is_timed_eagerly_for_every_method(quick_run):
    records, stdout = quick_run
    sweep = embedding_sweep.sweep_records(records)
    assert not [r for r in sweep if "error" in r]
    found = {(r["case_name"], r["N"], r["method"], r["mode"]): r for r in sweep}
    configs = embedding_sweep.configs_for(True)
    for config in configs:
        for n in embedding_sweep.QUICK_TOKENS:
            for method in embedding_sweep.METHODS:
                record = found[(config.name, n, method, "eager")]
                assert record["ms_median"] > 0 and record["V"] == config.num_weights and record["D"] == config.dim
                assert record["bytes"] > 0 and record["pct_copy_bw"] > 0
            assert found[(config.name, n, "graphsafe", "eager")]["speedup_vs_index_add"] > 0
    assert {r["mode"] for r in sweep} == {"eager"}  # replays need CUDA
    assert len(sweep) == len(configs) * len(embedding_sweep.QUICK_TOKENS) * len(embedding_sweep.METHODS)
    assert "token sweep" in stdout and "vocab-128k" in stdout


def test_sweep_targets_of_a_quick_cpu_run(quick_run):
    records, _ = quick_run
    targets = [r for r in records if r.get("record") == "target" and r["description"].startswith("sweep")]
    assert len(targets) == 2 * len(embedding_sweep.CONFIGS)  # eager ≤ index_add, and the floor (unjudged here)
    assert {t["status"] for t in targets if "floor" in t["description"]} == {"SKIP"}
    assert {t["status"] for t in targets if "floor" not in t["description"]} <= {"PASS", "MISS"}


def _record(config, n, method, mode, ms, pct=50.0):
    return {"record": "measurement", "suite": "embedding", "part": "sweep", "case_name": config, "N": n,
            "method": method, "mode": mode, "ms_median": ms, "pct_copy_bw": pct}


def test_sweep_targets_judge_every_point_and_the_floor():
    ctx = SimpleNamespace(device=torch.device("cuda"), quick=False)
    tokens = embedding_sweep.TOKENS
    records = []
    for config in embedding_sweep.CONFIGS:
        for n in tokens:
            for mode in embedding_sweep.MODES:
                slower = config.name == "vocab-32k" and mode == "replayed" and n == 1024
                records.append(_record(config.name, n, "index_add", mode, 1.0))
                records.append(_record(config.name, n, "graphsafe", mode, 1.5 if slower else 0.5,
                                       pct=85.0 if config.name == "vocab-128k" else 60.0))
    verdicts = {t.description.split(":")[0]: t for t in embedding_sweep.evaluate_sweep(records, ctx, Target)}
    assert verdicts["sweep vocab-32k eager"].status == "PASS"
    assert verdicts["sweep vocab-32k replayed"].status == "MISS"
    assert "N=[1024]" in verdicts["sweep vocab-32k replayed"].note
    assert verdicts["sweep vocab-128k replayed"].status == "PASS"
    assert verdicts["sweep vocab-32k"].status == "MISS" and verdicts["sweep vocab-128k"].status == "PASS"
    # A point left unmeasured is an error, not a pass.
    partial = [r for r in records if not (r["N"] == tokens[0] and r["method"] == "index_add")]
    statuses = {t.status for t in embedding_sweep.evaluate_sweep(partial, ctx, Target) if "index_add" in t.description}
    assert statuses == {"ERROR"}
