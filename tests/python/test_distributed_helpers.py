"""graphsafe.distributed's helpers on real process groups (gloo, 2 and 3 processes spawned by the tests through
distributed_harness): local_view / like_param on FSDP2 parameters and gradients (even shards, uneven ones, empty
ones), sum_across_shards bitwise equal on every rank and to the single-process sum in rank order, and DDP with
graphsafe.optim.AdamW against single-process training.

The functions named _on_* run in the child processes (module level: the harness imports this module there). Starting
a process costs seconds of CPU (importing torch), so each world size is one run of _on_world (FSDP2 views, sums,
DDP training, one after another in the same group), shared by the tests that check its parts: a failure in one
part fails those tests with the failing rank's traceback."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from distributed_harness import FSDP2_AVAILABLE, DistributedTestFailure, requires_fsdp2, requires_gloo, \
    run_in_processes

import graphsafe.distributed as gd

# Linear layers whose weights have 6, 5 and 1 rows: even shards on 2 and 3 ranks (6), uneven ones (5: 3+2 on
# 2 ranks, 2+2+1 on 3) and empty ones (1 row: ranks past the first hold (0, 5)).
_LAYER_SIZES = ((4, 6), (6, 5), (5, 1))


def _fsdp2_model() -> nn.Module:
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(i, o, bias=o != 1) for i, o in _LAYER_SIZES))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    return model


def _chunk_rows(rows: int, world: int, rank: int) -> int:
    """The rows rank r holds of a dim 0 of `rows` under Shard(0): torch.chunk's split (ceil-sized chunks, the
    last ones short or empty)."""
    per = -(-rows // world)
    return max(0, min(per, rows - rank * per))


class _HostReads(TorchDispatchMode):
    """Records the ops that read a device value on the host (.item(), .tolist(), bool(), data-dependent shapes)."""

    HOST_READS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::equal", "aten::is_nonzero"}

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name in self.HOST_READS:
            self.seen.append(func._schema.name)
        return func(*args, **(kwargs or {}))


# ------------------------------------------------------------------------------------------------------------
# In this process: plain tensors, the summation order
# ------------------------------------------------------------------------------------------------------------


def test_plain_tensors_pass_through_without_a_process_group():
    plain = torch.nn.Parameter(torch.ones(3))
    assert gd.local_view(plain) == (plain, None) and not gd.is_dtensor(plain)
    state = torch.zeros(3)
    assert gd.like_param(state, plain) is state and gd.like_param(state, None) is state
    partials = torch.tensor([1.0, 2.0])
    assert gd.sum_across_shards(partials, plain) is partials
    with pytest.raises(TypeError, match="plain"):
        gd.like_param([0.0], plain)


def test_sum_rows_in_order_adds_left_to_right_from_the_first_row():
    rows = torch.tensor([[1e8, -0.0], [1.0, -0.0], [-1e8, -0.0]], dtype=torch.float32)
    total = gd.sum_rows_in_order(rows)
    assert total[0].item() == 0.0  # (1e8 + 1) rounds to 1e8 in fp32; (1e8 + -1e8) + 1 would give 1
    assert torch.equal(total[1:].view(torch.int32), torch.tensor([-0.0]).view(torch.int32))  # no +0.0 start
    assert torch.equal(gd.sum_rows_in_order(rows[:1]), rows[0])
    with pytest.raises(ValueError, match="no rows"):
        gd.sum_rows_in_order(rows[:0])


# ------------------------------------------------------------------------------------------------------------
# local_view / like_param on FSDP2 parameters
# ------------------------------------------------------------------------------------------------------------


def _on_views(rank: int, world: int) -> dict:
    from torch.distributed.tensor import DTensor, Shard
    model = _fsdp2_model()
    shapes = {}
    for name, p in model.named_parameters():
        local, spec = gd.local_view(p)
        assert type(local) is torch.Tensor and not gd.is_dtensor(local), name
        assert gd.local_view(p)[0] is local, "local_view gives the same local tensor object at every call"
        with torch.no_grad():
            assert p.to_local() is local
        assert spec.placements == (Shard(0),) and spec.shape == p.shape and spec.stride == p.stride()
        assert spec.mesh is p.device_mesh and spec.sharded_mesh_dims == (0,)
        assert tuple(local.shape) == (_chunk_rows(p.shape[0], world, rank), *p.shape[1:]), (name, local.shape)
        assert local.is_contiguous() and p.data_ptr() == 0  # the DTensor's own address is not its data's
        shapes[name] = tuple(local.shape)

        # A state made on the local shard, wrapped: the parameter's layout, the state's memory.
        state = torch.arange(local.numel(), dtype=torch.float32).reshape(local.shape) + 100.0 * rank
        wrapped = gd.like_param(state, p)
        assert isinstance(wrapped, DTensor) and wrapped.placements == p.placements
        assert wrapped.device_mesh is p.device_mesh and wrapped.shape == p.shape and wrapped.stride() == p.stride()
        back, back_spec = gd.local_view(wrapped)
        assert back.shape == state.shape and back_spec == spec
        if state.numel():
            assert back.data_ptr() == state.data_ptr()
            state.add_(1.0)  # the step writes the local tensor in place: seen through the wrapper
            assert torch.equal(back, state)
        # The whole state gathers to each rank's pieces in rank order (uneven and empty shards included).
        pieces = [torch.arange(_chunk_rows(p.shape[0], world, r) * (p.numel() // p.shape[0]), dtype=torch.float32)
                  .reshape(_chunk_rows(p.shape[0], world, r), *p.shape[1:]) + 100.0 * r + 1.0 for r in range(world)]
        assert torch.equal(wrapped.full_tensor(), torch.cat(pieces)), name
        # The same wrapping from the spec alone, and the round trip of the parameter itself.
        assert torch.equal(gd.like_param(state, spec).full_tensor(), wrapped.full_tensor())
        assert torch.equal(gd.like_param(local.detach().clone(), p).full_tensor(), p.full_tensor())
        # Dtypes other than the parameter's (bf16 states, 8-bit codes) keep the layout.
        codes = gd.like_param(torch.zeros(local.shape, dtype=torch.uint8), p)
        assert codes.dtype == torch.uint8 and codes.shape == p.shape
        with pytest.raises(ValueError, match="does not fit"):
            gd.like_param(torch.zeros(local.numel() + 1), p)

    # Gradients after backward (reduce-scatter done): DTensors of the parameter's layout, contiguous local shards.
    model(torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))).sum().backward()
    for name, p in model.named_parameters():
        g_local, g_spec = gd.local_view(p.grad)
        assert g_spec.placements == p.placements and g_spec.shape == p.shape, name
        assert g_local.shape == gd.local_view(p)[0].shape and g_local.is_contiguous(), name
    # Plain tensors pass through.
    plain = torch.ones(3)
    assert gd.local_view(plain) == (plain, None) and gd.like_param(plain, plain) is plain
    assert gd.like_param(plain, None) is plain
    return shapes


def _on_world(rank: int, world: int) -> dict:
    return {"world": world, "views": _on_views(rank, world), "sums": _on_sums(rank, world),
            "ddp": _on_ddp(rank, world)}


@pytest.fixture(scope="module", params=[2, 3], ids=["2ranks", "3ranks"])
def world_results(request, tmp_path_factory) -> list[dict]:
    """_on_world's results, rank by rank, for 2 and then 3 processes (one run each, shared by the tests)."""
    if not FSDP2_AVAILABLE:
        pytest.skip("needs torch.distributed with gloo, DTensor and FSDP2 (torch.distributed.fsdp.fully_shard)")
    return run_in_processes(_on_world, request.param, workdir=tmp_path_factory.mktemp("world"))


@requires_fsdp2
def test_local_view_and_like_param_on_fsdp2_shards(world_results):
    shapes = [result["views"] for result in world_results]
    # The local shards of every parameter add up to the whole along dim 0.
    rows = {f"{i}.{kind}": o for i, (_, o) in enumerate(_LAYER_SIZES) for kind in ("weight", "bias")}
    for name in shapes[0]:
        assert sum(s[name][0] for s in shapes) == rows[name], name
    assert shapes[-1]["2.weight"] == (0, 5)  # an empty shard was exercised


# ------------------------------------------------------------------------------------------------------------
# sum_across_shards
# ------------------------------------------------------------------------------------------------------------


def _partials_of(rank: int, k: int = 16) -> torch.Tensor:
    """Rank `rank`'s partials: magnitudes from 1e-3 to 1e7 with both signs, so that the order of the adds
    changes the rounded sums (the test checks that it does)."""
    gen = torch.Generator().manual_seed(1234 + rank)
    mantissa = torch.rand(k, generator=gen, dtype=torch.float64) * 2 - 1
    exponent = torch.randint(-3, 8, (k,), generator=gen).to(torch.float64)
    return (mantissa * 10.0 ** exponent).to(torch.float32)


def _on_sums(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor
    model = _fsdp2_model()
    out = {}
    for name, p in model.named_parameters():
        partials = _partials_of(rank)
        with _HostReads() as reads:
            total = gd.sum_across_shards(partials, p)
        assert reads.seen == [], f"sum_across_shards read a device value on the host: {reads.seen}"
        assert total.dtype == torch.float32 and total.shape == partials.shape and total.device == partials.device
        assert torch.equal(partials, _partials_of(rank)), "the partials are left as they were"
        out[name] = total
    # The real use: [sum p^2, sum g^2] over the local shard (empty shards give 0), totalled.
    model(torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))).sum().backward()
    norms = {}
    for name, p in model.named_parameters():
        local, _ = gd.local_view(p)
        g_local, _ = gd.local_view(p.grad)
        mine = torch.stack([local.detach().square().sum(), g_local.square().sum()])
        norms[name] = (mine, gd.sum_across_shards(mine, p))
    out["norms"] = norms
    # A replicated parameter: every rank holds the whole, the partials are the totals.
    mesh = init_device_mesh("cpu", (world,))
    replicated = distribute_tensor(torch.ones(4), mesh, [Replicate()])
    partials = _partials_of(rank)
    assert gd.sum_across_shards(partials, replicated) is partials
    assert gd.sum_across_shards(partials, torch.ones(4)) is partials  # a plain tensor
    assert gd.sum_across_shards(partials, None) is partials
    return out


@requires_fsdp2
def test_sum_across_shards_is_bitwise_the_rank_order_sum(world_results):
    world = world_results[0]["world"]
    results = [result["sums"] for result in world_results]
    stacked = torch.stack([_partials_of(r) for r in range(world)])
    reference = stacked[0].clone()  # the single-process sum, in rank order, written out here
    for r in range(1, world):
        reference = reference + stacked[r]
    assert torch.equal(gd.sum_rows_in_order(stacked), reference)
    # The data makes the order matter: another order gives other bits somewhere.
    reverse = stacked[-1].clone()
    for r in range(world - 2, -1, -1):
        reverse = reverse + stacked[r]
    assert not torch.equal(reverse, reference) or world == 2  # (two addends: a + b == b + a exactly)
    for name in results[0]:
        if name == "norms":
            continue
        for rank, result in enumerate(results):
            assert torch.equal(result[name].view(torch.int32), reference.view(torch.int32)), (name, rank)
    # The real norms: every rank has the same bits, the rank-order sum of the ranks' own partials.
    for name in results[0]["norms"]:
        mine = torch.stack([result["norms"][name][0] for result in results])
        for rank, result in enumerate(results):
            assert torch.equal(result["norms"][name][1], gd.sum_rows_in_order(mine)), (name, rank)


def _on_sums_2d(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    partials = _partials_of(rank)
    both = distribute_tensor(torch.ones(4, 4), mesh, [Shard(0), Shard(1)])
    hsdp = distribute_tensor(torch.ones(4, 4), mesh, [Replicate(), Shard(0)])  # HSDP: replicated over "a"
    return {"both": gd.sum_across_shards(partials, both), "hsdp": gd.sum_across_shards(partials, hsdp),
            "coordinate": mesh.get_coordinate()}


@requires_fsdp2
def test_sum_across_shards_on_a_2d_mesh_follows_mesh_order(tmp_path):
    results = run_in_processes(_on_sums_2d, 4, workdir=tmp_path)
    # Sharded on both dimensions: all four partials, in row-major order of the mesh coordinates (= rank order).
    assert [tuple(r["coordinate"]) for r in results] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    everyone = gd.sum_rows_in_order(torch.stack([_partials_of(r) for r in range(4)]))
    for result in results:
        assert torch.equal(result["both"], everyone)
    # Replicated over "a": only the ranks of one "b" group count, each group its own.
    for rank, result in enumerate(results):
        group = [rank - rank % 2, rank - rank % 2 + 1]
        assert torch.equal(result["hsdp"], gd.sum_rows_in_order(torch.stack([_partials_of(r) for r in group])))


# ------------------------------------------------------------------------------------------------------------
# DDP + graphsafe.optim.AdamW
# ------------------------------------------------------------------------------------------------------------

_DDP_STEPS, _PER_RANK = 3, 4


def _ddp_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def _ddp_batch(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(world * _PER_RANK, 4, generator=gen), torch.randn(world * _PER_RANK, 3, generator=gen)


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _on_ddp(rank: int, world: int) -> torch.Tensor:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    import graphsafe.optim
    model = _ddp_model()
    ddp = DistributedDataParallel(model)
    assert all(type(p) is nn.Parameter for p in ddp.parameters())
    opt = graphsafe.optim.AdamW(ddp.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(_DDP_STEPS):
        x, y = _ddp_batch(step, world)
        rows = slice(rank * _PER_RANK, (rank + 1) * _PER_RANK)
        nn.functional.mse_loss(ddp(x[rows]), y[rows]).backward()
        assert all(type(p.grad) is torch.Tensor and p.grad.is_contiguous() for p in ddp.parameters())
        opt.step()
        opt.zero_grad()
    flat = _flat(model)
    everyone = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(everyone, flat)
    assert all(torch.equal(everyone[0], other) for other in everyone), "the replicas drifted apart"
    return flat


@requires_fsdp2
def test_ddp_with_graphsafe_adamw_matches_single_process(world_results):
    import graphsafe.optim
    world = world_results[0]["world"]
    results = [result["ddp"] for result in world_results]

    # Single process on the concatenated batch: the same training, but its gradient is one mean over
    # world * _PER_RANK rows, DDP's the sum over ranks of each rank's mean times 1/world, rounded differently.
    whole = _ddp_model()
    opt = graphsafe.optim.AdamW(whole.parameters(), lr=1e-2, weight_decay=0.1)
    # Single process with DDP's gradient arithmetic: per-rank gradients, each times 1/world, added in rank order.
    emulated = _ddp_model()
    opt_emulated = graphsafe.optim.AdamW(emulated.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(_DDP_STEPS):
        x, y = _ddp_batch(step, world)
        nn.functional.mse_loss(whole(x), y).backward()
        opt.step()
        opt.zero_grad()
        per_rank = []
        for r in range(world):
            rows = slice(r * _PER_RANK, (r + 1) * _PER_RANK)
            emulated.zero_grad()
            nn.functional.mse_loss(emulated(x[rows]), y[rows]).backward()
            per_rank.append([p.grad * (1.0 / world) for p in emulated.parameters()])
        for i, p in enumerate(emulated.parameters()):
            p.grad = gd.sum_rows_in_order(torch.stack([grads[i] for grads in per_rank]))
        opt_emulated.step()
        opt_emulated.zero_grad()

    for rank, flat in enumerate(results):
        torch.testing.assert_close(flat, _flat(whole), rtol=1e-5, atol=1e-6)
        if world == 2:
            # Two addends: gloo's sum is a + b in whichever order, the same bits as the rank-order sum.
            assert torch.equal(flat, _flat(emulated)), rank
        else:
            # Three or more: gloo's ring all-reduce adds each chunk of the bucket starting from another rank,
            # so the order (and the last bit) depends on the element's position: tolerance only.
            torch.testing.assert_close(flat, _flat(emulated), rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------------------------------------------------------
# The harness itself: failures and hangs reach the test, bounded in time
# ------------------------------------------------------------------------------------------------------------


def _on_failure(rank: int, world: int) -> None:
    import time
    if rank == 0:
        raise RuntimeError("rank zero refuses")
    time.sleep(3600)  # stuck, as a rank waiting in a collective for the failed one would be


def _on_hang(rank: int, world: int) -> None:
    import time
    time.sleep(3600)


@requires_gloo
def test_harness_forwards_a_rank_s_exception_and_stops_the_others(tmp_path):
    with pytest.raises(DistributedTestFailure) as failure:
        run_in_processes(_on_failure, 2, workdir=tmp_path, timeout=60, grace=1)
    text = str(failure.value)
    assert "rank 0 raised" in text and "RuntimeError: rank zero refuses" in text and "_on_failure" in text
    assert "rank 1 was still running" in text


@requires_gloo
def test_harness_kills_a_run_past_its_time_limit(tmp_path):
    with pytest.raises(DistributedTestFailure, match=r"timed out after 3 s[\s\S]*rank 0 did not finish"):
        run_in_processes(_on_hang, 1, workdir=tmp_path, timeout=3)


def _on_abort(rank: int, world: int) -> None:
    import os
    os.abort()  # as a crash in native code ends a process (stop 29's rank died of glibc's heap check this way)


@requires_gloo
def test_harness_shows_the_python_stack_of_a_rank_killed_by_a_signal(tmp_path):
    with pytest.raises(DistributedTestFailure) as failure:
        run_in_processes(_on_abort, 1, workdir=tmp_path, timeout=60)
    text = str(failure.value)
    assert "rank 0 was killed by SIGABRT" in text
    assert "Fatal Python error: Aborted" in text and "in _on_abort" in text
