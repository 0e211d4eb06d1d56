"""How a parameter's optimizer states are stored, checked and converted.

Each state is kept in one of three forms, chosen per parameter from its group's state_bits and min_8bit_size:
fp32 (32), bf16 (16), or 8-bit blockwise codes with one fp32 absmax per block and the 256-value map the codes
index (8). Beside them a parameter's state holds its step count (a 0-d fp32 tensor) and, for an algorithm with a
schedule (the table's per-tensor values, include/graphsafe/optim_algorithms.h), each schedule value (0-d
float64). The core writes states through their raw addresses, so a state must be exactly in its form (dtype,
shape, device, contiguous) before a step passes it; _StateStorage._state_of makes or converts it, and
_check_state_tensors refuses one replaced by hand in another form. The optimizer's state mapping itself is a
_StateMap, which counts its changes so that the cached at-once path knows when to look states up again.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import torch
from torch import Tensor

from .. import _C, ops
from .._core_args import dtype_name
from .._tensor_checks import require_readable, unreadable_reason
from ._shards import local_of


class _StateMap(defaultdict):
    """The optimizer's `state` (parameter -> its state dict), a defaultdict(dict) that counts the changes made to
    it. An eager step looks its parameters' state dicts up once and reuses that list while the mapping is the same
    object at the same count and the parameters are the same objects (_states_looked_up): a look-up costs a
    Tensor.__hash__, a Python function (the dearest read of an at-once step).
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


def _state_keys(names: list[str], bits: int, schedule: tuple[str, ...] = ()) -> list[str]:
    """The state entries the core writes through raw addresses: per name the state (fp32, bf16) or the 8-bit
    codes, the 8-bit absmax, the schedule values, and the step."""
    return names + ([f"{n}_absmax" for n in names] if bits == 8 else []) + list(schedule) + ["step"]


def _state_entry_count(names: list[str], bits: int, schedule: tuple[str, ...] = ()) -> int:
    """How many entries a parameter's state holds in the form `bits` needs: step (+ block_size for 8 bits), the
    schedule values, and per name the state (+ its absmax and map for 8 bits)."""
    return (3 * len(names) + 2 if bits == 8 else len(names) + 1) + len(schedule)


def _in_step_form(state: dict[str, Any], names: list[str], bits: int, block_size: int,
                  schedule: tuple[str, ...] = ()) -> bool:
    """Whether a parameter's state holds the entries a step with this storage reads, or must be made or converted
    first (_state_of): missing, another storage (8-bit entries or block size, or the other unquantised dtype:
    state_bits changed between 32 and 16). Entries of the right names in any other form are the state check's
    to reject (_check_state_tensors)."""
    if len(state) != _state_entry_count(names, bits, schedule) or not all(
            key in state for key in _state_keys(names, bits, schedule)):
        return False
    if bits == 8:
        return state.get("block_size") == block_size
    return not any(getattr(state[name], "dtype", None) is _OTHER_UNQUANTIZED[bits] for name in names)


def _state_forms(p: Tensor, names: list[str], bits: int, block_size: int,
                 schedule: tuple[str, ...] = ()) -> list[tuple[str, torch.dtype, tuple]]:
    """Each state entry the core writes through its raw address (_state_keys' order) with the form the kernels
    read it in: (key, dtype, shape), contiguous on p's device."""
    blocks = (p.numel() + block_size - 1) // block_size

    def form(key: str) -> tuple[torch.dtype, tuple]:
        if key == "step":
            return torch.float32, ()
        if key in schedule:
            return torch.float64, ()
        if key in names:
            return (torch.uint8 if bits == 8 else _UNQUANTIZED_STATE_DTYPES[bits]), tuple(p.shape)
        return torch.float32, (blocks,)  # an 8-bit state's absmax

    return [(key, *form(key)) for key in _state_keys(names, bits, schedule)]


def _has_form(t: Any, dtype: torch.dtype, shape: tuple, device: torch.device) -> bool:
    """Whether t is a tensor the core can read (see _tensor_checks) of this dtype, shape and device, contiguous."""
    return unreadable_reason(t) is None and t.dtype is dtype \
        and tuple(t.shape) == shape and t.device == device and t.is_contiguous()


def _check_loaded_number(owner: str, step: Any, key: str = "step") -> None:
    """ValueError/TypeError unless a loaded step count (or schedule value, `key`) is a number or a one-element real
    tensor, finite and >= 0."""
    if isinstance(step, Tensor):
        require_readable(owner, f"the saved state '{key}'", step)
        if step.numel() != 1 or step.is_complex() or step.dtype == torch.bool:
            raise ValueError(f"{owner}: the saved state '{key}' must be a number or a one-element real tensor, got a "
                             f"{dtype_name(step.dtype)} tensor of shape {tuple(step.shape)}")
        value = float(step.detach().to("cpu", torch.float64))
    elif isinstance(step, (int, float)) and not isinstance(step, bool):
        value = float(step)
    else:
        raise TypeError(f"{owner}: the saved state '{key}' must be a number or a one-element tensor, got "
                        f"{type(step).__name__} {step!r}")
    if not (math.isfinite(value) and value >= 0.0):
        raise ValueError(f"{owner}: the saved state '{key}' must be finite and >= 0, got {value}")


def _check_state_tensors(owner: str, p: Tensor, state: dict[str, Any], names: list[str], bits: int,
                         block_size: int, schedule: tuple[str, ...] = ()) -> None:
    """Raises ValueError unless every state tensor the core writes through its raw address has the form the
    kernels read: a state replaced by hand with another dtype, size or device would be read and written out
    of bounds (load_state_dict converts any form; _state_of makes these)."""
    for key, dtype, shape in _state_forms(p, names, bits, block_size, schedule):
        t = state[key]
        if not _has_form(t, dtype, shape, p.device):
            got = unreadable_reason(t) or (
                f"a {'contiguous' if t.is_contiguous() else 'non-contiguous'} {dtype_name(t.dtype)} tensor of shape "
                f"{tuple(t.shape)} on {t.device}")
            raise ValueError(
                f"{owner}: state '{key}' of a parameter of shape {tuple(p.shape)} is {got}; the step writes it in "
                f"place as a contiguous {dtype_name(dtype)} tensor of shape {shape} on {p.device} (a state "
                f"replaced by hand must keep that form; load_state_dict converts any)")


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
        raise ValueError(f"{where}: state '{name}' is a {dtype_name(value.dtype)} tensor; optimizer states are "
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


class _StateStorage:
    """GraphsafeOptimizer's part that makes each parameter's state in the form its step needs. Reads the
    optimizer's state, algorithm, _schedule_names, _core_options, _initial_state and _step_of_loaded_state."""

    def _bits_of(self, group: dict[str, Any], p: Tensor) -> int:
        """How p's states are stored (32, 16 or 8 bits; _storage_bits)."""
        return _storage_bits(group["state_bits"], group["min_8bit_size"], p.numel())

    def _state_of(self, group: dict[str, Any], p: Tensor, names: list[str], bits: int,
                  loading: bool = False) -> dict[str, Any]:
        """p's state in the form the core needs, created on its first step and converted when the form
        changed (a state_dict of the other kind was loaded, or state_bits / block_size was changed).

        fp32 form (bits 32): 'step' and one fp32 tensor per name; bf16 form (16): the same in bf16. 8-bit form:
        'step', 'block_size' and per name the codes (uint8, p's shape), '<name>_absmax' (fp32, one per block)
        and '<name>_qmap' (the 256-value map the codes index). Every form: the schedule values, 0-d float64
        tensors (0 on the first step). A state an option turns on later (e.g. SGD momentum set after the first
        step) starts from its initial value (_initial_state; torch's SGD would start the buffer as a copy of the
        gradient, which differs only when dampening != 0). A loaded state (loading=True) that lacks one of its
        algorithm's states or schedule values is an incomplete checkpoint: ValueError, instead of a silent
        restart."""
        state = self.state[p]
        p = local_of(p)  # a DTensor parameter's states are its local shard's (_shards.py)
        owner = f"{type(self).__name__}.load_state_dict"
        if loading:
            if "step" not in state:
                state["step"] = self._step_of_loaded_state(state)
            _check_loaded_number(owner, state["step"])
            for key in self._schedule_names:
                if key not in state:
                    raise ValueError(f"{owner}: the saved state of a parameter of shape {tuple(p.shape)} has no "
                                     f"'{key}' (it has {sorted(state)}); {type(self).__name__} keeps "
                                     f"{list(self._schedule_names)} beside its states")
                _check_loaded_number(owner, state[key], key)
        for key, dtype in (("step", torch.float32),) + tuple((key, torch.float64) for key in self._schedule_names):
            value = state.get(key, 0.0)
            if not _has_form(value, dtype, (), p.device):
                state[key] = torch.as_tensor(value, dtype=dtype).detach().to(p.device).reshape(()).clone()
        block_size = group["block_size"]
        options = self._core_options(group)
        updates: dict[str, dict[str, Tensor]] = {}
        unquantized = _UNQUANTIZED_STATE_DTYPES.get(bits)
        for j, name in enumerate(names):
            signed = _C.optim_state_is_signed(self.algorithm, options, j)
            if (_holds_8bit(state, name, p, block_size, signed) if bits == 8
                    else _has_form(state.get(name), unquantized, tuple(p.shape), p.device)):
                continue  # kept as it is (its raw bits, NaN payloads included)
            where = owner if loading else f"{type(self).__name__} step"
            value = _state_as_fp32(state, name, p, where)
            if value is None:
                if loading:
                    raise ValueError(
                        f"{type(self).__name__}.load_state_dict: the saved state of a parameter of shape {tuple(p.shape)} "
                        f"has no '{name}' (it has {sorted(state)}); {type(self).__name__} with the saved options keeps "
                        f"{names}")
                value = self._initial_state(group, p, name)
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
