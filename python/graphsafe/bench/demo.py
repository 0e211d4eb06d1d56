"""`graphsafe demo`: a small embedding-heavy backward, three ways, on whatever device is available.

Shows what graphsafe is for: the same gradient as PyTorch's embedding backward, accumulated in fp32 (so it
stays accurate in bf16), bitwise repeatable, honouring padding_idx and scale_grad_by_freq, and capturable in
a CUDA graph, where the index_add workaround is not repeatable and ignores both options, and aten's kernel
may need a host sync that capture forbids.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._core_args import dtype_name
from .embedding import METHODS, float64_reference, max_abs_error
from .harness import resolve_device
from .environment import device_name
from .indices import ZIPF_EXPONENT, most_frequent_row, zipf_indices
from .report import first_line, fmt_bool, fmt_error, fmt_ms, markdown_table
from .timing import TimerConfig, time_function

VOCAB, DIM, TOKENS, SEED = 32000, 256, 8192, 0
DTYPES = (torch.bfloat16, torch.float32)
CAPTURE_ORDER = ("graphsafe", "index_add", "aten")  # aten last: a failed capture is the riskiest thing we do


@dataclass(frozen=True)
class Variant:
    name: str
    padding_idx: int = -1
    scale_grad_by_freq: bool = False


@dataclass
class DemoRow:
    dtype: torch.dtype
    variant: Variant
    method: str
    ms: float | None = None
    error: float | None = None
    repeatable: bool | None = None
    capture: str = "n/a (cpu)"
    note: str = ""
    eager: torch.Tensor | None = None  # kept on CUDA only, to compare a graph replay with


def run_demo(device_arg: str | None = None) -> int:
    device = resolve_device(device_arg)
    indices = zipf_indices(VOCAB, TOKENS, SEED).to(device)
    padding_row = most_frequent_row(indices, VOCAB)  # padding is usually the most common token
    variants = (Variant("plain"), Variant(f"padding_idx={padding_row}", padding_idx=padding_row),
                Variant("scale_grad_by_freq", scale_grad_by_freq=True))
    timer = TimerConfig(warmup=3, repeats=10) if device.type == "cuda" else TimerConfig(warmup=1, repeats=3)
    print(_intro(device, padding_row), flush=True)
    rows, grads = [], {}
    for dtype in DTYPES:
        generator = torch.Generator(device=device).manual_seed(SEED)
        grads[dtype] = torch.randn(TOKENS, DIM, dtype=dtype, device=device, generator=generator)
        for variant in variants:
            rows += _measure_variant(grads[dtype], indices, variant, timer)
    if device.type == "cuda":
        _check_captures(rows, grads, indices)
    print(_table(rows))
    print()
    print(_explanation(device))
    return 0


def _measure_variant(grad, indices, variant: Variant, timer: TimerConfig) -> list[DemoRow]:
    reference = float64_reference(grad, indices, VOCAB, variant.padding_idx, variant.scale_grad_by_freq)
    rows = []
    for method, backward in METHODS.items():
        row = DemoRow(grad.dtype, variant, method, note=_ignored_option(method, variant))

        def call(backward=backward):
            return backward(grad, indices, VOCAB, variant.padding_idx, variant.scale_grad_by_freq)

        try:
            first, second = call(), call()
            row.repeatable = bool(torch.equal(first, second))
            row.error = max_abs_error(first, reference)
            row.ms = time_function(call, [()], grad.device, timer).ms_median
            row.eager = first if grad.device.type == "cuda" else None
        except Exception as exc:  # show what failed and carry on with the other methods
            row.note = first_line(exc)
        rows.append(row)
    return rows


def _ignored_option(method: str, variant: Variant) -> str:
    if method != "index_add":
        return ""
    if variant.padding_idx >= 0:
        return "ignores padding_idx"
    if variant.scale_grad_by_freq:
        return "ignores scale_grad_by_freq"
    return ""


def _check_captures(rows: list[DemoRow], grads: dict, indices: torch.Tensor) -> None:
    for method in CAPTURE_ORDER:
        for row in rows:
            if row.method != method:
                continue
            grad, backward, variant = grads[row.dtype], METHODS[method], row.variant
            row.capture = capture_status(
                lambda: backward(grad, indices, VOCAB, variant.padding_idx, variant.scale_grad_by_freq), row.eager
            )
            row.eager = None


def capture_status(call, eager: torch.Tensor | None) -> str:
    """Capture one call in a CUDA graph, replay it, compare with the eager result; what happened, in words."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up on a side stream, as torch.cuda.graph's docs ask
        for _ in range(2):
            call()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.current_stream()
    try:
        with torch.cuda.graph(graph):
            captured = call()
        graph.replay()
        torch.cuda.synchronize()
    except Exception as exc:  # e.g. a host sync inside capture; report it and leave the device usable
        _settle_after_failed_capture(stream)
        return f"no: {first_line(exc)}"
    if eager is None:
        return "yes"
    return "yes" if torch.equal(captured, eager) else "yes (replay ≠ eager bitwise)"


def _settle_after_failed_capture(stream: torch.cuda.Stream) -> None:
    # torch.cuda.graph's __exit__ leaves its capture stream current when capture_end raises: restore ours.
    torch.cuda.set_stream(stream)
    try:
        torch.cuda.synchronize()
    except Exception:  # noqa: BLE001 - the capture error was already reported; nothing more to say
        pass


def _intro(device: torch.device, padding_row: int) -> str:
    return (
        f"graphsafe demo on {device.type} ({device_name(device)})\n"
        f"Embedding backward of a {VOCAB} x {DIM} table for {TOKENS} tokens, zipf-skewed (p ∝ 1/k^{ZIPF_EXPONENT}); "
        f"padding row = the most frequent row ({padding_row}).\n"
        "Methods: graphsafe = graphsafe.ops.embedding_backward; aten = torch.ops.aten.embedding_dense_backward; "
        "index_add = torch.zeros(V, D).index_add_(0, idx, grad).\n"
    )


def _table(rows: list[DemoRow]) -> str:
    footnotes: dict[str, int] = {}

    def capture_cell(text: str) -> str:
        if not text.startswith("no:"):
            return text
        number = footnotes.setdefault(text[len("no: "):], len(footnotes) + 1)
        return f"no [{number}]"

    table_rows = [
        (dtype_name(r.dtype), r.variant.name, r.method, fmt_ms(r.ms), fmt_error(r.error),
         fmt_bool(r.repeatable), capture_cell(r.capture), r.note)
        for r in rows
    ]
    headers = ("dtype", "variant", "method", "ms", "max abs err vs fp64", "bitwise repeatable", "CUDA graph", "note")
    text = markdown_table(headers, table_rows, (False, False, False, True, True, False, False, False))
    if footnotes:
        text += "\n\n" + "\n".join(f"[{n}] {message}" for message, n in footnotes.items())
    return text


def _explanation(device: torch.device) -> str:
    lines = [
        "- max abs err: against aten's backward on the float64 gradient (same indices and options).",
        "- bitwise repeatable: two calls on the same input give torch.equal results.",
    ]
    if device.type == "cuda":
        lines.append("- CUDA graph: captured with torch.cuda.graph, replayed, compared bitwise with the eager result.")
    else:
        lines.append("- CUDA graph capture is checked only on a CUDA device (run with a GPU to see it).")
    return "\n".join(lines)
