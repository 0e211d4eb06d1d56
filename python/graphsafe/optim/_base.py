"""The shared machinery of graphsafe's optimizers: device-resident lr and step, one core call per bucket
of parameters (same device and dtype), fp32, bf16 or 8-bit states, state_dict round trips.

Why lr and step are tensors: a step captured in a CUDA graph reads them from device memory on every
replay, so torch.optim.lr_scheduler schedulers (which fill_ a tensor lr in place) keep working, and no
value is ever read back to the host. Other hyperparameters (betas, eps, weight_decay, ...) are passed by
value: a captured graph keeps the values it was captured with.
"""

from __future__ import annotations

import copy
import inspect
import math
from collections import defaultdict
from itertools import chain, compress, repeat
from operator import attrgetter, is_, is_not, itemgetter
from typing import Any, Callable, Iterable

import torch
from torch import Tensor
from torch.autograd import _profiler_enabled
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

from .. import _C, ops
from .._errors import raise_pending_device_error
from .._tensor_checks import require_readable, unreadable_reason

try:  # what torch.compile checks its inputs' tensors with, in C++ (_tensor_guard)
    from torch._C._dynamo.guards import TensorGuards as _TensorGuards
except ImportError:
    _TensorGuards = None

_PARAM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Algorithms whose step needs scratch memory (per-chunk norms of LAMB and LARS); for the others the core's
# optim_workspace_bytes is 0 and is not asked (a test checks the two agree).
_NEEDS_WORKSPACE = frozenset({"lamb", "lars"})
# Group options that say how states are stored; load_state_dict keeps the loading optimizer's.
_STORAGE_OPTIONS = ("state_bits", "block_size", "min_8bit_size")
# What _prepare_group_at_once reads from every parameter, gradient and state (map calls these in C).
_grad_of, _dtype_of, _device_of = attrgetter("grad"), attrgetter("dtype"), attrgetter("device")
_layout_of, _shape_of = attrgetter("layout"), attrgetter("shape")
_block_size_of = itemgetter("block_size")
_PLAIN_TENSOR, _STRIDED = {Tensor}, {torch.strided}
# For one parameter the per-parameter loop is cheaper (this CPU, SGD, a group's whole step: 17.1 against 19.1 us;
# 2 parameters 20.8 against 21.4, 4 parameters 26.6 against 25.7).
_AT_ONCE_MIN_PARAMS = 2
# The raw CUDA stream torch is issuing to on a device (torch.cuda.current_stream builds a Stream object each
# time, a few microseconds of an eager step); the public call where this private one is missing.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_is_cpu = attrgetter("is_cpu")


class _StateMap(defaultdict):
    """The optimizer's `state` (parameter -> its state dict), a defaultdict(dict) that counts the changes made to
    it. An eager step looks its parameters' state dicts up once and reuses that list while the mapping is the same
    object at the same count and the parameters are the same objects (_states_looked_up): a look-up costs a
    Tensor.__hash__, a Python function (this CPU: 115 ns a parameter, the dearest read of an at-once step).
    Counted: every way Python changes a dict (a state dict set, replaced or deleted by hand, clear, update,
    load_state_dict's new mapping, a state made on first use). Not counted, and not needing it: a parameter's own
    state dict changed in place (the step reads its entries again every time). Not seen: the mapping changed by C
    code that bypasses these methods (dict.__setitem__(opt.state, ...) called on the base class). Pickles,
    copies and deep-copies as a defaultdict does (into a _StateMap, counting from 0: a new object)."""

    __slots__ = ("version",)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.version = getattr(self, "version", 0) + 1  # (never back to a count seen: __init__ called again)

    def __missing__(self, key: Any) -> Any:
        self.version += 1
        return super().__missing__(key)

    def __setitem__(self, key: Any, value: Any) -> None:
        self.version += 1
        super().__setitem__(key, value)

    def __delitem__(self, key: Any) -> None:
        self.version += 1
        super().__delitem__(key)

    def pop(self, *args: Any) -> Any:
        self.version += 1
        return super().pop(*args)

    def popitem(self) -> tuple[Any, Any]:
        self.version += 1
        return super().popitem()

    def clear(self) -> None:
        self.version += 1
        super().clear()

    def update(self, *args: Any, **kwargs: Any) -> None:
        self.version += 1
        super().update(*args, **kwargs)

    def setdefault(self, *args: Any) -> Any:
        self.version += 1
        return super().setdefault(*args)

    def __ior__(self, other: Any) -> "_StateMap":
        self.version += 1
        return super().__ior__(other)


def _current_stream(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    if _raw_stream is not None:
        return _raw_stream(device.index if device.index is not None else torch.cuda.current_device())
    return torch.cuda.current_stream(device).cuda_stream


def _dtype_text(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


_DTYPE_NAMES = {dtype: _dtype_text(dtype) for dtype in _PARAM_DTYPES}  # the core's names


def _lr_tensor(lr: float | Tensor, device: torch.device) -> Tensor:
    if isinstance(lr, Tensor):
        if lr.numel() != 1:
            raise ValueError(f"lr must be a number or a one-element tensor, got a tensor of shape {tuple(lr.shape)}")
        require_readable("optimizer", "lr", lr)
        return lr.detach().to(device=device, dtype=torch.float32, copy=True).reshape(())
    return torch.tensor(float(lr), dtype=torch.float32, device=device)


def _check_lr(lr: Any) -> None:
    """ValueError unless lr is a number or a one-element tensor >= 0 (+inf allowed, NaN not: torch.optim's rule).
    Reads a tensor's value on the host: for construction, add_param_group and load_state_dict only, never a
    step (a captured step cannot read it; the core checks the lr it reads there)."""
    if isinstance(lr, Tensor):
        if lr.numel() != 1:
            raise ValueError(f"lr must be a number or a one-element tensor, got a tensor of shape {tuple(lr.shape)}")
        require_readable("optimizer", "lr", lr)
        if lr.is_complex() or lr.dtype == torch.bool:
            raise TypeError(f"lr must be a real number, got a {_dtype_text(lr.dtype)} tensor")
        value = float(lr.detach().to("cpu", torch.float64))
    else:
        try:
            value = float(lr)
        except (TypeError, ValueError):
            raise TypeError(f"lr must be a number or a one-element tensor, got {type(lr).__name__} {lr!r}") from None
    if not value >= 0.0:  # (NaN fails too)
        raise ValueError(f"Invalid learning rate: {value}")


class GraphsafeOptimizer(torch.optim.Optimizer):
    """Base class: subclasses name the core algorithm and map a param group to core options."""

    algorithm: str = ""

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        defaults: dict[str, Any],
        *,
        skip_zeros: bool = False,
        state_bits: int = 32,
        block_size: int = 256,
        min_8bit_size: int = 4096,
    ) -> None:
        _check_storage_options(state_bits, block_size, min_8bit_size)
        _check_lr(defaults["lr"])
        defaults = dict(defaults, skip_zeros=bool(skip_zeros), state_bits=state_bits, block_size=block_size,
                        min_8bit_size=min_8bit_size)
        super().__init__(params, defaults)
        self.state = _StateMap(dict, self.state)  # (torch's plain defaultdict, empty still)
        for group in self.param_groups:
            self._check_group(group)
            group["lr"] = _lr_tensor(group["lr"], self._group_device(group))
        self._initialised = True  # groups added from now on are checked by add_param_group

    # ---- what subclasses provide ----

    def _options(self, group: dict[str, Any]) -> dict[str, float]:
        """The algorithm's own core options for a param group ({name: number}, booleans as 0/1);
        maximize and skip_zeros, which every algorithm has, are added by _core_options."""
        raise NotImplementedError

    def _core_options(self, group: dict[str, Any]) -> dict[str, float]:
        return dict(self._options(group), maximize=1.0 if group["maximize"] else 0.0,
                    skip_zeros=1.0 if group["skip_zeros"] else 0.0)

    def _state_names(self, group: dict[str, Any]) -> list[str]:
        """Names of the states the algorithm keeps per parameter, in the core's order."""
        raise NotImplementedError

    def _initial_state_value(self, group: dict[str, Any], name: str) -> float:
        return 0.0

    def _step_of_loaded_state(self, state: dict[str, Any]) -> float:
        """The step count of a loaded, non-empty parameter state that has none. The update rules read the step
        (bias corrections, warm-ups, first-step rules), so a restart from 0 would silently change training: an
        error here; an algorithm whose rule reads the step only to tell the first step apart overrides this."""
        raise ValueError(
            f"{type(self).__name__}.load_state_dict: a saved parameter state has no 'step' (it has {sorted(state)}); "
            f"{type(self).__name__}'s update depends on the step count, so it will not restart from step 0. Save "
            "the checkpoint with its step counts, or set state['step'] in the state_dict by hand.")

    # ---- checks ----

    def _check_group(self, group: dict[str, Any]) -> None:
        """Raises the clear error for a param group the step cannot take (its lr, options and parameters);
        changes nothing."""
        _check_lr(group["lr"])
        _C.optim_validate(self.algorithm, self._core_options(group))
        _check_storage_options(group["state_bits"], group["block_size"], group["min_8bit_size"])
        for p in group["params"]:
            require_readable(type(self).__name__, "a parameter", p)
            if p.dtype not in _PARAM_DTYPES:
                raise TypeError(f"{type(self).__name__}: parameters must be float32, float16 or bfloat16, got {p.dtype}")
            if p.device.type not in ("cpu", "cuda"):
                raise ValueError(f"{type(self).__name__}: parameters must be on cpu or cuda, got {p.device}")
            if not p.is_contiguous():
                raise ValueError(f"{type(self).__name__}: parameters must be contiguous (the step updates them in place)")

    @staticmethod
    def _group_device(group: dict[str, Any]) -> torch.device:
        devices = {p.device for p in group["params"]}
        if len(devices) > 1:
            raise ValueError(f"all parameters of a param group must be on one device, got {sorted(map(str, devices))}")
        return devices.pop() if devices else torch.device("cpu")

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        groups_before = len(self.param_groups)
        super().add_param_group(param_group)
        if hasattr(self, "_initialised") and len(self.param_groups) > groups_before:
            group = self.param_groups[-1]
            try:
                self._check_group(group)
                group["lr"] = _lr_tensor(group["lr"], self._group_device(group))
            except Exception:
                self.param_groups.pop()  # a refused group is not kept: the optimizer stays as it was
                raise

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._initialised = True
        # torch's plain defaultdict (an optimizer pickled before _StateMap, torch.optim.Optimizer.load_state_dict)
        if isinstance(self.state, dict) and type(self.state) is not _StateMap:
            self.state = _StateMap(dict, self.state)
        for cache in ("_checked_states", "_checked_params"):  # new groups and states (load_state_dict): checked anew
            self.__dict__.pop(cache, None)

    # ---- the step ----

    def _bits_of(self, group: dict[str, Any], p: Tensor) -> int:
        """How p's states are stored (32, 16 or 8 bits; _storage_bits)."""
        return _storage_bits(group["state_bits"], group["min_8bit_size"], p.numel())

    def _state_of(self, group: dict[str, Any], p: Tensor, names: list[str], bits: int,
                  loading: bool = False) -> dict[str, Any]:
        """p's state in the form the core needs, created on its first step and converted when the form
        changed (a state_dict of the other kind was loaded, or state_bits / block_size was changed).

        fp32 form (bits 32): 'step' and one fp32 tensor per name; bf16 form (16): the same in bf16. 8-bit form:
        'step', 'block_size' and per name the codes (uint8, p's shape), '<name>_absmax' (fp32, one per block)
        and '<name>_qmap' (the 256-value map the codes index). A state an option turns on later (e.g. SGD momentum set after the first step)
        starts from its initial value (zeros; torch's SGD would start the buffer as a copy of the gradient,
        which differs only when dampening != 0). A loaded state (loading=True) that lacks one of its
        algorithm's states is an incomplete checkpoint: ValueError, instead of a silent restart from zeros."""
        state = self.state[p]
        if loading:
            if "step" not in state:
                state["step"] = self._step_of_loaded_state(state)
            _check_loaded_step(f"{type(self).__name__}.load_state_dict", state["step"])
        step = state.get("step", 0.0)
        if not _has_form(step, torch.float32, (), p.device):
            state["step"] = torch.as_tensor(step, dtype=torch.float32).detach().to(p.device).reshape(()).clone()
        block_size = group["block_size"]
        options = self._core_options(group)
        updates: dict[str, dict[str, Tensor]] = {}
        unquantized = _UNQUANTIZED_STATE_DTYPES.get(bits)
        for j, name in enumerate(names):
            signed = _C.optim_state_is_signed(self.algorithm, options, j)
            if (_holds_8bit(state, name, p, block_size, signed) if bits == 8
                    else _has_form(state.get(name), unquantized, tuple(p.shape), p.device)):
                continue  # kept as it is (its raw bits, NaN payloads included)
            where = f"{type(self).__name__}.load_state_dict" if loading else f"{type(self).__name__} step"
            value = _state_as_fp32(state, name, p, where)
            if value is None:
                if loading:
                    raise ValueError(
                        f"{type(self).__name__}.load_state_dict: the saved state of a parameter of shape {tuple(p.shape)} "
                        f"has no '{name}' (it has {sorted(state)}); {type(self).__name__} with the saved options keeps "
                        f"{names}")
                value = torch.full_like(p, self._initial_state_value(group, name), dtype=torch.float32)
            if bits == 8:
                codes, absmax = ops.quantize_blockwise(value, block_size, signed)
                updates[name] = {name: codes, f"{name}_absmax": absmax,
                                 f"{name}_qmap": ops.quantization_map(signed, p.device)}
            else:  # fp32, or rounded to nearest bf16
                updates[name] = {name: value.to(unquantized)}
        # Applied only once every state converted: a failure above leaves the state as it was. The group's
        # state-check cache is dropped with the tensors it holds (it would keep them alive).
        if updates:
            self.__dict__.get("_checked_states", {}).pop(id(group), None)
        for name, entries in updates.items():
            for key in (f"{name}_absmax", f"{name}_qmap"):
                state.pop(key, None)
            state.update(entries)
        if bits == 8:
            state["block_size"] = block_size
        else:
            state.pop("block_size", None)
        return state

    def _reject_grad(self, p: Tensor, g: Tensor) -> None:
        """Raises the clear error for a gradient the core cannot take."""
        name = type(self).__name__
        require_readable(name, "a parameter", p)
        if g.is_sparse or g.layout != torch.strided:
            raise RuntimeError(f"{name} does not support sparse gradients; use a dense gradient (graphsafe.nn.Embedding gives one)")
        if g.is_complex() or p.is_complex():
            raise RuntimeError(f"{name} does not support complex parameters or gradients")
        if g.dtype != p.dtype:
            raise TypeError(f"{name}: gradient dtype {g.dtype} differs from its parameter's {p.dtype}")
        if g.device != p.device:
            raise ValueError(f"{name}: gradient on {g.device} but its parameter on {p.device}")
        require_readable(name, "a gradient", g)
        raise ValueError(f"{name}: gradient shape {tuple(g.shape)} differs from its parameter's {tuple(p.shape)}")

    def step(self, *args: Any, **kwargs: Any):
        """step(closure=None): one optimizer step (closure re-evaluates the model and returns the loss, as in
        torch.optim).

        torch.optim.Optimizer wraps each subclass's step in its profile_hook_step: a profiler range and the
        step hooks, which cost more host time than the rest of a small eager step (this CPU, SGD, one
        parameter: 15 of 34 us; an empty step alone: 8 us). This step is marked as wrapped already, so torch
        leaves it alone, and it takes torch's own wrapper whenever that has something to do: a step hook
        registered (the optimizer's or a global one) or the autograd profiler on. A subclass that overrides
        step is wrapped by torch as usual; its super().step() then runs no hooks a second time (the class's
        step is torch's wrapper: its code is that wrapper's). A step decorated with functools.wraps copies the
        mark and is not wrapped by torch: this step runs the hooks then. The arguments are passed on as given,
        so that hooks see what torch's would. Not seen without a hook: observers of torch's record_function
        ranges other than the autograd profiler of this thread (a standalone ExecutionTraceObserver); any step
        hook, even one that does nothing, makes every step take torch's wrapper."""
        if getattr(type(self).step, "__code__", None) is not _TORCH_WRAPPER_CODE and (
                _global_optimizer_pre_hooks or _global_optimizer_post_hooks or self._optimizer_step_pre_hooks
                or self._optimizer_step_post_hooks or _profiler_enabled()):
            return _step_with_torch_wrapper(self, *args, **kwargs)
        return self._unwrapped_step(*args, **kwargs)

    step.hooked = True  # what torch.optim.Optimizer._patch_step_function looks for: leave this step unwrapped

    def _unwrapped_step(self, closure: Callable[[], Any] | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # Grad mode off, as torch.no_grad would set it (set directly: the decorator costs more than the
        # rest of a small eager step's Python).
        grad_was_enabled = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            self._step_groups()
        finally:
            torch._C._set_grad_enabled(grad_was_enabled)
        return loss

    def _step_groups(self) -> None:
        pending: list[Callable[[], None]] = []
        for group in self.param_groups:
            issues = self._prepare_group_at_once(group)
            if issues is not None:
                pending.extend(issues)
                continue
            # (param, grad) pairs per (device, dtype); each gradient is fetched once per step
            buckets: dict[tuple[torch.device, torch.dtype], list[tuple[Tensor, Tensor]]] = defaultdict(list)
            for p in group["params"]:
                g = p.grad
                if g is not None:
                    buckets[(p.device, p.dtype)].append((p, g))
            for (device, dtype), pairs in buckets.items():
                pending.append(self._prepare_bucket(group, device, dtype, pairs))
        # Every bucket of every group is checked before the first one is stepped: a step that raises leaves
        # all parameters and their existing states as they were.
        for issue in pending:
            issue()

    def _group_memo(self, cache: str, group: dict[str, Any]) -> dict[Any, Any]:
        """What this optimizer remembers about a param group between steps in `cache` (an attribute: dropped by
        __setstate__ where it names it). Keyed by the group's id; the entry holds the group itself, so that the
        id cannot be reused by another group while it lives."""
        entries = self.__dict__.setdefault(cache, {})
        entry = entries.get(id(group))
        if entry is None or entry[0] is not group:
            entry = entries[id(group)] = (group, {})
        return entry[1]

    def _bucket_options(self, group: dict[str, Any], dtype: torch.dtype) -> tuple[dict[str, float], list[str]]:
        """Checks a group's options for a step on parameters of `dtype`; returns the core options and the
        state names."""
        options = self._core_options(group)
        # Validated before anything changes (a rejected step changes nothing); once per group while its
        # options stay the same.
        memo = self._group_memo("_validated_options", group)
        if memo.get("options") != options:
            _C.optim_validate(self.algorithm, options)
            memo["options"] = options
        _check_storage_options(group["state_bits"], group["block_size"], group["min_8bit_size"])
        if dtype not in _PARAM_DTYPES:  # a parameter's dtype changed after construction (p.data = ...)
            if dtype.is_complex:
                raise RuntimeError(f"{type(self).__name__} does not support complex parameters or gradients")
            raise TypeError(f"{type(self).__name__}: parameters must be float32, float16 or bfloat16, got {dtype}")
        return options, self._state_names(group)

    def _prepare_group_at_once(self, group: dict[str, Any]) -> list[Callable[[], None]] | None:
        """The common case of a step, checked and gathered list by list instead of parameter by parameter
        (each check below runs over all parameters in C, through map or one TensorGuards call; the Python loop in
        _prepare_bucket costs about twice as much per parameter, and an eager step of many small tensors is bound
        by that cost). What stays as it was between steps is read once (_params_checked_once, _grads_fit,
        _states_looked_up, _check_states_once say when it is read again); at every step: each gradient, its
        form (in one call while alike the last step's) and address, the parameters' addresses and form, and
        every state entry the core writes, its identity, address and dtype.

        Taken for groups of _AT_ONCE_MIN_PARAMS parameters or more (below, its fixed cost is more than the
        loop's) when the group's parameters with a gradient, and those gradients, are on one device, strided
        and contiguous, each gradient of its parameter's dtype and shape, and every state already in the form
        this step needs. Parameters of several dtypes, or with 8-bit and fp32 states side by side (sizes on
        both sides of min_8bit_size), make one core call per kind, as the per-parameter path does. Returns the
        functions that issue the calls, or None, having changed nothing: the general path then handles the
        group, raising its clear errors, copying non-contiguous gradients, creating and converting states."""
        params = group["params"]
        if len(params) < _AT_ONCE_MIN_PARAMS:
            return None
        grads = list(map(_grad_of, params))
        if set(map(type, grads)) != _PLAIN_TENSOR:  # a parameter without a gradient, or a tensor subclass
            keep = list(map(is_not, grads, repeat(None)))
            params, grads = list(compress(params, keep)), list(compress(grads, keep))
            if not grads or set(map(type, grads)) != _PLAIN_TENSOR:
                return None
        param_ptrs = list(map(Tensor.data_ptr, params))
        seen = self._params_checked_once(group, params, param_ptrs)
        if seen is None or not _grads_fit(seen, grads):
            return None
        numels, shapes = seen.numels, seen.shapes
        states = self._states_looked_up(seen)
        # One core call per (dtype, storage bits), in the order the kinds first appear (8 bits from min_8bit_size
        # elements under state_bits=8, fp32 below).
        _check_storage_options(group["state_bits"], group["block_size"], group["min_8bit_size"])
        kinds = seen.kinds(group["state_bits"], group["min_8bit_size"])
        columns = (params, grads, numels, param_ptrs, shapes, states)
        if len(kinds) == 1:
            buckets = {kinds[0][0]: columns}
        else:
            buckets = {kind: tuple(list(map(column.__getitem__, indices)) for column in columns)
                       for kind, indices in kinds}
        issues = []
        for (dtype, kind_bits), bucket in buckets.items():
            issue = self._prepare_kind_at_once(group, seen.device, dtype, kind_bits, *bucket)
            if issue is None:
                return None
            issues.append(issue)
        return issues

    def _params_checked_once(self, group: dict[str, Any], params: list[Tensor],
                             param_ptrs: list[int]) -> _ParamsSeen | None:
        """For _prepare_group_at_once: the group's parameters with a gradient as last read (their device, dtypes,
        shapes and element counts; _ParamsSeen) when they are all contiguous and on one device, None otherwise.
        Read again only when a parameter is another object or changed since the step that last read them (p.data
        = ... replaces a parameter's tensor; p.data = p.data.t() keeps address and shape): its address (read at
        every step, the core takes it), or what the parameters' guard compares (_tensor_guard: Python type, dtype,
        device, layout, shape and strides, in one call; where torch has no guard, the dtypes and shapes and
        contiguity, read at every step). A tensor on another device cannot take the address of one that is alive
        (CUDA's unified addressing); not seen, as in _check_states_once: a tensor made on another device at the
        address of one freed between two steps."""
        memo = self._group_memo("_checked_params", group)
        seen = memo.get("params")
        if (seen is not None and seen.ptrs == param_ptrs and len(seen.params) == len(params)
                and all(map(is_, params, seen.params)) and seen.still_holds(params)):
            return seen
        if not all(map(Tensor.is_contiguous, params)):
            return None
        devices = set(map(_device_of, params))
        if len(devices) != 1:
            return None
        seen = memo["params"] = _ParamsSeen(params, param_ptrs, devices.pop())
        return seen

    def _states_looked_up(self, seen: _ParamsSeen) -> list[dict[str, Any]]:
        """The state dicts of seen's parameters (() for a parameter without state yet), looked up again only when
        the parameters were read again or the state mapping is another object or has changed since (_StateMap's
        count; a mapping of another type, set by hand, is looked up at every step). Their entries are the
        caller's to read at every step: a state dict can be changed in place."""
        mapping = self.state
        if type(mapping) is not _StateMap:
            return list(map(mapping.get, seen.params, repeat(())))
        looked_up = seen.states
        if looked_up is None or looked_up[0] is not mapping or looked_up[1] != mapping.version:
            looked_up = seen.states = (mapping, mapping.version, list(map(mapping.get, seen.params, repeat(()))))
        return looked_up[2]

    def _prepare_kind_at_once(self, group: dict[str, Any], device: torch.device, dtype: torch.dtype, bits: int,
                              params: list[Tensor], grads: list[Tensor], numels: list[int], param_ptrs: list[int],
                              shapes: list[torch.Size], states: list[dict[str, Any]]) -> Callable[[], None] | None:
        """_prepare_group_at_once's core call for the parameters of one dtype whose states are stored in `bits`
        (32, 16 or 8), or None if a state is not in the form the call needs (missing, or another form to
        convert). param_ptrs, shapes and states: the parameters' addresses, shapes and state dicts, as read
        already."""
        options, names = self._bucket_options(group, dtype)  # raises as the general path would
        if set(map(len, states)) != {_state_entry_count(names, bits)}:
            return None
        try:
            if bits == 8 and set(map(_block_size_of, states)) != {group["block_size"]}:
                return None
            # key by key (states, absmax, steps), as the core takes them
            tensors = [list(map(itemgetter(key), states)) for key in _state_keys(names, bits)]
            # At every step, not only where the state check runs: `.data = t.data.view(another dtype)` keeps a
            # state's object and address, which is all that check's cache compares.
            if bits != 8 and set(map(_dtype_of, chain.from_iterable(tensors[:len(names)]))) - {_UNQUANTIZED_STATE_DTYPES[bits]}:
                return None  # fp32 states under state_bits=16, or the other way round: convert (or the clear error)
        except KeyError:  # other state names with the same count (options changed): convert
            return None
        except AttributeError:  # a state replaced by hand with something else than a tensor: the clear error
            return None
        call = self._kind_call(group, (device, dtype, bits), params, grads, states, names, tensors, numels,
                               param_ptrs, shapes)
        return self._issuer(group, device, dtype, options, {bits: call}, [])

    def _kind_call(self, group: dict[str, Any], kind: tuple[torch.device, torch.dtype, int], params: list[Tensor],
                   grads: list[Tensor], states: list[dict[str, Any]], names: list[str], tensors: list[list[Tensor]],
                   numels: list[int], param_ptrs: list[int], shapes: list[torch.Size]) -> tuple:
        """One core call of either gathering path, for parameters of one kind (device, dtype, state bits)
        whose states hold every _state_keys entry (tensors: per key, its tensors over the parameters; param_ptrs
        and shapes: the parameters' addresses and shapes): the state tensors checked (_check_states_once), then
        their addresses."""
        try:
            key_ptrs = [list(map(Tensor.data_ptr, key_tensors)) for key_tensors in tensors]
        except (TypeError, RuntimeError):  # a state that is not a tensor, or one without storage: the full check
            key_ptrs = None                 # names it
        self._check_states_once(group, kind, params, states, names, tensors, key_ptrs, shapes)
        return _core_call(param_ptrs, list(map(Tensor.data_ptr, grads)), key_ptrs, len(names), numels)

    def _check_states_once(self, group: dict[str, Any], kind: tuple[torch.device, torch.dtype, int],
                           params: list[Tensor], states: list[dict[str, Any]], names: list[str],
                           tensors: list[list[Tensor]], key_ptrs: list[list[int]] | None,
                           shapes: list[torch.Size]) -> None:
        """_check_state_tensors for every parameter of a core call, skipped while nothing it depends on changed
        since an earlier step checked the group's parameters of this kind (device, dtype, state bits): the
        parameters' shapes (as read already; a .data can be replaced by one of another size, which the old
        states do not fit), the block size, and per state tensor the very object and its address (a tensor
        changed in place, `.data = ...` or a growing `resize_`, gets new memory while the old is still held; a
        shrinking resize_ keeps the memory it writes into). An identity test and an address comparison per
        tensor instead of five checks; the address is the one the call passes anyway. Not seen: two in-place
        changes between steps whose second lands at the first's freed address (docs/optim.md)."""
        checked = self._group_memo("_checked_states", group)
        block_size = group["block_size"]
        now = None if key_ptrs is None else (shapes, block_size, key_ptrs)
        seen = checked.get(kind)
        if (now is not None and seen is not None and seen[0] == now and len(seen[1]) == len(tensors)
                and all(len(a) == len(b) and all(map(is_, a, b)) for a, b in zip(tensors, seen[1]))):
            return
        owner = type(self).__name__
        for p, state in zip(params, states):
            _check_state_tensors(owner, p, state, names, kind[2], block_size)
        checked[kind] = (now, tensors)

    def _prepare_bucket(self, group: dict[str, Any], device: torch.device, dtype: torch.dtype,
                        pairs: list[tuple[Tensor, Tensor]]) -> Callable[[], None]:
        """Checks one (device, dtype) bucket of a group, (param, grad) pairs, and gathers what the core needs;
        returns the function that steps it. The general path: any mix of parameters, states to create or
        convert, gradients to make contiguous, and the clear error for a gradient the core cannot take."""
        options, names = self._bucket_options(group, dtype)
        # Two core calls at most: with state_bits=8, parameters with fp32 states and those with 8-bit states.
        kinds: dict[int, tuple[list[Tensor], list[Tensor], list[dict[str, Any]], list[int]]] = {}
        contiguous_copies = []  # alive until the core calls have been issued
        all_states = self.state
        # What _bits_of reads, read once per bucket.
        state_bits, min_8bit_size, block_size = group["state_bits"], group["min_8bit_size"], group["block_size"]
        strided = torch.strided
        for p, g in pairs:
            if not (g.layout is strided and g.dtype is dtype and g.shape == p.shape and g.device == device) or (
                    type(g) is not Tensor and unreadable_reason(g) is not None):
                self._reject_grad(p, g)
            if type(p) is not torch.nn.Parameter and type(p) is not Tensor:  # (set by hand after construction)
                require_readable(type(self).__name__, "a parameter", p)
            if not p.is_contiguous():  # checked at construction, but p.data can be replaced since
                raise ValueError(f"{type(self).__name__}: parameters must be contiguous (the step updates them in "
                                 f"place); a parameter of shape {tuple(p.shape)} has strides {p.stride()}")
            if not g.is_contiguous():
                g = g.contiguous()
                contiguous_copies.append(g)
            numel = p.numel()
            bits = _storage_bits(state_bits, min_8bit_size, numel)
            state = all_states[p]
            if not _in_step_form(state, names, bits, block_size):
                state = self._state_of(group, p, names, bits)
            kind_params, kind_grads, kind_states, kind_numels = kinds.setdefault(bits, ([], [], [], []))
            kind_params.append(p)
            kind_grads.append(g)
            kind_states.append(state)
            kind_numels.append(numel)
        calls = {}
        for bits, (kind_params, kind_grads, kind_states, kind_numels) in kinds.items():
            tensors = [list(map(itemgetter(key), kind_states)) for key in _state_keys(names, bits)]
            calls[bits] = self._kind_call(group, (device, dtype, bits), kind_params, kind_grads, kind_states,
                                          names, tensors, kind_numels, list(map(Tensor.data_ptr, kind_params)),
                                          list(map(_shape_of, kind_params)))
        return self._issuer(group, device, dtype, options, calls, contiguous_copies)

    def _issuer(self, group: dict[str, Any], device: torch.device, dtype: torch.dtype, options: dict[str, float],
                calls: dict[int, tuple], contiguous_copies: list[Tensor]) -> Callable[[], None]:
        """The function that issues a bucket's core calls ({state bits: (param, grad, state, absmax and step
        addresses, numels)}, the state and absmax addresses state by state), once every bucket of the step has
        been checked."""
        lr = group["lr"]
        # The core reads one float32 at lr's address: a float set by hand, or a tensor of another dtype or
        # device, becomes a 0-d float32 tensor on the device again (eager steps only; a captured step, and
        # later fill_s of the tensor set by hand, do not see it).
        if not isinstance(lr, Tensor) or lr.device != device or lr.dtype is not torch.float32 or lr.numel() != 1:
            if not isinstance(lr, Tensor):
                _check_lr(lr)
            group["lr"] = lr = _lr_tensor(lr, device)
        if device.type == "cuda":
            # An error a kernel recorded earlier (an invalid lr in a step before this one, an out-of-range index)
            # is raised here, before anything of this step is issued (reads mapped host memory; no sync).
            raise_pending_device_error()
            finish_counter = self._finish_counter(device)
        else:
            # The CPU core refuses an invalid lr itself, but only when its call comes: read here (host memory),
            # so that no group of the step is applied when a later one's lr is invalid.
            if not lr.item() >= 0.0:
                raise ValueError(f"invalid learning rate {lr.item()} in the optimizer's lr tensor (it must be >= 0): "
                                 "the step changed nothing")
            finish_counter = 0
        block_size = group["block_size"]

        def issue() -> None:
            stream = _current_stream(device)
            for bits, call in calls.items():
                if not call[0]:
                    continue
                param_ptrs, grad_ptrs, state_ptrs, absmax_ptrs, step_ptrs, numels = call
                workspace_bytes = (_C.optim_workspace_bytes(device.type, self.algorithm, options, numels)
                                   if self.algorithm in _NEEDS_WORKSPACE else 0)
                workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=device) if workspace_bytes else None
                _C.optim_step(
                    device.type,
                    device.index or 0,
                    stream,
                    self.algorithm,
                    options,
                    _DTYPE_NAMES[dtype],
                    lr.data_ptr(),
                    param_ptrs,
                    grad_ptrs,
                    state_ptrs,
                    absmax_ptrs,
                    step_ptrs,
                    numels,
                    workspace.data_ptr() if workspace is not None else 0,
                    workspace_bytes,
                    True,  # increment_steps: the core counts every step (on CUDA, see _finish_counter)
                    bits,  # state_bits
                    block_size,
                    finish_counter,
                )
            # The gradients' contiguous copies were read through raw addresses: this reference keeps them alive
            # until here (a closure holds only the names it uses).
            contiguous_copies.clear()

        return issue

    def _finish_counter(self, device: torch.device) -> int:
        """The address of the zeroed 32-bit counter the CUDA element-wise update kernels count their finished
        blocks in, to add 1 to the steps in the update's last block instead of a launch of their own
        (OptimStepArgs::finish_counter): one per device for this optimizer, whose steps run one after
        another; the kernels leave it 0. A captured step keeps its address, so it lives as long as the
        optimizer. It is made outside CUDA graph capture only: made inside, its zeroing would be a node of
        the graph, not run until the first replay, and an eager step before that would read garbage. A step
        captured before any eager one on the device gets 0 instead (the steps counted by a launch ahead)."""
        counters = self.__dict__.setdefault("_finish_counters", {})
        counter = counters.get(device)
        if counter is None:
            if torch.cuda.is_current_stream_capturing():
                return 0
            counter = counters[device] = torch.zeros((), dtype=torch.int32, device=device)
        return counter.data_ptr()

    # ---- persistence ----

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state_dict from any graphsafe optimizer of the same algorithm, on any device.

        Unlike torch.optim.Optimizer.load_state_dict, states take this optimizer's storage (state_bits,
        block_size and min_8bit_size are kept from this optimizer, not the checkpoint): fp32 and bf16 states are
        quantised for parameters kept in 8 bits, 8-bit states dequantised for parameters kept in fp32 or bf16,
        and a torch.optim state_dict's half states widened to fp32 (state_bits=32) or kept as, or rounded to,
        bf16 (state_bits=16); states move to their parameter's device; lr moves with its group. A state of the
        wrong shape raises ValueError.
        """
        owner = f"{type(self).__name__}.load_state_dict"
        _check_state_dict_structure(owner, state_dict)
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        for group, saved in zip(self.param_groups, saved_groups):
            if len(group["params"]) != len(saved["params"]):
                raise ValueError("loaded state dict contains a parameter group that doesn't match the size of optimizer's group")
        id_to_param = {
            saved_id: p
            for group, saved in zip(self.param_groups, saved_groups)
            for saved_id, p in zip(saved["params"], group["params"])
        }
        state: defaultdict[Tensor, dict[str, Any]] = _StateMap(dict)
        for saved_id, values in state_dict["state"].items():
            if saved_id not in id_to_param:
                continue
            p = id_to_param[saved_id]
            if not isinstance(values, dict):
                raise TypeError(f"{owner}: a saved parameter state must be a dict, got {type(values).__name__}")
            for key, value in values.items():
                if isinstance(value, Tensor):
                    require_readable(owner, f"the saved state '{key}' of a parameter of shape {tuple(p.shape)}", value)
            state[p] = {
                k: v.detach().to(device=p.device, copy=True) if isinstance(v, Tensor) else copy.deepcopy(v)
                for k, v in values.items()
            }
        groups = []
        for group, saved in zip(self.param_groups, saved_groups):
            device = self._group_device(group)
            # Options the saved groups lack (a torch.optim state_dict has no skip_zeros, ...) keep this
            # optimizer's values; everything saved wins, as in torch.
            new = {k: v for k, v in group.items() if k != "params"}
            for k, v in saved.items():
                if isinstance(v, Tensor):
                    require_readable(owner, f"the saved param group's '{k}'", v)
            new.update({
                k: v.detach().to(device=device, copy=True) if isinstance(v, Tensor) else copy.deepcopy(v)
                for k, v in saved.items()
                if k != "params"
            })
            new["params"] = group["params"]
            new["lr"] = _lr_tensor(new["lr"], device)
            # How states are stored is this optimizer's choice, not a hyperparameter: a checkpoint of the
            # other kind is converted to it (_conform_loaded_state), never the optimizer to the checkpoint.
            for key in _STORAGE_OPTIONS:
                new[key] = group[key]
            self._check_group(new)  # the saved hyperparameters too: refused now, not at the next step
            groups.append(new)
        before = {"state": self.state, "param_groups": self.param_groups}
        self.__setstate__({"state": state, "param_groups": groups})
        try:
            self._conform_loaded_state()
        except Exception:
            self.__setstate__(before)  # a rejected checkpoint leaves the optimizer as it was
            raise

    def _conform_loaded_state(self) -> None:
        """The core writes states through raw addresses, so every loaded state is brought into the form
        the kernels expect (see _state_of): fp32, bf16 or 8-bit as this optimizer keeps that parameter (a state
        of another kind is converted; torch's bf16/fp16 states are widened to fp32 or kept in bf16), contiguous,
        the parameter's shape, on its device; step a 0-d fp32 tensor there."""
        for group in self.param_groups:
            names = self._state_names(group)
            for p in group["params"]:
                if self.state.get(p):
                    self._state_of(group, p, names, self._bits_of(group, p), loading=True)


# The step through torch's wrapper (GraphsafeOptimizer.step says when): the profiler range
# "Optimizer.step#<class>.step" and the step hooks, exactly as torch runs them around any optimizer's step.
_step_with_torch_wrapper = torch.optim.Optimizer.profile_hook_step(GraphsafeOptimizer._unwrapped_step)
# The code of every function profile_hook_step makes: a class whose step it is was wrapped by torch.
_TORCH_WRAPPER_CODE = _step_with_torch_wrapper.__code__
# What inspect.signature shows for step: the closure argument, not (*args, **kwargs).
GraphsafeOptimizer.step.__signature__ = inspect.signature(GraphsafeOptimizer._unwrapped_step)


def _all_on(device: torch.device, tensors: list[Tensor]) -> bool:
    """Whether all tensors are on `device`. On CUDA by their device index (Tensor.get_device, an int: reading
    Tensor.device makes a torch.device per tensor, the dearest check of an at-once step, this CPU: 162 against 68
    ns): CPU and meta tensors give -1, never a CUDA index; on the CPU by Tensor.is_cpu. Not told apart: another
    indexed device type with the same index (an out-of-tree backend in the same process)."""
    if device.type == "cuda":
        return set(map(Tensor.get_device, tensors)) == {device.index}
    if device.type == "cpu":  # a bool per tensor (meta tensors, also -1 by get_device, are not CPU's)
        return all(map(_is_cpu, tensors))
    return set(map(_device_of, tensors)) == {device}


class _ParamsSeen:
    """A param group's parameters with a gradient as _params_checked_once read them (all contiguous, on `device`),
    and what later steps reuse while they stay as read: the gradients' guard (_grads_fit) and the state dicts
    looked up (_states_looked_up)."""

    __slots__ = ("params", "ptrs", "device", "dtypes", "shapes", "numels", "guard", "grad_guard", "states",
                 "kinds_by_storage")

    def __init__(self, params: list[Tensor], ptrs: list[int], device: torch.device) -> None:
        self.params, self.ptrs, self.device = list(params), ptrs, device
        self.dtypes = list(map(_dtype_of, params))
        self.shapes = list(map(_shape_of, params))
        self.numels = list(map(Tensor.numel, params))
        self.guard = _tensor_guard(params)
        self.grad_guard = None  # alike the gradients last found to fit
        self.states: tuple[Any, int, list[dict[str, Any]]] | None = None  # (mapping, its count, the state dicts)
        self.kinds_by_storage: dict[tuple[Any, Any], list[tuple[tuple[torch.dtype, int], list[int]]]] = {}

    def kinds(self, state_bits: int, min_8bit_size: int) -> list[tuple[tuple[torch.dtype, int], list[int]]]:
        """The parameters' kinds, (dtype, storage bits), in the order they first appear, each with the positions of
        its parameters: what one core call takes. Worked out once per storage option values (valid ones,
        _check_storage_options): they depend on nothing else but the dtypes and element counts read here. (A
        Python loop over the parameters, about 1 us each, where a group mixes kinds.)"""
        key = (state_bits, min_8bit_size)
        kinds = self.kinds_by_storage.get(key)
        if kinds is None:
            positions: dict[tuple[torch.dtype, int], list[int]] = {}
            for i, (dtype, numel) in enumerate(zip(self.dtypes, self.numels)):
                positions.setdefault((dtype, _storage_bits(state_bits, min_8bit_size, numel)), []).append(i)
            kinds = self.kinds_by_storage[key] = list(positions.items())
        return kinds

    def still_holds(self, params: list[Tensor]) -> bool:
        """Whether params (these parameters, at the same addresses) still have the dtypes, shapes and contiguity
        read, and the device (only through the guard: without one, the address stands for it)."""
        if self.guard is not None:
            return self.guard.check(*params)
        return self.same_form(params)

    def same_form(self, tensors: list[Tensor]) -> bool:
        """Whether tensors (strided ones, one per parameter) have the parameters' dtypes and shapes and are
        contiguous, read through map list by list."""
        return (list(map(_dtype_of, tensors)) == self.dtypes  # dtypes are singletons: compared by identity
                and list(map(_shape_of, tensors)) == self.shapes and all(map(Tensor.is_contiguous, tensors)))


def _grads_fit(seen: _ParamsSeen, grads: list[Tensor]) -> bool:
    """Whether every gradient is strided, contiguous and of its parameter's dtype, shape and device (seen: the
    parameters, as read). Read through map, list by list, unless the gradients are alike the ones last found to fit
    (seen.grad_guard, one call): a training loop's gradients are new tensors at every step, but alike."""
    guard = seen.grad_guard
    if guard is not None and guard.check(*grads):
        return True
    if not (_all_on(seen.device, grads) and set(map(_layout_of, grads)) == _STRIDED and seen.same_form(grads)):
        return False
    seen.grad_guard = _tensor_guard(grads)
    return True


def _tensor_guard(tensors: list[Tensor]) -> Any:
    """A check that other tensors are alike these, in one call: guard.check(*others) is True only if each is of the
    same Python type, device (type and index), layout, dtype, shape, strides (so as contiguous) and requires_grad
    as its counterpart here, whatever its address; the others must be as many, and distinct objects (False
    otherwise). torch's TensorGuards, which torch.compile made to check its inputs at every call, in C++: this CPU,
    about 100 ns a tensor, against 70-170 ns for each of those properties read through map. None where this
    torch has no TensorGuards or one that fails _tensor_guards_serve; the caller then reads the properties.

    TensorGuards ends the process on a strided nested tensor (its strides throw in C++); none reaches a guard: one
    is made only of tensors whose shapes were read (a nested tensor's raise), checks only tensors that are these
    very parameters (after the identity test) or gradients (a dense parameter's cannot be nested: the grad
    setter and autograd refuse), and a tensor cannot become nested in place (set_data refuses)."""
    # Strided tensors only: building a guard of a sparse CSR/BSR tensor also ends the process (its strides throw).
    # The callers pass none today; this check keeps that from resting on their order of checks.
    if not _TENSOR_GUARDS_SERVE or set(map(_layout_of, tensors)) != _STRIDED:
        return None
    try:
        return _TensorGuards(*tensors, dynamic_dims_sizes=None, dynamic_dims_strides=None)
    except Exception:  # (a guard only saves reads: never a reason for a step to fail)
        return None


def _tensor_guards_serve() -> bool:
    """Whether this torch's TensorGuards takes _tensor_guard's arguments and tells apart everything _tensor_guard
    says it does (a private torch API: checked once, at import, on tiny CPU tensors, rather than trusted)."""
    if _TensorGuards is None:
        return False
    try:
        def zeros(*shape: int, **kwargs: Any) -> Tensor:  # (whatever default dtype and device were set)
            return torch.zeros(*shape, **{"dtype": torch.float32, "device": "cpu", **kwargs})

        def alike() -> list[Tensor]:
            return [zeros(2, 3), torch.nn.Parameter(zeros(2, 2))]

        guard = _TensorGuards(*alike(), dynamic_dims_sizes=None, dynamic_dims_strides=None)
        param = torch.nn.Parameter(zeros(2, 2))
        others = [
            [zeros(2, 3, dtype=torch.float64), param],  # dtype
            [zeros(3, 2), param],  # shape, the same numel
            [zeros(3, 2).t(), param],  # strides: not contiguous
            [zeros(2, 3), torch.nn.Parameter(zeros(2, 2).t())],  # transposed, the same shape
            [zeros(2, 3).to_sparse(), param],  # layout
            [zeros(2, 3, device="meta"), param],  # device
            [zeros(2, 3), zeros(2, 2)],  # Python type
        ]
        return guard.check(*alike()) is True and not any(guard.check(*other) for other in others)
    except Exception:  # another signature, or anything else: not used
        return False


_TENSOR_GUARDS_SERVE = _tensor_guards_serve()  # (at import: no tracing or dispatch mode around it)


def _check_storage_options(state_bits: Any, block_size: Any, min_8bit_size: Any) -> None:
    """The group options that say how states are stored (checked at construction and at every step, since a
    param group can be edited in between)."""
    if state_bits not in (32, 16, 8) or isinstance(state_bits, bool):
        raise ValueError(f"state_bits must be 32, 16 or 8, got {state_bits!r}")
    ops.check_block_size(block_size)
    if not isinstance(min_8bit_size, int) or isinstance(min_8bit_size, bool) or min_8bit_size < 0:
        raise ValueError(f"min_8bit_size must be an int >= 0, got {min_8bit_size!r}")


def _storage_bits(state_bits: int, min_8bit_size: int, numel: int) -> int:
    """How a parameter of numel elements keeps its states under a group's state_bits: 8-bit codes from
    min_8bit_size elements (fp32 below), bf16 for every parameter under 16, fp32 under 32."""
    if state_bits == 8:
        return 8 if numel >= min_8bit_size else 32
    return int(state_bits)  # (32.0 is accepted as 32: the core takes an int)


# The dtype of the states that are not quantised, per storage bits; and the other one, whose states a step
# converts (state_bits changed between 32 and 16; any other dtype is a state replaced by hand: rejected).
_UNQUANTIZED_STATE_DTYPES = {32: torch.float32, 16: torch.bfloat16}
_OTHER_UNQUANTIZED = {32: torch.bfloat16, 16: torch.float32}


def _state_keys(names: list[str], bits: int) -> list[str]:
    """The state entries the core writes through raw addresses: per name the state (fp32, bf16) or the 8-bit
    codes, the 8-bit absmax, and the step."""
    return names + ([f"{n}_absmax" for n in names] if bits == 8 else []) + ["step"]


def _state_entry_count(names: list[str], bits: int) -> int:
    """How many entries a parameter's state holds in the form `bits` needs: step (+ block_size for 8 bits), and
    per name the state (+ its absmax and map for 8 bits)."""
    return 3 * len(names) + 2 if bits == 8 else len(names) + 1


def _in_step_form(state: dict[str, Any], names: list[str], bits: int, block_size: int) -> bool:
    """Whether a parameter's state holds the entries a step with this storage reads, or must be made or converted
    first (_state_of): missing, another storage (8-bit entries or block size, or the other unquantised dtype:
    state_bits changed between 32 and 16). Entries of the right names in any other form are the state check's
    to reject (_check_state_tensors)."""
    if len(state) != _state_entry_count(names, bits) or not all(key in state for key in _state_keys(names, bits)):
        return False
    if bits == 8:
        return state.get("block_size") == block_size
    return not any(getattr(state[name], "dtype", None) is _OTHER_UNQUANTIZED[bits] for name in names)


def _state_forms(p: Tensor, names: list[str], bits: int, block_size: int) -> list[tuple[str, torch.dtype, tuple]]:
    """Each state entry the core writes through its raw address (_state_keys' order) with the form the kernels
    read it in: (key, dtype, shape), contiguous on p's device."""
    blocks = (p.numel() + block_size - 1) // block_size

    def form(key: str) -> tuple[torch.dtype, tuple]:
        if key == "step":
            return torch.float32, ()
        if key in names:
            return (torch.uint8 if bits == 8 else _UNQUANTIZED_STATE_DTYPES[bits]), tuple(p.shape)
        return torch.float32, (blocks,)  # an 8-bit state's absmax

    return [(key, *form(key)) for key in _state_keys(names, bits)]


def _has_form(t: Any, dtype: torch.dtype, shape: tuple, device: torch.device) -> bool:
    """Whether t is a tensor the core can read (see _tensor_checks) of this dtype, shape and device, contiguous."""
    return unreadable_reason(t) is None and t.dtype is dtype \
        and tuple(t.shape) == shape and t.device == device and t.is_contiguous()


def _check_state_dict_structure(owner: str, state_dict: Any) -> None:
    """TypeError unless state_dict has the shape of an optimizer's: a dict with a 'state' dict and a
    'param_groups' list of dicts, each with its 'params' list (what load_state_dict reads before anything else)."""
    expected = "a state_dict: a dict with 'state' (a dict) and 'param_groups' (a list of dicts with 'params')"
    if not isinstance(state_dict, dict):
        raise TypeError(f"{owner}: expected {expected}, got {type(state_dict).__name__}")
    for key in ("state", "param_groups"):
        if key not in state_dict:
            raise ValueError(f"{owner}: the state_dict has no '{key}' (it has {sorted(map(str, state_dict))}); "
                             f"expected {expected}")
    if not isinstance(state_dict["state"], dict) or not isinstance(state_dict["param_groups"], (list, tuple)):
        raise TypeError(f"{owner}: expected {expected}, got 'state' a {type(state_dict['state']).__name__} and "
                        f"'param_groups' a {type(state_dict['param_groups']).__name__}")
    for group in state_dict["param_groups"]:
        if not isinstance(group, dict):
            raise TypeError(f"{owner}: a saved param group must be a dict, got {type(group).__name__}")
        if not isinstance(group.get("params"), (list, tuple)):
            raise ValueError(f"{owner}: a saved param group has no 'params' list (it has {sorted(map(str, group))})")


def _check_loaded_step(owner: str, step: Any) -> None:
    """ValueError/TypeError unless a loaded step count is a number or a one-element real tensor, finite and >= 0."""
    if isinstance(step, Tensor):
        require_readable(owner, "the saved state 'step'", step)
        if step.numel() != 1 or step.is_complex() or step.dtype == torch.bool:
            raise ValueError(f"{owner}: the saved state 'step' must be a number or a one-element real tensor, got a "
                             f"{_dtype_text(step.dtype)} tensor of shape {tuple(step.shape)}")
        value = float(step.detach().to("cpu", torch.float64))
    elif isinstance(step, (int, float)) and not isinstance(step, bool):
        value = float(step)
    else:
        raise TypeError(f"{owner}: the saved state 'step' must be a number or a one-element tensor, got "
                        f"{type(step).__name__} {step!r}")
    if not (math.isfinite(value) and value >= 0.0):
        raise ValueError(f"{owner}: the saved state 'step' must be finite and >= 0, got {value}")


def _check_state_tensors(owner: str, p: Tensor, state: dict[str, Any], names: list[str], bits: int,
                         block_size: int) -> None:
    """Raises ValueError unless every state tensor the core writes through its raw address has the form the
    kernels read: a state replaced by hand with another dtype, size or device would be read and written out
    of bounds (load_state_dict converts any form; _state_of makes these)."""
    for key, dtype, shape in _state_forms(p, names, bits, block_size):
        t = state[key]
        if not _has_form(t, dtype, shape, p.device):
            got = unreadable_reason(t) or (
                f"a {'contiguous' if t.is_contiguous() else 'non-contiguous'} {_dtype_text(t.dtype)} tensor of shape "
                f"{tuple(t.shape)} on {t.device}")
            raise ValueError(
                f"{owner}: state '{key}' of a parameter of shape {tuple(p.shape)} is {got}; the step writes it in "
                f"place as a contiguous {_dtype_text(dtype)} tensor of shape {shape} on {p.device} (a state "
                f"replaced by hand must keep that form; load_state_dict converts any)")


def _core_call(param_ptrs: list[int], grad_ptrs: list[int], key_ptrs: list[list[int]], state_count: int,
               numels: list[int]) -> tuple:
    """One core call's addresses and sizes, as _issuer passes them: key_ptrs holds per _state_keys entry the
    addresses over the tensors (states, then 8-bit absmax, then steps); the core takes the states and absmax
    flat, state by state (state j of tensor t at j * count + t)."""
    return (param_ptrs, grad_ptrs, list(chain.from_iterable(key_ptrs[:state_count])),
            list(chain.from_iterable(key_ptrs[state_count:-1])), list(key_ptrs[-1]), numels)


def _holds_8bit(state: dict[str, Any], name: str, p: Tensor, block_size: int, signed: bool) -> bool:
    """Whether state already holds `name` as 8-bit codes the kernels can use as they are: this block size,
    graphsafe's map, on p's device, the right shapes (anything else is converted)."""
    forms = {key: (dtype, shape) for key, dtype, shape in _state_forms(p, [name], 8, block_size)}
    codes, absmax, qmap = state.get(name), state.get(f"{name}_absmax"), state.get(f"{name}_qmap")
    return (state.get("block_size") == block_size and _has_form(codes, *forms[name], p.device)
            and _has_form(absmax, *forms[f"{name}_absmax"], p.device) and isinstance(qmap, Tensor)
            and qmap.device == p.device and torch.equal(qmap.cpu(), ops.quantization_map(signed)))


def _state_as_fp32(state: dict[str, Any], name: str, p: Tensor, where: str) -> Tensor | None:
    """state[name] as an fp32 tensor of p's shape on p's device (8-bit codes dequantised with the saved map
    and block size), or None if absent."""
    value = state.get(name)
    if value is None:
        return None
    if not isinstance(value, Tensor):
        raise ValueError(f"{where}: state '{name}' is not a tensor")
    if not (value.is_floating_point() or value.dtype == torch.uint8):  # (uint8: 8-bit codes)
        raise ValueError(f"{where}: state '{name}' is a {_dtype_text(value.dtype)} tensor; optimizer states are "
                         "floating-point (or 8-bit codes, uint8, with their absmax and map)")
    absmax, qmap = state.get(f"{name}_absmax"), state.get(f"{name}_qmap")
    if value.dtype == torch.uint8:
        if not (isinstance(absmax, Tensor) and isinstance(qmap, Tensor)):
            raise ValueError(f"{where}: 8-bit state '{name}' has codes but not its '{name}_absmax' and '{name}_qmap'")
        block_size = state.get("block_size")
        if not isinstance(block_size, int) or block_size <= 0 or qmap.numel() != 256:
            raise ValueError(f"{where}: 8-bit state '{name}' needs its block_size and a 256-value map")
        if value.numel() != p.numel() or absmax.numel() != (p.numel() + block_size - 1) // block_size:
            raise ValueError(f"{where}: 8-bit state '{name}' does not fit its parameter of shape {tuple(p.shape)}")
        scales = absmax.detach().to(p.device, torch.float32).repeat_interleave(block_size)[: p.numel()]
        value = qmap.detach().to(p.device, torch.float32)[value.detach().to(p.device).reshape(-1).long()] * scales
        return value.reshape(p.shape).contiguous()
    if value.shape != p.shape:
        raise ValueError(f"{where}: state '{name}' has shape {tuple(value.shape)}, its parameter {tuple(p.shape)}")
    return value.detach().to(device=p.device, dtype=torch.float32).contiguous()
