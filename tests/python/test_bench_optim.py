"""The optim benchmark's report logic (not its timings): which graphsafe row a "≤ torch fused" target compares.

A bf16 row runs graphsafe twice, with its default fp32 states and with bf16 states (state_bits=16); the target
compares the row with the same storage as torch's (bf16 states for bf16 parameters, fp32 for fp32). Records
here are made up, so that each target's outcome is known."""

from __future__ import annotations

import torch

import graphsafe.bench.optim as bo
import graphsafe.bench.optim_report as bor
from graphsafe.bench.harness import BenchContext
from graphsafe.bench.timing import CopyBandwidth, TimerConfig


def context() -> BenchContext:
    return BenchContext(torch.device("cpu"), True, TimerConfig(1, 1), CopyBandwidth(100.0, 1, 1.0), lambda r: None)


def record(case: bo.OptimCase, method: str, ms: float, state_dtype: str) -> dict:
    return {"record": "measurement", "group": "compare", "case": case.label, "method": method,
            "impl": "fused" if method == "torch" else "graphsafe", "ms_median": ms, "ms_min": ms, "host_ms": ms,
            "gbps": 1.0, "pct_copy_bw": 1.0, "bytes_per_element": 14, "state_dtype": state_dtype}


def test_bf16_rows_compare_bf16_states_with_torch_and_fp32_rows_fp32_states():
    ctx = context()
    records = []
    for case in bo.compare_cases(ctx.quick):
        records.append(record(case, "torch", 1.0, dtype_of(case)))
        if case.dtype == torch.float32:
            records.append(record(case, "graphsafe", 0.5, "fp32"))  # faster: PASS
        else:
            records.append(record(case, "graphsafe", 2.0, "fp32"))  # fp32 states, slower: not what is compared
            records.append(record(case, bo.SAME_STORAGE_METHOD, 0.8, "bf16"))  # bf16 states, faster: PASS
    targets = {t.description: t for t in bo.evaluate_targets(records, ctx)}
    for case in bo.compare_cases(ctx.quick):
        states = "fp32" if case.dtype == torch.float32 else "bf16"
        target = targets[f"{case.label}: graphsafe ({states} states) ≤ torch fused"]
        assert target.status == "PASS", target
        assert target.value == ("0.500 vs 1.000 ms" if states == "fp32" else "0.800 vs 1.000 ms")
    table = bor._compare_table(bor._index(records), ctx)
    bf16_case = next(c for c in bo.compare_cases(ctx.quick) if c.dtype == torch.bfloat16)
    rows = [line for line in table.splitlines() if line.startswith(f"| {bf16_case.label} ")]
    assert len(rows) == 3 and "fp32" in rows[0] and "bf16" in rows[1] and "torch fused" in rows[2]


def test_a_missing_bf16_state_row_is_an_error_not_the_fp32_row():
    ctx = context()
    case = next(c for c in bo.compare_cases(ctx.quick) if c.dtype == torch.bfloat16)
    records = [record(case, "torch", 1.0, "bf16"), record(case, "graphsafe", 0.5, "fp32")]
    targets = {t.description: t for t in bo.evaluate_targets(records, ctx)}
    assert targets[f"{case.label}: graphsafe (bf16 states) ≤ torch fused"].status == "ERROR"


def dtype_of(case: bo.OptimCase) -> str:
    return "fp32" if case.dtype == torch.float32 else "bf16"


def test_host_bound_rounds_combine_to_each_methods_median():
    """A host-bound compare row's rounds (measure_compare_case) become one record per method: the median of the
    rounds' ms medians, the bandwidth recomputed from it, the smallest ms min; a failed round is the record."""
    ctx = context()
    case = bo.compare_cases(ctx.quick)[0]
    rounds = []
    for ms, ms_min, host in ((0.40, 0.38, 0.39), (0.70, 0.60, 0.69), (0.35, 0.33, 0.34)):
        r = record(case, "graphsafe", ms, "fp32") | {"ms_min": ms_min, "host_ms": host, "bytes": 10**9}
        rounds.append(r)
    combined = bo.combine_rounds(rounds, ctx)
    assert combined["ms_median"] == 0.40 and combined["ms_min"] == 0.33 and combined["host_ms"] == 0.39
    assert combined["rounds"] == [0.40, 0.70, 0.35]
    assert combined["gbps"] == round(10**9 / 0.40e-3 / 1e9, 2)
    failed = dict(rounds[1], error="out of memory")
    del failed["ms_median"]
    assert bo.combine_rounds([rounds[0], failed, rounds[2]], ctx) is failed
    assert bo.host_bound([rounds[0]]) and not bo.host_bound([dict(rounds[0], host_ms=0.1)])


def test_a_host_bound_row_on_cuda_is_measured_in_alternating_rounds(monkeypatch):
    """measure_compare_case: a row bound by the host (host ms near ms median) gets HOST_BOUND_ROUNDS rounds, the
    methods' order reversed every other round, and speed-ups from the combined medians; a device-bound row, or
    any row on the CPU, one round."""
    case = next(c for c in bo.compare_cases(True) if c.dtype == torch.bfloat16)
    calls = []
    host_share = {"value": 0.9}

    def fake(ctx, case_, method):
        calls.append(method)
        ms = {"torch": 1.0, "graphsafe": 0.8, bo.SAME_STORAGE_METHOD: 0.5}[method] + 0.01 * len(calls)
        return record(case_, method, ms, "bf16") | {"host_ms": host_share["value"] * ms, "bytes": 10**6}

    monkeypatch.setattr(bo, "measure_method", fake)
    cuda = BenchContext(torch.device("cuda"), True, TimerConfig(1, 1), CopyBandwidth(100.0, 1, 1.0), lambda r: None)
    records = bo.measure_compare_case(cuda, case)
    methods = bo.compare_methods(case)
    assert calls == [m for r in range(bo.HOST_BOUND_ROUNDS) for m in (methods[::-1] if r % 2 else methods)]
    assert [r["method"] for r in records] == methods and all(len(r["rounds"]) == bo.HOST_BOUND_ROUNDS for r in records)
    assert records[1]["speedup_vs_torch"] == round(records[0]["ms_median"] / records[1]["ms_median"], 3)
    for ctx, share in ((cuda, 0.1), (context(), 0.9)):
        calls.clear()
        host_share["value"] = share
        records = bo.measure_compare_case(ctx, case)
        assert calls == methods and "rounds" not in records[0]
    calls.clear()
    records = bo.measure_compare_case(context(), case, rounds_wanted=2)  # asked for: whatever the row
    assert calls == methods + methods[::-1] and len(records[0]["rounds"]) == 2
