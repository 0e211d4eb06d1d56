"""compile_step on models it does not trace or whose settings it does not reproduce, on real process groups (gloo,
2 processes through distributed_harness):

* an FSDP2 model (fully_shard): not traced; the report's gate findings name the FSDP2 modules and why; the step
  runs eagerly through autograd and equals the plain FSDP2 loop bitwise; a capture mode is refused;
* DDP with a communication hook, data_parallel on an FSDP2 model, a process group other than the DDP's: refused
  with ValueError;
and, in this process, data_parallel without an initialised process group (RuntimeError) and bad DataParallel
settings (ValueError).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distributed_harness import requires_fsdp2, run_in_processes

import graphsafe
from graphsafe.graph import CaptureError, DataParallel

STEPS = 3


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(40, 6), nn.Flatten(), nn.Linear(6 * 4, 5), nn.ReLU(), nn.Linear(5, 3))


def _sharded() -> nn.Module:
    from torch.distributed.fsdp import fully_shard
    model = _net()
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer)
    return fully_shard(model)


def _loss(logits, target):
    return nn.functional.cross_entropy(logits, target)


def _batch(step: int, rank: int):
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, 40, (5, 4), generator=gen), torch.randint(0, 3, (5,), generator=gen)


def _local_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.to_local().detach().clone() for n, p in model.named_parameters()}


def _refusal(fn) -> str:
    try:
        fn()
    except (ValueError, CaptureError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "accepted"


def _on_ranks(rank: int, world: int) -> dict:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    out: dict = {}

    model = _sharded()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    step = graphsafe.compile_step(model, _loss, optimizer)
    out["compiled_losses"] = [step(_batch(i, rank)).clone() for i in range(STEPS)]
    out["compiled"] = _local_params(model)
    out["mode"], out["report"], out["captured"] = step.mode, str(step.report), step.captured
    out["findings"] = [(f.node, f.op, f.rule) for f in step.report.gate.unsafe]
    out["grad_is_this_step"] = all(p.grad is not None for p in model.parameters())

    reference = _sharded()
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.05)
    losses = []
    for i in range(STEPS):
        ids, target = _batch(i, rank)
        loss = _loss(reference(ids), target)
        loss.backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        losses.append(loss.detach().clone())
    out["eager_losses"], out["eager"] = losses, _local_params(reference)

    sharded = _sharded()
    full = graphsafe.compile_step(sharded, _loss, torch.optim.AdamW(sharded.parameters()), mode="full")
    out["full_mode"] = _refusal(lambda: full(_batch(0, rank)))
    out["fsdp2_with_data_parallel"] = _refusal(
        lambda: graphsafe.compile_step(sharded, _loss, torch.optim.AdamW(sharded.parameters()), data_parallel=True))

    plain = DDP(_net())
    plain.register_comm_hook(None, _noop_hook)
    out["comm_hook"] = _refusal(lambda: graphsafe.compile_step(plain, _loss, torch.optim.SGD(plain.parameters(), 0.1)))
    other = dist.new_group(list(range(world)))
    ddp = DDP(_net())
    out["other_group"] = _refusal(lambda: graphsafe.compile_step(
        ddp, _loss, torch.optim.SGD(ddp.parameters(), 0.1), data_parallel=DataParallel(group=other)))
    out["not_a_group"] = _refusal(lambda: graphsafe.compile_step(
        ddp, _loss, torch.optim.SGD(ddp.parameters(), 0.1), data_parallel="world"))
    return out


def _noop_hook(state, bucket):
    from torch.futures import Future
    future = Future()
    future.set_result(bucket.buffer())
    return future


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_in_processes(_on_ranks, 2, timeout=180, workdir=tmp_path_factory.mktemp("fsdp2"))


def _same_bits(a, b):
    return a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


@requires_fsdp2
def test_fsdp2_step_runs_eagerly_and_equals_the_plain_fsdp2_loop(two_ranks):
    for rank, result in enumerate(two_ranks):
        assert result["mode"] == "eager" and not result["captured"]
        assert all(_same_bits(a, b) for a, b in zip(result["compiled_losses"], result["eager_losses"])), rank
        assert [n for n in result["eager"] if not _same_bits(result["eager"][n], result["compiled"][n])] == [], rank
        assert result["grad_is_this_step"]


@requires_fsdp2
def test_fsdp2_report_names_the_sharded_modules_and_why(two_ranks):
    result = two_ranks[0]
    assert [node for node, _, _ in result["findings"]] == ["module <root>", "module 0", "module 2", "module 4"]
    assert {(op, rule) for _, op, rule in result["findings"]} == {("fully_shard", "fsdp2")}
    assert "make_fx cannot trace" in result["report"]
    assert "not traced (fsdp2" in result["report"]


@requires_fsdp2
def test_refusals_on_ranks(two_ranks):
    result = two_ranks[0]
    assert result["full_mode"].startswith("CaptureError: mode='full': this model cannot be traced")
    assert result["fsdp2_with_data_parallel"].startswith("ValueError: compile_step: data parallelism over a sharded")
    assert result["comm_hook"].startswith("ValueError: compile_step: the DDP model has a communication hook (_noop_hook)")
    assert result["other_group"] == ("ValueError: compile_step: data_parallel names a process group other than the "
                                     "DDP model's")
    assert result["not_a_group"].startswith("TypeError: compile_step: data_parallel must be None, True, a ProcessGroup")


def test_data_parallel_needs_a_process_group_and_valid_settings():
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is initialised in this process")
    model = _net()
    with pytest.raises(RuntimeError, match="init_process_group"):
        graphsafe.compile_step(model, _loss, torch.optim.SGD(model.parameters(), 0.1), data_parallel=True)
    with pytest.raises(ValueError, match="reduction must be one of all_reduce, rank_order"):
        DataParallel(reduction="tree")
    with pytest.raises(ValueError, match="bucket_cap_mb must be > 0"):
        DataParallel(bucket_cap_mb=0)
