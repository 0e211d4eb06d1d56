"""The optim benchmark's report logic (not its timings): which graphsafe row a "≤ torch fused" target compares.

A bf16 row runs graphsafe twice, with its default fp32 states and with bf16 states (state_bits=16); the target
compares the row with the same storage as torch's (bf16 states for bf16 parameters, fp32 for fp32). Records
here are made up, so that each target's outcome is known. The state_bits group (8-bit against 32-bit states, issue
22) also runs for real at quick sizes on the CPU."""

from __future__ import annotations

import torch

import graphsafe.bench.optim as bo
import graphsafe.bench.optim_cases as oc
import graphsafe.bench.optim_report as bor
from graphsafe.bench.harness import BenchContext
from graphsafe.bench.timing import CopyBandwidth, TimerConfig


def context() -> BenchContext:
    return BenchContext(torch.device("cpu"), True, TimerConfig(1, 1), CopyBandwidth(100.0, 1, 1.0), lambda r: None)


def record(case: bo.OptimCase, method: str, ms: float, state_dtype: str) -> dict:
    return {"record": "measurement", "group": case.group, "case": case.label, "method": method,
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


def cuda_context(quick: bool = True) -> BenchContext:
    """A CUDA context for made-up records and measure_method stand-ins (nothing touches a device)."""
    return BenchContext(torch.device("cuda"), quick, TimerConfig(1, 1), CopyBandwidth(100.0, 1, 1.0), lambda r: None)


def test_state_bits_rows_run_at_quick_sizes_on_the_cpu():
    """Each state_bits row, measured for real: 32-bit then 8-bit states over the same parameters, the 8-bit record's
    ratio against the 32-bit one and the storage its states really have (at quick sizes the ×200 tensors are under
    min_8bit_size and keep fp32 states); the targets are SKIPped at quick sizes but show both medians."""
    ctx = BenchContext(torch.device("cpu"), True, TimerConfig(1, 2), CopyBandwidth(100.0, 1, 1.0), lambda r: None)
    cases = bo.state_bits_cases(ctx.quick)
    assert [(c.algorithm, c.tensors, c.total) for c in cases] == [
        (a, n, 16 * 2**20 // oc.QUICK_DIVISOR) for a in ("AdamW", "Lion") for n in (1, 200)]
    a = bo.new_optimizer(cases[1], "graphsafe", ctx.device, ctx.seed)
    b = bo.new_optimizer(cases[1], bo.EIGHT_BIT_METHOD, ctx.device, ctx.seed)
    assert all(torch.equal(p, q) and torch.equal(p.grad, q.grad) for p, q in zip(bo._params(a), bo._params(b)))
    records = []
    for case in cases:
        base, eight = bo.measure_compare_case(ctx, case)
        assert (base["method"], eight["method"]) == ("graphsafe", bo.EIGHT_BIT_METHOD)
        assert "error" not in base and "error" not in eight, (base, eight)
        assert base["group"] == eight["group"] == "state_bits" and "rounds" not in eight
        assert eight["speedup_vs_32bit"] == round(base["ms_median"] / eight["ms_median"], 3)
        assert "speedup_vs_32bit" not in base and "speedup_vs_torch" not in eight
        assert base["state_dtype"] == "fp32" and base["tensors_by_state_dtype"] == {"fp32": case.tensors}
        storage = "8-bit" if case.tensors == 1 else "fp32"  # 16K elements ≥ min_8bit_size; 16K / 200 are not
        assert eight["state_dtype"] == storage and eight["tensors_by_state_dtype"] == {storage: case.tensors}
        records += [base, eight]
    targets = {t.description: t for t in bo.evaluate_targets(records, ctx)}
    table = bor._state_bits_table(bor._index(records), ctx)
    for case, (base, eight) in zip(cases, zip(records[::2], records[1::2])):
        target = targets[f"{case.label}: 8-bit ≤ 32-bit states"]
        assert target.status == "SKIP" and target.value == f"{eight['ms_median']:.3f} vs {base['ms_median']:.3f} ms"
        row = next(line for line in table.splitlines() if line.startswith(f"| {case.label} "))
        assert f"{eight['speedup_vs_32bit']:.2f}" in row and eight["state_dtype"] in row
    assert "### 8-bit against 32-bit states" in bo.render(records, ctx)


def test_state_bits_target_follows_the_two_records():
    """8-bit ≤ 32-bit: PASS or MISS from the two medians on CUDA at full sizes; SKIP at quick sizes or off CUDA;
    ERROR where a record is missing or failed, or where the 8-bit method's states are not all 8-bit."""
    case = bo.state_bits_cases(False)[1]
    description = f"{case.label}: 8-bit ≤ 32-bit states"

    def verdict(ms_8: float | None, ms_32: float, ctx: BenchContext, storage: str = "8-bit"):
        eight = record(case, bo.EIGHT_BIT_METHOD, ms_8, storage) if ms_8 is not None else {
            "record": "measurement", "group": case.group, "case": case.label, "method": bo.EIGHT_BIT_METHOD,
            "error": "out of memory"}
        targets = bo.evaluate_targets([record(case, "graphsafe", ms_32, "fp32"), eight], ctx)
        return next(t for t in targets if t.description == description)

    full = cuda_context(quick=False)
    assert verdict(0.24, 0.25, full).status == "PASS" and verdict(0.25, 0.25, full).status == "PASS"
    missed = verdict(0.27, 0.25, full)
    assert missed.status == "MISS" and missed.value == "0.270 vs 0.250 ms"
    assert verdict(0.24, 0.25, full, "8-bit ×150, fp32 ×50").status == "ERROR"
    failed = verdict(None, 0.25, full)
    assert failed.status == "ERROR" and failed.note == "out of memory"
    cpu = BenchContext(torch.device("cpu"), False, TimerConfig(1, 1), CopyBandwidth(100.0, 1, 1.0), lambda r: None)
    assert (verdict(0.27, 0.25, cpu).status, verdict(0.27, 0.25, cpu).note) == ("SKIP", "target is for CUDA")
    quick_case = bo.state_bits_cases(True)[1]
    quick_targets = bo.evaluate_targets([record(quick_case, "graphsafe", 0.25, "fp32"),
                                         record(quick_case, bo.EIGHT_BIT_METHOD, 0.27, "fp32")], cuda_context())
    quick_target = next(t for t in quick_targets if t.description == f"{quick_case.label}: 8-bit ≤ 32-bit states")
    assert (quick_target.status, quick_target.note) == ("SKIP", "target is for full sizes")


def test_a_failing_8bit_method_is_an_error_not_a_crash(monkeypatch):
    """The 8-bit method failing leaves the 32-bit record, an error record for the 8-bit one (no ratio), an ERROR
    target with its message, and the table and error list drawn."""
    real = bo.graphsafe_optimizer

    def refuse_8bit(algorithm, params, state_bits=32):
        if state_bits == 8:
            raise RuntimeError("8-bit states refused")
        return real(algorithm, params, state_bits)

    monkeypatch.setattr(bo, "graphsafe_optimizer", refuse_8bit)
    ctx = context()
    case = bo.state_bits_cases(ctx.quick)[0]
    base, eight = bo.measure_compare_case(ctx, case)
    assert "ms_median" in base and "8-bit states refused" in eight["error"]
    assert "ms_median" not in eight and "speedup_vs_32bit" not in eight
    target = next(t for t in bo.evaluate_targets([base, eight], ctx) if t.description.startswith(case.label))
    assert target.status == "ERROR" and "refused" in target.note
    text = bo.render([base, eight], ctx)
    assert f"- state_bits {case.label} {bo.EIGHT_BIT_METHOD}: " in text
    row = next(line for line in text.splitlines() if line.startswith(f"| {case.label} "))
    assert row.split("|")[3].strip() == "-"  # the 8-bit ms cell


def test_state_bits_rows_on_cuda_always_take_alternating_rounds(monkeypatch):
    """On CUDA a state_bits row is measured in HOST_BOUND_ROUNDS alternating rounds even when no method looks bound
    by the host (its ×200 steps are, and the host drifts); its ratio is the 32-bit median / the 8-bit one."""
    case = bo.state_bits_cases(True)[1]
    calls = []

    def fake(ctx, case_, method):
        calls.append(method)
        ms = {"graphsafe": 1.0, bo.EIGHT_BIT_METHOD: 0.9}[method] + 0.01 * len(calls)
        return record(case_, method, ms, "8-bit") | {"host_ms": 0.1 * ms, "bytes": 10**6}

    monkeypatch.setattr(bo, "measure_method", fake)
    records = bo.measure_compare_case(cuda_context(), case)
    methods = ["graphsafe", bo.EIGHT_BIT_METHOD]
    assert calls == [m for r in range(bo.HOST_BOUND_ROUNDS) for m in (methods[::-1] if r % 2 else methods)]
    assert all(len(r["rounds"]) == bo.HOST_BOUND_ROUNDS for r in records)
    assert records[1]["speedup_vs_32bit"] == round(records[0]["ms_median"] / records[1]["ms_median"], 3)
    calls.clear()
    bo.measure_compare_case(context(), case)
    assert calls == methods
