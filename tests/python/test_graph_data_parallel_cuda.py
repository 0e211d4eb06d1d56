"""The data-parallel compile_step on GPUs with NCCL (skipped without CUDA): one process per visible GPU (a world of
one on a single GPU), spawned through distributed_harness.

* mode="full": forward, backward, the bucketed NCCL all-reduces and the optimizer step captured in one CUDA graph
  per rank, replayed; equal to the DDP model trained eagerly (graphsafe.nn.Embedding for the same embedding
  gradients) over 6 steps: bitwise on 1 and 2 GPUs (a + b = b + a), to rounding on more (NCCL's order for an
  element depends on its position in the buffer, and DDP's buckets lay the gradients out differently);
* reduction="rank_order" (all-gather, then adds in rank order) captured the same way, bitwise repeatable;
* a gloo group for the gradients of a CUDA step: the gate names the collectives (host_collective), the step runs
  piecewise (captured regions around eager gloo collectives) and still equals the eager DDP run;
* every rank's parameters identical.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distributed_harness import run_in_processes

import graphsafe
from graphsafe.graph import DataParallel
from graphsafe.graph.rewrite import use_graphsafe_embeddings

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or not torch.distributed.is_nccl_available(),
                                reason="needs CUDA and NCCL")

STEPS = 6


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(300, 32, padding_idx=0)
        self.fc = nn.Linear(32, 64)
        self.out = nn.Linear(64, 7)

    def forward(self, ids):
        return self.out(torch.relu(self.fc(self.emb(ids).mean(1))))


def _loss(logits, target):
    return nn.functional.cross_entropy(logits, target)


def _batch(step: int, rank: int, device):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    ids, target = torch.randint(0, 300, (16, 9), generator=gen), torch.randint(0, 7, (16,), generator=gen)
    return ids.to(device), target.to(device)


def _net(device) -> nn.Module:
    torch.manual_seed(0)
    return _Net().to(device)


def _optimizer(params):
    return graphsafe.optim.AdamW(params, lr=0.02, weight_decay=0.01, skip_zeros=True)


def _params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters()}


def _compiled(rank, device, mode, **kwargs) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = _net(device)
    ddp = DDP(model, device_ids=[device.index], bucket_cap_mb=0.01)
    step = graphsafe.compile_step(ddp, _loss, _optimizer(ddp.parameters()), mode=mode, **kwargs)
    losses = [step(_batch(i, rank, device)).cpu() for i in range(STEPS)]
    return {"losses": losses, "params": _params(model), "mode": step.mode, "captured": step.captured,
            "unsafe": sorted({f.rule for f in step.report.gate.unsafe}),
            "notes": sorted({f.rule for f in step.report.gate.notes}), "buckets": len(step.data_parallel.buckets),
            "fallbacks": list(step.report.fallbacks)}


def _ddp_eager(rank, device) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = use_graphsafe_embeddings(_net(device))
    ddp = DDP(model, device_ids=[device.index], bucket_cap_mb=0.01)
    optimizer = _optimizer(ddp.parameters())
    losses = []
    for i in range(STEPS):
        ids, target = _batch(i, rank, device)
        loss = _loss(ddp(ids), target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach().cpu())
    return {"losses": losses, "params": _params(model)}


def _on_gpus(rank: int, world: int) -> dict:
    import torch.distributed as dist
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    out = {"eager": _ddp_eager(rank, device), "full": _compiled(rank, device, "full"),
           "full_again": _compiled(rank, device, "full"),
           "rank_order": _compiled(rank, device, "full", data_parallel=DataParallel(reduction="rank_order")),
           "rank_order_again": _compiled(rank, device, "full", data_parallel=DataParallel(reduction="rank_order"))}
    gloo = dist.new_group(backend="gloo")
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = _net(device)
    ddp = DDP(model, device_ids=[device.index], process_group=gloo, bucket_cap_mb=0.01)
    step = graphsafe.compile_step(ddp, _loss, _optimizer(ddp.parameters()))
    losses = [step(_batch(i, rank, device)).cpu() for i in range(STEPS)]
    out["gloo"] = {"losses": losses, "params": _params(model), "mode": step.mode, "captured": step.captured,
                   "unsafe": sorted({f.rule for f in step.report.gate.unsafe}), "fallbacks": step.report.fallbacks}
    torch.cuda.synchronize()
    return out


@pytest.fixture(scope="module")
def gpus(tmp_path_factory):
    return run_in_processes(_on_gpus, torch.cuda.device_count(), timeout=300, backend="nccl",
                            workdir=tmp_path_factory.mktemp("nccl"))


def _same(a, b) -> bool:
    return a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _equal_runs(a: dict, b: dict) -> bool:
    return all(_same(x, y) for x, y in zip(a["losses"], b["losses"])) and all(
        _same(a["params"][n], b["params"][n]) for n in a["params"])


def test_full_capture_with_nccl_all_reduce_in_the_graph(gpus):
    for result in gpus:
        full = result["full"]
        assert full["mode"] == "full" and full["captured"] and full["fallbacks"] == []
        assert full["unsafe"] == [] and "collective" in full["notes"] and full["buckets"] > 1


def test_full_capture_equals_ddp_eager(gpus):
    for rank, result in enumerate(gpus):
        if len(gpus) <= 2:
            assert _equal_runs(result["full"], result["eager"]), rank
        else:
            for n, p in result["eager"]["params"].items():
                torch.testing.assert_close(result["full"]["params"][n], p, rtol=1e-4, atol=1e-5)


def test_captured_runs_repeat_bitwise_and_ranks_agree(gpus):
    for result in gpus:
        assert _equal_runs(result["full"], result["full_again"])
        assert _equal_runs(result["rank_order"], result["rank_order_again"])
        assert result["rank_order"]["captured"]
    for key in ("full", "rank_order", "gloo"):
        assert all(_same(gpus[0][key]["params"][n], r[key]["params"][n]) for r in gpus[1:] for n in r[key]["params"])


def test_gloo_group_on_cuda_runs_piecewise_and_equals_ddp_eager(gpus):
    for rank, result in enumerate(gpus):
        gloo = result["gloo"]
        assert gloo["unsafe"] == ["host_collective"]
        assert gloo["mode"] == "piecewise" and gloo["captured"], gloo["fallbacks"]
        if len(gpus) <= 2:
            assert _equal_runs(gloo, result["eager"]), rank
