"""Pictures and progress (issue 22): `graphsafe bench --plot DIR [--from FILE]`, `graphsafe train --plot FILE`, the
error when matplotlib is missing, and the training progress drawn by tqdm.

The headline runs start `python -m graphsafe ...` in a fresh interpreter outside the source tree, as a user runs
it; the error paths run in-process through graphsafe.cli.main, which parses exactly as the command does.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from graphsafe.bench.optim import compare_methods
from graphsafe.bench.optim_cases import algorithm_cases, compare_cases, eight_bit_cases, graph_cases
from graphsafe.cli import main

requires_matplotlib = pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                                         reason="needs matplotlib (pip install 'graphsafe[plot]')")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TINY_TRAIN = ["--device", "cpu", "--vocab", "64", "--dim", "8", "--layers", "1", "--seq-len", "4", "--batch-size", "2"]
NO_MATPLOTLIB = ("graphsafe {command}: error: --plot: plots need matplotlib, which is not installed: "
                 "pip install 'graphsafe[plot]' (or: pip install matplotlib)")


def _python(args: list[str], cwd: Path, **kwargs) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the installed package, as a user has it
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, text=True, timeout=300, **kwargs)


def _assert_png(path: Path) -> None:
    assert path.is_file(), path
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 10_000, (path, len(data))


# ---------------------------------------------------------------------------------------------------------
# graphsafe bench --plot
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def embedding_run(tmp_path_factory):
    """The embedding suite at quick sizes on the CPU, its JSON lines saved and its plot drawn."""
    folder = tmp_path_factory.mktemp("bench_plot")
    run = _python(["-m", "graphsafe", "bench", "--suite", "embedding", "--device", "cpu", "--quick", "--repeats", "1",
                   "--json-out", "run.jsonl", "--plot", "plots"], folder, capture_output=True)
    return folder, run


@requires_matplotlib
def test_bench_plot_draws_the_embedding_suite(embedding_run):
    folder, run = embedding_run
    assert run.returncode == 0, run.stderr
    assert "Traceback" not in run.stderr
    _assert_png(folder / "plots" / "embedding.png")
    assert [p.name for p in (folder / "plots").iterdir()] == ["embedding.png"]
    assert f"[graphsafe bench] plot: plots{os.sep}embedding.png" in run.stderr.splitlines()


@requires_matplotlib
def test_bench_plot_from_a_saved_run(embedding_run, tmp_path, capsys):
    """--from draws the same picture from the --json-out file, or from the command's whole stdout (its tables
    passed over), without measuring."""
    folder, run = embedding_run
    assert run.returncode == 0, run.stderr
    (tmp_path / "stdout.txt").write_text(run.stdout)
    for source, out in ((folder / "run.jsonl", tmp_path / "a"), (tmp_path / "stdout.txt", tmp_path / "b")):
        assert main(["bench", "--plot", str(out), "--from", str(source)]) == 0
        _assert_png(out / "embedding.png")
        captured = capsys.readouterr()
        assert captured.out == "" and f"plot: {out / 'embedding.png'}" in captured.err


def _optim_records() -> list[dict]:
    """A made-up full-size optim run on a GPU: every case's records as the suite writes them (the fields the plot
    reads), graph replays included."""
    records = [{"record": "environment", "device": "cuda", "device_name": "a GPU", "quick": False,
                "date": "2026-12-02T00:00:00+00:00", "graphsafe_commit": "0000000", "copy_bw_gbps": 4000.0,
                "suites": ["optim"]}]

    def measurement(case, method, pct):
        impl = "fused" if method == "torch" else "graphsafe"
        return {"record": "measurement", "suite": "optim", "group": case.group, "case": case.label, "method": method,
                "impl": impl, "ms_median": 1.0, "pct_copy_bw": pct}

    for i, case in enumerate(compare_cases(False)):
        records += [measurement(case, method, 40 + i + 10 * k) for k, method in enumerate(compare_methods(case))]
    records += [measurement(case, "graphsafe", 85.0) for case in graph_cases(False)]
    records += [measurement(case, "graphsafe", 60.0 + i) for i, case in enumerate(algorithm_cases(False))]
    records += [measurement(case, "graphsafe", 70.0 + i) for i, case in enumerate(eight_bit_cases(False))]
    return records + [{"record": "target", "suite": "optim", "status": "PASS"}]


def _write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@requires_matplotlib
def test_bench_plot_draws_the_optim_suite_from_its_records(tmp_path, capsys):
    saved = _write_jsonl(tmp_path / "optim.jsonl", _optim_records())
    assert main(["bench", "--suite", "optim", "--plot", str(tmp_path / "plots"), "--from", str(saved)]) == 0
    _assert_png(tmp_path / "plots" / "optim.png")
    assert "no plot for" not in capsys.readouterr().err


@requires_matplotlib
def test_a_suite_without_a_plot_draws_none(tmp_path, capsys):
    environment, optim = _optim_records()[0], _optim_records()[1:3]
    cpu = [{"record": "measurement", "suite": "cpu", "kind": "embedding", "case": "llm-small", "method": "aten",
            "ms_median": 1.0}]
    saved = _write_jsonl(tmp_path / "run.jsonl", [environment, *optim, *cpu])
    assert main(["bench", "--plot", str(tmp_path / "plots"), "--from", str(saved)]) == 0
    assert [p.name for p in (tmp_path / "plots").iterdir()] == ["optim.png"]
    assert "[graphsafe bench] no plot for suite(s) cpu (plots exist for embedding, optim)" in capsys.readouterr().err
    only_cpu = _write_jsonl(tmp_path / "cpu.jsonl", [environment, *cpu])
    with pytest.raises(SystemExit, match=r"cpu.jsonl has no measurements of a suite with a plot \(embedding, optim\)"):
        main(["bench", "--plot", str(tmp_path / "none"), "--from", str(only_cpu)])


@requires_matplotlib
@pytest.mark.parametrize("lines,message", [
    (['{"record": "measurement", "suite": "optim"}'], "cannot plot {file}: no environment record"),
    (["{not json"], "{file}, line 1: not a JSON record"),
    (['{"record": "environment"}', '{"record": "measurement", "suite": "embedding", "method": "aten", "N": 8, '
      '"ms_median": 1.0, "case": 1, "bytes": 100}'],
     "cannot plot {file}: suite embedding: a record lacks the field 'copy_bw_gbps'"),
])
def test_a_saved_run_that_cannot_be_drawn_says_why(tmp_path, lines, message):
    saved = tmp_path / "bad.jsonl"
    saved.write_text("\n".join(lines) + "\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--plot", str(tmp_path / "plots"), "--from", str(saved)])
    assert str(exit_info.value).startswith("graphsafe: " + message.format(file=saved))


@pytest.mark.parametrize("args,message", [
    (["--from", "{file}"], "--from FILE draws the plots of a saved run: give --plot DIR too"),
    (["--plot", "{dir}", "--from", "{file}", "--device", "cpu", "--repeats", "3"],
     "--from plots a saved run without measuring; --device, --repeats would not apply"),
    (["--plot", "{dir}", "--from", "{dir}/missing.jsonl"], "argument --from: no file '{dir}/missing.jsonl'"),
    (["--plot", "{file}"], "argument --plot: '{file}' is a file, not a folder"),
])
def test_bench_plot_options_refuse_what_cannot_work(tmp_path, capsys, args, message):
    saved = tmp_path / "run.jsonl"
    saved.write_text("")
    fill = {"file": str(saved), "dir": str(tmp_path)}
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", *(a.format(**fill) for a in args)])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"graphsafe bench: error: {message.format(**fill)}"


# ---------------------------------------------------------------------------------------------------------
# Without matplotlib: one line naming the extra, before anything runs
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("command,args", [
    ("bench", ["--suite", "embedding", "--device", "cpu", "--quick", "--plot", "plots"]),
    ("train", [*TINY_TRAIN, "--steps", "2", "--plot", "curves.png"]),
])
def test_plot_without_matplotlib_names_the_extra(tmp_path, command, args):
    """matplotlib's import is blocked (None in sys.modules makes it raise ImportError), then the command runs as
    `python -m graphsafe` does."""
    code = ("import runpy, sys; sys.modules['matplotlib'] = None; sys.argv = ['graphsafe', *sys.argv[1:]]; "
            "runpy.run_module('graphsafe', run_name='__main__', alter_sys=True)")
    run = _python(["-c", code, command, *args], tmp_path, capture_output=True)
    assert "Traceback" not in run.stderr, run.stderr
    assert run.returncode == 1, (run.stdout, run.stderr)
    assert run.stderr.strip().splitlines()[-1] == NO_MATPLOTLIB.format(command=command)
    assert run.stdout == "" and list(tmp_path.iterdir()) == []  # nothing measured, trained or written


# ---------------------------------------------------------------------------------------------------------
# graphsafe train --plot, and its progress through tqdm
# ---------------------------------------------------------------------------------------------------------


@requires_matplotlib
def test_train_plot_draws_the_methods_it_ran(tmp_path, capsys):
    path = tmp_path / "curves.png"
    assert main(["train", *TINY_TRAIN, "--steps", "3", "--compare-torch", "--plot", str(path)]) == 0
    _assert_png(path)
    out = capsys.readouterr().out
    assert out.rstrip().splitlines()[-1] == f"plot: {path}"
    assert "\r" not in out and len([line for line in out.splitlines() if line.startswith("step ")]) == 3


def test_train_plot_file_must_be_an_image(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", *TINY_TRAIN, "--plot", str(tmp_path / "curves.txt")])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"graphsafe train: error: --plot FILE must end in .png, .svg or .pdf, got {str(tmp_path / 'curves.txt')!r}")


@pytest.mark.parametrize("columns", [120, 0], ids=["sized", "unsized"])
def test_train_progress_on_a_terminal_is_a_tqdm_bar(tmp_path, columns):
    """On a terminal (a pseudo-terminal here, sized or, as some containers give, not) the progress is tqdm's bar,
    rewritten in place; in a pipe or a log it is one plain line per step (test_train_plot_draws_the_methods_it_ran,
    test_graph_train_cli.py)."""
    pty = pytest.importorskip("pty")
    import fcntl
    import struct
    import termios

    try:
        master, terminal = pty.openpty()
    except OSError as exc:
        pytest.skip(f"no pseudo-terminal here: {exc}")
    if columns:
        fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    with subprocess.Popen([sys.executable, "-m", "graphsafe", "train", *TINY_TRAIN, "--steps", "4"], cwd=tmp_path,
                          env=env, stdout=terminal, stderr=subprocess.PIPE) as proc:
        os.close(terminal)
        chunks = []
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the terminal closed: the command has ended
                break
            if not chunk:
                break
            chunks.append(chunk)
        stderr = proc.stderr.read().decode()
    os.close(master)
    assert proc.returncode == 0, stderr
    out = b"".join(chunks).decode().replace("\r\n", "\n")  # the terminal's line ends, not tqdm's redraws
    bars = [line for line in out.split("\r") if line.startswith("train: ")]
    # tqdm redraws at most every 0.1 s, so the updates between the first and the last depend on the speed
    assert bars and " 0/4 [" in bars[0], out
    assert any(bar.startswith("train: 100%|") and " 4/4 [" in bar and "step" in bar and ", loss " in bar
               for bar in bars), out
    assert "step     1/4" not in out  # the plain lines are for pipes and logs


def test_tqdm_is_a_requirement_and_matplotlib_the_plot_extra():
    """tqdm draws every `graphsafe train` progress bar, so it is required; matplotlib only --plot's pictures. CI
    installs requirements-dev.txt (then graphsafe with --no-deps), so both are listed there too."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    root = Path(__file__).resolve().parents[2]
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    names = lambda specs: {spec.split(">")[0].split("=")[0].split("<")[0].strip() for spec in specs}  # noqa: E731
    assert "tqdm" in names(project["dependencies"])
    assert names(project["optional-dependencies"]["plot"]) == {"matplotlib"}
    assert "matplotlib" in names(project["optional-dependencies"]["test"])
    requirements = [line for line in (root / "requirements-dev.txt").read_text().splitlines()
                    if line and not line.startswith("#")]
    assert {"tqdm", "matplotlib"} <= names(requirements)
