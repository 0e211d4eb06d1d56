"""Output: JSON lines (strict JSON, non-finite floats as strings) and markdown tables."""

from __future__ import annotations

import json
import math
import sys
from typing import IO, Iterable, Sequence


class JsonLines:
    """Writes each record as one JSON line to stdout (flushed, so a long run shows progress) and to a file."""

    def __init__(self, stream: IO[str] = sys.stdout, path: str | None = None) -> None:
        self._stream = stream
        self._file = open(path, "w", encoding="utf-8") if path else None  # noqa: SIM115 - closed in close()
        self.records: list[dict] = []

    def emit(self, record: dict) -> None:
        line = json.dumps(json_safe(record), allow_nan=False)
        self.records.append(record)
        print(line, file=self._stream, flush=True)
        if self._file:
            print(line, file=self._file, flush=True)

    def close(self) -> None:
        if self._file:
            self._file.close()
            self._file = None


def json_safe(value):
    """inf and nan become strings ("inf", "-inf", "nan"), so every line is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(item) for item in value]
    return value


def markdown_table(
    headers: Sequence[str], rows: Iterable[Sequence[object]], align_right: Sequence[bool] | None = None
) -> str:
    rows = [[str(cell) for cell in row] for row in rows]
    widths = [max([len(header)] + [len(row[i]) for row in rows]) for i, header in enumerate(headers)]
    right = list(align_right) if align_right else [False] * len(headers)

    def line(cells: Sequence[str]) -> str:
        padded = [cell.rjust(w) if r else cell.ljust(w) for cell, w, r in zip(cells, widths, right)]
        return "| " + " | ".join(padded) + " |"

    rule = "|" + "|".join(("-" * (w + 1) + ":") if r else ("-" * (w + 2)) for w, r in zip(widths, right)) + "|"
    return "\n".join([line(headers), rule, *(line(row) for row in rows)])


def fmt_ms(ms: float | None) -> str:
    if ms is None:
        return "-"
    return f"{ms:.3f}" if ms < 10 else f"{ms:.1f}"


def fmt_float(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def fmt_error(value: float | None) -> str:
    if value is None:
        return "-"
    if value == 0:
        return "0"
    return f"{value:.2e}" if math.isfinite(value) else str(value)


def fmt_bool(value: bool | None) -> str:
    return "-" if value is None else ("yes" if value else "NO")


def fmt_bytes(count: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= scale:
            return f"{count / scale:.2f} {unit}"
    return f"{count} B"


def first_line(error: BaseException) -> str:
    """The original error (the first in a chain of 'during handling' errors), one line, clipped."""
    while error.__context__ is not None and error.__cause__ is None:
        error = error.__context__
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{type(error).__name__}: {text}"[:200]
