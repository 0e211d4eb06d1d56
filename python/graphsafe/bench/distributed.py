"""The `dist` suite: `graphsafe train`'s default LM and recommender, data-parallel, at 1 process and at N.

    graphsafe bench --suite dist                              # N = the visible GPUs on CUDA, 2 on the CPU
    GRAPHSAFE_BENCH_NPROC=4 graphsafe bench --suite dist      # another N (on CUDA at most the visible GPUs)

Four methods, each at 1 process and at N processes (one GPU per rank, NCCL; gloo on the CPU):
- graphsafe captured: DistributedDataParallel + graphsafe.compile_step(mode="auto") + graphsafe AdamW. On CUDA the
  whole step (forward, backward, the bucketed gradient all-reduce, the optimizer) is one CUDA graph replay; on
  the CPU nothing is captured (mode auto runs the traced graph eagerly), so this row equals the next one there;
- graphsafe eager: the same traced graph, all-reduce included, run op by op (mode="eager");
- torch DDP: the plain PyTorch loop, DDP + torch.optim.AdamW (fused=True on CUDA, foreach on the CPU);
- torch FSDP2: fully_shard on every block (the recommender: every child with parameters) and on the model,
  torch.optim.AdamW as above.
All four use `graphsafe train`'s optimizer settings (AdamW, lr 1e-2, weight decay 0.01) and its data: each rank
trains on its own per-rank batch of a global batch of N x that (weak scaling: the work per rank is fixed).

Per row: the step time (each rank's median over the timed steps, the slowest rank's reported), the throughput
(tokens/s for the LM, rows/s for the recommender, all ranks together), the scaling efficiency (N-process
throughput / (N x 1-process throughput) of the same method), the throughput against torch DDP at the same
process count, and the communication time: the step's collectives at the same sizes and dtypes, timed alone
after training (trainer/parallel.py communication_ms; torch DDP: the buckets its reducer built).

Targets (issue 23, the default LM, at N >= 2 GPUs): the captured N-GPU step >= 1.5x the torch DDP loop's
throughput; the captured N-GPU throughput >= 0.9 N x the captured 1-GPU throughput (1.8x at N = 2). On the CPU,
and with fewer than 2 GPUs, they are reported and SKIPped with the reason.

The suite starts its own processes (python, not torchrun: a TCPStore in this process, torchrun's environment in
each rank, as `graphsafe train --nproc` does); rank 0 writes the results, this process reads and prints them.
Every group of processes is bounded in time: GRAPHSAFE_BENCH_DIST_TIMEOUT seconds (default 300 quick, 600 full),
then its ranks are ended and its rows report the error. Quick mode (the CPU's default) uses tiny models and a
few steps, so that a test runs the suite in seconds. On the CPU every rank runs os.cpu_count() // N threads, at
1 process too, so the 1-process run has the resources of one of the N ranks.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, replace
from datetime import timedelta
from types import SimpleNamespace

import torch

from .harness import BenchContext, Suite, Target, progress, register_suite
from .report import first_line, fmt_ms, markdown_table

MODELS = ("lm", "recsys")
METHODS = ("graphsafe captured", "graphsafe eager", "torch DDP", "torch FSDP2")
NPROC_ENV = "GRAPHSAFE_BENCH_NPROC"
TIMEOUT_ENV = "GRAPHSAFE_BENCH_DIST_TIMEOUT"
TARGET_VS_DDP = 1.5  # captured N-GPU throughput / torch DDP N-GPU throughput, default LM
TARGET_EFFICIENCY = 0.9  # captured N-GPU throughput / (N x captured 1-GPU throughput): 1.8x at N = 2
WARMUP_STEPS = 4  # untimed: the trace; on CUDA compile_step's 2 eager warm-up steps and the capture
QUICK_SIZES = {"lm": dict(vocab=256, dim=32, layers=1, heads=4, seq_len=16, batch_size=4),
               "recsys": dict(vocab=256, users=1000, dim=16, batch_size=64)}


# -- arithmetic (unit-tested) -------------------------------------------------------------------------------------

def throughput(units_per_rank_step: int, nproc: int, ms_per_step: float) -> float:
    """Tokens (or rows) per second over all ranks: each rank handles units_per_rank_step per step."""
    return units_per_rank_step * nproc / (ms_per_step / 1e3)


def scaling_efficiency(throughput_n: float, throughput_1: float, nproc: int) -> float:
    """N-process throughput / (N x 1-process throughput): 1.0 is perfect weak scaling."""
    return throughput_n / (nproc * throughput_1)


def _find(records: list[dict], model: str, method: str, nproc: int) -> dict:
    return next((r for r in records if r.get("record") == "measurement" and r["model"] == model
                 and r["method"] == method and r["nproc"] == nproc), {})


def add_comparisons(records: list[dict]) -> None:
    """Fill each measurement's efficiency (against the same method at 1 process) and its throughput against
    torch DDP at the same process count."""
    for r in records:
        if "throughput" not in r:
            continue
        one = _find(records, r["model"], r["method"], 1)
        if r["nproc"] > 1 and "throughput" in one:
            r["efficiency"] = scaling_efficiency(r["throughput"], one["throughput"], r["nproc"])
        ddp = _find(records, r["model"], "torch DDP", r["nproc"])
        if "throughput" in ddp:
            r["vs_torch_ddp"] = r["throughput"] / ddp["throughput"]


def verdicts(records: list[dict], device_type: str, nproc: int, quick: bool) -> list[Target]:
    """Issue 23's two targets on the default LM, from the measurements (after add_comparisons)."""
    ours_n = _find(records, "lm", "graphsafe captured", nproc)
    ours_1 = _find(records, "lm", "graphsafe captured", 1)
    ddp_n = _find(records, "lm", "torch DDP", nproc)
    skip = ""
    if device_type != "cuda":
        skip = f"{device_type}: gloo, no CUDA graphs; reported, no verdict"
    elif nproc < 2:
        skip = f"fewer than 2 GPUs (N = {nproc}): nothing to scale over"
    checks = [
        (f"captured {nproc}-GPU step ≥ {TARGET_VS_DDP:g}x the torch DDP loop's throughput (default LM)",
         ours_n, ddp_n, TARGET_VS_DDP, f"≥ {TARGET_VS_DDP:g}x"),
        (f"captured {nproc}-GPU throughput ≥ {TARGET_EFFICIENCY * nproc:g}x the 1-GPU captured throughput "
         "(weak scaling, default LM)", ours_n, ours_1, TARGET_EFFICIENCY * nproc,
         f"≥ {TARGET_EFFICIENCY * nproc:g}x ({TARGET_EFFICIENCY:g} × {nproc})"),
    ]
    targets = []
    for description, ours, theirs, needed, threshold in checks:
        if "throughput" not in ours or "throughput" not in theirs or (ours is theirs):
            why = ours.get("error") or theirs.get("error") or "measurement missing"
            targets.append(Target("dist", description, "SKIP" if skip else "ERROR", "", threshold, skip or why))
            continue
        ratio = ours["throughput"] / theirs["throughput"]
        value = f"{ratio:.2f}x ({_fmt_rate(ours)} vs {_fmt_rate(theirs)})"
        if skip:
            targets.append(Target("dist", description, "SKIP", value, threshold, skip))
        else:
            targets.append(Target("dist", description, "PASS" if ratio >= needed else "MISS", value, threshold,
                                  "quick sizes" if quick else ""))
    return targets


# -- the suite, in the bench process -------------------------------------------------------------------------------

def nproc_for(device: torch.device) -> int:
    """N: GRAPHSAFE_BENCH_NPROC if set, else the visible GPUs on CUDA, else 2."""
    visible = torch.cuda.device_count() if device.type == "cuda" else None
    raw = os.environ.get(NPROC_ENV, "").strip()
    if not raw:
        return visible if visible is not None else 2
    try:
        n = int(raw)
    except ValueError:
        raise SystemExit(f"graphsafe bench: {NPROC_ENV} must be a positive integer, got {raw!r}") from None
    if n < 1:
        raise SystemExit(f"graphsafe bench: {NPROC_ENV} must be a positive integer, got {n}")
    if visible is not None and n > visible:
        raise SystemExit(f"graphsafe bench: {NPROC_ENV}={n} but only {visible} GPU(s) are visible (one per rank)")
    return n


def configs(ctx: BenchContext) -> dict[str, dict]:
    """Each model's TrainConfig (as a dict): the trainer's defaults for the device, or tiny sizes when quick."""
    from ..trainer.run import default_config
    out = {}
    for model in MODELS:
        config = default_config(ctx.device.type, model=model)
        # sparse_updates off: a data-parallel step is never fused, and the tables' skip_zeros group it would add
        # would make graphsafe's AdamW differ from the torch loops' it is compared with.
        config = replace(config, device=ctx.device.type, progress=False, parallel="ddp", sparse_updates=False,
                         **(QUICK_SIZES[model] if ctx.quick else {}))
        out[model] = asdict(config)
    return out


def run_suite(ctx: BenchContext) -> list[dict]:
    nproc = nproc_for(ctx.device)
    spec = {"device": ctx.device.type, "steps": ctx.timer.repeats, "warmup": WARMUP_STEPS, "configs": configs(ctx),
            "methods": list(METHODS), "threads_per_rank": max(1, (os.cpu_count() or 1) // nproc)}
    timeout = float(os.environ.get(TIMEOUT_ENV) or (300 if ctx.quick else 600))
    records: list[dict] = []
    for world in dict.fromkeys((1, nproc)):
        backend = "nccl" if spec["device"] == "cuda" else "gloo"
        progress(f"dist: {world} process{'es' if world > 1 else ''} ({backend})")
        records += launch_group(world, spec, timeout)
    add_comparisons(records)
    for record in records:
        ctx.emit(record)
    return records


def launch_group(world: int, spec: dict, timeout: float) -> list[dict]:
    """Run the worker in `world` processes (torchrun's environment, a TCPStore hosted here); rank 0's
    measurements, or one error record per (model, method) when the group failed or ran past `timeout`."""
    from torch import distributed as dist

    from ..trainer.parallel import _end
    with tempfile.TemporaryDirectory(prefix="graphsafe-bench-dist-") as tmp:
        spec_path, out_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "out.json")
        with open(spec_path, "w", encoding="utf-8") as f:
            json.dump(spec, f)
        store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=timeout),
                              wait_for_workers=False)
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), WORLD_SIZE=str(world),
                   LOCAL_WORLD_SIZE=str(world), TORCHELASTIC_USE_AGENT_STORE="True", GRAPHSAFE_LAUNCHED="1",
                   OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", str(spec["threads_per_rank"])))
        code = ("import sys; from graphsafe.bench.distributed import worker_main; "
                "sys.exit(worker_main(sys.argv[1], sys.argv[2]))")
        procs, logs = [], []
        failure = None
        try:
            for rank in range(world):
                log = open(os.path.join(tmp, f"rank{rank}.log"), "w+", encoding="utf-8")  # noqa: SIM115
                logs.append(log)
                procs.append(subprocess.Popen([sys.executable, "-c", code, spec_path, out_path],
                                              stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                              env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank))))
            failure = _wait(procs, time.monotonic() + timeout)
        finally:
            for proc in procs:
                _end(proc, signal.SIGKILL)
            tails = []
            for rank, log in enumerate(logs):
                log.seek(0)
                tails.append(log.read()[-4000:])
                log.close()
            del store
        if failure is None and os.path.exists(out_path):
            with open(out_path, encoding="utf-8") as f:
                return json.load(f)
        rank, why = failure if failure is not None else (0, "wrote no results")
        progress(f"dist: {world} process(es) failed: rank {rank} {why}; its output ends with:\n{tails[rank][-2000:]}")
        last = next((line for line in reversed(tails[rank].strip().splitlines()) if line.strip()), "")
        error = f"rank {rank} of {world} {why}" + (f": {last.strip()[:200]}" if last else "")
        return [_base_record(model, method, world, spec) | {"error": error}
                for model in spec["configs"] for method in spec["methods"]]


def _wait(procs: list[subprocess.Popen], deadline: float, grace: float = 10.0) -> tuple[int, str] | None:
    """None when every rank exits with 0; else (a failed rank, what happened). A failed rank's peers get `grace`
    seconds (they may wait in a collective with it); past the deadline every rank is reported as timed out."""
    failed, failed_at = None, None
    while True:
        for rank, proc in enumerate(procs):
            code = proc.poll()
            if code not in (None, 0) and failed is None:
                how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
                failed, failed_at = (rank, how), time.monotonic()
        if all(proc.poll() is not None for proc in procs):
            return failed
        now = time.monotonic()
        if failed_at is not None and now - failed_at > grace:
            return failed
        if now > deadline:
            rank = next(i for i, proc in enumerate(procs) if proc.poll() is None)
            return failed or (rank, f"ran past the time limit ({TIMEOUT_ENV})")
        time.sleep(0.05)


def _base_record(model: str, method: str, world: int, spec: dict) -> dict:
    config = spec["configs"][model]
    units = config["batch_size"] * (config["seq_len"] if model == "lm" else 1)
    return {"record": "measurement", "suite": "dist", "model": model, "method": method, "nproc": world,
            "backend": "nccl" if spec["device"] == "cuda" else "gloo", "batch_per_rank": config["batch_size"],
            "global_batch": config["batch_size"] * world, "unit": "tokens" if model == "lm" else "rows",
            "units_per_rank_step": units}


# -- the worker, in each rank ----------------------------------------------------------------------------------------

def worker_main(spec_path: str, out_path: str) -> int:
    """One rank: join the group (trainer/parallel.py start()), measure every (model, method), rank 0 writes."""
    from ..trainer import parallel
    with open(spec_path, encoding="utf-8") as f:
        spec = json.load(f)
    pctx = parallel.start("ddp", spec["device"])
    results = []
    try:
        for model in spec["configs"]:
            for method in spec["methods"]:
                results.append(_measure_guarded(model, method, spec, pctx))
                gc.collect()
                if pctx.device.startswith("cuda"):
                    torch.cuda.empty_cache()
        if pctx.is_main:
            with open(out_path + ".tmp", "w", encoding="utf-8") as f:
                json.dump(results, f)
            os.replace(out_path + ".tmp", out_path)
    finally:
        gc.collect()
        parallel.finish()
    return 0


def _measure_guarded(model: str, method: str, spec: dict, pctx) -> dict:
    from ..trainer.parallel import fsdp2_available
    from ..trainer.run import TrainConfig, matmul_precision
    record = _base_record(model, method, pctx.world_size, spec)
    config = replace(TrainConfig(**spec["configs"][model]), device=pctx.device)
    try:
        if method == "torch FSDP2" and not fsdp2_available():
            raise RuntimeError("this torch has no torch.distributed.fsdp.fully_shard (FSDP2)")
        with matmul_precision(config):
            record.update(_measure(method, config, spec, pctx, record["units_per_rank_step"]))
    except Exception as exc:  # noqa: BLE001 - one failed method is reported, the others still run
        record["error"] = first_line(exc)
        print(f"rank {pctx.rank}: {model} / {method}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
    return record


def _measure(method: str, config, spec: dict, pctx, units: int) -> dict:
    from torch import distributed as dist

    from ..graph import compile_step
    from ..trainer import parallel
    from ..trainer.run import OPTIMIZERS, _build, _optimizer, eager_torch_step
    device = torch.device(pctx.device)
    model, data, loss_fn, inputs, what = _build(config, pctx)
    batches = [next(data) for _ in range(spec["warmup"] + spec["steps"])]
    lr, weight_decay = OPTIMIZERS["adamw"][1]["lr"], OPTIMIZERS["adamw"][1]["weight_decay"]
    cuda = device.type == "cuda"
    ctx, step = pctx, None
    if method.startswith("graphsafe"):
        trained = parallel.wrap_model(model, pctx)  # DDP: compile_step all-reduces inside the traced step
        step = compile_step(trained, loss_fn, _optimizer(config, trained),
                            mode="auto" if method == "graphsafe captured" else "eager", num_model_inputs=inputs)
        step_fn = step
    else:
        if method == "torch DDP":
            trained = parallel.wrap_model(model, pctx)
        else:  # plain FSDP2: torch.nn.Embedding as it is (parallel.wrap_model would swap in graphsafe's)
            from torch.distributed.fsdp import fully_shard
            for unit in parallel._shard_units(model):
                fully_shard(unit)
            trained = model = fully_shard(model)
            ctx = replace(pctx, mode="fsdp2")
        optimizer = torch.optim.AdamW(trained.parameters(), lr=lr, weight_decay=weight_decay, fused=cuda or None,
                                      foreach=None if cuda else True)
        step_fn = eager_torch_step(trained, loss_fn, optimizer, inputs)
    times, loss = [], None
    for i, batch in enumerate(batches):
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        loss = step_fn(batch)
        float(loss)  # reading the loss synchronises: the time covers the whole step
        if i >= spec["warmup"]:
            times.append((time.perf_counter() - start) * 1e3)
    final_loss = parallel.mean_over_ranks(loss)
    ms = _max_over_ranks(statistics.median(times), device)
    if method == "torch DDP":  # the buckets DDP's reducer built (sizes in bytes), all-reduced alone
        sizes = [int(s) for s in str(trained._get_ddp_logging_data().get("bucket_sizes", "")).split(",") if s.strip()]
        dtype = next(trained.parameters()).dtype
        buckets = [SimpleNamespace(numel=s // dtype.itemsize, dtype=dtype, nbytes=s) for s in sizes]
        comm_ms, comm_what = parallel.communication_ms(SimpleNamespace(data_parallel=SimpleNamespace(buckets=buckets)),
                                                       trained, ctx)
    else:
        comm_ms, comm_what = parallel.communication_ms(step, trained, ctx)
    mode = "eager (autograd)"
    if step is not None:
        mode = step.mode + (" (captured)" if step.captured else "" if cuda else " (cpu: no CUDA graphs)")
    dist.barrier()
    return {"mode": mode, "what": what, "ms_median": ms, "ms_min": _max_over_ranks(min(times), device),
            "steps_timed": len(times), "throughput": throughput(units, pctx.world_size, ms), "comm_ms": comm_ms,
            "comm_what": comm_what, "loss": final_loss}


def _max_over_ranks(value: float, device: torch.device) -> float:
    from torch import distributed as dist
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


# -- report ------------------------------------------------------------------------------------------------------

def _fmt_rate(r: dict) -> str:
    x = r["throughput"]
    scaled = f"{x / 1e6:.2f}M" if x >= 1e6 else f"{x / 1e3:.1f}k" if x >= 1e3 else f"{x:.0f}"
    return f"{scaled} {'tok' if r['unit'] == 'tokens' else 'rows'}/s"


def evaluate_targets(records: list[dict], ctx: BenchContext) -> list[Target]:
    nproc = max((r["nproc"] for r in records if r.get("record") == "measurement"), default=1)
    return verdicts(records, ctx.device.type, nproc, ctx.quick)


def render(records: list[dict], ctx: BenchContext) -> str:
    rows = []
    for r in records:
        if r.get("record") != "measurement":
            continue
        head = (r["model"], r["method"], str(r["nproc"]))
        if "error" in r:
            rows.append(head + ("-",) * 6 + (f"error: {r['error']}",))
            continue
        share = f" ({100 * r['comm_ms'] / r['ms_median']:.0f}%)" if r["ms_median"] else ""
        rows.append(head + (r["mode"], fmt_ms(r["ms_median"]), _fmt_rate(r),
                            f"{r['efficiency']:.2f}" if "efficiency" in r else "-",
                            f"{r['vs_torch_ddp']:.2f}" if "vs_torch_ddp" in r else "-",
                            f"{fmt_ms(r['comm_ms'])}{share}", ""))
    sizes = []
    for model in MODELS:
        r = next((r for r in records if r.get("model") == model and "what" in r), None)
        if r is not None:
            sizes.append(f"{r['what']}, {r['batch_per_rank']} rows per rank")
    backend = "NCCL, one GPU per rank" if ctx.device.type == "cuda" else "gloo, CPU"
    return "\n\n".join([
        f"## data parallel: `graphsafe train` models at 1 and N processes ({ctx.describe_device()}; {backend})",
        "; ".join(sizes) + ". AdamW (lr 1e-2, weight decay 0.01). ms/step: the slowest rank's median of "
        f"{ctx.timer.repeats} steps after {WARMUP_STEPS} untimed ones; throughput over all ranks; efficiency: "
        "N-process throughput / (N × 1-process throughput), same method; comm: the step's collectives at the same "
        "sizes, timed alone (share of the step time).",
        markdown_table(("model", "method", "procs", "mode", "ms/step", "throughput", "scaling eff.", "× vs torch DDP",
                        "comm ms", "note"), rows,
                       align_right=(False, False, True, False, True, True, True, True, True, False)),
    ])


register_suite(Suite("dist", "data-parallel training step at 1 and N processes: captured/eager graphsafe vs "
                     "torch DDP and FSDP2", run_suite, evaluate_targets, render))
