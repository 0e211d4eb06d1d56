"""Shared helpers for graphsafe's Python tests.

Test modules import the plain helpers from here (`from conftest import ...`): pytest puts this folder on
sys.path (default "prepend" import mode, no __init__.py), and helpers used inside hypothesis tests must not
be function-scoped fixtures.

What lives here:
  * `requires_cuda`: skip marker for tests that need a GPU *and* graphsafe's CUDA backend.
  * `stable_seed`: a seed from test parameters, the same in every process.
  * index generators (uniform, zipf-skewed, hot rows), all driven by an explicit seeded torch.Generator and
    built on the CPU (move them with .to(device)), so a CPU run and a CUDA run see the same indices.
  * `fp64_reference_and_bound`: aten's embedding_dense_backward in float64 plus a per-element error bound
    derived from how graphsafe accumulates (see the function's comment).
  * `assert_bitwise_equal`: equality of bit patterns (stricter than torch.equal, which calls -0.0 == +0.0).
  * `OpRecorder`: a TorchDispatchMode that records which ops ran (e.g. to prove a backward went through
    graphsafe.embedding_backward and not aten.embedding_dense_backward).
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import zlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import graphsafe

# --------------------------------------------------------------------------------------------------------
# Markers
# --------------------------------------------------------------------------------------------------------

CUDA_USABLE = bool(torch.cuda.is_available() and graphsafe.cuda_backend_built())

requires_cuda = pytest.mark.skipif(
    not torch.cuda.is_available() or not graphsafe.cuda_backend_built(),
    reason="needs a CUDA device and graphsafe built with its CUDA backend",
)

GRAD_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)

# Sorted positions per tile and tiles per group of the documented reduction order (graphsafe::kEmbeddingTile
# and graphsafe::kEmbeddingTileGroup in include/graphsafe/embedding.h; part of the numerical contract).
TILE = 32
TILE_GROUP = 32


# --------------------------------------------------------------------------------------------------------
# Seeds and generators
# --------------------------------------------------------------------------------------------------------


def make_generator(seed: int) -> torch.Generator:
    """A CPU torch.Generator seeded with `seed`."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(int(seed))
    return gen


def stable_seed(*parts) -> int:
    """A seed from test parameters that is the same in every process (unlike hash() of strings)."""
    return zlib.crc32(repr(parts).encode())


@pytest.fixture
def gen(request) -> torch.Generator:
    """A CPU generator seeded from the test's node id: stable across runs, different between tests."""
    digest = hashlib.sha256(request.node.nodeid.encode()).digest()
    return make_generator(int.from_bytes(digest[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF)


def _shape_of(n_or_shape) -> tuple[int, ...]:
    if isinstance(n_or_shape, int):
        return (n_or_shape,)
    return tuple(int(s) for s in n_or_shape)


def uniform_indices(shape, num_weights: int, generator: torch.Generator, dtype=torch.int64) -> torch.Tensor:
    """Indices drawn uniformly from [0, num_weights), of the given shape (an int means 1-D)."""
    shape = _shape_of(shape)
    if math.prod(shape) == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.randint(0, num_weights, shape, generator=generator, dtype=torch.int64).to(dtype)


def zipf_indices(
    shape, num_weights: int, generator: torch.Generator, dtype=torch.int64, exponent: float = 1.1
) -> torch.Tensor:
    """Zipf-skewed indices: rank k (1-based) has probability proportional to 1/k^exponent, and the ranks are
    assigned to rows by a random permutation, so the hot rows are scattered over the table. Sampled with
    replacement through torch.multinomial."""
    shape = _shape_of(shape)
    n = math.prod(shape)
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    ranks = torch.arange(1, num_weights + 1, dtype=torch.float64)
    probs = ranks.pow(-exponent)
    probs = probs / probs.sum()
    rank_of_sample = torch.multinomial(probs, n, replacement=True, generator=generator)
    row_of_rank = torch.randperm(num_weights, generator=generator)
    return row_of_rank[rank_of_sample].reshape(shape).to(dtype)


def hot_row_indices(
    shape, num_weights: int, generator: torch.Generator, dtype=torch.int64, num_hot: int = 2
) -> torch.Tensor:
    """Every index comes from a small set of `num_hot` random rows (so each of them occurs about
    numel/num_hot times: long runs that span several tiles and tile groups)."""
    shape = _shape_of(shape)
    n = math.prod(shape)
    num_hot = max(1, min(num_hot, num_weights))
    hot = torch.randperm(num_weights, generator=generator)[:num_hot]
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    pick = torch.randint(0, num_hot, (n,), generator=generator)
    return hot[pick].reshape(shape).to(dtype)


INDEX_GENERATORS = {
    "uniform": uniform_indices,
    "zipf": zipf_indices,
    "hot": hot_row_indices,
}


def random_grad(shape, dtype: torch.dtype, generator: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    """Standard-normal values (times `scale`) rounded to `dtype`."""
    return (torch.randn(_shape_of(shape), generator=generator, dtype=torch.float64) * scale).to(dtype)


# --------------------------------------------------------------------------------------------------------
# References
# --------------------------------------------------------------------------------------------------------


def normalise_padding_idx(padding_idx: int | None, num_weights: int) -> int:
    """graphsafe's convention: None/-1 = none, other negatives count from the end (-2 = num_weights - 2).
    aten.embedding_dense_backward compares indices with padding_idx as given, so the reference must be
    handed the normalised row."""
    if padding_idx is None or padding_idx == -1:
        return -1
    return padding_idx + num_weights if padding_idx < 0 else padding_idx


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _gamma(k: torch.Tensor, u: float) -> torch.Tensor:
    """(1 + u)^k - 1: bound on the relative effect of k roundings of unit roundoff u (Higham, Lemma 3.1;
    it is <= gamma_k = k*u / (1 - k*u) when k*u < 1, and unlike gamma_k stays valid for any k)."""
    return torch.expm1(k.to(torch.float64) * torch.log1p(torch.tensor(u, dtype=torch.float64)))


def fp64_reference_and_bound(
    grad: torch.Tensor,
    indices: torch.Tensor,
    num_weights: int,
    padding_idx: int | None,
    scale_grad_by_freq: bool,
    out_dtype: torch.dtype | None = None,
    accumulation: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (ref, bound), both float64 [num_weights, D], with |result - ref| <= bound elementwise for any
    result computed the way graphsafe documents it.

    ref is aten.embedding_dense_backward on grad upcast to float64 (exact inputs: every fp16/bf16/fp32 value
    is exact in fp64). For a row r with n = count(r) contributing occurrences g_1..g_n and
    A = sum_i |g_i| (divided by n under scale_grad_by_freq), the bound is the sum of:

      * accumulation: the n - 1 additions (any summation tree, so also the tiled one) plus, with
        scale_grad_by_freq, one division, each rounded in the accumulation format of unit roundoff u_acc
        (2^-24 fp32, 2^-53 fp64): |fl(sum) - sum| <= gamma_n(u_acc) * A           (Higham, Sec. 4.2)
        where gamma_k = (1 + u)^k - 1
      * the reference's own float64 rounding (aten may scale each term before summing):
        gamma_{n+2}(2^-53) * A
      * the single final rounding of the accumulator to the output dtype, only when that dtype is narrower
        than the accumulator: u_out * |x| + (half the subnormal spacing), where |x| <= |ref| + the two terms
        above.

    Rows that never occur (and the padding row) get bound 0: they must be exactly zero.
    Nothing here is a fudge factor; a result outside the bound cannot come from the documented algorithm.
    `accumulation` overrides the accumulator format (used to bound other implementations, e.g. torch's).
    """
    out_dtype = grad.dtype if out_dtype is None else out_dtype
    acc_dtype = accumulation_dtype(out_dtype) if accumulation is None else accumulation
    d = grad.shape[-1]
    g64 = grad.detach().to("cpu", torch.float64).reshape(-1, d)
    idx = indices.detach().to("cpu", torch.int64).reshape(-1)
    pad = normalise_padding_idx(padding_idx, num_weights)

    ref = torch.ops.aten.embedding_dense_backward(g64, idx, num_weights, pad, scale_grad_by_freq)
    abs_sum = torch.ops.aten.embedding_dense_backward(g64.abs(), idx, num_weights, pad, scale_grad_by_freq)

    contributing = idx[idx != pad] if pad >= 0 else idx
    counts = torch.bincount(contributing, minlength=num_weights).to(torch.float64).unsqueeze(1)  # [V, 1]

    u_acc = torch.finfo(acc_dtype).eps / 2
    acc_err = _gamma(counts, u_acc) * abs_sum
    ref_err = _gamma(counts + 2, 2.0**-53) * abs_sum
    bound = acc_err + ref_err
    if accumulation is not None:
        # A low-precision accumulator may also underflow: each of the n operations can then lose up to
        # half the subnormal spacing of that format in absolute terms.
        fa = torch.finfo(acc_dtype)
        bound = bound + counts * (fa.smallest_normal * fa.eps / 2)
    if torch.finfo(out_dtype).bits < torch.finfo(acc_dtype).bits:
        fi = torch.finfo(out_dtype)
        half_subnormal_spacing = fi.smallest_normal * fi.eps / 2
        bound = bound + (fi.eps / 2) * (ref.abs() + bound) + half_subnormal_spacing
    bound = torch.where(counts > 0, bound, torch.zeros_like(bound))
    return ref, bound


def assert_within_bound(out: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor, what: str = "result") -> None:
    """|out - ref| <= bound elementwise (out compared in float64), with a readable failure message."""
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    err = (out.detach().to("cpu", torch.float64) - ref).abs()
    bad = ~(err <= bound)  # also catches NaN
    if bool(bad.any()):
        where = bad.nonzero()[:5].tolist()
        details = ", ".join(
            f"[{r},{c}]: got {float(out[r, c])!r} ref {float(ref[r, c])!r} err {float(err[r, c]):.3g} "
            f"bound {float(bound[r, c]):.3g}"
            for r, c in where
        )
        raise AssertionError(f"{what}: {int(bad.sum())} element(s) outside the error bound; first: {details}")


_BITS_VIEW = {
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
    torch.float32: torch.int32,
    torch.float64: torch.int64,
}


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor, what: str = "result") -> None:
    """Same dtype, shape and bit pattern for every element (so -0.0 != +0.0 and NaN payloads count)."""
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a = actual.detach().cpu().contiguous()
    e = expected.detach().cpu().contiguous()
    view = _BITS_VIEW.get(a.dtype)
    if view is not None:
        a, e = a.view(view), e.view(view)
    if not torch.equal(a, e):
        diff = (a != e).nonzero()[:5].tolist()
        af, ef = actual.detach().cpu(), expected.detach().cpu()
        details = ", ".join(f"{tuple(p)}: {af[tuple(p)].item()!r} vs {ef[tuple(p)].item()!r}" for p in diff)
        raise AssertionError(f"{what}: {int((a != e).sum())} element(s) differ bitwise; first: {details}")


# --------------------------------------------------------------------------------------------------------
# Op recording
# --------------------------------------------------------------------------------------------------------


class OpRecorder(TorchDispatchMode):
    """Records the name of every op that reaches the dispatcher's Python mode while active."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


# --------------------------------------------------------------------------------------------------------
# Optimizer helpers (test_optim*.py)
# --------------------------------------------------------------------------------------------------------

HALF_DTYPES = (torch.float16, torch.bfloat16)
PARAM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class _ScheduleFreeInTrainMode(graphsafe.optim.AdamWScheduleFree):
    """AdamWScheduleFree put in train mode at construction, as its users call train() before training (it starts
    in eval mode, as the schedulefree package's does), so that the tests written for every algorithm step it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.train()


_ScheduleFreeInTrainMode.__name__ = _ScheduleFreeInTrainMode.__qualname__ = "AdamWScheduleFree"


def optim_cases() -> dict[str, tuple[type, dict]]:
    """One representative configuration per algorithm (and per Adam weight-decay flavour), each with
    weight_decay > 0 and the options that create every state the algorithm can keep (amsgrad, momentum,
    centered, ...), so properties checked over these cases cover every state buffer. Learning rates are
    large enough that bf16/fp16 parameters move by more than half an ulp per step."""
    import graphsafe.optim as go

    return {
        "Adam": (go.Adam, dict(lr=0.02, weight_decay=0.1, amsgrad=True)),
        "Adam-decoupled": (go.Adam, dict(lr=0.02, weight_decay=0.1, amsgrad=True, decoupled_weight_decay=True)),
        "AdamW": (go.AdamW, dict(lr=0.02, weight_decay=0.1, amsgrad=True)),
        "SGD": (go.SGD, dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.1)),
        "SGD-nesterov": (go.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.1)),
        "RMSprop": (go.RMSprop, dict(lr=0.01, alpha=0.9, momentum=0.5, centered=True, weight_decay=0.1)),
        "Adagrad": (go.Adagrad, dict(lr=0.05, lr_decay=0.01, initial_accumulator_value=0.1, weight_decay=0.1)),
        "Lion": (go.Lion, dict(lr=0.02, weight_decay=0.1)),
        "LAMB": (go.LAMB, dict(lr=0.02, weight_decay=0.1)),
        "LARS": (go.LARS, dict(lr=1.0, momentum=0.9, weight_decay=0.1, trust_coefficient=0.02)),
        "AdEMAMix": (go.AdEMAMix, dict(lr=0.02, weight_decay=0.1, t_alpha=6, t_beta3=6)),
        "AdamWScheduleFree": (_ScheduleFreeInTrainMode, dict(lr=0.02, weight_decay=0.1, warmup_steps=3, r=0.5)),
    }


OPTIM_CASE_NAMES = tuple(optim_cases())


def make_optimizer(case: str, params, **extra):
    """The optimizer of optim_cases()[case] over params, with `extra` options added or overriding."""
    cls, kw = optim_cases()[case]
    return cls(params, **dict(kw, **extra))


def per_tensor_keys(optimizer) -> frozenset[str]:
    """The state entries an optimizer keeps per parameter rather than per element: 'step' and its algorithm's
    schedule values (the table's, include/graphsafe/optim_algorithms.h: 0-d float64 tensors)."""
    return frozenset({"step", *graphsafe._C.optim_algorithms()[optimizer.algorithm]["schedule"]})


def initial_state(optimizer, name: str, param_before: torch.Tensor, value: float = 0.0) -> torch.Tensor:
    """What state `name` starts as on a parameter's first step, in fp32: a copy of the parameter as it was before
    (the table's init "param") or filled with `value` (the algorithm's initial value, e.g. Adagrad's
    initial_accumulator_value)."""
    states = graphsafe._C.optim_algorithms()[optimizer.algorithm]["states"]
    if next(s["init"] for s in states if s["name"] == name) == "param":
        return param_before.detach().float().clone()
    return torch.full_like(param_before, value, dtype=torch.float32)


def storable(case: str, state_bits: int) -> bool:
    """Whether optim_cases()[case]'s algorithm can keep every state in state_bits bits (the table's widths)."""
    algorithm = optim_cases()[case][0].algorithm
    return all(state_bits in state["storage_bits"] for state in graphsafe._C.optim_algorithms()[algorithm]["states"])


def skip_unless_storable(case: str, state_bits: int) -> None:
    """Skips a test of optim_cases()[case] at state_bits whose algorithm cannot keep every state in that width
    (the table's storage widths: AdamWScheduleFree's z is never 8-bit; its refusal is tested on its own)."""
    algorithm = optim_cases()[case][0].algorithm
    for state in graphsafe._C.optim_algorithms()[algorithm]["states"]:
        if state_bits not in state["storage_bits"]:
            pytest.skip(f"{case} keeps its state {state['name']} in {state['storage_bits']} bits only")


def make_params(shapes, dtype: torch.dtype, generator: torch.Generator, device="cpu", offsets=None, scale=0.5):
    """nn.Parameters of the given shapes with values ~ N(0, scale^2) rounded to `dtype` (drawn on the CPU, so
    every device gets the same values). offsets[i] > 0 makes parameter i a contiguous view that starts
    offsets[i] elements into a larger buffer (a pointer not aligned for vector loads)."""
    params = []
    for i, shape in enumerate(shapes):
        shape = _shape_of(shape)
        offset = 0 if offsets is None else int(offsets[i])
        values = random_grad(shape, dtype, generator, scale=scale)
        n = math.prod(shape)
        buf = torch.zeros(n + offset, dtype=dtype, device=device)
        view = buf[offset:].view(shape)
        view.copy_(values.to(device))
        params.append(torch.nn.Parameter(view))
    return params


def clone_params(params):
    """Fresh nn.Parameters with the same values (and no grads)."""
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def set_grad_any_dtype(p, g):
    """Attach a gradient whose dtype differs from p's (torch refuses unless grad_dtype is cleared)."""
    p.grad_dtype = None
    p.grad = g


def state_tensors(optimizer, p) -> dict[str, torch.Tensor]:
    """The tensors the optimizer keeps for parameter p (step included), by name."""
    return {k: v for k, v in optimizer.state[p].items() if isinstance(v, torch.Tensor)}


def snapshot_states(optimizer, params) -> list[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """Copies of each parameter and of its state tensors, to compare with later: [(param, {name: state})]."""
    return [(p.detach().clone(), {k: v.clone() for k, v in state_tensors(optimizer, p).items()}) for p in params]


def assert_same_run(opt_a, params_a, opt_b, params_b, what: str) -> None:
    """Two runs ended alike: the parameters and every state tensor (8-bit codes, absmax and maps, and the step)
    bitwise equal, and the same block_size."""
    for i, (a, b) in enumerate(zip(params_a, params_b)):
        assert_bitwise_equal(a, b, f"{what}: param {i}")
        sa, sb = state_tensors(opt_a, a), state_tensors(opt_b, b)
        assert sa.keys() == sb.keys(), f"{what}: param {i} state names {sorted(sa)} vs {sorted(sb)}"
        for k in sa:
            assert_bitwise_equal(sa[k], sb[k], f"{what}: param {i} state {k}")
        assert opt_a.state[a].get("block_size") == opt_b.state[b].get("block_size"), f"{what}: param {i} block_size"


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| over the whole tensor, in float64 (the absolute difference's
    norm when expected is all zeros). NaN anywhere gives NaN, which fails every <= comparison."""
    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    num = torch.linalg.vector_norm(a - e)
    den = torch.linalg.vector_norm(e)
    return float(num / den) if float(den) > 0 else float(num)


def assert_rel_close(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str = "result") -> None:
    assert tuple(actual.shape) == tuple(expected.shape), f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    err = rel_err(actual, expected)
    assert err <= tol, f"{what}: ||actual - expected|| / ||expected|| = {err:.3g} > {tol:.3g}"


def ulp_of(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing of `dtype`'s representable numbers at |x| (x any float tensor; result float64): eps * 2^e
    for |x| in [2^e, 2^(e+1)), and the subnormal spacing below the smallest normal number."""
    fi = torch.finfo(dtype)
    x = x.detach().to("cpu", torch.float64).abs()
    _, exponent = torch.frexp(x)  # x = m * 2^exponent, m in [0.5, 1)
    spacing = fi.eps * torch.pow(2.0, (exponent - 1).to(torch.float64))
    return torch.clamp(spacing, min=fi.smallest_normal * fi.eps)


def assert_within_ulps(actual: torch.Tensor, expected: torch.Tensor, ulps: float, what: str = "result",
                       scale: torch.Tensor | None = None) -> None:
    """|actual - expected| <= ulps * ulp(max(|actual|, |expected|, |scale|)) elementwise, in the ulps of
    actual's dtype. `scale` (e.g. the parameter before the step) covers results that cancel: x = p + delta
    computed twice in fp32 may differ by a few fp32 ulps of |p|, which is far below one ulp of a 16-bit
    dtype at |p| but arbitrarily many ulps of a result near zero."""
    assert tuple(actual.shape) == tuple(expected.shape), f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    magnitude = torch.maximum(a.abs(), e.abs())
    if scale is not None:
        magnitude = torch.maximum(magnitude, scale.detach().to("cpu", torch.float64).abs())
    bound = ulps * ulp_of(magnitude, actual.dtype)
    err = (a - e).abs()
    bad = ~(err <= bound)  # NaN fails too
    if bool(bad.any()):
        where = bad.nonzero()[:5].tolist()
        details = ", ".join(f"{tuple(w)}: {a[tuple(w)].item()!r} vs {e[tuple(w)].item()!r}" for w in where)
        raise AssertionError(f"{what}: {int(bad.sum())} element(s) differ by more than {ulps} ulp; first: {details}")


def libgomp():
    """The OpenMP runtime graphsafe's CPU backend links (already loaded), to set its thread count; None if absent."""
    try:
        lib = ctypes.CDLL("libgomp.so.1")
        lib.omp_get_max_threads.restype = ctypes.c_int
        return lib
    except OSError:
        return None


# --------------------------------------------------------------------------------------------------------
# Skip reasons in the summary
# --------------------------------------------------------------------------------------------------------


def _skip_reason(report) -> str:
    """A skipped report's reason (pytest keeps (path, line, "Skipped: reason") in longrepr)."""
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return reason.removeprefix("Skipped: ")


def pytest_terminal_summary(terminalreporter) -> None:
    """Say why tests were skipped, one line per reason with its count (without a GPU about a thousand CUDA tests
    skip; pytest's final line only counts them, and -rs would list them test function by test function)."""
    from collections import Counter

    reasons = Counter(_skip_reason(r) for r in terminalreporter.stats.get("skipped", ()))
    if not reasons:
        return
    terminalreporter.write_sep("-", "skip reasons")
    for reason, count in reasons.most_common():
        terminalreporter.write_line(f"{count:6d} skipped: {reason}")
