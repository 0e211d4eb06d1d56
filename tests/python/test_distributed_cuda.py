"""graphsafe's optimizers under torch.distributed on CUDA with NCCL, in what one GPU can check (the 2-GPU runs
are issue 23's, with the same code): a world of one process, FSDP2 and plain DTensor parameters on the device,
and a step captured in a CUDA graph whose collectives (LAMB/LARS's all-gather of the shards' norms) are nodes of
the graph. With one rank every collective is an identity, so each run must equal the same training without
torch.distributed bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import requires_cuda
from distributed_harness import FSDP2_AVAILABLE, run_in_processes
from test_distributed_optim import BATCH, _fsdp2, _full, batch, make_model, make_optimizer

NCCL_AVAILABLE = bool(torch.distributed.is_available() and torch.distributed.is_nccl_available())
pytestmark = [requires_cuda, pytest.mark.skipif(not (FSDP2_AVAILABLE and NCCL_AVAILABLE),
                                                reason="needs torch.distributed with NCCL, DTensor and FSDP2")]

CASES = [("AdamW", 32), ("AdamW", 8), ("AdamWScheduleFree", 16), ("LAMB", 32), ("LAMB", 8), ("LARS", 32),
         ("SGD", 16)]
STEPS = 6


def _train(model, opt, steps: int = STEPS) -> None:
    for step in range(steps):
        x, y = batch(step, 1)
        opt.zero_grad()
        nn.functional.mse_loss(model(x.cuda()), y.cuda()).backward()
        opt.step()


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
