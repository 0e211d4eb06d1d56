"""`graphsafe train` across processes on the CPU (gloo): `--nproc 2` end to end for the LM (DDP, FSDP2) and the
recommender (DDP), the documented torchrun command, a world of one in this process, and the argument errors.

The reference for a data-parallel run is the single-process run with the global batch: rank r trains on rows
r*b..(r+1)*b-1 of the batch a single process draws with --batch-size 2b (trainer/data.py), and the progress line
shows the mean of the ranks' losses, so the two runs' losses agree to rounding (the mean of two half-batch means
and the gradient average are summed in another order than one mean over the whole batch). A world of one equals
the plain run bitwise (its all-reduce is a sum over one rank of grad * 1.0).

Each multi-process run starts 2 Python processes (seconds of CPU each for importing torch): sizes are tiny.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from distributed_harness import FSDP2_AVAILABLE, GLOO_AVAILABLE

from graphsafe.cli import main

SMALL = ["--device", "cpu", "--vocab", "512", "--dim", "32", "--layers", "1", "--seed", "3"]
SMALL_RECSYS = ["--device", "cpu", "--model", "recsys", "--vocab", "512", "--dim", "16", "--seed", "3"]
requires_gloo = pytest.mark.skipif(not GLOO_AVAILABLE, reason="needs torch.distributed with the gloo backend")


def _run(args: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env)


def _losses(text: str) -> list[float]:
    return [float(line.split("loss")[1].split()[0]) for line in text.splitlines() if line.startswith("step ")]


def _row(text: str, label: str) -> str:
    rows = [line for line in text.splitlines() if line.startswith(f"| {label} ")]
    assert len(rows) == 1, (label, text)
    return rows[0].split("|")[2].strip()


def _single_process_losses(capsys, args: list[str]) -> list[float]:
    assert main(["train", *args]) == 0
    return _losses(capsys.readouterr().out)


def _close(a: list[float], b: list[float], tol: float = 2e-3) -> bool:
    # the progress line prints 4 decimals; the runs differ by summation order only
    return len(a) == len(b) and all(abs(x - y) <= tol * max(1.0, abs(y)) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def ddp_lm_run():
    return _run(["-m", "graphsafe", "train", "--nproc", "2", "--parallel", "ddp", "--steps", "3",
                 "--check-determinism", *SMALL])


@requires_gloo
def test_nproc_ddp_trains_the_lm_and_rank_0_reports(ddp_lm_run, capsys):
    run = ddp_lm_run
    assert run.returncode == 0, run.stderr[-4000:]
    out = run.stdout
    assert len(_losses(out)) == 3 and out.count("graphsafe train:") == 1 and out.count("| world size ") == 1
    assert _row(out, "world size") == ("2 (2 processes (--nproc), gloo, cpu); each rank trains on its own 8 rows of a "
                                       "global batch of 16")
    assert _row(out, "parallel").startswith("ddp: DistributedDataParallel traced without its hooks; the gradient "
                                            "all-reduce is in the traced step (1 bucket(s) in parameter order")
    assert re.fullmatch(r"[\d.]+ ms \(\d+% of the step time\): 1 gradient all-reduce\(s\), [\d.]+ MiB per step, "
                        r"timed alone after training \(median of 5\)", _row(out, "communication"))
    assert _row(out, "replicas") == "parameters bitwise identical on all 2 ranks"
    assert _row(out, "determinism").startswith("bitwise equal (") and "on each of 2 ranks" in _row(out, "determinism")
    assert _row(out, "loss").endswith("(3 steps; mean over 2 ranks)")
    # the same global batches in one process
    assert _close(_losses(out), _single_process_losses(capsys, ["--steps", "3", "--batch-size", "16", *SMALL]))


@requires_gloo
def test_nproc_ddp_trains_the_recommender(capsys):
    run = _run(["-m", "graphsafe", "train", "--nproc", "2", "--steps", "3", "--batch-size", "32", *SMALL_RECSYS])
    assert run.returncode == 0, run.stderr[-4000:]
    assert _row(run.stdout, "world size").startswith("2 (2 processes (--nproc), gloo, cpu)")
    assert _row(run.stdout, "parallel").startswith("ddp:")  # --parallel ddp is the default with --nproc 2
    reference = _single_process_losses(capsys, ["--steps", "3", "--batch-size", "64", *SMALL_RECSYS])
    assert _close(_losses(run.stdout), reference)


@pytest.mark.skipif(not FSDP2_AVAILABLE, reason="needs torch.distributed with gloo and FSDP2")
def test_nproc_fsdp2_trains_the_lm_like_ddp(ddp_lm_run):
    run = _run(["-m", "graphsafe", "train", "--nproc", "2", "--parallel", "fsdp2", "--steps", "3", *SMALL])
    assert run.returncode == 0, run.stderr[-4000:]
    out = run.stdout
    assert _row(out, "parallel").startswith("fsdp2: fully_shard per block and on the model")
    assert _row(out, "mode used").startswith("eager (not traced): not traced (fsdp2: 2 finding(s)")
    assert re.match(r"[\d.]+ ms .*: 3 all-gather\(s\) and 2 reduce-scatter\(s\)", _row(out, "communication"))
    assert _row(out, "optimizer state").endswith("this rank's shards")
    assert _close(_losses(out), _losses(ddp_lm_run.stdout))


@requires_gloo
def test_the_documented_torchrun_command_trains(ddp_lm_run):
    run = _run(["-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "graphsafe", "train", "--parallel", "ddp",
                "--steps", "3", *SMALL])
    assert run.returncode == 0, run.stderr[-4000:]
    assert _row(run.stdout, "world size").startswith("2 (2 processes (torchrun), gloo, cpu)")
    assert _losses(run.stdout) == _losses(ddp_lm_run.stdout)


@requires_gloo
def test_parallel_ddp_alone_is_a_world_of_one_equal_to_the_plain_run(capsys):
    import torch.distributed as dist
    assert main(["train", "--parallel", "ddp", "--steps", "2", *SMALL]) == 0
    out = capsys.readouterr().out
    assert _row(out, "world size").startswith("1 (1 process (in-process), gloo, cpu)")
    assert not dist.is_initialized()  # the run's own group is gone
    assert _losses(out) == _single_process_losses(capsys, ["--steps", "2", *SMALL])


@requires_gloo
def test_a_failing_rank_ends_the_launch_with_one_error_line(capfd):
    from graphsafe.trainer.parallel import launch
    # the ranks' own argument check fails (exit status 2 after argparse's message)
    assert launch(2, ["train", "--device", "cpu", "--steps", "0"]) == 1
    err = capfd.readouterr().err.strip().splitlines()
    assert "graphsafe train: error: argument --steps: must be a positive integer, got 0" in err
    assert re.fullmatch(r"graphsafe train: error: rank [01] of 2 exited with status 2 \(its error is above\); the "
                        r"other ranks were stopped", err[-1])


BAD = [
    (["--nproc", "0"], "argument --nproc: must be a positive integer, got 0"),
    (["--nproc", "two"], "argument --nproc: invalid positive integer value: 'two'"),
    (["--nproc", "2", "--parallel", "none"], "--nproc 2 with --parallel none would train 2 independent copies; use "
                                             "--parallel ddp or fsdp2"),
    (["--parallel", "fsdp2", "--mode", "full"], "--parallel fsdp2 cannot run --mode full: FSDP2's collectives run in "
                                                "module hooks that compile_step cannot trace, so its step runs eagerly "
                                                "(use --mode auto or eager, or --parallel ddp to capture)"),
    (["--parallel", "fsdp2", "--mode", "piecewise"], "--parallel fsdp2 cannot run --mode piecewise: FSDP2's "
                                                     "collectives run in module hooks that compile_step cannot trace, "
                                                     "so its step runs eagerly (use --mode auto or eager, or "
                                                     "--parallel ddp to capture)"),
]


@pytest.mark.parametrize("args,message", BAD, ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_bad_parallel_arguments_end_in_one_error_line(capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--device", "cpu", *args])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.strip().splitlines()[-1] == f"graphsafe train: error: {message}"


def test_unknown_parallel_mode_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--device", "cpu", "--parallel", "zero3"])
    assert exit_info.value.code == 2
    # how argparse quotes the choices differs between Python versions
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(
        "graphsafe train: error: argument --parallel: invalid choice: 'zero3' (choose from ")


def test_nproc_under_torchrun_is_an_error(capsys, monkeypatch):
    for name, value in dict(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="1").items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("GRAPHSAFE_LAUNCHED", raising=False)
    for args, message in ((["--nproc", "2"], "--nproc starts the processes itself; under torchrun leave it out "
                                             "(torchrun's --nproc-per-node sets the number of processes)"),
                          (["--parallel", "none"], "--parallel none in a world of 2 processes would train 2 "
                                                   "independent copies; use --parallel ddp or fsdp2")):
        with pytest.raises(SystemExit) as exit_info:
            main(["train", "--device", "cpu", *args])
        assert exit_info.value.code == 2
        assert capsys.readouterr().err.strip().splitlines()[-1] == f"graphsafe train: error: {message}"
