"""`graphsafe train`: train a demo model with compile_step and report what the graph trainer did.

The model is plain PyTorch (torch.nn.Embedding); compile_step traces it, rewrites the embedding backward,
gates and captures the step. The summary shows the mode chosen, the rewrites, any unsafe nodes with their
reasons, step times (captured vs the same graph run eagerly, and optionally a plain PyTorch loop), optimizer
state memory and, with --check-determinism, whether two runs end with bitwise identical parameters.
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import time
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from .. import optim
from ..graph import compile_step
from . import parallel
from .data import LMData, RecsysData
from .models import MixtureOfExperts, RecsysModel, TransformerLM, lm_loss, recsys_loss
from .parallel import PARALLEL_MODES, ParallelContext
from .plot import FORMATS as PLOT_FORMATS, plot_training, require_matplotlib
from .progress import Progress

__all__ = ["TrainConfig", "TrainResult", "ConfigError", "check_config", "train", "OPTIMIZERS", "MATMUL_PRECISIONS",
           "default_config", "matmul_precision"]

# name -> (class, default options). Learning rates are chosen so the demo's loss falls within 20 steps.
OPTIMIZERS: dict[str, tuple[type, dict]] = {
    "adam": (optim.Adam, dict(lr=1e-2)),
    "adamw": (optim.AdamW, dict(lr=1e-2, weight_decay=0.01)),
    "sgd": (optim.SGD, dict(lr=0.5, momentum=0.9)),
    "rmsprop": (optim.RMSprop, dict(lr=2e-3)),
    "adagrad": (optim.Adagrad, dict(lr=0.1)),
    "lion": (optim.Lion, dict(lr=2e-3, weight_decay=0.01)),
    "lamb": (optim.LAMB, dict(lr=2e-2)),
    "lars": (optim.LARS, dict(lr=1.0)),
    "ademamix": (optim.AdEMAMix, dict(lr=1e-2)),
}

# State tensors per parameter element with each optimizer's default options (for the memory estimate).
_STATES_PER_ELEMENT = {"adam": 2, "adamw": 2, "sgd": 1, "rmsprop": 1, "adagrad": 1, "lion": 1, "lamb": 2, "lars": 1,
                       "ademamix": 3}

# Seeds go to torch.Generator.manual_seed (the data uses seed + 1 too); the range is numpy's, easy to state.
SEED_RANGE = (0, 2**32 - 1)

# The Markov chain and the recommender's Zipf ids need a few ids besides the padding id 0.
MIN_VOCAB = 8

# How CUDA runs fp32 matrix products ("tf32": tensor cores with 10-bit mantissa inputs, fp32 accumulation, the
# usual setting for training on Ampere and later; "ieee": full fp32). Both are deterministic. The setting applies
# to every method a run compares (compile_step and the PyTorch loop alike) and is restored afterwards.
MATMUL_PRECISIONS = ("tf32", "ieee")

# Default sizes. The CPU default keeps `graphsafe train --steps 20 --device cpu` well under a minute on two
# cores with a 32K vocabulary; CUDA runs a larger model by default.
SIZES = {
    "cpu": dict(dim=64, layers=2, heads=4, seq_len=32, batch_size=8, steps=30, users=50_000, recsys_batch=512,
                matmul="ieee"),
    "cuda": dict(dim=256, layers=4, heads=8, seq_len=128, batch_size=32, steps=200, users=1_000_000,
                 recsys_batch=8192, matmul="tf32"),
}


@dataclass
class TrainConfig:
    model: str = "lm"  # "lm" or "recsys"
    moe: bool = False
    experts: int = 8
    optimizer: str = "adamw"
    lr: float | None = None
    state_bits: int = 32
    skip_zeros: bool = False
    # compile_step(sparse_updates=...): tables whose group has skip_zeros get the row-sparse step. recsys puts its
    # tables in a skip_zeros=True group for it (_optimizer); lm tables qualify with --skip-zeros.
    sparse_updates: bool = True
    mode: str = "auto"
    steps: int = 30
    device: str = "cpu"
    seed: int = 0
    batch_size: int = 8
    seq_len: int = 32
    vocab: int = 32768  # LM vocabulary, or the recommender's item count
    dim: int = 64
    layers: int = 2
    heads: int = 4
    users: int = 50_000
    matmul: str = "tf32"  # fp32 matrix products on CUDA: "tf32" or "ieee" (no effect on the CPU)
    check_determinism: bool = False
    compare_torch: bool = False
    progress: bool = True
    parallel: str = "none"  # "ddp" or "fsdp2": data parallel over the ranks of the process group (parallel.py)
    plot: str | None = None  # a file for the loss and step-time curves of every method run (plot.py; needs matplotlib)


def default_config(device: str, **overrides) -> TrainConfig:
    sizes = dict(SIZES["cuda" if device.startswith("cuda") else "cpu"])
    recsys_batch = sizes.pop("recsys_batch")
    if overrides.get("model") == "recsys":
        sizes["batch_size"] = recsys_batch
    sizes.update({k: v for k, v in overrides.items() if v is not None})
    return TrainConfig(device=device, **sizes)


class ConfigError(ValueError):
    """A TrainConfig that cannot run; the message names the option as `graphsafe train` spells it."""


def check_config(config: TrainConfig) -> None:
    """Raise ConfigError for settings that cannot train: out-of-range numbers, combinations the models refuse,
    or sizes whose parameters, gradients, optimizer states and largest activations alone exceed the device's
    memory (checked before anything is allocated, so an absurd size fails at once instead of swapping)."""
    if config.model not in ("lm", "recsys"):
        raise ConfigError(f"unknown --model {config.model!r} (lm or recsys)")
    if config.optimizer not in OPTIMIZERS:
        raise ConfigError(f"unknown --optimizer {config.optimizer!r} ({', '.join(sorted(OPTIMIZERS))})")
    if config.state_bits not in (32, 16, 8):
        raise ConfigError(f"--state-bits must be 32, 16 or 8, got {config.state_bits}")
    if config.moe and config.model != "lm":
        raise ConfigError("--moe applies to --model lm only")
    if config.parallel not in PARALLEL_MODES:
        raise ConfigError(f"unknown --parallel {config.parallel!r} ({', '.join(PARALLEL_MODES)})")
    if config.parallel == "fsdp2":
        if not parallel.fsdp2_available():
            raise ConfigError("--parallel fsdp2 needs torch.distributed.fsdp.fully_shard (FSDP2), which this torch lacks")
        if config.mode in ("full", "piecewise"):
            raise ConfigError(f"--parallel fsdp2 cannot run --mode {config.mode}: FSDP2's collectives run in module "
                              "hooks that compile_step cannot trace, so its step runs eagerly (use --mode auto or "
                              "eager, or --parallel ddp to capture)")
    if config.plot is not None and os.path.splitext(config.plot)[1].lower() not in PLOT_FORMATS:
        raise ConfigError(f"--plot FILE must end in {', '.join(PLOT_FORMATS[:-1])} or {PLOT_FORMATS[-1]}, "
                          f"got {config.plot!r}")
    if config.lr is not None and not (math.isfinite(config.lr) and config.lr > 0):
        raise ConfigError(f"--lr must be a positive finite number, got {config.lr}")
    if not SEED_RANGE[0] <= config.seed <= SEED_RANGE[1]:
        raise ConfigError(f"--seed must be an integer from {SEED_RANGE[0]} to {SEED_RANGE[1]}, got {config.seed}")
    for name, value in (("--steps", config.steps), ("--batch-size", config.batch_size), ("--seq-len", config.seq_len),
                        ("--dim", config.dim), ("--layers", config.layers)):
        if value < 1:
            raise ConfigError(f"{name} must be >= 1, got {value}")
    if config.vocab < MIN_VOCAB:
        raise ConfigError(f"--vocab must be >= {MIN_VOCAB}, got {config.vocab}")
    if config.model == "lm" and config.dim % config.heads:
        raise ConfigError(f"--dim must be a multiple of {config.heads} (the attention heads at the "
                          f"{'cuda' if config.device.startswith('cuda') else 'cpu'} size), got {config.dim}")
    needed, have = estimated_bytes(config), _memory_bytes(config.device)
    where = f"{config.device}'s memory" if config.device.startswith("cuda") else "this machine's memory"
    if have is not None and needed > have:
        sizes = "--vocab, --dim, --batch-size or --seq-len" if config.model == "lm" else "--vocab, --dim or --batch-size"
        raise ConfigError(f"these sizes need at least {needed / 2**30:.1f} GiB (parameters, gradients, optimizer "
                          f"states, largest activations), more than the {have / 2**30:.1f} GiB of {where}; "
                          f"lower {sizes}")


def estimated_bytes(config: TrainConfig) -> int:
    """A lower bound on the memory one run allocates: parameters, their gradients and optimizer states (fp32
    parameters), the largest activations (the LM's logits and their gradient, attention scores) and the data."""
    d, f32 = config.dim, 4
    if config.model == "lm":
        params = 2 * config.vocab * d + config.seq_len * d + config.layers * 12 * d * d
        if config.moe:
            params += config.experts * 4 * d * d
        activations = (2 * config.batch_size * config.seq_len * config.vocab * f32
                       + config.layers * config.seq_len ** 2 * (1 + config.batch_size * config.heads * f32))
        data = config.vocab * 4 * 8
    else:
        params = (config.users + 2 * config.vocab + 1024) * d
        activations = config.batch_size * 4 * d * 4 * f32
        data = (config.users + config.vocab) * 8 * f32
    states = _STATES_PER_ELEMENT.get(config.optimizer, 1) * config.state_bits // 8
    return params * (2 * f32 + states) + activations + data


def _memory_bytes(device: str) -> int | None:
    """The device's total memory (None when unknown)."""
    try:
        if device.startswith("cuda"):
            return torch.cuda.get_device_properties(torch.device(device)).total_memory
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, RuntimeError, AssertionError):
        return None


@dataclass
class RunStats:
    losses: list[float] = field(default_factory=list)
    step_ms: list[float] = field(default_factory=list)

    def median_ms(self, skip: int) -> float | None:
        times = self.step_ms[skip:] or self.step_ms
        return statistics.median(times) if times else None

    def step_time(self, skip: int, first: str) -> str:
        """The typical step time and what it measured: the median of the steps after the first `skip` (whose
        one-off work, named by `first`, later steps do not repeat), or, with no step after them, the mean of all."""
        n = len(self.step_ms)
        head = "step 1" if skip == 1 else f"steps 1-{skip}"
        if n == skip + 1:
            return f"{self.step_ms[-1]:.2f} ms (step {n} alone; {head}: {first})"
        if n > skip:
            return f"{statistics.median(self.step_ms[skip:]):.2f} ms (median of steps {skip + 1}-{n}; {head}: {first})"
        if n == 1:
            return f"{self.step_ms[0]:.2f} ms (the only step, {first} included)"
        return (f"{statistics.mean(self.step_ms):.2f} ms (mean of all {n} steps, {first} included: too few steps to "
                f"leave {'it' if skip == 1 else 'them'} out)")


@dataclass
class TrainResult:
    config: TrainConfig
    stats: RunStats
    step: object  # the CompiledStep
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    extra: dict = field(default_factory=dict)


def _build(config: TrainConfig, ctx: ParallelContext | None = None):
    """(model, data, loss_fn, model inputs per batch, description), all from config.seed: the same model on
    every rank, and each rank's rows of the global batch (data.py)."""
    torch.manual_seed(config.seed)
    device = torch.device(config.device)
    rank, world = (ctx.rank, ctx.world_size) if ctx is not None else (0, 1)
    if config.model == "lm":
        model = TransformerLM(config.vocab, config.dim, config.layers, config.heads, config.seq_len,
                              config.experts if config.moe else 0)
        data = LMData(config.vocab, config.batch_size, config.seq_len, config.seed, device, rank, world)
        loss_fn, inputs = lm_loss, 1
        what = (f"transformer LM: vocab {config.vocab}, dim {config.dim}, {config.layers} layer"
                f"{'s' if config.layers != 1 else ''}"
                + (f", top-1 MoE with {config.experts} experts ({_cold_range(config.experts)} start cold)"
                   if config.moe else ""))
    elif config.model == "recsys":
        if config.moe:
            raise ConfigError("--moe applies to --model lm only")
        model = RecsysModel(config.users, config.vocab, 1024, config.dim)
        data = RecsysData(config.users, config.vocab, 1024, config.batch_size, config.seed, device, rank, world)
        loss_fn, inputs = recsys_loss, 4
        what = f"recommender: {config.users} users, {config.vocab} items, dim {config.dim}"
    else:
        raise ConfigError(f"unknown --model {config.model!r} (lm or recsys)")
    model = model.to(device)
    params = sum(p.numel() for p in model.parameters())
    return model, data, loss_fn, inputs, f"{what} ({params / 1e6:.1f}M parameters)"


def tables_skip_zeros(config: TrainConfig) -> bool:
    """Whether the embedding tables get a param group of their own with skip_zeros=True: recsys with sparse
    updates (the row-sparse step needs skip_zeros, which --skip-zeros would give every parameter)."""
    return config.model == "recsys" and config.sparse_updates and not config.skip_zeros


def _optimizer(config: TrainConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    cls, options = OPTIMIZERS[config.optimizer]
    options = dict(options, **({"lr": config.lr} if config.lr is not None else {}))
    params = list(model.parameters())
    if tables_skip_zeros(config):
        # A table row the batch did not touch then keeps its value and states (no weight decay or momentum on
        # it), which is what lets compile_step step the tables row-sparse.
        tables = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
        params = [{"params": [p for p in params if id(p) in tables], "skip_zeros": True},
                  {"params": [p for p in params if id(p) not in tables]}]
    return cls(params, **options, skip_zeros=config.skip_zeros, state_bits=config.state_bits)


@contextlib.contextmanager
def matmul_precision(config: TrainConfig):
    """Run CUDA fp32 matrix products at config.matmul inside the block; the CPU is left as it is.

    Set through torch's older flag (torch.backends.cuda.matmul.allow_tf32), which keeps every precision query
    of torch readable meanwhile (setting the newer fp32_precision makes torch.get_float32_matmul_precision()
    raise); if the caller uses the newer flag already, so does this. Restored on the way out."""
    if config.matmul not in MATMUL_PRECISIONS:
        raise SystemExit(f"graphsafe train: unknown matmul precision {config.matmul!r} (tf32 or ieee)")
    if not config.device.startswith("cuda"):
        yield
        return
    matmul = torch.backends.cuda.matmul
    try:
        flag, before, value = "allow_tf32", matmul.allow_tf32, config.matmul == "tf32"
    except RuntimeError:  # torch refuses the older flag once the newer one was set
        flag, before, value = "fp32_precision", matmul.fp32_precision, config.matmul
    setattr(matmul, flag, value)
    try:
        yield
    finally:
        setattr(matmul, flag, before)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _run_loop(step_fn: Callable, data, steps: int, device: torch.device, show: Callable[[int, float, float], None] | None,
              ctx: ParallelContext | None = None):
    stats = RunStats()
    for i in range(1, steps + 1):
        batch = next(data)
        _synchronize(device)
        start = time.perf_counter()
        loss_tensor = step_fn(batch)
        loss = float(loss_tensor)  # reading the loss synchronises, so the time covers the whole step
        stats.step_ms.append((time.perf_counter() - start) * 1e3)
        if ctx is not None:  # the global batch's loss (the mean of the ranks' losses), outside the timed part
            loss = parallel.mean_over_ranks(loss_tensor)
            show = show if ctx.is_main else None
        stats.losses.append(loss)
        if show is not None:
            show(i, loss, stats.step_ms[-1])
    return stats


def _graph_run(config: TrainConfig, show=None, mode: str | None = None, ctx: ParallelContext | None = None) -> TrainResult:
    model, data, loss_fn, inputs, what = _build(config, ctx)
    trained = parallel.wrap_model(model, ctx) if ctx is not None else model
    if ctx is not None and ctx.mode == "fsdp2":
        model = trained  # FSDP2 works on a copy with graphsafe embeddings (parallel.wrap_model)
    optimizer = _optimizer(config, trained)
    step = compile_step(trained, loss_fn, optimizer, mode=mode or config.mode, num_model_inputs=inputs,
                        sparse_updates=config.sparse_updates)
    extra = {"model": what, "data": data.describe()}
    # Cold experts' weights are read whole on each rank: not under FSDP2, where each rank holds a shard.
    cold = _cold_expert_weights(model) if ctx is None or ctx.mode == "ddp" else None
    stats = _run_loop(step, data, config.steps, torch.device(config.device), show, ctx)
    if cold is not None:
        last_inputs = next(data)[0]
        extra["experts_without_tokens"] = model.experts_without_tokens(last_inputs)
        now = _cold_expert_weights(model)
        extra["cold_experts_unchanged"] = all(torch.equal(a, b) for a, b in zip(cold, now))
    return TrainResult(config, stats, step, model, optimizer, extra)


def _cold_range(experts: int) -> str:
    """The experts whose router bias starts low (MixtureOfExperts), e.g. "experts 4-7"."""
    first, last = experts // 2, experts - 1
    return f"expert {last}" if first == last else f"experts {first}-{last}"


def _cold_expert_weights(model: torch.nn.Module) -> list[torch.Tensor] | None:
    for module in model.modules():
        if isinstance(module, MixtureOfExperts):
            half = module.experts // 2
            return [module.w_in[half:].detach().clone(), module.w_out[half:].detach().clone()]
    return None


def _torch_baseline(config: TrainConfig, ctx: ParallelContext | None = None) -> tuple[RunStats, torch.optim.Optimizer]:
    """The same model and data in a plain eager PyTorch loop with torch.optim.AdamW (fused on cuda), wrapped in
    DDP or FSDP2 as the graphsafe run is."""
    model, data, loss_fn, inputs, _ = _build(config, ctx)
    if ctx is not None:
        model = parallel.wrap_model(model, ctx)
    device = torch.device(config.device)
    lr = config.lr if config.lr is not None else OPTIMIZERS["adamw"][1]["lr"]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, fused=device.type == "cuda")
    return (_run_loop(eager_torch_step(model, loss_fn, optimizer, inputs), data, config.steps, device, None, ctx),
            optimizer)


def eager_torch_step(model: torch.nn.Module, loss_fn: Callable, optimizer: torch.optim.Optimizer,
                     num_model_inputs: int = 1) -> Callable:
    """The plain PyTorch loop's step(batch) -> loss, what compile_step is compared with: forward, loss,
    backward, optimizer.step(), zero_grad()."""

    def step(batch):
        loss = loss_fn(model(*batch[:num_model_inputs]), *batch[num_model_inputs:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    return step


def train(config: TrainConfig) -> TrainResult:
    """Run the configured training and the comparisons it asks for; print progress and the summary.
    Settings that cannot train raise ConfigError (check_config) before anything is built.

    With config.parallel "ddp" or "fsdp2" this is one rank of a data-parallel run (parallel.py: under torchrun or
    --nproc, else a world of one): rank 0 prints, and the result of every rank is returned. The process group stays
    up (the result's model holds it): parallel.finish() leaves it once the result is dropped."""
    check_config(config)
    if config.plot is not None:  # a missing matplotlib is said before training, not after
        require_matplotlib()
    ctx = parallel.start(config.parallel, config.device) if config.parallel != "none" else None
    if ctx is not None:
        config = replace(config, device=ctx.device)
    device = torch.device(config.device)
    matmul = f", {config.matmul} matmuls" if device.type == "cuda" else ""
    _print_main(ctx, f"graphsafe train: {_run_name(config, ctx)}{matmul}, "
                f"{config.optimizer} (state_bits={config.state_bits}, skip_zeros={config.skip_zeros}"
                f"{'; embedding tables skip_zeros=True for --sparse-updates' if tables_skip_zeros(config) else ''}), "
                f"mode={config.mode}, {config.steps} steps, seed {config.seed}")
    with matmul_precision(config):
        return _train(config, ctx)


def _run_name(config: TrainConfig, ctx: ParallelContext | None) -> str:
    device = torch.device(config.device)
    where = f"{ctx.world_size} x {device.type} ({config.parallel})" if ctx is not None else str(device)
    return f"{config.model}{' + MoE' if config.moe else ''} on {where}"


def _print_main(ctx: ParallelContext | None, text: str) -> None:
    if ctx is None or ctx.is_main:
        print(text, flush=True)


def _train(config: TrainConfig, ctx: ParallelContext | None = None) -> TrainResult:
    shown = config.progress and (ctx is None or ctx.is_main)
    with Progress(config.steps) if shown else contextlib.nullcontext() as show:
        result = _graph_run(config, show, ctx=ctx)
    step = result.step
    # Every method's per-step losses and times, by the name the plot's legend gives it.
    curves = result.extra["curves"] = {f"graphsafe ({_mode_label(config, step)[1]})": result.stats}
    if step.captured:  # the same traced graph without capture, for the eager-vs-captured line
        eager = _graph_run(replace(config, steps=min(config.steps, 20)), mode="eager", ctx=ctx)
        result.extra["eager_time"] = eager.stats.step_time(1, "the trace")
        curves["graphsafe (same graph, eager)"] = eager.stats
    if ctx is not None:
        comm_ms, what = parallel.communication_ms(step, result.model, ctx)
        result.extra["communication"] = (comm_ms, what)
        if ctx.mode == "ddp":
            result.extra["replicas_differing"] = parallel.replicas_identical(result.model)
    if config.check_determinism:
        again = _graph_run(config, ctx=ctx)
        pairs = list(zip(result.model.parameters(), again.model.parameters()))
        differing = sum(1 for a, b in pairs if not _same_bits(a, b))
        where = "two runs"
        if ctx is not None:  # the most any rank found
            ranks = f"each of {ctx.world_size} ranks" if ctx.world_size > 1 else "one rank"
            differing, where = _max_over_ranks(differing), f"two runs, on {ranks}"
        result.extra["determinism"] = (f"bitwise equal ({len(pairs)} parameter tensors, {where})" if differing == 0
                                       else f"DIFFERENT: {differing} of {len(pairs)} parameter tensors differ")
    if config.compare_torch:
        torch_stats, torch_opt = _torch_baseline(config, ctx)
        curves["PyTorch eager (AdamW)"] = torch_stats
        result.extra["torch_time"] = torch_stats.step_time(1, "warm-up")
        result.extra["torch_final_loss"] = torch_stats.losses[-1]
        result.extra["torch_state_bytes"] = optim.state_bytes(torch_opt)
    result.extra["parallel"] = ctx
    _print_main(ctx, summary(result))
    if config.plot is not None and (ctx is None or ctx.is_main):
        plot_training(curves, f"graphsafe train: {_run_name(config, ctx)}, {config.optimizer} "
                      f"({config.state_bits}-bit states), seed {config.seed}", config.plot)
        _print_main(ctx, f"plot: {config.plot}")
    return result


def _max_over_ranks(value: int) -> int:
    import torch.distributed as dist
    count = torch.tensor([value], dtype=torch.int64)
    if dist.get_backend() == "nccl":
        count = count.cuda()
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return int(count)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (torch.equal calls -0.0 == +0.0 and NaN != NaN); a DTensor's local shards."""
    a, b = (t.to_local() if hasattr(t, "to_local") else t for t in (a, b))
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.detach().reshape(-1).view(torch.uint8), b.detach().reshape(-1).view(torch.uint8))


def _parallel_rows(config: TrainConfig, result: TrainResult, ctx: ParallelContext) -> list[tuple[str, str]]:
    rows = [("world size", f"{ctx.world_size} ({ctx.describe()}); each rank trains on its own "
             f"{config.batch_size} rows of a global batch of {config.batch_size * ctx.world_size}")]
    plan = getattr(result.step, "data_parallel", None)
    if ctx.mode == "ddp" and plan is not None:
        total = sum(b.nbytes for b in plan.buckets)
        rows.append(("parallel", f"ddp: DistributedDataParallel traced without its hooks; the gradient all-reduce is "
                     f"in the traced step ({len(plan.buckets)} bucket(s) in parameter order, {_mb(total)}, "
                     f"grad * 1/{ctx.world_size} summed, as DDP's reducer does)"))
    else:
        rows.append(("parallel", "fsdp2: fully_shard per block and on the model; parameters, gradients and optimizer "
                     "states sharded over the ranks; not traced (FSDP2 communicates in module hooks), the step runs "
                     "eagerly through autograd"))
    return rows


def _mb(count: int) -> str:
    return f"{count / 2**20:.1f} MiB"


def _mode_label(config: TrainConfig, step) -> tuple[str, str, str]:
    """(the mode that ran as the summary states it, its short form for the step-time row, what the first steps
    did that later steps do not)."""
    # FSDP2: nothing traced; the first step sets up the module's and the optimizer's state
    if not getattr(getattr(step, "report", None), "traced", True):
        return "eager (not traced)", "eager, not traced", "lazy initialisation"
    if not config.device.startswith("cuda"):
        requested = "" if step.mode == "eager" else f"; {step.mode} asked for"
        return f"eager (CPU: no CUDA graphs{requested})", "eager", "the trace"
    if step.captured:
        warm = step.warmup_steps
        return (f"{step.mode} (captured)", f"{step.mode}, captured",
                f"the trace, {warm} eager warm-up step{'s' if warm != 1 else ''} and the capture")
    if step.mode != "eager":
        return (f"{step.mode} (not captured yet: the capture is step {step.warmup_steps + 1})",
                f"{step.mode}, not captured", "the trace")
    return "eager", "eager", "the trace"


def _first_steps(config: TrainConfig, step) -> int:
    """How many steps of a run did one-off work (trace; on CUDA the warm-up steps and the capture)."""
    return step.warmup_steps + 1 if step.captured else 1


def _sparse_update_rows(config: TrainConfig, report) -> list[tuple[str, str]]:
    sparse = report.sparse_update
    if not sparse.enabled:
        why = "--no-sparse-updates" if not config.sparse_updates else sparse.note
        return [("sparse updates", f"off ({why})")]
    rows = [("sparse updates", f"{len(sparse.fused)} table(s) fused: row-sparse gradient + graphsafe.optim.sparse_step"
             + ("" if sparse.fused or sparse.refused else " (no embedding table reached)"))]
    rows += [("", f"{t.name} {list(t.shape)}: up to {t.capacity} rows per step") for t in sparse.fused]
    rows += [("not fused", f"{name}: {why}") for name, why in sparse.refused]
    return rows


def summary(result: TrainResult) -> str:
    from ..bench.report import markdown_table

    config, stats, step, extra = result.config, result.stats, result.step, result.extra
    report = step.report
    device = config.device + (f" (fp32 matmuls: {config.matmul})" if config.device.startswith("cuda") else "")
    rows = [("model", extra["model"]), ("data", extra["data"]), ("device", device)]
    ctx = extra.get("parallel")
    if ctx is not None:
        rows += _parallel_rows(config, result, ctx)
    label, short, first = _mode_label(config, step)
    rows.append(("mode used", f"{label}: {report.decision}"))
    rows += [("fallback", f) for f in report.fallbacks]
    rewrites = report.rewrite.rewritten
    if not report.traced:
        rows.append(("rewrites", "none (not traced): the model's torch.nn.Embedding modules were swapped for "
                     "graphsafe.nn.Embedding before sharding, the same deterministic backward"))
    else:
        rows.append(("rewrites", f"{len(rewrites)} embedding backward(s) -> graphsafe.embedding_backward"
                     + (f"; {len(report.rewrite.left_alone)} left alone" if report.rewrite.left_alone else "")))
    rows += [("", r.split(": ", 1)[-1]) for r in rewrites]
    rows += [("left alone", f"{n}: {why}") for n, why in report.rewrite.left_alone]
    rows += _sparse_update_rows(config, report)
    by_rule = report.gate.by_rule()
    rows.append(("unsafe nodes", "none (the whole step is capturable)" if not by_rule else f"{len(report.gate.unsafe)}"))
    for rule, findings in by_rule.items():
        names = ", ".join(f.node for f in findings[:4]) + (", ..." if len(findings) > 4 else "")
        rows.append((f"  {rule}", f"{names}: {findings[0].reason}"))
    over = f"; mean over {ctx.world_size} rank{'s' if ctx.world_size != 1 else ''}" if ctx is not None else ""
    rows.append(("loss", f"{stats.losses[0]:.4f} -> {stats.losses[-1]:.4f} ({len(stats.losses)} steps{over})"))
    rows.append((f"step time ({short})", stats.step_time(_first_steps(config, step), first)))
    if "communication" in extra:
        ms, what = extra["communication"]
        typical = stats.median_ms(_first_steps(config, step))
        share = f" ({100 * ms / typical:.0f}% of the step time)" if typical else ""
        rows.append(("communication", f"{ms:.2f} ms{share}: {what}"))
    if "replicas_differing" in extra:
        differing = extra["replicas_differing"]
        same = (f"parameters bitwise identical on all {ctx.world_size} ranks" if ctx.world_size > 1
                else "one rank: nothing to compare")
        rows.append(("replicas", same if differing == 0
                     else f"DIFFERENT: {differing} parameter tensor(s) differ between ranks"))
    if "eager_time" in extra:
        rows.append(("step time (same graph, eager)", extra["eager_time"]))
    if "torch_time" in extra:
        rows.append(("step time (PyTorch eager, AdamW)", f"{extra['torch_time']}; final loss "
                     f"{extra['torch_final_loss']:.4f}"))
    state = optim.state_bytes(result.optimizer)
    line = f"{_mb(state)} ({config.optimizer}, {config.state_bits}-bit states)"
    if ctx is not None and ctx.mode == "fsdp2":
        line += ", this rank's shards"
    if "torch_state_bytes" in extra:
        line += f"; torch.optim.AdamW: {_mb(extra['torch_state_bytes'])}"
    rows.append(("optimizer state", line))
    if "experts_without_tokens" in extra:
        idle = extra["experts_without_tokens"]
        names = ", ".join(map(str, idle)) if idle else "none"
        rows.append(("MoE", f"{len(idle)} of {config.experts} experts got no token in a fresh batch ({names}; "
                     f"{_cold_range(config.experts)} start cold); cold experts' weights unchanged bitwise: "
                     f"{'yes' if extra['cold_experts_unchanged'] else 'no'}"
                     + ("" if config.skip_zeros else " (use --skip-zeros to leave them untouched)")))
    rows.append(("determinism", extra.get("determinism", "not checked (add --check-determinism)")))
    return "\n" + markdown_table(["", "result"], rows)
