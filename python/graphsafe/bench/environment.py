"""What a benchmark run ran on: torch, device, graphsafe version and source commit, date."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from pathlib import Path

import torch

import graphsafe


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return _cpu_model() or platform.processor() or platform.machine() or "cpu"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def source_tree() -> Path | None:
    """The graphsafe checkout this package came from (editable install), else the one we are run from."""
    candidates = [Path(graphsafe.__file__).resolve().parent, Path.cwd()]
    for start in candidates:
        top = _git(start, "rev-parse", "--show-toplevel")
        if top and (Path(top) / "python" / "graphsafe").is_dir():
            return Path(top)
    return None


def git_commit(tree: Path | None) -> str:
    """Short commit of the source tree, with '-dirty' when tracked files differ from it; 'unknown' if unreachable.

    GRAPHSAFE_COMMIT overrides it, for copies of the tree without .git (e.g. on a remote benchmark machine).
    """
    if os.environ.get("GRAPHSAFE_COMMIT"):
        return os.environ["GRAPHSAFE_COMMIT"]
    if tree is None:
        return "unknown"
    commit = _git(tree, "rev-parse", "--short", "HEAD")
    if not commit:
        return "unknown"
    dirty = _git(tree, "status", "--porcelain", "--untracked-files=no")
    return f"{commit}-dirty" if dirty else commit


def _git(cwd: Path, *args: str) -> str:
    try:
        done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def environment_record(device: torch.device, copy_bw_gbps: float, copy_bytes: int, quick: bool) -> dict:
    tree = source_tree()
    return {
        "record": "environment",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "python": platform.python_version(),
        "device": device.type,
        "device_name": device_name(device),
        "cpu_threads": torch.get_num_threads(),
        "host_cpus": os.cpu_count(),
        "copy_bw_gbps": round(copy_bw_gbps, 2),
        "copy_bytes": copy_bytes,
        "graphsafe_version": graphsafe.__version__,
        "graphsafe_commit": git_commit(tree),
        "graphsafe_source": str(tree) if tree else "unknown",
        "cuda_backend_built": graphsafe.cuda_backend_built(),
        "quick": quick,
    }
