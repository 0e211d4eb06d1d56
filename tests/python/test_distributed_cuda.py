"""graphsafe's optimizers under torch.distributed on CUDA with NCCL. On one GPU: a world of one process, FSDP2 and
plain DTensor parameters on the device, and a step captured in a CUDA graph; with one rank every collective is an
identity, so each run must equal the same training without torch.distributed bit for bit. On every visible GPU
(one process each: issue 23's run on 2 GPUs uses this file unchanged): every algorithm at 32/16/8-bit states on an
FSDP2 model against one GPU training on the whole batch (to the CPU tests' tolerance), every rank's parameters
equal, and two runs bitwise equal.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import requires_cuda
from distributed_harness import FSDP2_AVAILABLE, run_in_processes
from test_distributed_optim import (BATCH, CONFIGS, _fsdp2, _full, assert_close_training, batch, make_model,
                                   make_optimizer)

NCCL_AVAILABLE = bool(torch.distributed.is_available() and torch.distributed.is_nccl_available())
pytestmark = [requires_cuda, pytest.mark.skipif(not (FSDP2_AVAILABLE and NCCL_AVAILABLE),
                                                reason="needs torch.distributed with NCCL, DTensor and FSDP2")]

CASES = [("AdamW", 32), ("AdamW", 8), ("AdamWScheduleFree", 16), ("LAMB", 32), ("LAMB", 8), ("LARS", 32),
         ("SGD", 16)]
STEPS = 6


def _train(model, opt) -> None:
    _train_slice(model, opt, 1, None, STEPS)


def _fsdp2_world_of_one(rank: int, world: int) -> dict:
    out = {}
    for case, bits in CASES:
        sharded = _fsdp2(make_model().cuda())
        opt = make_optimizer(case, sharded.parameters(), bits, skip=True)
        _train(sharded, opt)
        plain = make_model().cuda()
        plain_opt = make_optimizer(case, plain.parameters(), bits, skip=True)
        _train(plain, plain_opt)
        out[(case, bits)] = ([t.cpu() for t in _full(sharded)], [p.detach().cpu() for p in plain.parameters()])
    return out


def _captured_dtensor_step(rank: int, world: int) -> dict:
    """DTensor parameters (Shard(0) on a 1-device mesh) stepped eagerly, against the same step captured in a CUDA
    graph after warm-up steps and replayed, per case; and both against plain tensors."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh = init_device_mesh("cuda", (world,))
    out = {}
    gen = torch.Generator().manual_seed(5)
    shapes = [(33, 8), (7,), (1, 5)]
    start = [torch.randn(s, generator=gen).cuda() for s in shapes]
    grads = [[torch.randn(s, generator=gen).cuda() for s in shapes] for _ in range(8)]
    for case, bits in CASES:
        runs = []
        for kind in ("plain", "eager", "captured"):
            if kind == "plain":
                params = [nn.Parameter(t.clone()) for t in start]
            else:
                params = [nn.Parameter(distribute_tensor(t.clone(), mesh, [Shard(0)])) for t in start]
            opt = make_optimizer(case, params, bits, skip=True)
            static = [torch.zeros_like(t) for t in start]
            for p, g in zip(params, static):
                p.grad = distribute_tensor(g, mesh, [Shard(0)]) if kind != "plain" else g
            locals_ = [p.grad.to_local() if kind != "plain" else p.grad for p in params]
            graph = None
            for step, values in enumerate(grads):
                for g, v in zip(locals_, values):
                    g.copy_(v)
                if kind == "captured" and step == 3:  # three eager steps make the states, then capture
                    torch.cuda.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        opt.step()
                if graph is not None:
                    graph.replay()
                else:
                    opt.step()
            torch.cuda.synchronize()
            runs.append([(p.full_tensor() if kind != "plain" else p).detach().cpu() for p in params])
        out[(case, bits)] = runs
    return out


def test_fsdp2_on_a_world_of_one_equals_training_without_it(tmp_path):
    results = run_in_processes(_fsdp2_world_of_one, 1, timeout=300, workdir=tmp_path, backend="nccl")[0]
    for (case, bits), (sharded, plain) in results.items():
        for i, (a, b) in enumerate(zip(sharded, plain)):
            assert torch.equal(a, b), f"{case} {bits}-bit param {i}: FSDP2 on one GPU differs from plain training"


def test_captured_dtensor_step_with_its_collectives_equals_eager_and_plain(tmp_path):
    results = run_in_processes(_captured_dtensor_step, 1, timeout=300, workdir=tmp_path, backend="nccl")[0]
    for (case, bits), (plain, eager, captured) in results.items():
        for i, (a, b, c) in enumerate(zip(plain, eager, captured)):
            assert torch.equal(b, a), f"{case} {bits}-bit param {i}: DTensor eager step differs from plain tensors"
            assert torch.equal(c, b), f"{case} {bits}-bit param {i}: the captured replays differ from eager steps"


GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
GPU_CONFIGS = [(case, bits) for case, bits, skip in CONFIGS if skip]  # every algorithm and width, skip_zeros on


def _train_slice(model, opt, world: int, rank: int | None, steps: int = 10) -> None:
    """steps steps; rank None: each step's whole batch on this process, else rank's slice of it."""
    for step in range(steps):
        x, y = batch(step, world)
        if rank is not None:
            x, y = x[rank * BATCH:(rank + 1) * BATCH], y[rank * BATCH:(rank + 1) * BATCH]
        opt.zero_grad()
        nn.functional.mse_loss(model(x.cuda()), y.cuda()).backward()
        opt.step()


def _every_config_on_gpus(rank: int, world: int) -> dict:
    out = {}
    for case, bits in GPU_CONFIGS:
        model = _fsdp2(make_model().cuda())
        opt = make_optimizer(case, model.parameters(), bits, skip=True)
        _train_slice(model, opt, world, rank)
        if hasattr(opt, "eval"):  # AdamWScheduleFree: x, as evaluation sees it
            opt.eval()
        out[(case, bits)] = [t.cpu() for t in _full(model)]
    return out


def test_fsdp2_on_every_visible_gpu_matches_one_gpu_and_repeats(tmp_path):
    world = GPUS
    runs = []
    for i in range(2):
        workdir = tmp_path / f"run{i}"
        workdir.mkdir()
        runs.append(run_in_processes(_every_config_on_gpus, world, timeout=500, workdir=workdir, backend="nccl"))
    start = [p.detach() for p in make_model().parameters()]
    for case, bits in GPU_CONFIGS:
        model = make_model().cuda()
        opt = make_optimizer(case, model.parameters(), bits, skip=True)
        _train_slice(model, opt, world, None)
        if hasattr(opt, "eval"):
            opt.eval()
        reference = [p.detach().cpu() for p in model.parameters()]
        for run in runs:
            for rank, result in enumerate(run):
                got = result[(case, bits)]
                assert_close_training(got, reference, start, bits, case, f"{case} {bits}-bit, {world} GPUs, rank {rank}")
                for a, b in zip(got, run[0][(case, bits)]):
                    assert torch.equal(a, b), f"{case} {bits}-bit: rank {rank} gathered other parameters than rank 0"
        for a, b in zip(runs[0][0][(case, bits)], runs[1][0][(case, bits)]):
            assert torch.equal(a.view(torch.int32), b.view(torch.int32)), f"{case} {bits}-bit: two runs differ"
