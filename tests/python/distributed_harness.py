"""Multi-process tests without a launcher: run_in_processes(fn, world_size, ...) starts world_size fresh Python
processes (subprocess, not fork: the test process has torch's and OpenMP's threads running), joins them into one
gloo process group through a FileStore in a scratch folder, calls fn(rank, world_size, *args) in each, and returns
what each rank's fn returned (saved with torch.save, loaded back here), in rank order.

Bounded in time: past `timeout` seconds every child still running is killed and the test fails, naming the ranks
that did not finish, with the tail of each rank's output. When a rank raises, its traceback is forwarded (the
others are given `grace` seconds to finish, then killed: they may be waiting in a collective for the failed one),
and the test fails with every failed rank's traceback. The processes started here are ended by their ids, never
by name.

fn must be a module-level function of an importable module (a test module: pytest puts this folder on sys.path,
and the children get the parent's sys.path); its arguments and results must survive torch.save / torch.load
(tensors, numbers, strings, lists, dicts, tuples). Each child runs with one intra-op thread (OMP_NUM_THREADS=1): CI
has 2 cores, and 3 ranks with a thread pool each would only contend.

Skip markers: `requires_gloo` (torch.distributed built with gloo) and `requires_fsdp2` (also fully_shard).
"""

from __future__ import annotations

import importlib
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

__all__ = ["run_in_processes", "DistributedTestFailure", "requires_gloo", "requires_fsdp2", "GLOO_AVAILABLE",
           "FSDP2_AVAILABLE"]


def _gloo_available() -> bool:
    try:
        import torch.distributed as dist
        return bool(dist.is_available() and dist.is_gloo_available())
    except Exception:
        return False


def _fsdp2_available() -> bool:
    if not GLOO_AVAILABLE:
        return False
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
        from torch.distributed.tensor import DTensor  # noqa: F401
        return True
    except Exception:
        return False


GLOO_AVAILABLE = _gloo_available()
FSDP2_AVAILABLE = _fsdp2_available()
requires_gloo = pytest.mark.skipif(not GLOO_AVAILABLE, reason="needs torch.distributed with the gloo backend")
requires_fsdp2 = pytest.mark.skipif(
    not FSDP2_AVAILABLE,
    reason="needs torch.distributed with gloo, DTensor and FSDP2 (torch.distributed.fsdp.fully_shard)")


class DistributedTestFailure(AssertionError):
    """A multi-process test failed: a rank raised or died, or the run went past its time limit."""


def run_in_processes(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 90.0,
                     grace: float = 5.0, workdir: str | os.PathLike | None = None,
                     backend: str = "gloo") -> list[Any]:
    """fn(rank, world_size, *args) in world_size processes of one process group; returns their results in rank
    order, or raises DistributedTestFailure (see the module's docstring). workdir: a scratch folder (a test's
    tmp_path); a new temporary one when None."""
    __tracebackhide__ = True  # pytest: show the ranks' tracebacks, not this function's source
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or module == "__main__" or "<locals>" in qualname or "." in qualname:
        raise ValueError(f"run_in_processes: fn must be a module-level function of an importable module, got "
                         f"{module}.{qualname}")
    if world_size < 1:
        raise ValueError(f"run_in_processes: world_size must be >= 1, got {world_size}")
    root = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="graphsafe-dist-"))
    run_dir = Path(tempfile.mkdtemp(prefix="run-", dir=root))
    with open(run_dir / "call.pkl", "wb") as f:
        pickle.dump({"module": module, "qualname": qualname, "world_size": world_size, "backend": backend,
                     "timeout": timeout}, f)
    torch.save(args, run_dir / "args.pt")
    # PYTHONFAULTHANDLER: a rank killed by a signal (a crash in native code) writes every thread's Python stack to
    # its log first, which the failure shows.
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
               PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1")
    procs: list[subprocess.Popen] = []
    logs = []
    try:
        for rank in range(world_size):
            log = open(run_dir / f"rank{rank}.log", "wb")
            logs.append(log)
            procs.append(subprocess.Popen(
                [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
                 "import distributed_harness as h; h._child_main()", str(run_dir), str(rank)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env))
        timed_out, stopped = _wait(procs, time.monotonic() + timeout, grace)
    finally:
        for proc in procs:  # every child still running (a failure above, or this test interrupted)
            _kill(proc)
        for log in logs:
            log.close()
    failures = []
    for rank, proc in enumerate(procs):
        if proc.returncode == 0:
            continue
        err = run_dir / f"rank{rank}.err"
        if err.exists():
            failures.append(f"--- rank {rank} raised:\n{err.read_text()}")
        elif rank in stopped:
            failures.append(f"--- rank {rank} was still running {grace:g} s after another rank failed (killed); its "
                            f"output ended with:\n{_tail(run_dir / f'rank{rank}.log')}")
        elif rank in timed_out:
            failures.append(f"--- rank {rank} did not finish within {timeout:g} s (killed); its output ended with:\n"
                            f"{_tail(run_dir / f'rank{rank}.log')}")
        else:
            failures.append(f"--- rank {rank} {_exit_text(proc.returncode)}; its output ended with:\n"
                            f"{_tail(run_dir / f'rank{rank}.log')}")
    if failures:
        what = f"timed out after {timeout:g} s" if timed_out else "failed"
        raise DistributedTestFailure(f"{module}.{qualname} on {world_size} processes {what}:\n" + "\n".join(failures))
    return [torch.load(run_dir / f"result{rank}.pt", weights_only=False) for rank in range(world_size)]


def _wait(procs: list[subprocess.Popen], deadline: float, grace: float) -> tuple[set[int], set[int]]:
    """Waits until every process has ended; returns (ranks killed at the deadline, ranks killed `grace` seconds
    after another one failed: they may be blocked in a collective with the failed one)."""
    failed_at = None
    while True:
        running = [rank for rank, proc in enumerate(procs) if proc.poll() is None]
        if not running:
            return set(), set()
        now = time.monotonic()
        if failed_at is None and any(proc.returncode not in (None, 0) for proc in procs):
            failed_at = now
        if now >= deadline or (failed_at is not None and now - failed_at >= grace):
            for rank in running:
                _kill(procs[rank])
            return (set(running), set()) if now >= deadline else (set(), set(running))
        time.sleep(0.02)


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover - a process that survives SIGKILL
            pass


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def _tail(path: Path, chars: int = 4000) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no output)"
    return text[-chars:] if text else "(no output)"


def _child_main() -> None:
    """A child's life: join the group, run fn, save its result or its traceback, leave the group."""
    run_dir, rank = Path(sys.argv[1]), int(sys.argv[2])
    try:
        with open(run_dir / "call.pkl", "rb") as f:
            call = pickle.load(f)
        import torch.distributed as dist
        torch.set_num_threads(1)
        world_size = call["world_size"]
        if call["backend"] == "nccl":  # one GPU per rank (NCCL needs the device chosen before the group)
            torch.cuda.set_device(rank % torch.cuda.device_count())
        store = dist.FileStore(str(run_dir / "store"), world_size)
        dist.init_process_group(call["backend"], store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=max(call["timeout"], 1.0)))
        try:
            fn = getattr(importlib.import_module(call["module"]), call["qualname"])
            args = torch.load(run_dir / "args.pt", weights_only=False)
            result = fn(rank, world_size, *args)
            torch.save(result, run_dir / f"result{rank}.pt")
        finally:
            dist.destroy_process_group()
    except BaseException:
        (run_dir / f"rank{rank}.err").write_text(traceback.format_exc())
        sys.stdout.flush()
        os._exit(1)  # no interpreter teardown: a gloo thread blocked on a dead peer must not hold the exit up
    sys.stdout.flush()
    os._exit(0)
