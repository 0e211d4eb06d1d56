"""graphsafe's optimizers on FSDP2 models (torch.distributed.fsdp.fully_shard: every parameter and gradient a
DTensor shard), in 2 and 3 gloo processes that the tests spawn themselves (distributed_harness.py): every
algorithm at 32/16/8-bit states, with and without skip_zeros, trains as the same model on one process does (to
tolerance: FSDP2 averages the ranks' gradients in another order than one backward over the whole batch), and
two runs give the same bits; state_dict holds DTensor states; torch.distributed.checkpoint saves and loads them
(a stopped and resumed run continues bitwise; a 2-rank checkpoint loads on 3 ranks).

Each process runs every configuration in a loop (a process start costs seconds on CI's two cores); the
single-process references run here, in the test process.
"""

from __future__ import annotations

import copy


import pytest
import torch
from torch import nn

import graphsafe
from conftest import optim_cases, rel_err
from distributed_harness import requires_fsdp2, run_in_processes

pytestmark = requires_fsdp2

CASES = optim_cases()
# One case per algorithm (their options create every state the algorithm can keep), LAMB and LARS included.
ALGORITHM_CASES = ["Adam", "AdamW", "SGD", "RMSprop", "Adagrad", "Lion", "LAMB", "LARS", "AdEMAMix",
                   "AdamWScheduleFree"]
STEPS = 10
ROWS_IN, HIDDEN, ROWS_OUT, BATCH = 12, 7, 5, 6  # 7 and 5 rows: uneven shards on 2 and 3 ranks


def storable(case: str, bits: int) -> bool:
    algorithm = CASES[case][0].algorithm
    return all(bits in s["storage_bits"] for s in graphsafe._C.optim_algorithms()[algorithm]["states"])


CONFIGS = [(case, bits, skip) for case in ALGORITHM_CASES for bits in (32, 16, 8) for skip in (False, True)
           if storable(case, bits)]


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(ROWS_IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, ROWS_OUT))


def batch(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole batch of a step (each rank takes its slice); a quarter of the inputs zero, so that gradients
    have exact zeros (skip_zeros has elements to skip)."""
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(BATCH * world, ROWS_IN, generator=gen)
    x[:, ::4] = 0.0
    return x, torch.randn(BATCH * world, ROWS_OUT, generator=gen)


def make_optimizer(case: str, params, bits: int, skip: bool) -> torch.optim.Optimizer:
    cls, kw = CASES[case]
    extra = dict(state_bits=bits, skip_zeros=skip)
    if bits == 8:
        extra.update(min_8bit_size=0, block_size=32)
    return cls(params, **dict(kw, **extra))


def train(model: nn.Module, opt: torch.optim.Optimizer, world: int, rank: int | None, steps: int = STEPS) -> None:
    """steps steps; rank None: the whole batch on one process, else rank's slice of it."""
    for step in range(steps):
        x, y = batch(step, world)
        if rank is not None:
            x, y = x[rank * BATCH:(rank + 1) * BATCH], y[rank * BATCH:(rank + 1) * BATCH]
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _fsdp2(model: nn.Module) -> nn.Module:
    from torch.distributed.fsdp import fully_shard
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    return fully_shard(model)


def _full(model: nn.Module) -> list[torch.Tensor]:
    return [p.full_tensor().detach().clone() for p in model.parameters()]


def _train_every_config(rank: int, world: int) -> dict:
    results = {}
    for case, bits, skip in CONFIGS:
        model = _fsdp2(make_model())
        opt = make_optimizer(case, model.parameters(), bits, skip)
        train(model, opt, world, rank)
        if hasattr(opt, "eval"):  # AdamWScheduleFree: compare x, as evaluation would see it
            opt.eval()
        results[(case, bits, skip)] = _full(model)
    return results


@pytest.fixture(scope="module")
def fsdp2_runs(tmp_path_factory) -> dict:
    """Every configuration trained on 2 ranks twice and on 3 ranks once; each rank's gathered parameters."""
    runs = {}
    for name, world in (("2a", 2), ("2b", 2), ("3", 3)):
        runs[name] = run_in_processes(_train_every_config, world, timeout=400,
                                      workdir=tmp_path_factory.mktemp(f"fsdp2_{name}"))
    return runs


# 8-bit and 16-bit states: a gradient that differs in its last bit (FSDP2 averages the ranks' gradients in another
# order than one backward over the whole batch), and 8-bit blocks that are the shard's, not the whole tensor's,
# round states differently; so, as the 8-bit tests compare 8-bit with 32-bit training, the relative error of the
# whole update (bounds of test_optim_8bit_vs_32bit.py for 8 bits).
UPDATE_BOUND = {8: {"Lion": 0.12}, 16: {}}
DEFAULT_UPDATE_BOUND = {8: 0.05, 16: 0.01}


def assert_close_training(got, reference, start, bits, case, what):
    if bits == 32:
        for i, (a, b) in enumerate(zip(got, reference)):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m: f"{what}, param {i}: {m}")
        return
    update = torch.cat([(a - s).flatten() for a, s in zip(got, start)])
    expected = torch.cat([(b - s).flatten() for b, s in zip(reference, start)])
    err = rel_err(update, expected)
    bound = UPDATE_BOUND[bits].get(case, DEFAULT_UPDATE_BOUND[bits])
    assert err <= bound, f"{what}: the {bits}-bit update is off by {err:.4f} (bound {bound})"


@pytest.mark.parametrize("case,bits,skip", CONFIGS, ids=[f"{c}-{b}-{'skip' if s else 'dense'}" for c, b, s in CONFIGS])
def test_fsdp2_training_matches_one_process_and_repeats_bitwise(fsdp2_runs, case, bits, skip):
    for name, ranks in fsdp2_runs.items():
        world = len(ranks)
        model = make_model()  # the same training on one process: each step's whole batch at once
        opt = make_optimizer(case, model.parameters(), bits, skip)
        train(model, opt, world, None)
        if hasattr(opt, "eval"):
            opt.eval()
        reference = [p.detach() for p in model.parameters()]
        start = [p.detach() for p in make_model().parameters()]
        for rank, result in enumerate(ranks):
            got = result[(case, bits, skip)]
            assert_close_training(got, reference, start, bits, case, f"{case} {world} ranks, rank {rank}")
            for a, b in zip(got, ranks[0][(case, bits, skip)]):  # every rank gathers the same parameters
                assert torch.equal(a, b)
    for a, b in zip(fsdp2_runs["2a"][0][(case, bits, skip)], fsdp2_runs["2b"][0][(case, bits, skip)]):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)), "two runs on 2 ranks differ"


# --------------------------------------------------------------------------------------------------------
# torch.distributed.checkpoint (DCP) through get_state_dict / set_state_dict
# --------------------------------------------------------------------------------------------------------

CHECKPOINT_CASES = [("AdamW", 32), ("AdamW", 16), ("AdamW", 8), ("SGD", 8), ("AdamWScheduleFree", 32), ("LAMB", 8)]


def _save(model, opt, path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))


def _load(model, opt, path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _full_states(opt, model) -> dict:
    """Every state of every parameter as the whole tensor (DTensors gathered; 8-bit ones as fp32 values)."""
    out = {}
    for i, (p, saved) in enumerate(zip(model.parameters(), opt.state_dict()["state"].values())):
        for key, value in saved.items():
            if isinstance(value, torch.Tensor):
                out[(i, key)] = value.full_tensor() if hasattr(value, "full_tensor") else value.clone()
    return out


def _resume_job(rank: int, world: int, root: str) -> dict:
    """Per case: 8 steps uninterrupted, against 4 steps, a DCP save, a fresh model and optimizer loaded from it,
    and 4 more steps. Also saves each case's checkpoint after 4 steps for the 3-rank load."""
    out = {}
    for case, bits in CHECKPOINT_CASES:
        path = f"{root}/{case}-{bits}"
        model = _fsdp2(make_model())
        opt = make_optimizer(case, model.parameters(), bits, skip=True)
        train(model, opt, world, rank, steps=4)
        _save(model, opt, path)
        saved_states = _full_states(opt, model)
        for step in range(4, 8):  # (train() restarts its batches at 0: these are steps 4 to 7)
            _one_step(model, opt, world, rank, step)
        uninterrupted = _full(model)
        resumed_model = _fsdp2(make_model(seed=99))  # other weights: all must come from the checkpoint
        resumed_opt = make_optimizer(case, resumed_model.parameters(), bits, skip=True)
        _load(resumed_model, resumed_opt, path)
        loaded_states = _full_states(resumed_opt, resumed_model)
        for step in range(4, 8):
            _one_step(resumed_model, resumed_opt, world, rank, step)
        out[(case, bits)] = dict(uninterrupted=uninterrupted, resumed=_full(resumed_model), saved=saved_states,
                                 loaded=loaded_states)
    return out


def _one_step(model, opt, world: int, rank: int, step: int) -> None:
    x, y = batch(step, world)
    x, y = x[rank * BATCH:(rank + 1) * BATCH], y[rank * BATCH:(rank + 1) * BATCH]
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def _load_on_another_world_job(rank: int, world: int, root: str) -> dict:
    """Each case's 2-rank checkpoint loaded into a model and optimizer on this world."""
    out = {}
    for case, bits in CHECKPOINT_CASES:
        model = _fsdp2(make_model(seed=99))
        opt = make_optimizer(case, model.parameters(), bits, skip=True)
        _load(model, opt, f"{root}/{case}-{bits}")
        out[(case, bits)] = dict(params=_full(model), states=_full_states(opt, model))
    return out


@pytest.fixture(scope="module")
def checkpoint_runs(tmp_path_factory) -> tuple[list, list]:
    root = str(tmp_path_factory.mktemp("dcp"))
    saved = run_in_processes(_resume_job, 2, root, timeout=300, workdir=tmp_path_factory.mktemp("dcp_2"))
    loaded = run_in_processes(_load_on_another_world_job, 3, root, timeout=300,
                              workdir=tmp_path_factory.mktemp("dcp_3"))
    return saved, loaded


@pytest.mark.parametrize("case,bits", CHECKPOINT_CASES, ids=[f"{c}-{b}" for c, b in CHECKPOINT_CASES])
def test_dcp_save_load_continue_equals_uninterrupted_bitwise(checkpoint_runs, case, bits):
    saved, _ = checkpoint_runs
    for rank, result in enumerate(saved):
        run = result[(case, bits)]
        assert run["saved"].keys() == run["loaded"].keys()
        for key, value in run["saved"].items():
            assert torch.equal(run["loaded"][key], value), f"rank {rank}: state {key} not restored bitwise"
        for i, (a, b) in enumerate(zip(run["resumed"], run["uninterrupted"])):
            assert torch.equal(a, b), f"rank {rank} param {i}: the resumed run differs from the uninterrupted one"


@pytest.mark.parametrize("case,bits", CHECKPOINT_CASES, ids=[f"{c}-{b}" for c, b in CHECKPOINT_CASES])
def test_dcp_checkpoint_of_2_ranks_loads_on_3(checkpoint_runs, case, bits):
    """The 2-rank checkpoint on 3 ranks (other shard boundaries): parameters and 32/16-bit states exactly; 8-bit
    states, saved as their fp32 values and quantised again in the new shards' blocks, within a quantisation step
    of each block's largest value."""
    saved, loaded = checkpoint_runs
    expected = saved[0][(case, bits)]["saved"]
    for rank, result in enumerate(loaded):
        run = result[(case, bits)]
        assert run["states"].keys() == expected.keys()
        for key, value in expected.items():
            got = run["states"][key]
            if bits == 8 and value.dim() > 0:
                torch.testing.assert_close(got, value, rtol=0.0, atol=float(value.abs().max()) * 0.02 + 1e-12)
            else:
                assert torch.equal(got, value), f"rank {rank}: state {key} changed on 3 ranks"


# --------------------------------------------------------------------------------------------------------
# LAMB/LARS trust ratios on shards == one process with the same split, bitwise
# --------------------------------------------------------------------------------------------------------

SPLIT_SHAPES = [(7, 5), (5,), (13, 3)]  # uneven over 2 and 3 ranks
SPLIT_STEPS = 4


def _split_grads(step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(500 + step)
    grads = [torch.randn(shape, generator=gen) for shape in SPLIT_SHAPES]
    for g in grads:
        g.view(-1)[::5] = 0.0  # skip_zeros has elements to skip
    return grads


def _split_start() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(499)
    return [torch.randn(shape, generator=gen) for shape in SPLIT_SHAPES]


def _layerwise_on_shards_job(rank: int, world: int, case: str) -> list[torch.Tensor]:
    """DTensor parameters sharded by rows, the same explicit gradients on every rank, graphsafe's optimizer."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (world,))
    params = [nn.Parameter(distribute_tensor(t, mesh, [Shard(0)])) for t in _split_start()]
    opt = make_optimizer(case, params, 32, skip=True)
    for step in range(SPLIT_STEPS):
        for p, g in zip(params, _split_grads(step)):
            p.grad = distribute_tensor(g, mesh, [Shard(0)])
        opt.step()
    return [p.full_tensor() for p in params]


def _same_split_reference(case: str, world: int) -> list[torch.Tensor]:
    """One process: each parameter cut into the ranks' row shards (torch.chunk's split, as DTensor's Shard(0)),
    each shard a tensor of the core with its own states; per step each shard's squared norms from the core's
    measuring pass, summed over the shards in rank order (shard 0 + shard 1 + ...), and every shard stepped with
    those totals."""
    from graphsafe import _C
    from graphsafe.distributed import sum_rows_in_order
    cls, kw = CASES[case]
    opt = cls([nn.Parameter(torch.zeros(1))], **kw, skip_zeros=True)  # for its core options only
    group = opt.param_groups[0]
    options, names = opt._core_options(group), opt._state_names(group)
    shards = [list(t.clone().chunk(world)) + [t.new_empty((0,) + t.shape[1:])] * (world - len(t.chunk(world)))
              for t in _split_start()]
    states = [[[torch.zeros_like(s) for _ in names] for s in row] for row in shards]
    steps = [[torch.zeros(()) for _ in row] for row in shards]
    lr = torch.tensor(float(group["lr"]))
    for step in range(SPLIT_STEPS):
        for i, g in enumerate(_split_grads(step)):
            grads = list(g.chunk(world)) + [g.new_empty((0,) + g.shape[1:])] * (world - len(g.chunk(world)))
            grads = [x.contiguous() for x in grads]

            def call(r):
                numel = shards[i][r].numel()
                workspace = torch.empty(_C.optim_workspace_bytes("cpu", opt.algorithm, options, [numel]),
                                        dtype=torch.uint8)
                return dict(device_type="cpu", device_index=0, stream=0, algorithm=opt.algorithm, options=options,
                            param_dtype="float32", lr=lr.data_ptr(), params=[shards[i][r].data_ptr()],
                            grads=[grads[r].data_ptr()], states=[s.data_ptr() for s in states[i][r]], absmax=[],
                            steps=[steps[i][r].data_ptr()], numels=[numel], workspace=workspace.data_ptr(),
                            workspace_bytes=workspace.numel(), increment_steps=True, state_bits=32,
                            block_size=256), workspace

            partials = torch.zeros(world, 2)
            for r in range(world):
                args, workspace = call(r)
                _C.optim_layerwise_norms(**args, norms=partials[r].data_ptr())
            totals = sum_rows_in_order(partials).contiguous()
            for r in range(world):
                args, workspace = call(r)
                _C.optim_step(**args, finish_counter=0, layerwise_norms=totals.data_ptr())
    return [torch.cat(row) for row in shards]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("case", ["LAMB", "LARS"])
def test_layerwise_trust_ratios_on_shards_equal_one_process_with_the_same_split(tmp_path, case, world):
    ranks = run_in_processes(_layerwise_on_shards_job, world, case, timeout=120, workdir=tmp_path)
    reference = _same_split_reference(case, world)
    for rank, params in enumerate(ranks):
        for i, (a, b) in enumerate(zip(params, reference)):
            assert torch.equal(a.view(torch.int32), b.view(torch.int32)), f"{case} {world} ranks, rank {rank} param {i}"


# --------------------------------------------------------------------------------------------------------
# Checkpoints of one process loaded on shards; DTensors the step cannot take
# --------------------------------------------------------------------------------------------------------

def _whole_checkpoint(bits: int) -> dict:
    """A one-process AdamW checkpoint (4 steps), as torch.save would keep it."""
    model = make_model()
    opt = make_optimizer("AdamW", model.parameters(), bits, skip=True)
    train(model, opt, 1, None, steps=4)
    return copy.deepcopy(opt.state_dict())


def _load_whole_job(rank: int, world: int) -> dict:
    """Each rank loads the one-process checkpoint into an FSDP2 optimizer and reports its local states."""
    out = {}
    for bits in (32, 8):
        model = _fsdp2(make_model())
        opt = make_optimizer("AdamW", model.parameters(), bits, skip=True)
        opt.load_state_dict(_whole_checkpoint(bits))
        out[bits] = [{k: v.clone() for k, v in opt.state[p].items() if isinstance(v, torch.Tensor)}
                     for p in model.parameters()]
    return out


def _refusals_job(rank: int, world: int) -> dict:
    """What the optimizer says to DTensors it cannot step, and that nothing changed."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    from torch.distributed.tensor import DTensor
    partial = nn.Parameter(DTensor.from_local(torch.ones(4, 3), mesh, [Partial()]))
    try:
        graphsafe.optim.AdamW([partial])
        out["partial"] = None
    except ValueError as e:
        out["partial"] = str(e)
    p = nn.Parameter(distribute_tensor(torch.ones(4, 3), mesh, [Shard(0)]))
    opt = graphsafe.optim.AdamW([p])
    before = p.to_local().clone()
    for name, grad in (("replicated grad", distribute_tensor(torch.ones(4, 3), mesh, [Replicate()])),
                       ("plain grad", torch.ones(4, 3))):
        try:
            p.grad = grad  # (torch itself may refuse the assignment)
            opt.step()
            out[name] = None
        except (TypeError, ValueError, RuntimeError) as e:
            out[name] = f"{type(e).__name__}: {e}"
    out["unchanged"] = torch.equal(p.to_local(), before) and not opt.state
    return out


def test_a_one_process_checkpoint_loads_on_shards(tmp_path):
    """Whole states (32-bit, and 8-bit codes with their scales) are cut to each rank's rows: equal to the rows of
    the whole states (8-bit: of their dequantised values, quantised again in the shard's blocks)."""
    ranks = run_in_processes(_load_whole_job, 2, timeout=120, workdir=tmp_path)
    whole = {bits: _whole_checkpoint(bits)["state"] for bits in (32, 8)}
    for bits in (32, 8):
        for rank, states in enumerate(ranks):
            for index, local in enumerate(states[bits]):
                saved = whole[bits][index]
                assert torch.equal(local["step"], saved["step"])
                for name in ("exp_avg", "exp_avg_sq"):
                    full = saved[name] if bits == 32 else graphsafe.ops.dequantize_blockwise(
                        saved[name], saved[f"{name}_absmax"], saved["block_size"], name == "exp_avg").reshape(
                        saved[name].shape)
                    rows = full.chunk(2)[rank] if rank < len(full.chunk(2)) else full[:0]
                    got = local[name] if bits == 32 else graphsafe.ops.dequantize_blockwise(
                        local[name], local[f"{name}_absmax"], saved["block_size"], name == "exp_avg").reshape(
                        rows.shape)
                    tol = 0.0 if bits == 32 else float(full.abs().max()) * 0.02
                    torch.testing.assert_close(got, rows, rtol=0.0, atol=tol,
                                               msg=lambda m: f"{bits}-bit rank {rank} param {index} {name}: {m}")


def test_dtensors_the_step_cannot_take_are_refused_and_change_nothing(tmp_path):
    result = run_in_processes(_refusals_job, 2, timeout=120, workdir=tmp_path)[0]
    assert result["partial"] is not None and "partial sums" in result["partial"]
    assert result["replicated grad"] is not None and "does not lie as its parameter" in result["replicated grad"]
    assert result["plain grad"] is not None and result["plain grad"].startswith("TypeError")
    assert result["unchanged"]
