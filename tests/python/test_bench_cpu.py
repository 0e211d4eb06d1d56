"""`graphsafe bench --suite cpu`, run as a user runs it: a fresh interpreter outside the source tree, quick sizes."""

import json
import subprocess
import sys

import pytest

from graphsafe.bench.cpu import EMBEDDING_METHODS, OPTIMIZER_METHODS, embedding_cases, optimizer_cases


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bench_cpu")
    out = folder / "cpu.jsonl"
    result = subprocess.run([sys.executable, "-m", "graphsafe", "bench", "--suite", "cpu", "--device", "cpu", "--quick",
                             "--repeats", "1", "--json-out", str(out)], cwd=folder, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in out.read_text().splitlines()], result.stdout


def test_every_case_is_timed_for_every_method(quick_run):
    records, _ = quick_run
    timed = {(r["case"], r["method"]) for r in records if r.get("record") == "measurement" and r.get("ms_median", 0) > 0
             and "error" not in r}
    wanted = {(c.name, m) for c in optimizer_cases(True) for m in OPTIMIZER_METHODS}
    wanted |= {(c.name, m) for c in embedding_cases(True) for m in EMBEDDING_METHODS}
    assert wanted <= timed, sorted(wanted - timed)


def test_quick_sizes_leave_the_targets_unjudged(quick_run):
    records, stdout = quick_run
    verdicts = [r["status"] for r in records if r.get("record") == "target"]
    assert verdicts and set(verdicts) == {"SKIP"}
    assert "graphsafe 8-bit" in stdout and "index_add" in stdout


def test_methods_are_timed_in_turn_each_round_starting_one_further():
    from graphsafe.bench.timing import TimerConfig, time_in_turn

    calls = []
    fns = [lambda name=name: calls.append(name) for name in "abc"]
    timings = time_in_turn(fns, TimerConfig(warmup=1, repeats=4))
    assert calls[:3] == list("abc")  # the warm-up round
    rounds = [calls[3 + 3 * r: 6 + 3 * r] for r in range(4)]
    assert rounds == [list("abc"), list("bca"), list("cab"), list("abc")]
    assert [t.repeats for t in timings] == [4, 4, 4]
    assert all(0 <= t.ms_min <= t.ms_median for t in timings)
