"""The optim benchmark's report logic (not its timings): which graphsafe row a "≤ torch fused" target compares.

A bf16 row runs graphsafe twice, with its default fp32 states and with bf16 states (state_bits=16); the target
compares the row with the same storage as torch's (bf16 states for bf16 parameters, fp32 for fp32). Records
here are made up, so that each target's outcome is known."""

from __future__ import annotations

import torch

import graphsafe.bench.optim as bo
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
    table = bo._compare_table(bo._index(records), ctx)
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
