"""The `train` suite: one whole training step, measured several ways, on two models.

- `lm`: `graphsafe train`'s default LM (graphsafe's own TransformerLM);
- `llama`: an unmodified Hugging Face LlamaForCausalLM (transformers), about 0.9B parameters on CUDA (hidden 2048,
  8 layers, vocab 128256, 4 x 1024 tokens, fp32 weights with TF32 matmuls); a tiny one on the CPU / --quick.

Methods:
- graphsafe captured: graphsafe.compile_step(mode="auto") with graphsafe AdamW (on CUDA the gate passes for these
  models, so the whole step, optimizer included, is one CUDA graph replay);
- graphsafe eager: the same traced, rewritten graph run op by op (mode="eager": auto mode's fallback, and the CPU
  path), to show what capture buys;
- torch eager: the model in a plain loop with torch.optim.AdamW (fused on CUDA);
- torch.compile (llama only): the same loop with torch.compile(model).

Each method trains its own copy of the model from the same seed on the same pre-generated batches. Reported:
the timer's median per step (CUDA events around each step, steps launched back to back) and the wall-clock
time per step over a run of steps (what a training loop sees, host overhead included).
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, replace
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

LR = 1e-3
BATCHES = 8


@dataclass(frozen=True)
class Workload:
    """One model of the suite: how to build it on a device, its loss, its batch shape and the methods it runs."""

    name: str
    methods: tuple[str, ...]
    config: TrainConfig  # vocab, batch_size, seq_len, seed and matmul precision (and the LM's sizes)
    make_model: Callable[[torch.device], torch.nn.Module]
    loss_fn: Callable
    describe: str


# The Hugging Face Llama of issue 22 (Llama 3's vocabulary and grouped-query attention, 8 layers of width 2048):
# 0.886B parameters, none tied.
LLAMA_CUDA = dict(vocab_size=128256, hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,
                  num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=1024, rope_theta=500000.0)
LLAMA_CUDA_BATCH = (4, 1024)  # sequences x tokens
LLAMA_SMALL = dict(vocab_size=1000, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=64)
LLAMA_SMALL_BATCH = (4, 32)


def _lm_workload(ctx: BenchContext) -> Workload:
    """The trainer's default size for the device (its CPU sizes when quick), on the device the bench runs on."""
    sizes = default_config("cpu" if ctx.quick else ctx.device.type)
    config = replace(sizes, device=str(ctx.device), matmul=default_config(ctx.device.type).matmul)

    def make_model(device: torch.device) -> torch.nn.Module:
        return TransformerLM(config.vocab, config.dim, config.layers, config.heads, config.seq_len).to(device)

    describe = (f"`graphsafe train` default LM: vocab {config.vocab}, dim {config.dim}, {config.layers} layers, "
                f"batch {config.batch_size} × seq {config.seq_len}")
    return Workload("lm", ("graphsafe captured", "graphsafe eager", "torch eager"), config, make_model, lm_loss,
                    describe)


def _llama_loss(output, targets: torch.Tensor) -> torch.Tensor:
    return lm_loss(output.logits, targets)


def _llama_workload(ctx: BenchContext) -> Workload:
    from transformers import LlamaConfig, LlamaForCausalLM  # optional: the case reports an error without it

    full = ctx.device.type == "cuda" and not ctx.quick
    sizes, (batch, seq) = (LLAMA_CUDA, LLAMA_CUDA_BATCH) if full else (LLAMA_SMALL, LLAMA_SMALL_BATCH)
    llama = LlamaConfig(**sizes, use_cache=False)
    config = replace(default_config(ctx.device.type), device=str(ctx.device), vocab=llama.vocab_size,
                     batch_size=batch, seq_len=seq)

    def make_model(device: torch.device) -> torch.nn.Module:
        with device:  # initialised where it trains (0.9B parameters initialised on the host take long)
            return LlamaForCausalLM(llama)

    describe = (f"Hugging Face LlamaForCausalLM: vocab {llama.vocab_size}, hidden {llama.hidden_size}, "
                f"{llama.num_hidden_layers} layers, {llama.num_attention_heads} heads ({llama.num_key_value_heads} kv), "
                f"MLP {llama.intermediate_size}, batch {batch} × seq {seq}")
    return Workload("llama", ("graphsafe captured", "graphsafe eager", "torch eager", "torch.compile"), config,
                    make_model, _llama_loss, describe)


WORKLOADS = {"lm": _lm_workload, "llama": _llama_workload}


def step_for(method: str, workload: Workload, device: torch.device) -> tuple[Callable, Callable[[], str]]:
    """(step(ids, targets), the mode it ran in) for one method, on a fresh model from the seed."""
    torch.manual_seed(workload.config.seed)
    model = workload.make_model(device)
    if method in ("torch eager", "torch.compile"):
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, fused=device.type == "cuda")
        runner = torch.compile(model) if method == "torch.compile" else model
        torch_step = eager_torch_step(runner, workload.loss_fn, optimizer)
        mode = "eager (autograd)" if method == "torch eager" else "torch.compile(model), fused AdamW"
        return (lambda ids, targets: torch_step((ids, targets))), lambda: mode
    optimizer = graphsafe.optim.AdamW(model.parameters(), lr=LR)
    compiled = compile_step(model, workload.loss_fn, optimizer,
                            mode="auto" if method == "graphsafe captured" else "eager")
    return (lambda ids, targets: compiled((ids, targets))), (
        lambda: compiled.mode + (" (captured)" if compiled.captured else ""))


def measure(ctx: BenchContext, workload: Workload, method: str) -> dict:
    with matmul_precision(workload.config):
        record = _measure(ctx, workload, method)
    gc.collect()  # the method's model, optimizer and graphs, before the next method builds its own
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()
    return record


def _measure(ctx: BenchContext, workload: Workload, method: str) -> dict:
    config = workload.config
    record = {"record": "measurement", "suite": "train", "case": workload.name, "method": method,
              "vocab": config.vocab, "batch_size": config.batch_size, "seq_len": config.seq_len,
              "describe": workload.describe, "matmul": config.matmul if ctx.device.type == "cuda" else "cpu"}
    try:
        data = LMData(config.vocab, config.batch_size, config.seq_len, config.seed, ctx.device)
        batches = [next(data) for _ in range(BATCHES)]
        step, mode = step_for(method, workload, ctx.device)
        for batch in batches[:4]:  # trace (or compile), warm up and capture before the timer's own warm-up
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
    for name, make_workload in WORKLOADS.items():
        try:
            workload = make_workload(ctx)
        except ImportError as exc:  # transformers missing: the case says so, the other case still runs
            record = {"record": "measurement", "suite": "train", "case": name, "method": "-",
                      "error": f"{first_line(exc)} (pip install transformers)"}
            ctx.emit(record)
            records.append(record)
            continue
        case_records = []
        for method in workload.methods:
            record = measure(ctx, workload, method)
            ctx.emit(record)
            case_records.append(record)
        torch_record = next((r for r in case_records if r["method"] == "torch eager" and "wall_ms" in r), None)
        for r in case_records:
            if torch_record is not None and "wall_ms" in r:
                r["speedup_vs_torch"] = torch_record["wall_ms"] / r["wall_ms"]
        records.extend(case_records)
    return records


# (case, method, least speedup over torch eager in wall time per step, issue): issue 5's captured step on the
# default LM; issue 22's traced graph run eagerly on it, and the captured Llama step (its aim: 1.05x).
TARGETS = (("lm", "graphsafe captured", 1.5, 5), ("lm", "graphsafe eager", 1.0, 22),
           ("llama", "graphsafe captured", 1.0, 22))


def evaluate_targets(records: list[dict], ctx: BenchContext) -> list[Target]:
    targets = []
    for case, method, least, issue in TARGETS:
        ours = next((r for r in records if r.get("case") == case and r["method"] == method), {})
        theirs = next((r for r in records if r.get("case") == case and r["method"] == "torch eager"), {})
        threshold = f"≥ {least:g}x"
        description = f"{case}: {method} ≥ {least:g}x torch eager (wall time per step; issue {issue})"
        if "wall_ms" not in ours or "wall_ms" not in theirs:
            missing = next((r for r in records if r.get("case") == case and "error" in r), {})
            note = ours.get("error") or theirs.get("error") or missing.get("error") or "missing"
            targets.append(Target("train", description, "ERROR", note=note))
            continue
        speedup = theirs["wall_ms"] / ours["wall_ms"]
        value = f"{speedup:.2f}x ({ours['wall_ms']:.3f} vs {theirs['wall_ms']:.3f} ms)"
        if ctx.device.type != "cuda":
            targets.append(Target("train", description, "SKIP", value, threshold, "targets are for CUDA"))
            continue
        status = "PASS" if speedup >= least else "MISS"
        targets.append(Target("train", description, status, value, threshold, "quick sizes" if ctx.quick else ""))
    return targets


def render(records: list[dict], ctx: BenchContext) -> str:
    sections = []
    for case in WORKLOADS:
        case_records = [r for r in records if r.get("case") == case]
        if not case_records:
            continue
        rows = []
        for r in case_records:
            if "error" in r:
                rows.append((r["method"], "-", "-", "-", "-", f"error: {r['error']}"))
                continue
            rows.append((r["method"], r["mode"], fmt_ms(r["ms_median"]), fmt_ms(r["wall_ms"]),
                         f"{r['speedup_vs_torch']:.2f}" if "speedup_vs_torch" in r else "-", ""))
        first = case_records[0]
        size = f"{first['describe']}, AdamW, fp32 matmuls: {first['matmul']}" if "describe" in first else case
        sections.append(f"## training step, {case} ({ctx.describe_device()}; {size})")
        sections.append(markdown_table(("method", "mode", "ms median", "wall ms/step", "× vs torch (wall)", "note"),
                                       rows, align_right=(False, False, True, True, True, False)))
    return "\n\n".join(sections)


register_suite(Suite("train", "one training step of the default LM and a Hugging Face Llama: captured vs eager vs "
                     "PyTorch", run_suite, evaluate_targets, render))
