"""Helpers of the bad-input matrix (test_bad_inputs*.py): refusal checks, tensor subclasses that graphsafe must
refuse, and a runner that executes crash-prone cases in a child Python, so that a crash fails one test instead of
ending pytest."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
META = torch.device("meta")

LAYOUT_WORDS = r"sparse|strided|dense|layout|nested"
NESTED_REFUSAL = (TypeError, ValueError, NotImplementedError)


def refused(fn, types, pattern: str = "", what: str = ""):
    """fn() must raise one of `types` whose message matches `pattern` (case-insensitive); returns the
    exception. Any other outcome raises AssertionError saying what happened instead."""
    what = what or getattr(fn, "__name__", "call")
    try:
        out = fn()
    except types as exc:
        if pattern and not re.search(pattern, str(exc), re.IGNORECASE):
            raise AssertionError(f"{what}: {type(exc).__name__} raised, but its message {str(exc)!r} "
                                 f"does not match {pattern!r} (it should name the argument and what is expected)")
        return exc
    except Exception as exc:  # the wrong type: show it
        names = types.__name__ if isinstance(types, type) else "/".join(t.__name__ for t in types)
        raise AssertionError(f"{what}: expected {names} matching {pattern!r}, got {type(exc).__name__}: {exc}") from exc
    raise AssertionError(f"{what}: expected a refusal matching {pattern!r}, but it returned {_short(out)}")


def handled_or_refused(fn, check, types, pattern: str, what: str = ""):
    """Either fn() returns and check(result) holds (check asserts, or returns False for a failure), or it raises one
    of `types` matching `pattern`."""
    try:
        out = fn()
    except types as exc:
        if not re.search(pattern, str(exc), re.IGNORECASE):
            raise AssertionError(f"{what}: refused with {type(exc).__name__}, but the message {str(exc)!r} "
                                 f"does not match {pattern!r}")
        return
    except Exception as exc:
        raise AssertionError(f"{what}: expected a result or a clear refusal, got {type(exc).__name__}: {exc}") from exc
    assert check(out) is not False, f"{what}: the result does not hold: {_short(out)}"


def _short(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)}, {x.dtype}, on {x.device}"
    return repr(x)[:200]


def plain(t: torch.Tensor) -> torch.Tensor:
    return t.as_subclass(torch.Tensor) if type(t) is not torch.Tensor else t


def dense(t: torch.Tensor) -> torch.Tensor:
    return t.to_dense() if t.layout != torch.strided else t


def same(a: torch.Tensor, b: torch.Tensor, what: str = "result") -> None:
    a, b = plain(a), plain(b)
    assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {a.dtype}{tuple(a.shape)} != {b.dtype}{tuple(b.shape)}"
    assert torch.equal(a, b), f"{what}: values differ"


class Sub(torch.Tensor):
    """A plain tensor subclass (storage of its own, default __torch_function__)."""


class Wrapper(torch.Tensor):
    """A wrapper subclass without storage of its own, as DTensor is: every op unwraps, runs, rewraps."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor):
        r = torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=inner.device,
                                                requires_grad=inner.requires_grad)
        r.inner = inner
        return r

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        from torch.utils._pytree import tree_map

        unwrap = lambda t: t.inner if isinstance(t, Wrapper) else t  # noqa: E731
        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
        return tree_map(lambda t: Wrapper(t) if isinstance(t, torch.Tensor) else t, out)


def as_sub(t: torch.Tensor, requires_grad: bool = False) -> torch.Tensor:
    return torch.Tensor._make_subclass(Sub, t, requires_grad)


_RUNNER = textwrap.dedent("""
    import json, sys, traceback
    sys.path.insert(0, {here!r})
    import importlib
    table = getattr(importlib.import_module({module!r}), {table!r})
    for name in sys.argv[1:]:
        print(json.dumps({{"start": name}}), flush=True)
        try:
            table[name]()
            result = {{"name": name, "ok": True, "error": ""}}
        except BaseException as exc:
            text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            text = text if len(text) < 2500 else text[:2000] + " ... " + text[-400:]
            result = {{"name": name, "ok": False, "error": text}}
        print(json.dumps(result), flush=True)
""")


def run_isolated(module: str, table: str, names, timeout: float = 240.0) -> dict[str, tuple[bool, str]]:
    """Runs table[name]() for each name in one child Python (restarted after a case that ends the process):
    {name: (passed, error text)}. A crash (segfault, abort) is reported against the case that was running."""
    code = _RUNNER.format(here=HERE, module=module, table=table)
    results: dict[str, tuple[bool, str]] = {}
    pending = list(names)
    while pending:
        try:
            proc = subprocess.run([sys.executable, "-c", code, *pending], capture_output=True, text=True,
                                  timeout=timeout, cwd=HERE)
            stdout, stderr, rc = proc.stdout, proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as exc:
            stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            stderr, rc = "timed out", "timeout"
        running = None
        for line in stdout.splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if "start" in record:
                running = record["start"]
            else:
                results[record["name"]] = (record["ok"], record["error"])
        if all(n in results for n in pending):
            break
        if running is None or running in results:  # died before or between cases
            for n in pending:
                results.setdefault(n, (False, f"child Python failed (exit {rc}) outside any case: {stderr[-2000:]}"))
            break
        results[running] = (False, f"the process died in this case (exit {rc}; a negative exit is a signal, "
                                   f"-11 a segfault): {stderr[-1500:]}")
        pending = pending[pending.index(running) + 1:]
    return results


_STARTED: dict[tuple[str, str], tuple[threading.Thread, dict]] = {}


def _start_isolated(module: str, table_name: str) -> tuple[threading.Thread, dict]:
    """Runs the table's cases in a background thread (once): the child Python works while the in-process tests
    of the module run."""
    if (module, table_name) not in _STARTED:
        names, box = list(getattr(sys.modules[module], table_name)), {}
        thread = threading.Thread(target=lambda: box.update(results=run_isolated(module, table_name, names)),
                                  daemon=True)
        thread.start()
        _STARTED[module, table_name] = (thread, box)
    return _STARTED[module, table_name]


def isolated_fixture(module: str, table_name: str):
    """Two module-scoped fixtures: one (autouse) starts every case of `table_name` in a child Python when the
    module's first test runs; the other waits for their results ({name: (passed, error)})."""

    @pytest.fixture(scope="module", autouse=True)
    def start():
        _start_isolated(module, table_name)

    @pytest.fixture(scope="module")
    def results():
        thread, box = _start_isolated(module, table_name)
        thread.join()
        return box["results"]

    return start, results


def check_isolated(results: dict[str, tuple[bool, str]], name: str) -> None:
    passed, error = results[name]
    assert passed, f"{name}: {error}"


def gen_tensor(*shape, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


def idx(*values, dtype=torch.int64) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)
