"""GraphsafeOptimizer, the base class of graphsafe's optimizers: construction and its checks, the step (torch's
step wrapper left out while it has nothing to do), the general per-parameter gathering of a step, and the core
call, one per bucket of parameters (same device, dtype and state storage). Its parts live beside it:
_state_storage (the fp32, bf16 and 8-bit forms states are kept in, and their conversions), _fast_path (the cached
at-once gathering of a common-case step), _persistence (load_state_dict), _learning_rate (lr as a device tensor), _sparse (the row-sparse step).

Why lr and step are tensors: a step captured in a CUDA graph reads them from device memory on every
replay, so torch.optim.lr_scheduler schedulers (which fill_ a tensor lr in place) keep working, and no
value is ever read back to the host. Other hyperparameters (betas, eps, weight_decay, ...) are passed by
value: a captured graph keeps the values it was captured with.
"""

from __future__ import annotations

import functools
import inspect
from collections import defaultdict
from itertools import chain
from operator import is_, itemgetter
from typing import Any, Callable, Iterable

import torch
from torch import Tensor
from torch.autograd import _profiler_enabled
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

from .. import _C
from .._core_args import current_stream, dtype_name
from .._tensor_checks import require_readable, unreadable_reason
from ._fast_path import _FastPath, _shape_of
from ._learning_rate import _check_lr, _lr_tensor
from ._persistence import _Persistence
from ._sparse import _SparseStep
from ._shards import check_grad, check_param, local_of, shard_layouts, whole_tensor_norms
from ._state_storage import _StateMap, _StateStorage, _check_state_tensors, _check_storage_options, \
    _in_step_form, _state_keys, _storage_bits

_PARAM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# The algorithm table (include/graphsafe/optim_algorithms.h), as the bindings give it.
_ALGORITHMS: dict[str, dict[str, Any]] = _C.optim_algorithms()
# Per algorithm, its schedule values' names and, per state, how a new one starts ("zero" or "param").
_SCHEDULES = {name: tuple(spec["schedule"]) for name, spec in _ALGORITHMS.items()}
_STATE_INITS = {name: {state["name"]: state["init"] for state in spec["states"]} for name, spec in _ALGORITHMS.items()}
# Algorithms whose step needs scratch memory (per-chunk norms of LAMB and LARS, the schedule weights of one with a
# schedule); for the others the core's optim_workspace_bytes is 0 and is not asked (a test checks the two agree).
_NEEDS_WORKSPACE = frozenset(name for name, spec in _ALGORITHMS.items() if spec["layerwise"] or spec["schedule"])
_LAYERWISE = frozenset(name for name, spec in _ALGORITHMS.items() if spec["layerwise"])
# Algorithms with a state that cannot take every storage width (state_bits is checked against the table).
_STORAGE_LIMITED = frozenset(name for name, spec in _ALGORITHMS.items()
                             if any(len(state["storage_bits"]) < 3 for state in spec["states"]))
_DTYPE_NAMES = {dtype: dtype_name(dtype) for dtype in _PARAM_DTYPES}  # the core's names
# The module the step's core call goes through, under a name that is not an import's: CPython compiles a call
# through an imported module's name with many keyword arguments (optim_step's 19) into building a dict and
# unpacking it (CALL_FUNCTION_EX), a call through any other name into a vectorcall with the names
# (LOAD_METHOD, KW_NAMES), which costs the host about what a positional call does.
_core = _C


@functools.lru_cache(maxsize=256)
def _table_state_names(algorithm: str, options: tuple[tuple[str, float], ...]) -> tuple[str, ...]:
    """The table's state names for an algorithm under these options (sorted (name, value) pairs)."""
    return tuple(_C.optim_state_names(algorithm, dict(options)))


class GraphsafeOptimizer(_FastPath, _StateStorage, _Persistence, _SparseStep, torch.optim.Optimizer):
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
        """Names of the states the algorithm keeps per parameter under this group's options, in the core's order:
        the algorithm table's (include/graphsafe/optim_algorithms.h), read through the bindings."""
        return list(_table_state_names(self.algorithm, tuple(sorted(self._core_options(group).items()))))

    @property
    def _schedule_names(self) -> tuple[str, ...]:
        """The algorithm's per-parameter schedule values (the table's), kept in each parameter's state."""
        return _SCHEDULES[self.algorithm]

    def _initial_state(self, group: dict[str, Any], p: Tensor, name: str) -> Tensor:
        """A new state `name` of parameter p, in fp32: a copy of p where the table says the state starts as the
        parameter, else filled with _initial_state_value."""
        if _STATE_INITS[self.algorithm][name] == "param":
            return p.detach().to(torch.float32, copy=True)
        return torch.full_like(p, self._initial_state_value(group, name), dtype=torch.float32)

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
        self._check_state_bits(group)
        for p in group["params"]:
            check_param(type(self).__name__, p)  # a DTensor: its local shard is what the core updates
            p = local_of(p)
            require_readable(type(self).__name__, "a parameter", p)
            if p.dtype not in _PARAM_DTYPES:
                raise TypeError(f"{type(self).__name__}: parameters must be float32, float16 or bfloat16, got {p.dtype}")
            if p.device.type not in ("cpu", "cuda"):
                raise ValueError(f"{type(self).__name__}: parameters must be on cpu or cuda, got {p.device}")
            if not p.is_contiguous():
                raise ValueError(f"{type(self).__name__}: parameters must be contiguous (the step updates them in place)")

    def _check_state_bits(self, group: dict[str, Any]) -> None:
        """ValueError if a state of the algorithm cannot be stored at the group's state_bits (the table's storage
        widths)."""
        for state in _ALGORITHMS[self.algorithm]["states"]:
            if group["state_bits"] not in state["storage_bits"]:
                raise ValueError(
                    f"{type(self).__name__}: state_bits={group['state_bits']} is not supported: its state "
                    f"'{state['name']}' can be stored in {' or '.join(map(str, state['storage_bits']))} bits only")

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
        step hooks, which cost more host time than the rest of a small eager step (docs/optim.md, "torch's
        step wrapper"). This step is marked as wrapped already, so torch leaves it alone, and it takes
        torch's own wrapper whenever that has something to do: a step hook registered (the optimizer's or a
        global one) or the autograd profiler on. A subclass that overrides step is wrapped by torch as usual;
        its super().step() then runs no hooks a second time (the class's step is torch's wrapper: its code is
        that wrapper's). A step decorated with functools.wraps copies the mark and is not wrapped by torch:
        this step runs the hooks then. The arguments are passed on as given, so that hooks see what torch's
        would. Not seen without a hook: observers of torch's record_function ranges other than the autograd
        profiler of this thread (a standalone ExecutionTraceObserver); any step hook, even one that does
        nothing, makes every step take torch's wrapper."""
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
        # Every CPU group's lr is checked before anything of the step is prepared (a state made or converted)
        # or issued: a NaN or negative lr in any group refuses the whole step, changing nothing. Read in C++
        # from the tensor's memory, not through torch (it is host memory; a CUDA group's lr is never read on
        # the host: its kernels check it on the device).
        cpu_lrs = []
        for group in self.param_groups:
            lr = group["lr"]
            if type(lr) is not Tensor:
                _check_lr(lr)  # a number set by hand
            elif lr.is_cpu and lr.dtype is torch.float32 and lr.numel() == 1:
                cpu_lrs.append(lr.data_ptr())
        if cpu_lrs:
            _C.optim_check_learning_rates(cpu_lrs)
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
            memo["names"] = _C.optim_state_names(self.algorithm, options)
            memo["options"] = options
        _check_storage_options(group["state_bits"], group["block_size"], group["min_8bit_size"])
        if self.algorithm in _STORAGE_LIMITED:
            self._check_state_bits(group)
        if dtype not in _PARAM_DTYPES:  # a parameter's dtype changed after construction (p.data = ...)
            if dtype.is_complex:
                raise RuntimeError(f"{type(self).__name__} does not support complex parameters or gradients")
            raise TypeError(f"{type(self).__name__}: parameters must be float32, float16 or bfloat16, got {dtype}")
        return options, memo["names"]

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
        return _core_call(param_ptrs, list(map(Tensor.data_ptr, grads)), key_ptrs, len(names), numels,
                          len(self._schedule_names))

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
            _check_state_tensors(owner, p, state, names, kind[2], block_size, self._schedule_names)
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
        schedule = self._schedule_names
        keys: dict[int, list[Tensor]] = {}  # per kind, the parameters as the group holds them (DTensors: not local)
        for key, g in pairs:
            p = key  # what the core updates: the parameter, or a DTensor parameter's local shard (and gradient's)
            if type(key) is not Tensor and type(key) is not torch.nn.Parameter:
                check_param(type(self).__name__, key)
                check_grad(type(self).__name__, key, g)
                p, g = local_of(key), local_of(g)
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
            # (a DTensor's storage follows its whole size, so that every rank keeps the same state forms)
            bits = _storage_bits(state_bits, min_8bit_size, key.numel())
            state = all_states[key]
            if not _in_step_form(state, names, bits, block_size, schedule):
                state = self._state_of(group, key, names, bits)
            kind_params, kind_grads, kind_states, kind_numels = kinds.setdefault(bits, ([], [], [], []))
            keys.setdefault(bits, []).append(key)
            kind_params.append(p)
            kind_grads.append(g)
            kind_states.append(state)
            kind_numels.append(numel)
        calls = {}
        for bits, (kind_params, kind_grads, kind_states, kind_numels) in kinds.items():
            tensors = [list(map(itemgetter(key), kind_states)) for key in _state_keys(names, bits, schedule)]
            calls[bits] = self._kind_call(group, (device, dtype, bits), kind_params, kind_grads, kind_states,
                                          names, tensors, kind_numels, list(map(Tensor.data_ptr, kind_params)),
                                          list(map(_shape_of, kind_params)))
        # LAMB/LARS on shards: each call's per-tensor norms summed across the shards (_shards.py)
        layouts = {bits: shard_layouts(kind_keys) for bits, kind_keys in keys.items()} if self.algorithm in _LAYERWISE \
            else {}
        return self._issuer(group, device, dtype, options, calls, contiguous_copies,
                            {bits: layout for bits, layout in layouts.items() if layout is not None})

    def _issuer(self, group: dict[str, Any], device: torch.device, dtype: torch.dtype, options: dict[str, float],
                calls: dict[int, tuple], contiguous_copies: list[Tensor],
                shards: dict[int, list] | None = None) -> Callable[[], None]:
        """The function that issues a bucket's core calls ({state bits: (param, grad, state, absmax and step
        addresses, numels, schedule addresses)}, the state, absmax and schedule addresses value by value), once
        every bucket of the step has been checked. shards: for LAMB/LARS calls over sharded DTensor parameters,
        per state bits the parameters' layouts (_shards.shard_layouts): their whole-tensor norms are formed first
        (the core's per-shard norms, summed across the shards), then the step takes them."""
        lr = group["lr"]
        # The core reads one float32 at lr's address: a float set by hand, or a tensor of another dtype or
        # device, becomes a 0-d float32 tensor on the device again (eager steps only; a captured step, and
        # later fill_s of the tensor set by hand, do not see it).
        if not isinstance(lr, Tensor) or lr.device != device or lr.dtype is not torch.float32 or lr.numel() != 1:
            if not isinstance(lr, Tensor):
                _check_lr(lr)
            group["lr"] = lr = _lr_tensor(lr, device)
        finish_counter = self._finish_counter(device) if device.type == "cuda" else 0
        block_size = group["block_size"]

        def issue() -> None:
            stream = current_stream(device)
            for bits, call in calls.items():
                if not call[0]:
                    continue
                param_ptrs, grad_ptrs, state_ptrs, absmax_ptrs, step_ptrs, numels, schedule_ptrs = call
                workspace_bytes = (_C.optim_workspace_bytes(device.type, self.algorithm, options, numels)
                                   if self.algorithm in _NEEDS_WORKSPACE else 0)
                workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=device) if workspace_bytes else None
                workspace_ptr = workspace.data_ptr() if workspace is not None else 0
                norms = None
                if shards and bits in shards:  # the same arguments as the step's (the norms it will use)
                    partials = torch.empty((len(numels), 2), dtype=torch.float32, device=device)
                    _core.optim_layerwise_norms(
                        device_type=device.type, device_index=device.index or 0, stream=stream,
                        algorithm=self.algorithm, options=options, param_dtype=_DTYPE_NAMES[dtype], lr=lr.data_ptr(),
                        params=param_ptrs, grads=grad_ptrs, states=state_ptrs, absmax=absmax_ptrs, steps=step_ptrs,
                        numels=numels, workspace=workspace_ptr, workspace_bytes=workspace_bytes, increment_steps=True,
                        state_bits=bits, block_size=block_size, norms=partials.data_ptr())
                    norms = whole_tensor_norms(partials, shards[bits])
                _core.optim_step(
                    device_type=device.type, device_index=device.index or 0, stream=stream,
                    algorithm=self.algorithm, options=options, param_dtype=_DTYPE_NAMES[dtype], lr=lr.data_ptr(),
                    params=param_ptrs, grads=grad_ptrs, states=state_ptrs, absmax=absmax_ptrs, steps=step_ptrs,
                    numels=numels, workspace=workspace_ptr, workspace_bytes=workspace_bytes,
                    increment_steps=True,  # the core counts every step (on CUDA, see _finish_counter)
                    state_bits=bits, block_size=block_size, finish_counter=finish_counter, schedule=schedule_ptrs,
                    layerwise_norms=norms.data_ptr() if norms is not None else 0)
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


# The step through torch's wrapper (GraphsafeOptimizer.step says when): the profiler range
# "Optimizer.step#<class>.step" and the step hooks, exactly as torch runs them around any optimizer's step.
_step_with_torch_wrapper = torch.optim.Optimizer.profile_hook_step(GraphsafeOptimizer._unwrapped_step)
# The code of every function profile_hook_step makes: a class whose step it is was wrapped by torch.
_TORCH_WRAPPER_CODE = _step_with_torch_wrapper.__code__
# What inspect.signature shows for step: the closure argument, not (*args, **kwargs).
GraphsafeOptimizer.step.__signature__ = inspect.signature(GraphsafeOptimizer._unwrapped_step)


def _core_call(param_ptrs: list[int], grad_ptrs: list[int], key_ptrs: list[list[int]], state_count: int,
               numels: list[int], schedule_count: int) -> tuple:
    """One core call's addresses and sizes, as _issuer passes them: key_ptrs holds per _state_keys entry the
    addresses over the tensors (states, then 8-bit absmax, then schedule values, then steps); the core takes the
    states, absmax and schedule values flat, value by value (state j of tensor t at j * count + t)."""
    schedule_start = len(key_ptrs) - 1 - schedule_count
    return (param_ptrs, grad_ptrs, list(chain.from_iterable(key_ptrs[:state_count])),
            list(chain.from_iterable(key_ptrs[state_count:schedule_start])), list(key_ptrs[-1]), numels,
            list(chain.from_iterable(key_ptrs[schedule_start:-1])))
