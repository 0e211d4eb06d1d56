"""graphsafe.optim.sparse_step: the row-sparse step equals the dense skip_zeros step on the scattered gradient,
bitwise, for every algorithm at 32-, 16- and 8-bit states (include/graphsafe/optim_sparse.h), touches only the
listed rows (8-bit: the blocks they share), reads no entry past count, and refuses bad input changing nothing.
The reference is the dense optimizer.step() of the same class with the rows scattered by hand (index_put)."""

from __future__ import annotations

import pytest
import torch

import graphsafe
from conftest import (CUDA_USABLE, OPTIM_CASE_NAMES, PARAM_DTYPES, assert_same_run, make_generator, make_optimizer,
                      random_grad, skip_unless_storable, snapshot_states, stable_seed)

STORAGE = {32: {}, 16: dict(state_bits=16), 8: dict(state_bits=8, min_8bit_size=0)}


def sparse_gradient(num_rows: int, dim: int, count: int, capacity: int, dtype, gen, device="cpu"):
    """count distinct rows in increasing order (the first and last row among them when count allows), their
    gradients with a few exact zeros, and a tail of capacity - count entries the step must not read (rows -1,
    gradients NaN); with the dense gradient they scatter into."""
    if count >= 2:
        interior = torch.randperm(num_rows - 2, generator=gen)[:count - 2] + 1
        chosen = torch.cat([torch.tensor([0, num_rows - 1]), interior])
    else:
        chosen = torch.randperm(num_rows, generator=gen)[:count]
    rows = torch.full((capacity,), -1, dtype=torch.int64)
    rows[:count] = torch.unique(chosen)
    row_grads = torch.full((capacity, dim), float("nan"), dtype=dtype)
    values = random_grad((count, dim), dtype, gen)
    values[torch.rand((count, dim), generator=gen) < 0.1] = 0.0  # zeros inside listed rows are skipped too
    row_grads[:count] = values
    dense = torch.zeros((num_rows, dim), dtype=dtype)
    dense[rows[:count]] = values
    to = dict(device=device)
    return rows.to(**to), row_grads.to(**to), torch.tensor(count, dtype=torch.int64, **to), dense.to(**to)


def run_both(case, bits, dtype, num_rows, dim, counts, block_size=32, device="cpu", seed=0):
    """The same table stepped densely (optimizer.step() on the scattered gradient) and sparsely, once per count;
    returns (dense optimizer, dense param, sparse optimizer, sparse param)."""
    gen = make_generator(stable_seed(case, bits, dtype, num_rows, dim, seed))
    start = random_grad((num_rows, dim), dtype, gen, scale=0.5)
    dense_p = torch.nn.Parameter(start.clone().to(device))
    sparse_p = torch.nn.Parameter(start.clone().to(device))
    extra = dict(STORAGE[bits], skip_zeros=True)
    if bits == 8:
        extra["block_size"] = block_size
    dense_opt = make_optimizer(case, [dense_p], **extra)
    sparse_opt = make_optimizer(case, [sparse_p], **extra)
    for count in counts:
        rows, row_grads, n, dense = sparse_gradient(num_rows, dim, count, count + 3, dtype, gen, device)
        dense_p.grad = dense
        dense_opt.step()
        graphsafe.optim.sparse_step(sparse_opt, sparse_p, rows, row_grads, n)
    return dense_opt, dense_p, sparse_opt, sparse_p


@pytest.mark.parametrize("bits", (32, 16, 8))
@pytest.mark.parametrize("case", OPTIM_CASE_NAMES)
def test_sparse_step_is_the_dense_skip_zeros_step_bitwise(case, bits):
    skip_unless_storable(case, bits)
    # 24 columns with blocks of 32: blocks straddle rows (a block shared by a listed and an unlisted row); an
    # empty step (count 0) and a step of every row among them.
    results = run_both(case, bits, torch.float32, 37, 24, counts=(5, 0, 37, 1, 12))
    assert_same_run(*results, f"{case} {bits}-bit")


@pytest.mark.parametrize("dtype", PARAM_DTYPES[1:])
@pytest.mark.parametrize("bits", (32, 16, 8))
@pytest.mark.parametrize("case", ("AdamW", "SGD", "Adagrad", "LAMB", "AdamWScheduleFree"))
def test_half_parameters(case, bits, dtype):
    skip_unless_storable(case, bits)
    assert_same_run(*run_both(case, bits, dtype, 29, 40, counts=(7, 3, 29)), f"{case} {bits}-bit {dtype}")


@pytest.mark.parametrize("dim, block_size", ((64, 32), (8, 64), (300, 128), (1, 32)))
@pytest.mark.parametrize("case", ("Adam", "RMSprop", "Lion", "AdEMAMix", "LARS"))
def test_8bit_blocks_across_and_within_rows(case, dim, block_size):
    """Rows larger than, equal to a multiple of, and smaller than a block; a table whose last block is partial."""
    results = run_both(case, 8, torch.float32, 23, dim, counts=(4, 23, 2), block_size=block_size)
    assert_same_run(*results, f"{case} D={dim} block {block_size}")


def test_untouched_rows_and_blocks_keep_their_bits():
    """Rows not listed keep parameter and states bit-identical (32-bit); with 8-bit states and a block size that
    divides the row, so do their codes and absmax."""
    for bits, extra in ((32, {}), (8, dict(state_bits=8, min_8bit_size=0, block_size=32))):
        gen = make_generator(stable_seed("untouched", bits))
        p = torch.nn.Parameter(random_grad((16, 64), torch.float32, gen))
        opt = graphsafe.optim.AdamW([p], lr=0.1, skip_zeros=True, **extra)
        rows, row_grads, count, _ = sparse_gradient(16, 64, 16, 16, torch.float32, gen)
        graphsafe.optim.sparse_step(opt, p, rows, row_grads, count)  # every row has state now
        before = snapshot_states(opt, [p])[0]
        listed = torch.tensor([2, 9, 10])
        graphsafe.optim.sparse_step(opt, p, listed, random_grad((3, 64), torch.float32, gen), torch.tensor(3))
        untouched = torch.ones(16, dtype=torch.bool)
        untouched[listed] = False
        assert torch.equal(p.detach()[untouched], before[0][untouched])
        for name, value in before[1].items():
            if name == "step":
                assert opt.state[p]["step"].item() == value.item() + 1
            elif name.endswith("absmax"):
                blocks_per_row = 64 // 32
                keep = untouched.repeat_interleave(blocks_per_row)
                assert torch.equal(opt.state[p][name][keep], value[keep]), name
            elif value.shape == p.shape or value.numel() == p.numel():
                assert torch.equal(opt.state[p][name].view(16, 64)[untouched], value.view(16, 64)[untouched]), name


def test_bitwise_repeatable_and_captured_count_is_read_at_run_time():
    """Two runs give the same bits; the count is read from its tensor at each call (changed in place between
    calls, as a captured step's would be)."""
    def run():
        gen = make_generator(7)
        p = torch.nn.Parameter(random_grad((20, 16), torch.float32, gen))
        opt = graphsafe.optim.Adam([p], lr=0.05, skip_zeros=True, state_bits=8, min_8bit_size=0, block_size=32)
        rows = torch.arange(20, dtype=torch.int64)
        row_grads = random_grad((20, 16), torch.float32, gen)
        count = torch.tensor(0, dtype=torch.int64)
        for n in (3, 11, 20):
            count.fill_(n)
            graphsafe.optim.sparse_step(opt, p, rows, row_grads, count)
        return opt, p
    assert_same_run(*run(), *run(), "two runs")


def test_refusals_change_nothing():
    gen = make_generator(3)
    p = torch.nn.Parameter(random_grad((10, 4), torch.float32, gen))
    opt = graphsafe.optim.AdamW([p], lr=0.1, skip_zeros=True)
    graphsafe.optim.sparse_step(opt, p, torch.tensor([1, 2]), random_grad((2, 4), torch.float32, gen), torch.tensor(2))
    before = snapshot_states(opt, [p])
    good = dict(rows=torch.tensor([1, 2]), row_grads=random_grad((2, 4), torch.float32, gen), count=torch.tensor(2))
    bad = [
        (dict(rows=torch.tensor([2, 1])), ValueError, "strictly increasing"),
        (dict(rows=torch.tensor([1, 1])), ValueError, "strictly increasing"),
        (dict(rows=torch.tensor([1, 10])), ValueError, "out of range"),
        (dict(rows=torch.tensor([-1, 2])), ValueError, "out of range"),
        (dict(count=torch.tensor(3)), ValueError, "count"),
        (dict(count=torch.tensor(-1)), ValueError, "count"),
        (dict(rows=torch.tensor([1, 2], dtype=torch.int32)), ValueError, "int64"),
        (dict(row_grads=random_grad((2, 5), torch.float32, gen)), ValueError, "row_grads"),
        (dict(row_grads=random_grad((2, 4), torch.float64, gen)), ValueError, "row_grads"),
        (dict(count=torch.tensor([1, 2])), ValueError, "count"),
    ]
    for change, error, match in bad:
        with pytest.raises(error, match=match):
            graphsafe.optim.sparse_step(opt, p, **dict(good, **change))
        assert torch.equal(p.detach(), before[0][0]), change
        for name, value in before[0][1].items():
            assert torch.equal(opt.state[p][name], value), (change, name)
    with pytest.raises(ValueError, match="not in any"):
        graphsafe.optim.sparse_step(opt, torch.nn.Parameter(torch.zeros(10, 4)), **good)
    no_skip = graphsafe.optim.AdamW([p], lr=0.1)
    with pytest.raises(ValueError, match="skip_zeros"):
        graphsafe.optim.sparse_step(no_skip, p, **good)
    with pytest.raises(TypeError, match="graphsafe optimizer"):
        graphsafe.optim.sparse_step(torch.optim.AdamW([p]), p, **good)
    flat = torch.nn.Parameter(torch.zeros(40))
    with pytest.raises(ValueError, match="2-D"):
        graphsafe.optim.sparse_step(graphsafe.optim.AdamW([flat], skip_zeros=True), flat, **good)


def test_invalid_learning_rate_is_refused_before_anything_changes():
    gen = make_generator(4)
    p = torch.nn.Parameter(random_grad((6, 4), torch.float32, gen))
    opt = graphsafe.optim.SGD([p], lr=0.1, momentum=0.9, skip_zeros=True)
    args = (torch.tensor([0, 5]), random_grad((2, 4), torch.float32, gen), torch.tensor(2))
    graphsafe.optim.sparse_step(opt, p, *args)
    before = snapshot_states(opt, [p])[0]
    opt.param_groups[0]["lr"].fill_(float("nan"))
    with pytest.raises(ValueError, match="learning rate"):
        graphsafe.optim.sparse_step(opt, p, *args)
    assert torch.equal(p.detach(), before[0])
    assert opt.state[p]["step"].item() == before[1]["step"].item()


@pytest.mark.skipif(not CUDA_USABLE, reason="needs a CUDA device and graphsafe's CUDA backend")
@pytest.mark.parametrize("bits", (32, 16, 8))
@pytest.mark.parametrize("case", OPTIM_CASE_NAMES)
def test_cuda_sparse_step_is_the_cuda_dense_step_bitwise(case, bits):
    skip_unless_storable(case, bits)
    results = run_both(case, bits, torch.float32, 37, 24, counts=(5, 0, 37, 1, 12), device="cuda")
    assert_same_run(*results, f"CUDA {case} {bits}-bit")
    results = run_both(case, bits, torch.bfloat16, 300, 128, counts=(40, 300, 7), block_size=256, device="cuda")
    assert_same_run(*results, f"CUDA {case} {bits}-bit bf16")
