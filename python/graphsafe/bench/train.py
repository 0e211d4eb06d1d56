"""The `train` suite: one whole training step of `graphsafe train`'s default LM, three ways.

- graphsafe captured: graphsafe.compile_step(mode="auto") with graphsafe AdamW (on CUDA the gate passes for
  this model, so the whole step, optimizer included, is one CUDA graph replay);
- graphsafe eager: the same traced, rewritten graph run op by op (mode="eager"), to show what capture buys;
- torch eager: the same model in a plain loop, torch.nn.Embedding + torch.optim.AdamW (fused on CUDA).

Each method trains its own copy of the model from the same seed on the same pre-generated batches. Reported:
the timer's median per step (CUDA events around each step, steps launched back to back) and the wall-clock
time per step over a run of steps (what a training loop sees, host overhead included).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Callable

import torch

import graphsafe.optim

from ..graph import compile_step
from ..trainer.data import LMData
from ..trainer.models import TransformerLM, lm_loss
from ..trainer.run import TrainConfig, default_config, eager_torch_step, matmul_precision
from .harness import BenchContext, Suite, Target, register_suite
from .report import first_line, fmt_ms, markdown_table
from .timing import synchronize, time_function

METHODS = ("graphsafe captured", "graphsafe eager", "torch eager")
LR = 1e-3
BATCHES = 8


def _config(ctx: BenchContext) -> TrainConfig:
    """The trainer's default size for the device (its CPU sizes when quick), on the device the bench runs on."""
    sizes = default_config("cpu" if ctx.quick else ctx.device.type)
    return replace(sizes, device=str(ctx.device), matmul=default_config(ctx.device.type).matmul)


def step_for(method: str, config: TrainConfig, device: torch.device) -> tuple[Callable, Callable[[], str]]:
    """(step(ids, targets), the mode it ran in) for one method, on a fresh model from the seed."""
    torch.manual_seed(config.seed)
    model = TransformerLM(config.vocab, config.dim, config.layers, config.heads, config.seq_len).to(device)
    if method == "torch eager":
        torch_step = eager_torch_step(model, lm_loss, torch.optim.AdamW(model.parameters(), lr=LR,
                                                                         fused=device.type == "cuda"))
        return (lambda ids, targets: torch_step((ids, targets))), lambda: "eager (autograd)"
    optimizer = graphsafe.optim.AdamW(model.parameters(), lr=LR)
    compiled = compile_step(model, lm_loss, optimizer, mode="auto" if method == "graphsafe captured" else "eager")
    return (lambda ids, targets: compiled((ids, targets))), (
        lambda: compiled.mode + (" (captured)" if compiled.captured else ""))


def measure(ctx: BenchContext, method: str) -> dict:
    config = _config(ctx)
    with matmul_precision(config):
        return _measure(ctx, method, config)


def _measure(ctx: BenchContext, method: str, config: TrainConfig) -> dict:
    record = {"record": "measurement", "suite": "train", "method": method, "vocab": config.vocab, "dim": config.dim,
              "layers": config.layers, "seq_len": config.seq_len, "batch_size": config.batch_size,
              "matmul": config.matmul if ctx.device.type == "cuda" else "cpu"}
    try:
        data = LMData(config.vocab, config.batch_size, config.seq_len, config.seed, ctx.device)
        batches = [next(data) for _ in range(BATCHES)]
        step, mode = step_for(method, config, ctx.device)
        for batch in batches[:4]:  # trace, warm up and capture before the timer's own warm-up
            step(*batch)
        timing = time_function(step, batches, ctx.device, ctx.timer)
        synchronize(ctx.device)
        start = time.perf_counter()
        for batch in batches:
            step(*batch)
        synchronize(ctx.device)
        record.update(mode=mode(), ms_median=timing.ms_median, ms_min=timing.ms_min,
                      wall_ms=(time.perf_counter() - start) * 1e3 / len(batches))
    except Exception as exc:  # noqa: BLE001 - one failed method is reported, the others still run
        record["error"] = first_line(exc)
    return record


def run_suite(ctx: BenchContext) -> list[dict]:
    records = []
    for method in METHODS:
        record = measure(ctx, method)
        ctx.emit(record)
        records.append(record)
    torch_record = next((r for r in records if r["method"] == "torch eager" and "wall_ms" in r), None)
    for r in records:
        if torch_record is not None and "wall_ms" in r:
            r["speedup_vs_torch"] = torch_record["wall_ms"] / r["wall_ms"]
    return records


# Issue 5's target: the captured step at least 1.5x faster than the eager PyTorch loop (wall time per step).
TARGET_SPEEDUP = 1.5


def evaluate_targets(records: list[dict], ctx: BenchContext) -> list[Target]:
    ours = next((r for r in records if r["method"] == "graphsafe captured"), {})
    theirs = next((r for r in records if r["method"] == "torch eager"), {})
    threshold = f"≥ {TARGET_SPEEDUP:g}x"
    description = f"captured step ≥ {TARGET_SPEEDUP:g}x faster than torch eager (wall time, default LM)"
    if "wall_ms" not in ours or "wall_ms" not in theirs:
        return [Target("train", description, "ERROR", note=ours.get("error") or theirs.get("error") or "missing")]
    speedup = theirs["wall_ms"] / ours["wall_ms"]
    value = f"{speedup:.2f}x ({ours['wall_ms']:.3f} vs {theirs['wall_ms']:.3f} ms)"
    if ctx.device.type != "cuda":
        return [Target("train", description, "SKIP", value, threshold, "no capture on the cpu")]
    status = "PASS" if speedup >= TARGET_SPEEDUP else "MISS"
    return [Target("train", description, status, value, threshold, "quick sizes" if ctx.quick else "")]


def render(records: list[dict], ctx: BenchContext) -> str:
    first = records[0]
    rows = []
    for r in records:
        if "error" in r:
            rows.append((r["method"], "-", "-", "-", "-", f"error: {r['error']}"))
            continue
        rows.append((r["method"], r["mode"], fmt_ms(r["ms_median"]), fmt_ms(r["wall_ms"]),
                     f"{r['speedup_vs_torch']:.2f}" if "speedup_vs_torch" in r else "-", ""))
    size = (f"vocab {first['vocab']}, dim {first['dim']}, {first['layers']} layers, batch {first['batch_size']} × "
            f"seq {first['seq_len']}, AdamW, fp32 matmuls: {first['matmul']}")
    return "\n\n".join([
        f"## training step: `graphsafe train` default LM ({ctx.describe_device()}; {size})",
        markdown_table(("method", "mode", "ms median", "wall ms/step", "× vs torch (wall)", "note"), rows,
                       align_right=(False, False, True, True, True, False)),
    ])


register_suite(Suite("train", "one training step of the default LM: captured vs eager vs PyTorch", run_suite,
                     evaluate_targets, render))
