"""The `graphsafe` command as a new user meets it (issue 18): errors, --version, the summary's wording, and the
first-run setup (requirements, Makefile, README, docs).

The user-facing runs start `python -m graphsafe ...` in a fresh interpreter with the working directory outside
the source tree; they run a few at a time (each pays torch's import). The many value checks run in-process through
graphsafe.cli.main, which parses exactly as the command does.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import graphsafe
from graphsafe.cli import build_parser, main
from graphsafe.trainer import default_config, train

ROOT = Path(__file__).resolve().parents[2]
TESTS = Path(__file__).resolve().parent

# name -> (arguments, exit code, the last line of stderr: exact text or a compiled pattern)
SUBPROCESS_CASES = {
    "version": (["--version"], 0, None),
    "lr-negative": (["train", "--lr", "-5"], 2,
                    "graphsafe train: error: argument --lr: must be a positive finite number, got -5"),
    "vocab-1": (["train", "--vocab", "1"], 2, "graphsafe train: error: argument --vocab: must be >= 8, got 1"),
    "steps-not-a-number": (["train", "--steps", "abc"], 2,
                           "graphsafe train: error: argument --steps: invalid positive integer value: 'abc'"),
    "dim-not-a-multiple-of-heads": (["train", "--device", "cpu", "--dim", "30"], 2,
                                    "graphsafe train: error: --dim must be a multiple of 4 (the attention heads at "
                                    "the cpu size), got 30"),
    "vocab-too-large": (["train", "--device", "cpu", "--vocab", "1000000000000"], 2,
                        re.compile(r"graphsafe train: error: these sizes need at least [\d.]+ GiB .*more than the "
                                   r"[\d.]+ GiB of this machine's memory; lower --vocab, --dim, --batch-size or "
                                   r"--seq-len")),
    "bench-repeats-0": (["bench", "--repeats", "0"], 2,
                        "graphsafe bench: error: argument --repeats: must be a positive integer, got 0"),
}


def _run_cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the installed package, as a user has it
    return subprocess.run([sys.executable, "-m", "graphsafe", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    cwd = tmp_path_factory.mktemp("user")
    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = {name: pool.submit(_run_cli, args, cwd) for name, (args, _, _) in SUBPROCESS_CASES.items()}
        return {name: future.result() for name, future in futures.items()}


@pytest.mark.parametrize("name", sorted(SUBPROCESS_CASES))
def test_cli_run_by_a_user(cli_runs, name):
    args, code, expected = SUBPROCESS_CASES[name]
    run = cli_runs[name]
    assert "Traceback" not in run.stderr, run.stderr
    assert "Failed to initialize NumPy" not in run.stderr, run.stderr
    assert run.returncode == code, (run.returncode, run.stdout, run.stderr)
    if name == "version":
        assert run.stdout.strip() == f"graphsafe {graphsafe.__version__}" == "graphsafe 0.1.0"
        return
    last = run.stderr.strip().splitlines()[-1]
    if isinstance(expected, str):
        assert last == expected
    else:
        assert expected.fullmatch(last), last
    assert "_positive_int" not in run.stderr and run.stdout == ""


# Every numeric option of `graphsafe train` and `graphsafe bench` with values that cannot run: each ends in one
# "graphsafe <command>: error: ..." line (after argparse's usage lines) and exit code 2, before any training.
BAD_VALUES = [
    (["train", "--lr", "0"], "argument --lr: must be a positive finite number, got 0"),
    (["train", "--lr", "nan"], "argument --lr: must be a positive finite number, got nan"),
    (["train", "--lr", "inf"], "argument --lr: must be a positive finite number, got inf"),
    (["train", "--lr", "fast"], "argument --lr: invalid number: 'fast'"),
    (["train", "--steps", "0"], "argument --steps: must be a positive integer, got 0"),
    (["train", "--steps", "-3"], "argument --steps: must be a positive integer, got -3"),
    (["train", "--steps", "1.5"], "argument --steps: invalid positive integer value: '1.5'"),
    (["train", "--batch-size", "0"], "argument --batch-size: must be a positive integer, got 0"),
    (["train", "--seq-len", "-1"], "argument --seq-len: must be a positive integer, got -1"),
    (["train", "--dim", "0"], "argument --dim: must be a positive integer, got 0"),
    (["train", "--layers", "0"], "argument --layers: must be a positive integer, got 0"),
    (["train", "--vocab", "0"], "argument --vocab: must be >= 8, got 0"),
    (["train", "--vocab", "many"], "argument --vocab: invalid integer value: 'many'"),
    (["train", "--seed", "-1"], "argument --seed: must be an integer from 0 to 4294967295, got -1"),
    (["train", "--seed", str(2**64)], f"argument --seed: must be an integer from 0 to 4294967295, got {2**64}"),
    (["train", "--seed", "x"], "argument --seed: invalid seed value: 'x'"),
    (["train", "--device", "cpu", "--dim", "6"], "--dim must be a multiple of 4 (the attention heads at the cpu "
                                                 "size), got 6"),
    (["train", "--device", "cpu", "--model", "recsys", "--moe"], "--moe applies to --model lm only"),
    (["bench", "--repeats", "-2"], "argument --repeats: must be a positive integer, got -2"),
    (["bench", "--repeats", "ten"], "argument --repeats: invalid positive integer value: 'ten'"),
    (["bench", "--seed", "-5"], "argument --seed: must be an integer from 0 to 4294967295, got -5"),
]
ABSURD_SIZES = [["--vocab", str(10**12)], ["--dim", str(10**7)], ["--layers", str(10**8)],
                ["--batch-size", str(10**7)], ["--seq-len", str(10**6)],
                ["--model", "recsys", "--vocab", str(10**12)]]


@pytest.mark.parametrize("args,message", BAD_VALUES, ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_bad_values_end_in_one_error_line(capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.strip().splitlines()[-1] == f"graphsafe {args[0]}: error: {message}"


@pytest.mark.parametrize("args", ABSURD_SIZES, ids=" ".join)
def test_absurd_sizes_are_refused_before_anything_is_allocated(capsys, args):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--device", "cpu", *args])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert re.fullmatch(r"graphsafe train: error: these sizes need at least [\d.]+ GiB .* memory; lower .*",
                        captured.err.strip().splitlines()[-1])


def test_bench_json_out_folder_must_exist(capsys, tmp_path):
    target = tmp_path / "missing" / "out.json"
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--json-out", str(target)])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"graphsafe bench: error: argument --json-out: cannot write {str(target)!r}: folder "
        f"{str(target.parent)!r} does not exist")


# ---------------------------------------------------------------------------------------------------------
# The summary says what it measured
# ---------------------------------------------------------------------------------------------------------

TINY = dict(vocab=64, dim=8, layers=1, seq_len=4, batch_size=2, progress=False)


def _row(text: str, label: str) -> str:
    rows = [line for line in text.splitlines() if line.startswith(f"| {label} ")]
    assert len(rows) == 1, (label, text)
    return rows[0].split("|")[2].strip()


def test_summary_on_the_cpu_reports_eager_and_what_the_time_is(capsys):
    """--mode full on the CPU: nothing is captured, so the summary says eager (not "full"); with 2 steps the
    time is step 2's (not a "median after the first 3 steps")."""
    train(default_config("cpu", steps=2, mode="full", **TINY))
    out = capsys.readouterr().out
    assert _row(out, "mode used").startswith("eager (CPU: no CUDA graphs; full asked for)")
    assert re.fullmatch(r"[\d.]+ ms \(step 2 alone; step 1: the trace\)", _row(out, r"step time (eager)"))
    assert "median after" not in out and "full, captured" not in out


def test_summary_step_time_wording():
    from graphsafe.trainer.run import RunStats

    trace, captured = "the trace", "the trace, 2 eager warm-up steps and the capture"
    times = RunStats(step_ms=[40.0, 3.0, 1.0, 2.0, 4.0])
    assert times.step_time(1, trace) == "2.50 ms (median of steps 2-5; step 1: the trace)"
    assert times.step_time(3, captured) == f"3.00 ms (median of steps 4-5; steps 1-3: {captured})"
    assert RunStats(step_ms=[4.0, 2.0]).step_time(3, captured) == (
        f"3.00 ms (mean of all 2 steps, {captured} included: too few steps to leave them out)")
    assert RunStats(step_ms=[5.0]).step_time(1, trace) == "5.00 ms (the only step, the trace included)"


def test_summary_mode_label_on_cuda():
    from graphsafe.trainer.run import _mode_label

    cuda = default_config("cuda")
    assert _mode_label(cuda, SimpleNamespace(mode="full", captured=True, warmup_steps=2)) == (
        "full (captured)", "full, captured", "the trace, 2 eager warm-up steps and the capture")
    assert _mode_label(cuda, SimpleNamespace(mode="piecewise", captured=False, warmup_steps=2))[:2] == (
        "piecewise (not captured yet: the capture is step 3)", "piecewise, not captured")
    assert _mode_label(default_config("cpu"), SimpleNamespace(mode="eager", captured=False, warmup_steps=2)) == (
        "eager (CPU: no CUDA graphs)", "eager", "the trace")


# ---------------------------------------------------------------------------------------------------------
# --moe: the cold half gets no token, the warm half shares them (docs/graph.md)
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_moe_routing_starts_with_only_the_cold_half_idle(seed):
    from graphsafe.trainer.data import LMData
    from graphsafe.trainer.models import TransformerLM

    config = default_config("cpu", moe=True, seed=seed)
    torch.manual_seed(seed)
    model = TransformerLM(config.vocab, config.dim, config.layers, config.heads, config.seq_len, config.experts)
    ids = next(LMData(config.vocab, config.batch_size, config.seq_len, seed, torch.device("cpu")))[0]
    assert model.experts_without_tokens(ids) == [4, 5, 6, 7]


def test_moe_summary_names_the_idle_experts(capsys):
    train(default_config("cpu", steps=2, moe=True, skip_zeros=True, **dict(TINY, vocab=256, dim=16, seq_len=8,
                                                                           batch_size=4)))
    moe = _row(capsys.readouterr().out, "MoE")
    assert moe.startswith("4 of 8 experts got no token in a fresh batch (4, 5, 6, 7; experts 4-7 start cold)")
    assert moe.endswith("cold experts' weights unchanged bitwise: yes")


# ---------------------------------------------------------------------------------------------------------
# First-run setup: requirements, Makefile, README, docs, pytest's summary
# ---------------------------------------------------------------------------------------------------------


def test_numpy_is_a_requirement():
    """torch warns "Failed to initialize NumPy" on every import without it."""
    requirements = (ROOT / "requirements-dev.txt").read_text().splitlines()
    assert "numpy" in [re.split(r"[<>=~ ]", line.strip())[0] for line in requirements]
    assert re.search(r'^dependencies = \[[^]]*"numpy', (ROOT / "pyproject.toml").read_text(), re.M)


def _make_dry_run(*args: str, **env: str) -> str:
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    environment = {k: v for k, v in os.environ.items() if k not in ("GRAPHSAFE_CUDA", "CMAKE_ARGS")} | env
    return subprocess.run(["make", "-n", "-C", str(ROOT), *args], env=environment, capture_output=True, text=True,
                          check=True).stdout


def test_make_install_shows_progress_and_passes_the_cuda_switch():
    default = _make_dry_run("install", "test-cpp")
    assert "echo \"==> installing the requirements" in default
    assert "echo \"==> building and installing graphsafe's C++/CUDA core" in default
    assert " -q" not in default  # pip's output shows; the build's through pip -v
    assert re.search(r'CMAKE_ARGS=" *-DGRAPHSAFE_CUDA=AUTO" \S+ -m pip install -v ', default)
    assert re.search(r"cmake -S \. -B \S+ .*-DGRAPHSAFE_CUDA=AUTO", default)  # CI's `make test`: CUDA when nvcc exists
    cpu_only = _make_dry_run("install", "test-cpp", GRAPHSAFE_CUDA="OFF")
    assert 'CMAKE_ARGS=" -DGRAPHSAFE_CUDA=OFF"' in cpu_only and "-DGRAPHSAFE_CUDA=OFF" in cpu_only.split("cmake -S")[1]


def test_readme_setup_covers_googletest_and_cpu_only_builds():
    setup = (ROOT / "README.md").read_text().split("## Three commands")[1].split("\n## ")[0]
    for needed in ("libgtest-dev", "GRAPHSAFE_GTEST_SOURCE_DIR", "GRAPHSAFE_CUDA=OFF make train", "make test"):
        assert needed in setup, needed


def test_docs_list_the_state_bits_the_cli_takes():
    train_parser = build_parser()._subparsers._group_actions[0].choices["train"]
    choices = next(a.choices for a in train_parser._actions if a.dest == "state_bits")
    assert f"`--state-bits {'|'.join(map(str, choices))}`" in (ROOT / "docs" / "graph.md").read_text()


def test_pytest_summary_counts_skips_by_reason(tmp_path):
    """tests/python/conftest.py's pytest_terminal_summary, loaded as a plugin into a pytest run of two skipping
    tests."""
    (tmp_path / "test_skips.py").write_text(textwrap.dedent("""
        import pytest

        @pytest.mark.parametrize("i", range(3))
        @pytest.mark.skipif(True, reason="needs a GPU")
        def test_gpu(i):
            pass

        def test_other():
            pytest.skip("not today")
    """))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider",
                          "--rootdir", str(tmp_path), "test_skips.py"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "skip reasons" in run.stdout
    assert "     3 skipped: needs a GPU" in run.stdout.splitlines()
    assert "     1 skipped: not today" in run.stdout.splitlines()
