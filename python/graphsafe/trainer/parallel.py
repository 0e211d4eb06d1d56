"""`graphsafe train` across processes: the process group, the launcher behind --nproc, the model wrappers
(DDP, FSDP2), and what the summary adds (world size, parallel mode, communication time, replicas).

Two ways in, one code path:
* `graphsafe train --nproc N ...` starts N local processes itself (launch()): it hosts a TCPStore on a free port
  and runs `python -m graphsafe train ...` N times with torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE,
  MASTER_ADDR, MASTER_PORT, and TORCHELASTIC_USE_AGENT_STORE=True, so every rank connects to the launcher's store
  instead of rank 0 hosting one: no port is chosen and then lost to a race).
* `torchrun --nproc-per-node N -m graphsafe train --parallel ddp ...` sets the same variables.
Each rank then joins the group through env:// (gloo on the CPU, NCCL on CUDA with one GPU per rank, cuda:LOCAL_RANK).
Without either, `--parallel ddp|fsdp2` runs a world of one in this process (a HashStore group).
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["PARALLEL_MODES", "ParallelContext", "under_launcher", "launch", "start", "finish", "wrap_model",
           "communication_ms", "replicas_identical", "mean_over_ranks", "fsdp2_available"]

PARALLEL_MODES = ("none", "ddp", "fsdp2")
_LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def under_launcher() -> bool:
    """True in a process started by torchrun or by --nproc (torchrun's environment is set)."""
    return all(os.environ.get(name) for name in _LAUNCH_ENV)


def fsdp2_available() -> bool:
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
        return dist.is_available()
    except ImportError:
        return False


@dataclass
class ParallelContext:
    mode: str  # "ddp" or "fsdp2"
    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: str
    owns_group: bool  # start() created the process group (finish() destroys it)
    launcher: str  # "--nproc", "torchrun" or "in-process"

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def describe(self) -> str:
        return (f"{self.world_size} process{'es' if self.world_size != 1 else ''} ({self.launcher}), {self.backend}, "
                f"{'one GPU per rank' if self.device.startswith('cuda') else 'cpu'}")



def start(mode: str, device: str) -> ParallelContext:
    """Join (or create) the process group for `mode` on `device` ("cpu" or "cuda..."); returns the context with the
    device this rank trains on."""
    cuda = device.startswith("cuda")
    backend = "nccl" if cuda else "gloo"
    if dist.is_initialized():  # a caller made the group already (a test, a notebook)
        rank, world = dist.get_rank(), dist.get_world_size()
        local = int(os.environ.get("LOCAL_RANK", rank))
        device = f"cuda:{local}" if cuda else "cpu"
        return ParallelContext(mode, rank, world, local, str(dist.get_backend()), device, False, "caller's group")
    launched = under_launcher()
    local = int(os.environ["LOCAL_RANK"]) if launched else 0
    options = {}
    if cuda:
        torch.cuda.set_device(local)
        # Created now rather than at the first collective: the communicator must exist before a CUDA graph
        # capture records a collective on it.
        options["device_id"] = torch.device("cuda", local)
    if launched:
        launcher = "--nproc" if os.environ.get("GRAPHSAFE_LAUNCHED") == "1" else "torchrun"
        dist.init_process_group(backend, init_method="env://", **options)
    else:
        launcher = "in-process"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **options)
    device = f"cuda:{local}" if cuda else "cpu"
    global _CREATED
    _CREATED = True
    return ParallelContext(mode, dist.get_rank(), dist.get_world_size(), local, backend, device, True, launcher)


def finish() -> None:
    """Leave the process group start() created, if any. Call it once the models, steps and optimizers of the run
    are gone: a gloo group destroyed while a DDP reducer still holds it can abort the process at exit (a
    std::thread left joinable; seen about one run in three on 2 ranks), and one destroyed afterwards cannot."""
    global _CREATED
    if _CREATED and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    _CREATED = False


_CREATED = False


def launch(nproc: int, argv: list[str]) -> int:
    """Run `python -m graphsafe <argv>` in nproc processes with torchrun's environment; returns the exit code
    (0 when every rank succeeded). Rank 0 prints; the others print only errors. When a rank fails, the others get a
    few seconds (they may be blocked in a collective with it), then are ended by their process ids."""
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(minutes=30), wait_for_workers=False)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), WORLD_SIZE=str(nproc),
               LOCAL_WORLD_SIZE=str(nproc), TORCHELASTIC_USE_AGENT_STORE="True", GRAPHSAFE_LAUNCHED="1")
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    procs: list[subprocess.Popen] = []
    try:
        for rank in range(nproc):
            procs.append(subprocess.Popen([sys.executable, "-m", "graphsafe", *argv],
                                          env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)),
                                          stdin=subprocess.DEVNULL))
        failed = _wait_for_ranks(procs)
    except KeyboardInterrupt:
        for proc in procs:
            _end(proc, signal.SIGINT)
        raise
    finally:
        for proc in procs:
            _end(proc, signal.SIGKILL)
    if failed is None:
        return 0
    rank, code = failed
    how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
    print(f"graphsafe train: error: rank {rank} of {nproc} {how} (its error is above); the other ranks were stopped",
          file=sys.stderr, flush=True)
    return 1


def _wait_for_ranks(procs: list[subprocess.Popen], grace: float = 10.0) -> tuple[int, int] | None:
    """None when all ranks exit with 0; else (first failed rank, its exit code), after ending the others."""
    failed, failed_at = None, None
    while True:
        for rank, proc in enumerate(procs):
            code = proc.poll()
            if code not in (None, 0) and failed is None:
                failed, failed_at = (rank, code), time.monotonic()
        if all(proc.poll() is not None for proc in procs):
            return failed
        if failed_at is not None and time.monotonic() - failed_at > grace:
            return failed
        time.sleep(0.05)


def _end(proc: subprocess.Popen, sig: int) -> None:
    if proc.poll() is None:
        try:
            proc.send_signal(sig)
            proc.wait(timeout=10)
        except (subprocess.TimeoutExpired, ProcessLookupError):
            proc.kill()


def wrap_model(model: torch.nn.Module, ctx: ParallelContext) -> torch.nn.Module:
    """DDP: DistributedDataParallel (compile_step traces the module inside and all-reduces in the graph).
    FSDP2: graphsafe.nn.Embedding for every torch.nn.Embedding (the step runs eagerly through autograd, so the
    deterministic backward comes from the module, not from the rewrite pass), then fully_shard on every child of
    the model's block list and on the model."""
    if ctx.mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        return DDP(model, device_ids=[ctx.local_rank] if ctx.device.startswith("cuda") else None)
    from torch.distributed.fsdp import fully_shard

    from ..graph.rewrite import use_graphsafe_embeddings
    model = use_graphsafe_embeddings(model)
    for child in _shard_units(model):
        fully_shard(child)
    return fully_shard(model)


def _shard_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, torch.nn.ModuleList):
        return list(blocks)
    # The recommender: its tables and its MLP, each sharded on its own.
    return [m for m in model.children() if any(True for _ in m.parameters())]


def mean_over_ranks(value: torch.Tensor) -> float:
    """The mean over the ranks of a one-element tensor (for the progress line and the summary's loss)."""
    total = value.detach().reshape(1).float().clone()
    dist.all_reduce(total)
    return float(total) / dist.get_world_size()


def replicas_identical(model: torch.nn.Module) -> int:
    """How many parameter tensors differ bitwise from rank 0's on some rank (0: every rank holds the same model)."""
    differing = 0
    with torch.no_grad():
        for p in model.parameters():
            reference = p.detach().clone()
            dist.broadcast(reference, 0)
            differing += int(not torch.equal(reference.reshape(-1).view(torch.uint8), p.detach().reshape(-1).view(torch.uint8)))
    count = torch.tensor([differing], dtype=torch.int64, device=next(model.parameters()).device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return int(count)


def communication_ms(step, model: torch.nn.Module, ctx: ParallelContext, repeats: int = 5) -> tuple[float, str]:
    """(milliseconds per step, what was timed): the collectives one training step makes, with the same sizes and
    dtypes, run alone after training (inside a captured step they cannot be timed apart from the kernels around
    them). DDP: the step's gradient buckets, all-reduced. FSDP2: per sharded module, the all-gathers of its
    parameters (forward, and again in backward for modules resharded after forward) and one reduce-scatter of
    its gradients."""
    device = torch.device(ctx.device)
    if ctx.mode == "ddp":
        plan = step.data_parallel
        buffers = [torch.zeros(b.numel, dtype=b.dtype, device=device) for b in plan.buckets]
        total = sum(b.nbytes for b in plan.buckets)

        def once():
            for buffer in buffers:
                dist.all_reduce(buffer)
        what = f"{len(buffers)} gradient all-reduce(s), {total / 2**20:.1f} MiB"
    else:
        gathers, scatters, total = _fsdp2_collectives(model, ctx.world_size, device)

        def once():
            for out, inp in gathers:
                dist.all_gather_into_tensor(out, inp)
            for out, inp in scatters:
                dist.reduce_scatter_tensor(out, inp)
        what = f"{len(gathers)} all-gather(s) and {len(scatters)} reduce-scatter(s), {total / 2**20:.1f} MiB"
    times = []
    for i in range(repeats + 1):
        dist.barrier()
        _sync(device)
        start = time.perf_counter()
        once()
        _sync(device)
        if i:  # the first round sets up the buffers' communication paths
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), f"{what} per step, timed alone after training (median of {repeats})"


def _fsdp2_collectives(model, world: int, device):
    from torch.distributed.fsdp import FSDPModule
    gathers, scatters, total = [], [], 0
    owned: set[int] = set()
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for unit in reversed(units):  # innermost first: a parameter belongs to the innermost FSDP module holding it
        params = [p for p in unit.parameters() if id(p) not in owned]
        owned.update(id(p) for p in params)
        if not params:
            continue
        # fully_shard pads each parameter's dim 0 to a multiple of the world size; one flat buffer per module
        shard = sum(-(-p.shape[0] // world) * (p.numel() // max(p.shape[0], 1)) for p in params)
        dtype = params[0].dtype
        inp = torch.zeros(shard, dtype=dtype, device=device)
        out = torch.zeros(shard * world, dtype=dtype, device=device)
        passes = 1 if unit is model else 2  # the root is not resharded after forward
        gathers += [(out, inp)] * passes
        scatters.append((torch.zeros(shard, dtype=dtype, device=device), torch.zeros(shard * world, dtype=dtype,
                                                                                     device=device)))
        total += (passes + 1) * out.numel() * out.element_size()
    return gathers, scatters, total


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
