"""compile_step's data-parallel step on real process groups (gloo, 2 and 3 processes spawned through
distributed_harness): the gradient all-reduce is in the traced graph, and training through it equals training
the DDP model eagerly (DDP's reducer, graphsafe.nn.Embedding so that the embedding gradients match the rewritten
graph's): losses and parameters bitwise on 2 ranks, every rank's parameters identical, two runs bitwise equal.
On 3 ranks gloo's ring all-reduce sums each chunk of a buffer starting at another rank, so the order of the
three adds depends on the element's position in its buffer, and DDP's buckets (reversed parameter order, rebuilt
after the first step) lay the gradients out differently from compile_step's (parameter order): equal to
rounding only. reduction="rank_order" (gather, then add in rank order) is bitwise equal to a single-process
reference that adds the ranks' gradients in rank order, on 2 and 3 ranks.

Starting processes costs seconds of CPU (importing torch), so each world size is one run of _on_world that trains
every variant one after the other in the same group; the tests check its parts.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distributed_harness import requires_fsdp2, requires_gloo, run_in_processes

import graphsafe
from graphsafe.graph import DataParallel
from graphsafe.graph.rewrite import use_graphsafe_embeddings

STEPS = 4
BATCH = 6


class _Net(nn.Module):
    """An embedding bag, BatchNorm (a buffer the step writes, so it is broadcast from rank 0), two linears."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 8, padding_idx=0)
        self.norm = nn.BatchNorm1d(8)
        self.fc = nn.Linear(8, 16)
        self.out = nn.Linear(16, 5)

    def forward(self, ids):
        return self.out(torch.relu(self.fc(self.norm(self.emb(ids).mean(1)))))


def _loss(logits, target):
    return nn.functional.cross_entropy(logits, target)


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return _Net()


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank r's batch of step i: different on every rank, the same in every run."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, 50, (BATCH, 7), generator=gen), torch.randint(0, 5, (BATCH,), generator=gen)


def _optimizer(params):
    return graphsafe.optim.AdamW(params, lr=0.05, weight_decay=0.01)


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


def _train_compiled(rank: int, world: int, make_step) -> dict:
    model = _net()
    step, module = make_step(model)
    losses = [step(_batch(i, rank)).clone() for i in range(STEPS)]
    return {"losses": losses, "state": _state(module), "step": step}


def _train_ddp_eager(rank: int, world: int, bucket_cap_mb: float) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = use_graphsafe_embeddings(_net())
    ddp = DDP(model, bucket_cap_mb=bucket_cap_mb)
    optimizer = _optimizer(ddp.parameters())
    losses = []
    for i in range(STEPS):
        ids, target = _batch(i, rank)
        loss = _loss(ddp(ids), target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach().clone())
    return {"losses": losses, "state": _state(model)}


def _collective_nodes(gm: torch.fx.GraphModule) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"
            and getattr(n.target, "namespace", None) == "_c10d_functional"]


def _gate_on_cuda(step) -> dict:
    """What the gate says about the data-parallel reduction in a CUDA step (traced on fake CUDA tensors): gloo
    collectives cannot be captured, NCCL ones can (checked by pretending the group's backend is NCCL). And the
    CPU step's graph split around its collectives (what piecewise does with them) computes the whole graph's values
    bitwise."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    from graphsafe.graph import GateReport, capture_gate, gate as gate_module
    from graphsafe.graph.partition import run_regions, split_regions
    plan = step.data_parallel

    def reduce(weight_grad, bias_grad, running_mean):
        plan.broadcast_written_buffers({"norm.running_mean": running_mean})
        return plan.reduce_gradients(["fc.weight", "fc.bias"], [weight_grad, bias_grad])

    broadcast, buckets = plan.broadcast, plan.buckets  # tracing `reduce` sets them: put back afterwards
    plan.broadcast = ["norm.running_mean"]
    with FakeTensorMode(shape_env=ShapeEnv()):
        gm = make_fx(reduce)(torch.empty(16, 8, device="cuda"), torch.empty(16, device="cuda"),
                             torch.empty(8, device="cuda"))
    plan.broadcast, plan.buckets = broadcast, buckets
    _, on_gloo = capture_gate(gm, "cuda")
    real = gate_module.collective_backend
    gate_module.collective_backend = lambda node, device: "nccl"
    try:
        _, on_nccl = capture_gate(gm, "cuda")
    finally:
        gate_module.collective_backend = real

    cpu_graph = step.graph_module
    collectives = [gate_module.Finding(n.name, str(n.target), "host_collective", "")
                   for n in cpu_graph.graph.nodes if gate_module._is_collective(n)]
    regions, _ = split_regions(cpu_graph, GateReport(torch.device("cuda"), unsafe=collectives), "cuda")
    inputs = step.traced.inputs(_batch(99, torch.distributed.get_rank()))
    with torch.no_grad():
        whole = cpu_graph(*inputs)
        pieces = run_regions(regions, cpu_graph, inputs)
    return {"gloo_unsafe": {(f.rule, f.op) for f in on_gloo.unsafe}, "nccl_unsafe": len(on_nccl.unsafe),
            "nccl_notes": sorted({f.rule for f in on_nccl.notes}), "collectives_in_fake_graph": len(collectives),
            "regions": [r.capturable for r in regions],
            "pieces_equal": all(torch.equal(a, b) for a, b in zip(whole, pieces))}


def _on_world(rank: int, world: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP
    cap = 0.001  # about 1 KiB per bucket: several buckets, so the bucketing itself is exercised
    out: dict = {"ddp_eager": _train_ddp_eager(rank, world, cap)}

    def ddp_step(model):
        ddp = DDP(model, bucket_cap_mb=cap)
        return graphsafe.compile_step(ddp, _loss, _optimizer(ddp.parameters())), model

    first = _train_compiled(rank, world, ddp_step)
    again = _train_compiled(rank, world, ddp_step)
    step = first.pop("step")
    again.pop("step")
    out["ddp_compiled"], out["ddp_compiled_again"] = first, again
    plan = step.data_parallel
    out["graph"] = {"collectives": _collective_nodes(step.graph_module), "buckets": len(plan.buckets),
                    "broadcast": list(plan.broadcast), "mode": step.mode, "report": str(step.report),
                    "grad_names": list(step.traced.grad_param_names),
                    "bucket_order": [i for b in plan.buckets for i in b.grad_indices]}
    out["gate"] = _gate_on_cuda(step)

    def group_step(model):
        return graphsafe.compile_step(model, _loss, _optimizer(model.parameters()),
                                      data_parallel=DataParallel(bucket_cap_mb=cap)), model

    group = _train_compiled(rank, world, group_step)
    group.pop("step")
    out["group_compiled"] = group

    def rank_order_step(model):
        return graphsafe.compile_step(model, _loss, _optimizer(model.parameters()),
                                      data_parallel=DataParallel(reduction="rank_order")), model

    ordered = _train_compiled(rank, world, rank_order_step)
    ordered.pop("step")
    out["rank_order"] = ordered
    return out


def _rank_order_reference(world: int) -> dict:
    """One process: each rank's gradients computed eagerly (graphsafe.nn.Embedding), times 1/world, added in rank
    order; BatchNorm statistics are rank 0's (the step broadcasts them from rank 0 before each forward). With one
    intra-op thread, as the ranks run (the harness's OMP_NUM_THREADS=1): torch's CPU reductions split their work by
    thread count, so another count can change the last bits."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _rank_order_reference_steps(world)
    finally:
        torch.set_num_threads(threads)


def _rank_order_reference_steps(world: int) -> dict:
    models = [use_graphsafe_embeddings(_net()) for _ in range(world)]
    optimizer = _optimizer(models[0].parameters())
    losses = []
    for i in range(STEPS):
        grads = []
        for rank, model in enumerate(models):
            model.load_state_dict(models[0].state_dict())
            ids, target = _batch(i, rank)
            loss = _loss(model(ids), target)
            grads.append(torch.autograd.grad(loss, list(model.parameters())))
            if rank == 0:
                losses.append(loss.detach())
        for k, p in enumerate(models[0].parameters()):
            total = grads[0][k] * (1.0 / world)
            for rank in range(1, world):
                total = total + grads[rank][k] * (1.0 / world)
            p.grad = total
        optimizer.step()
    return {"losses": losses, "state": _state(models[0])}


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                     b.reshape(-1).view(torch.uint8))


def _differing(a: dict, b: dict) -> list[str]:
    return [n for n in a if not _same_bits(a[n], b[n])]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_in_processes(_on_world, 2, timeout=240, workdir=tmp_path_factory.mktemp("dp2"))


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory):
    return run_in_processes(_on_world, 3, timeout=300, workdir=tmp_path_factory.mktemp("dp3"))


@requires_gloo
def test_all_reduce_is_in_the_traced_graph(two_ranks):
    graph = two_ranks[0]["graph"]
    assert graph["buckets"] > 1
    assert graph["collectives"].count("_c10d_functional.all_reduce.default") == graph["buckets"]
    # each collective is waited for: all_reduce's and the BatchNorm broadcasts' wait_tensor nodes
    assert graph["collectives"].count("_c10d_functional.wait_tensor.default") == len(
        [c for c in graph["collectives"] if not c.endswith("wait_tensor.default")])
    assert graph["bucket_order"] == sorted(graph["bucket_order"])  # parameter order
    assert graph["broadcast"] == ["norm.running_mean", "norm.running_var", "norm.num_batches_tracked"]
    assert graph["mode"] == "eager"
    assert "data_parallel (DistributedDataParallel): gloo, world 2" in graph["report"]


@requires_gloo
def test_ddp_compile_step_equals_ddp_eager_bitwise_on_two_ranks(two_ranks):
    for rank, result in enumerate(two_ranks):
        eager, compiled = result["ddp_eager"], result["ddp_compiled"]
        assert all(_same_bits(a, b) for a, b in zip(eager["losses"], compiled["losses"])), rank
        assert _differing(eager["state"], compiled["state"]) == [], rank
        # the process-group form (no DDP wrapper) is the same step
        assert _differing(eager["state"], result["group_compiled"]["state"]) == [], rank


@requires_gloo
@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_holds_the_same_parameters_and_two_runs_agree(world, two_ranks, three_ranks):
    results = two_ranks if world == 2 else three_ranks
    # Parameters only: each rank's BatchNorm statistics hold its own last batch (rank 0's are broadcast before
    # each forward pass, then every rank updates its copy), in DDP as here.
    params = [n for n, _ in _Net().named_parameters()]
    for key in ("ddp_compiled", "group_compiled", "rank_order"):
        for r in results[1:]:
            assert [n for n in params if not _same_bits(results[0][key]["state"][n], r[key]["state"][n])] == [], key
    for result in results:
        assert _differing(result["ddp_compiled"]["state"], result["ddp_compiled_again"]["state"]) == []
        assert all(_same_bits(a, b) for a, b in zip(result["ddp_compiled"]["losses"],
                                                    result["ddp_compiled_again"]["losses"]))


@requires_gloo
def test_ddp_compile_step_matches_ddp_eager_to_rounding_on_three_ranks(three_ranks):
    for result in three_ranks:
        eager, compiled = result["ddp_eager"], result["ddp_compiled"]
        torch.testing.assert_close(torch.stack(compiled["losses"]), torch.stack(eager["losses"]), rtol=1e-5, atol=1e-6)
        for name in eager["state"]:
            torch.testing.assert_close(compiled["state"][name], eager["state"][name], rtol=1e-4, atol=1e-5)


@requires_gloo
@pytest.mark.parametrize("world", [2, 3])
def test_rank_order_reduction_equals_the_single_process_sum_in_rank_order(world, two_ranks, three_ranks):
    results = two_ranks if world == 2 else three_ranks
    reference = _rank_order_reference(world)
    assert _differing(reference["state"], results[0]["rank_order"]["state"]) == []
    assert all(_same_bits(a, b) for a, b in zip(reference["losses"], results[0]["rank_order"]["losses"]))


@requires_gloo
def test_gate_names_gloo_collectives_on_cuda_and_passes_nccl_ones(two_ranks):
    gate = two_ranks[0]["gate"]
    assert {rule for rule, _ in gate["gloo_unsafe"]} == {"host_collective"}
    assert {op for _, op in gate["gloo_unsafe"]} == {"_c10d_functional.all_reduce.default",
                                                     "_c10d_functional.broadcast.default",
                                                     "_c10d_functional.wait_tensor.default"}
    assert gate["nccl_unsafe"] == 0 and gate["nccl_notes"] == ["collective"]
    assert False in gate["regions"] and True in gate["regions"]
    assert gate["pieces_equal"]
