"""graphsafe's custom ops (torch.library), with fake kernels so make_fx and torch.compile can trace them."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from . import _C
from ._core_args import cuda_scratch, current_stream, current_stream_getter, dtype_name, free_cuda_scratch
from ._errors import raise_pending_device_error
from ._tensor_checks import require_readable

__all__ = ["embedding_backward", "embedding_backward_sparse", "embedding", "quantize_blockwise", "dequantize_blockwise",
           "quantization_map"]

_GRAD_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_INDEX_DTYPES = (torch.int32, torch.int64)
_INT32_MAX = 2**31 - 1


def _normalise_padding_idx(padding_idx: int, num_weights: int) -> int:
    """-1 means none; other negatives count from the end (torch's convention)."""
    normalised = padding_idx + num_weights if padding_idx < -1 else padding_idx
    if padding_idx != -1 and not 0 <= normalised < num_weights:
        raise ValueError(
            f"embedding_backward: padding_idx {padding_idx} is out of range for {num_weights} rows (use -1 for none)"
        )
    return normalised


def _check_embedding_backward_inputs(grad: Tensor, indices: Tensor, num_weights: int, padding_idx: int) -> None:
    name = "embedding_backward"
    if grad.layout != torch.strided or indices.layout != torch.strided:
        raise TypeError(f"{name}: grad and indices must be dense (strided) tensors, got {grad.layout} and {indices.layout}")
    if grad.dtype not in _GRAD_DTYPES:
        raise TypeError(f"{name}: grad must be float32, float16, bfloat16 or float64, got {grad.dtype}")
    if indices.dtype not in _INDEX_DTYPES:
        raise TypeError(f"{name}: indices must be int32 or int64, got {indices.dtype}")
    if grad.device != indices.device:
        raise ValueError(f"{name}: grad is on {grad.device} but indices are on {indices.device}")
    if grad.device.type not in ("cpu", "cuda", "meta"):
        raise ValueError(f"{name}: graphsafe supports cpu and cuda tensors, got {grad.device}")
    if grad.dim() < 1:
        raise ValueError(f"{name}: grad must have shape [..., D], got a 0-d tensor")
    if tuple(grad.shape[:-1]) != tuple(indices.shape):
        raise ValueError(
            f"{name}: grad shape {tuple(grad.shape)} must be indices shape {tuple(indices.shape)} plus one trailing "
            "dimension D"
        )
    if not grad.is_contiguous() or not indices.is_contiguous():
        raise ValueError(f"{name}: grad and indices must be contiguous (call .contiguous() first)")
    if num_weights < 0:
        raise ValueError(f"{name}: num_weights must be >= 0, got {num_weights}")
    # Keys and positions are 32-bit in the core; checked here so nothing is allocated for a call that fails.
    if num_weights >= _INT32_MAX:
        raise ValueError(f"{name}: num_weights must be < 2^31 - 1, got {num_weights}")
    if indices.numel() >= _INT32_MAX:
        raise ValueError(f"{name}: at most 2^31 - 2 indices per call, got {indices.numel()}")
    _normalise_padding_idx(padding_idx, num_weights)


# What a call of the dense or the row-sparse backward needs beyond its tensors' addresses, all of it a function of the
# call's signature (see _backward_signature): kept per signature whose checks passed, so that a repeated call skips
# the checks, the workspace query and the dtype names (host time that sets the pace of a small eager call).
# Insertion-ordered and bounded: when full, the oldest half goes (a plan is cheap to make again). Only passes are
# kept, so a bad call is checked in full, and refused, every time.
class _BackwardPlan(NamedTuple):
    run: object  # the _C binding
    device_type: str
    device_index: int
    stream: object  # () -> the raw stream to issue to (torch's current one on the device; 0 on the CPU)
    grad_dtype: str
    index_dtype: str
    num_indices: int
    dim: int
    workspace_bytes: int
    workspace_like: Tensor  # an empty uint8 tensor on the device, whose new_empty allocates the workspace


_PLANS: dict[tuple, _BackwardPlan] = {}
_MAX_PLANS = 256
_STRIDED = torch.strided


def _backward_signature(name: str, grad: Tensor, indices: Tensor, num_weights: int, padding_idx: int) -> tuple | None:
    """Everything the checks and the plan read, as a hashable key, when grad and indices are plain dense tensors
    (the class Tensor itself, strided, not nested, contiguous): then both are a function of the key. None otherwise
    (a subclass, a Parameter, a sparse, nested or strided view...): such a call is checked in full."""
    if (type(grad) is not Tensor or type(indices) is not Tensor or grad.layout is not _STRIDED
            or indices.layout is not _STRIDED or grad.is_nested or indices.is_nested or not grad.is_contiguous()
            or not indices.is_contiguous()):
        return None
    return (name, grad.dtype, grad.device, grad.shape, indices.dtype, indices.device, indices.shape, num_weights,
            padding_idx)


def _make_plan(name: str, grad: Tensor, indices: Tensor, num_weights: int) -> _BackwardPlan:
    device = grad.device
    index = device.index or 0
    num_indices, dim, grad_dtype = indices.numel(), grad.shape[-1], dtype_name(grad.dtype)
    workspace_bytes = getattr(_C, f"{name}_workspace_bytes")(device.type, index, grad_dtype, num_indices, dim,
                                                             num_weights)
    run = _C.embedding_backward_dense if name == "embedding_backward" else _C.embedding_backward_sparse
    return _BackwardPlan(run, device.type, index, current_stream_getter(device), grad_dtype, dtype_name(indices.dtype),
                         num_indices, dim, workspace_bytes, torch.empty(0, dtype=torch.uint8, device=device))


def _embedding_backward_plan(name: str, grad: Tensor, indices: Tensor, num_weights: int,
                             padding_idx: int) -> _BackwardPlan:
    """The checked call's plan (name: the dense or the row-sparse binding). The checks run in full for every
    signature not seen passing before, before anything is allocated; the pending device error is read at every
    CUDA call."""
    signature = _backward_signature(name, grad, indices, num_weights, padding_idx)
    plan = _PLANS.get(signature) if signature is not None else None
    if plan is None:
        _check_embedding_backward_inputs(grad, indices, num_weights, padding_idx)
        require_readable(name, "grad", grad)
        require_readable(name, "indices", indices)
        plan = _make_plan(name, grad, indices, num_weights)
        if signature is not None:
            if len(_PLANS) >= _MAX_PLANS:
                for old in list(_PLANS)[: _MAX_PLANS // 2]:
                    del _PLANS[old]
            _PLANS[signature] = plan
    if plan.device_type == "cuda":
        raise_pending_device_error()
    return plan


def _run_embedding_backward(plan: _BackwardPlan, grad: Tensor, indices: Tensor, num_weights: int, padding_idx: int,
                            scale_grad_by_freq: bool, outputs: tuple[int, ...]) -> None:
    """The planned backward into the outputs' addresses, with a workspace of the size the plan asked for (on CUDA
    a block of torch's caching allocator, handed back once the kernels are issued)."""
    stream, workspace = plan.stream(), None
    address = cuda_scratch(plan.device_index, plan.workspace_bytes, stream) if plan.device_type == "cuda" else None
    if address is None:
        workspace = plan.workspace_like.new_empty(plan.workspace_bytes)
        address = workspace.data_ptr()
    try:
        plan.run(plan.device_type, plan.device_index, stream, *outputs, grad.data_ptr(), plan.grad_dtype,
                 indices.data_ptr(), plan.index_dtype, plan.num_indices, plan.dim, num_weights, padding_idx,
                 scale_grad_by_freq, address, plan.workspace_bytes)
    finally:
        if workspace is None:
            free_cuda_scratch(address)


# ---- registration ----
# The ops are declared with torch.library.Library rather than torch.library.custom_op: custom_op wraps every call in
# several Python layers (an autograd kernel that redispatches, a backend wrapper with an aliasing check and a
# dynamo-disable wrapper), which cost more host time than the op itself at small sizes. What custom_op gave and
# must hold here: the schema with the pt2_compliant tag, the fake kernel (also the Meta kernel), the kernel at
# CompositeExplicitAutograd (every backend; the checks refuse what is not cpu or cuda), an Autograd kernel (the
# embedding's backward rule; for the two backward ops an error when something backpropagates through them), and
# dynamo kept out of the kernels. The outputs are fresh tensors, so they never alias an input.
_LIB = torch.library.Library("graphsafe", "FRAGMENT")
_AFTER_AUTOGRAD = torch._C._after_autograd_keyset
# Keys left after the Autograd key for a plain CPU or CUDA call: the dispatcher goes straight to the kernel then,
# so the Autograd kernel calls it directly instead of redispatching (any other key, such as Python for fake or
# subclass tensors or Functionalize, goes through the dispatcher). Whether a keyset is such is kept by its raw
# bits, as comparing keysets costs more host time than the rest of the decision.
_KERNEL_ONLY = (torch._C.DispatchKeySet(torch._C.DispatchKey.CPU), torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA))
_KERNEL_ONLY_BY_BITS: dict[int, bool] = {}


def _kernel_only(keyset) -> bool:
    bits = keyset.raw_repr()
    known = _KERNEL_ONLY_BY_BITS.get(bits)
    if known is None:
        known = _KERNEL_ONLY_BY_BITS[bits] = (keyset & _AFTER_AUTOGRAD) in _KERNEL_ONLY
    return known


_dynamo_callback = getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None)
_dynamo_callback = getattr(_dynamo_callback, "get_eval_frame_callback", None)


def _outside_dynamo(kernel):
    """kernel, run with dynamo's frame hook off (as custom_op runs its kernels) when the hook is on, i.e. when the op
    runs eagerly inside a torch.compile'd region; torch._disable_dynamo's wrapper costs host time, so it is only
    used then."""
    disabled = torch._disable_dynamo(kernel)

    def run(*args):
        if _dynamo_callback is not None and _dynamo_callback() is None:
            return kernel(*args)
        return disabled(*args)

    return run


def _define(schema: str, kernel, fake, setup_context=None, backward=None):
    """Declares graphsafe::<schema> with kernel (every backend), fake (FakeTensor and Meta) and an Autograd kernel
    (backward(ctx, *grads) with setup_context(ctx, inputs, output) as in torch.library.register_autograd; without
    them, backpropagating through the op raises custom_op's RuntimeError). Returns the op's OpOverload."""
    name = schema[: schema.index("(")]
    _LIB.define(schema, tags=(torch.Tag.pt2_compliant_tag,))
    op = getattr(torch.ops.graphsafe, name).default
    # The arguments' defaults: the dispatcher leaves out trailing arguments equal to them; autograd gets all.
    defaults = tuple(a.default_value for a in op._schema.arguments)
    run = _outside_dynamo(kernel)
    _LIB.impl(name, run, "CompositeExplicitAutograd")
    torch.library.register_fake(f"graphsafe::{name}", fake, lib=_LIB)

    def forward(ctx, *args):  # args: the op's arguments, then the dispatch keyset (not differentiable)
        with torch._C._AutoDispatchBelowAutograd():
            output = op.redispatch(args[-1] & _AFTER_AUTOGRAD, *args[:-1])
        if setup_context is not None:
            setup_context(ctx, args[:-1], output)
        return output

    def backward_through(ctx, *grads):
        if backward is None:
            raise RuntimeError(f"Trying to backward through {op} but no autograd formula was registered. "
                               f"Please use register_autograd to add one.")
        return (*backward(ctx, *grads), None)

    function = type(f"GraphsafeBackwardFor_{name}", (torch.autograd.Function,),
                    {"forward": staticmethod(forward), "backward": staticmethod(backward_through)})

    def autograd_kernel(keyset, *args):
        if torch.is_grad_enabled() and torch._C._any_requires_grad(*args):
            return function.apply(*args, *defaults[len(args):], keyset)
        if _kernel_only(keyset):
            # No input requires grad (or grad mode is off), so autograd records nothing the kernel does: it runs
            # without the below-autograd guard, whose enter and exit cost host time.
            return run(*args)
        with torch._C._AutoDispatchBelowAutograd():
            return op.redispatch(keyset & _AFTER_AUTOGRAD, *args)

    _LIB.impl(name, autograd_kernel, "Autograd", with_keyset=True)
    return op


def _embedding_backward_kernel(grad: Tensor, indices: Tensor, num_weights: int, padding_idx: int = -1,
                               scale_grad_by_freq: bool = False) -> Tensor:
    plan = _embedding_backward_plan("embedding_backward", grad, indices, num_weights, padding_idx)
    out = grad.new_empty((num_weights, plan.dim))
    _run_embedding_backward(plan, grad, indices, num_weights, padding_idx, scale_grad_by_freq, (out.data_ptr(),))
    return out


def _embedding_backward_fake(grad, indices, num_weights, padding_idx=-1, scale_grad_by_freq=False):
    _check_embedding_backward_inputs(grad, indices, num_weights, padding_idx)
    return grad.new_empty((num_weights, grad.shape[-1]))


embedding_backward = _define(
    "embedding_backward(Tensor grad, Tensor indices, SymInt num_weights, SymInt padding_idx=-1, "
    "bool scale_grad_by_freq=False) -> Tensor",
    _embedding_backward_kernel, _embedding_backward_fake)
embedding_backward.__doc__ = """embedding_backward(grad, indices, num_weights, padding_idx=-1, scale_grad_by_freq=False)

    Dense gradient [num_weights, D] of an embedding lookup, deterministic and free of host syncs.

    grad: [..., D] float32/float16/bfloat16/float64 (the gradient of the looked-up rows), contiguous.
    indices: [...] int32/int64, the rows that were looked up, contiguous, on grad's device.
    padding_idx: row that receives no gradient; -1 for none, other negatives count from the end.
    scale_grad_by_freq: divide each row's gradient by the number of times it occurs in indices.
    The result has grad's dtype; sums run in fp32 (fp64 for fp64) in an order fixed by the input alone,
    identical on CPU and CUDA. Out-of-range indices raise IndexError on the CPU; on CUDA they are left out
    of the sum and raise graphsafe.DeviceIndexError at the next graphsafe CUDA call or graphsafe.check_errors().
    """


def _embedding_backward_sparse_kernel(grad: Tensor, indices: Tensor, num_weights: int, padding_idx: int = -1,
                                      scale_grad_by_freq: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    plan = _embedding_backward_plan("embedding_backward_sparse", grad, indices, num_weights, padding_idx)
    capacity, device = min(plan.num_indices, num_weights), grad.device
    rows = torch.empty((capacity,), dtype=torch.int64, device=device)
    row_grads = grad.new_empty((capacity, plan.dim))
    count = torch.empty((), dtype=torch.int64, device=device)
    _run_embedding_backward(plan, grad, indices, num_weights, padding_idx, scale_grad_by_freq,
                            (rows.data_ptr(), row_grads.data_ptr(), count.data_ptr()))
    return rows, row_grads, count


def _embedding_backward_sparse_fake(grad, indices, num_weights, padding_idx=-1, scale_grad_by_freq=False):
    _check_embedding_backward_inputs(grad, indices, num_weights, padding_idx)
    capacity = torch.sym_min(indices.numel(), num_weights)  # no guard on a symbolic N
    return (
        grad.new_empty((capacity,), dtype=torch.int64),
        grad.new_empty((capacity, grad.shape[-1])),
        grad.new_empty((), dtype=torch.int64),
    )


embedding_backward_sparse = _define(
    "embedding_backward_sparse(Tensor grad, Tensor indices, SymInt num_weights, SymInt padding_idx=-1, "
    "bool scale_grad_by_freq=False) -> (Tensor, Tensor, Tensor)",
    _embedding_backward_sparse_kernel, _embedding_backward_sparse_fake)
embedding_backward_sparse.__doc__ = """embedding_backward_sparse(grad, indices, num_weights, padding_idx=-1, scale_grad_by_freq=False)

    Row-sparse gradient of an embedding lookup: (rows, row_grads, count), free of host syncs.

    Takes embedding_backward's arguments, with the same checks and errors. With N = indices.numel() and
    U = min(N, num_weights):
    rows: int64 [U]. rows[:count] are the distinct rows that receive a contribution (padding_idx left out; on
    CUDA out-of-range indices too), strictly increasing; rows[count:] are -1.
    row_grads: [U, D] in grad's dtype. row_grads[k] for k < count is bit for bit row rows[k] of
    embedding_backward(grad, indices, num_weights, padding_idx, scale_grad_by_freq) (the same sums in the same
    order); row_grads[count:] are +0.
    count: int64 0-d tensor on grad's device, the number of distinct rows. It is never read on the host, so
    the op can be captured in a CUDA graph; every size comes from the shapes.
    Out-of-range indices raise IndexError on the CPU before anything is written; on CUDA they get no slot and
    raise graphsafe.DeviceIndexError at the next graphsafe CUDA call or graphsafe.check_errors().
    """


def _check_embedding_inputs(weight: Tensor, indices: Tensor) -> None:
    if weight.layout != torch.strided or indices.layout != torch.strided:
        raise TypeError(f"embedding: weight and indices must be dense (strided) tensors, got {weight.layout} and "
                        f"{indices.layout}")
    if weight.dim() != 2:
        raise ValueError(f"embedding: weight must be 2-D [num_weights, D], got shape {tuple(weight.shape)}")
    if indices.dtype not in _INDEX_DTYPES:
        raise TypeError(f"embedding: indices must be int32 or int64, got {indices.dtype}")
    if weight.device != indices.device:
        raise ValueError(f"embedding: weight is on {weight.device} but indices are on {indices.device}")
    if weight.shape[0] == 0 and indices.numel() > 0:  # known from shapes alone, on every device
        raise IndexError(f"embedding: the weight has 0 rows, so none of the {indices.numel()} indices is in range")


def _embedding_kernel(weight: Tensor, indices: Tensor, padding_idx: int = -1, scale_grad_by_freq: bool = False) -> Tensor:
    _check_embedding_inputs(weight, indices)
    _normalise_padding_idx(padding_idx, weight.shape[0])
    if weight.device.type not in ("cpu", "cuda") or not weight.is_contiguous() or weight.layout != torch.strided:
        return torch.nn.functional.embedding(indices, weight)  # rare layouts: torch's own kernel
    if weight.device.type == "cuda":
        raise_pending_device_error()
    indices = indices.contiguous()
    dim = weight.shape[1]
    out = torch.empty((*indices.shape, dim), dtype=weight.dtype, device=weight.device)
    _C.embedding_lookup(
        weight.device.type,
        weight.device.index or 0,
        current_stream(weight.device),
        out.data_ptr(),
        weight.data_ptr(),
        weight.element_size(),
        indices.data_ptr(),
        dtype_name(indices.dtype),
        indices.numel(),
        dim,
        weight.shape[0],
    )
    return out


def _embedding_fake(weight, indices, padding_idx=-1, scale_grad_by_freq=False):
    _check_embedding_inputs(weight, indices)
    return weight.new_empty((*indices.shape, weight.shape[-1]))


def _embedding_setup_context(ctx, inputs, output):
    weight, indices, padding_idx, scale_grad_by_freq = inputs
    ctx.save_for_backward(indices)
    ctx.num_weights = weight.shape[0]
    ctx.padding_idx = padding_idx
    ctx.scale_grad_by_freq = scale_grad_by_freq


def _embedding_backward_rule(ctx, grad_output):
    (indices,) = ctx.saved_tensors
    grad_weight = None
    if ctx.needs_input_grad[0]:
        grad_weight = embedding_backward(
            grad_output.contiguous(), indices.contiguous(), ctx.num_weights, ctx.padding_idx, ctx.scale_grad_by_freq
        )
    return grad_weight, None, None, None


embedding = _define(
    "embedding(Tensor weight, Tensor indices, SymInt padding_idx=-1, bool scale_grad_by_freq=False) -> Tensor",
    _embedding_kernel, _embedding_fake, _embedding_setup_context, _embedding_backward_rule)
embedding.__doc__ = """embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False)

    Embedding lookup weight[indices] whose backward is graphsafe's embedding_backward.

    Out-of-range indices raise IndexError on the CPU; on CUDA they yield zero rows (nothing is read out of
    bounds, also in a replayed graph) and raise graphsafe.DeviceIndexError at the next graphsafe CUDA call or
    graphsafe.check_errors(), instead of the device-side assert that stops torch's own kernel. (A
    non-contiguous weight goes through torch's F.embedding, and so through that assert.)
    """


# ---- 8-bit blockwise quantisation (docs/optim.md "8-bit states") ----


def check_block_size(block_size: int) -> None:
    """ValueError unless block_size is a power of two from 32 to 1024 (what both backends support)."""
    if not (isinstance(block_size, int) and not isinstance(block_size, bool) and 32 <= block_size <= 1024
            and block_size & (block_size - 1) == 0):
        raise ValueError(f"block_size must be a power of two from 32 to 1024, got {block_size!r}")


def quantization_map(signed: bool = True, device: torch.device | str = "cpu") -> Tensor:
    """The 256 increasing fp32 values of graphsafe's signed or unsigned 8-bit map."""
    return torch.tensor(_C.quantization_map(bool(signed)), dtype=torch.float32, device=device)


def quantize_blockwise(x: Tensor, block_size: int = 256, signed: bool = True) -> tuple[Tensor, Tensor]:
    """8-bit blockwise quantisation of a float tensor (CPU or CUDA): returns (codes, absmax), codes uint8 of
    x's shape and absmax fp32 with one scale per block of block_size consecutive elements (row-major). A
    value is map[code] * absmax; codes round to the nearest map value, ties toward zero. signed=False is for
    non-negative values (negative ones clamp to 0)."""
    check_block_size(block_size)
    require_readable("quantize_blockwise", "x", x)
    if not x.is_floating_point():
        raise TypeError(f"quantize_blockwise: expected a floating-point tensor, got {x.dtype}")
    if x.device.type not in ("cpu", "cuda"):
        raise ValueError(f"quantize_blockwise: tensors must be on cpu or cuda, got {x.device}")
    flat = x.detach().to(torch.float32).contiguous()
    numel = flat.numel()
    codes = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    absmax = torch.empty((numel + block_size - 1) // block_size, dtype=torch.float32, device=x.device)
    if numel:
        _C.quantize_blockwise(x.device.type, x.device.index or 0, current_stream(x.device), flat.data_ptr(), numel,
                              block_size, bool(signed), codes.data_ptr(), absmax.data_ptr())
    return codes, absmax


def dequantize_blockwise(codes: Tensor, absmax: Tensor, block_size: int = 256, signed: bool = True) -> Tensor:
    """The fp32 values of quantize_blockwise's (codes, absmax), in codes' shape."""
    check_block_size(block_size)
    require_readable("dequantize_blockwise", "codes", codes)
    require_readable("dequantize_blockwise", "absmax", absmax)
    if codes.dtype != torch.uint8:
        raise TypeError(f"dequantize_blockwise: codes must be a uint8 tensor, got {codes.dtype}")
    if absmax.dtype != torch.float32:
        raise TypeError(f"dequantize_blockwise: absmax must be a float32 tensor, got {absmax.dtype}")
    if codes.device != absmax.device or codes.device.type not in ("cpu", "cuda"):
        raise ValueError(f"dequantize_blockwise: codes on {codes.device} and absmax on {absmax.device}; both on one cpu or cuda device")
    numel = codes.numel()
    blocks = (numel + block_size - 1) // block_size
    if absmax.numel() != blocks:
        raise ValueError(f"dequantize_blockwise: {numel} codes in blocks of {block_size} need {blocks} absmax values, got {absmax.numel()}")
    codes_c, absmax_c = codes.contiguous(), absmax.contiguous()
    out = torch.empty(codes.shape, dtype=torch.float32, device=codes.device)
    if numel:
        _C.dequantize_blockwise(codes.device.type, codes.device.index or 0, current_stream(codes.device), codes_c.data_ptr(),
                                absmax_c.data_ptr(), numel, block_size, bool(signed), out.data_ptr())
    return out
