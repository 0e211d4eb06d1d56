"""The cached at-once path of an eager step: a param group in the common case (parameters and gradients on one
device, strided and contiguous, states already in their form) is checked and gathered list by list, each check
over all parameters in C (map, or one TensorGuards call), and what stays the same between steps is read once
(_ParamsSeen, the gradients' guard, the state dicts looked up through _StateMap's count, and per kind of core
call the state tensors and their flattened addresses while no state dict changed: _StatesGathered). Anything else
returns None and takes GraphsafeOptimizer's general, per-parameter path, which issues the same core calls.
"""

from __future__ import annotations

from collections import defaultdict
from itertools import chain, compress, repeat
from operator import attrgetter, is_, is_not, itemgetter
from typing import Any, Callable

import torch
from torch import Tensor

from .. import _C
from ._state_storage import _UNQUANTIZED_STATE_DTYPES, _StateMap, _check_storage_options, _state_entry_count, \
    _state_keys, _storage_bits

try:  # what torch.compile checks its inputs' tensors with, in C++ (_tensor_guard)
    from torch._C._dynamo.guards import TensorGuards as _TensorGuards
except ImportError:
    _TensorGuards = None
try:  # a dict's version tag (PEP 509), what torch.compile's guards tell a changed dict by (_StatesGathered)
    from torch._C._dynamo.guards import dict_version as _dict_version
except ImportError:
    _dict_version = None
try:  # the C function compiled code reads a tensor's data_ptr() with, by its address (_tensor_address_reader)
    from torch._C._dynamo.guards import _torchinductor_pyobject_tensor_data_ptr as _data_ptr_function
except ImportError:
    _data_ptr_function = None

# What _prepare_group_at_once reads from every parameter, gradient and state (map calls these in C).
_grad_of, _dtype_of, _device_of = attrgetter("grad"), attrgetter("dtype"), attrgetter("device")
_layout_of, _shape_of = attrgetter("layout"), attrgetter("shape")
_block_size_of = itemgetter("block_size")
_PLAIN_TENSOR, _STRIDED = {Tensor}, {torch.strided}
_DICT_TYPES = {dict, defaultdict}
# For one parameter the per-parameter loop is cheaper: the at-once path's fixed cost (its caches' checks) is more
# than the per-parameter reads it saves (docs/optim.md gives the crossover).
_AT_ONCE_MIN_PARAMS = 2
_is_cpu = attrgetter("is_cpu")


class _FastPath:
    """GraphsafeOptimizer's at-once gathering of a step. Reads the optimizer's state and its _bucket_options,
    _group_memo, _kind_call and _issuer, which the general path shares."""

    def _prepare_group_at_once(self, group: dict[str, Any]) -> list[Callable[[], None]] | None:
        """The common case of a step, checked and gathered list by list instead of parameter by parameter
        (each check below runs over all parameters in C, through map or one TensorGuards call; the Python loop in
        _prepare_bucket costs more per parameter, and an eager step of many small tensors is bound
        by that cost). What stays as it was between steps is read once (_params_checked_once, _grads_fit,
        _states_looked_up, _StatesGathered, _check_states_once say when it is read again); at every step: each
        gradient, its form (in one call while alike the last step's) and address, the parameters' addresses and
        form, each state dict's version, and every state tensor the core writes, its address and (fp32, bf16)
        dtype; where a state dict changed (or torch has no usable dict_version), its entries and their
        identities too.

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
        param_ptrs = _addresses_of(params)
        seen = self._params_checked_once(group, params, param_ptrs)
        if seen is None or not _grads_fit(seen, grads):
            return None
        numels, shapes = seen.numels, seen.shapes
        states = self._states_looked_up(seen)
        # One core call per (dtype, storage bits), in the order the kinds first appear (8 bits from min_8bit_size
        # elements under state_bits=8, fp32 below).
        _check_storage_options(group["state_bits"], group["block_size"], group["min_8bit_size"])
        kinds = seen.kinds(group["state_bits"], group["min_8bit_size"])
        # What the kinds' state dicts were looked up as and split by (_StatesGathered): the same objects stand for
        # the same dicts in the same places. None where the state mapping is not a _StateMap (looked up anew).
        looked_up = seen.states
        source = (looked_up, kinds) if looked_up is not None and looked_up[2] is states and looked_up[3] else None
        columns = (params, grads, numels, param_ptrs, shapes, states)
        if len(kinds) == 1:
            buckets = {kinds[0][0]: columns}
        else:
            buckets = {kind: tuple(list(map(column.__getitem__, indices)) for column in columns)
                       for kind, indices in kinds}
        issues = []
        for (dtype, kind_bits), bucket in buckets.items():
            issue = self._prepare_kind_at_once(group, seen.device, dtype, kind_bits, *bucket, source)
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
            states = list(map(mapping.get, seen.params, repeat(())))
            # (whether each is a dict, the only type dict_version reads: _StatesGathered)
            looked_up = seen.states = (mapping, mapping.version, states, set(map(type, states)) <= _DICT_TYPES)
        return looked_up[2]

    def _prepare_kind_at_once(self, group: dict[str, Any], device: torch.device, dtype: torch.dtype, bits: int,
                              params: list[Tensor], grads: list[Tensor], numels: list[int], param_ptrs: list[int],
                              shapes: list[torch.Size], states: list[dict[str, Any]],
                              source: tuple[Any, Any] | None = None) -> Callable[[], None] | None:
        """_prepare_group_at_once's core call for the parameters of one dtype whose states are stored in `bits`
        (32, 16 or 8), or None if a state is not in the form the call needs (missing, or another form to
        convert). param_ptrs, shapes and states: the parameters' addresses, shapes and state dicts, as read
        already; source: what the state dicts were looked up as and split into kinds by (identities; None if
        they were looked up anew), which with each dict's version lets a step reuse the state tensors gathered
        at an earlier one (_StatesGathered)."""
        options, names = self._bucket_options(group, dtype)  # raises as the general path would
        kind = (device, dtype, bits)
        versions = None
        if source is not None and _DICT_VERSIONS_SERVE:
            versions = list(map(_dict_version, states))
            checked = self._group_memo("_checked_states", group)
            gathered = checked.get((kind, _StatesGathered))
            if gathered is not None and gathered.holds(source, versions, names, group["block_size"],
                                                       checked.get(kind)):
                call = gathered.call(param_ptrs, grads)
                if call is not None:
                    return self._issuer(group, device, dtype, options, {bits: call}, [])
        schedule = self._schedule_names
        if set(map(len, states)) != {_state_entry_count(names, bits, schedule)}:
            return None
        try:
            if bits == 8 and set(map(_block_size_of, states)) != {group["block_size"]}:
                return None
            # key by key (states, absmax, steps), as the core takes them
            tensors = [list(map(itemgetter(key), states)) for key in _state_keys(names, bits, schedule)]
            # At every step, not only where the state check runs: `.data = t.data.view(another dtype)` keeps a
            # state's object and address, which is all that check's cache compares.
            if bits != 8 and set(map(_dtype_of, chain.from_iterable(tensors[:len(names)]))) - {_UNQUANTIZED_STATE_DTYPES[bits]}:
                return None  # fp32 states under state_bits=16, or the other way round: convert (or the clear error)
        except KeyError:  # other state names with the same count (options changed): convert
            return None
        except AttributeError:  # a state replaced by hand with something else than a tensor: the clear error
            return None
        call = self._kind_call(group, kind, params, grads, states, names, tensors, numels, param_ptrs, shapes)
        if versions is not None:  # (checked by _kind_call: kept in the state check's memo, dropped with it)
            checked = self._group_memo("_checked_states", group)
            checked[(kind, _StatesGathered)] = _StatesGathered(source, versions, names, group["block_size"], bits,
                                                               tensors, call, checked.get(kind))
        return self._issuer(group, device, dtype, options, {bits: call}, [])


class _StatesGathered:
    """One kind's state tensors as an at-once step gathered and checked them (_kind_call), flattened, with the core
    call's address lists, for later steps to reuse while nothing they stand for changed:
      * the state dicts: the same dicts in the same places (source: the look-up and the split into kinds, by
        identity), each at the dict_version it had (a dict gets a new version at any change that puts another
        object in it or takes one out, made through Python or C); the group's block size and the state names;
      * per tensor its address (`.data = ...`, set_, a growing resize_ move it) and, for fp32 and bf16 states, its
        dtype (`.data = t.data.view(another dtype)` keeps object and address; the dtype says which states a step
        converts, as _prepare_kind_at_once reads it otherwise);
      * the state check's cache entry for the kind (_check_states_once), the one they were checked under.
    Those are the identities and addresses the state check's cache compares, so a reuse is a step that check
    skips too; they are read here as one list each (an address or a dtype per tensor, a version per dict), where
    the step otherwise reads every entry of every state dict and compares its identity. An 8-bit state is two
    tensors (codes and absmax) where an fp32 one is one, so this saved the 8-bit steps the most; the addresses are
    compared in C++ where torch's address reader serves (_C.TensorAddresses: a function call a tensor, where
    Tensor.data_ptr through map costs a Python call and an int), so that the 8-bit step's extra tensors cost it
    less than the dtypes of the fp32 and bf16 states, read in Python. Kept in the group's "_checked_states" memo,
    so that it is dropped with it when a step creates or converts states (it holds the tensors)."""

    __slots__ = ("source", "versions", "names", "block_size", "state_check", "tensors", "ptrs", "addresses",
                 "unquantized", "dtype", "lists")

    def __init__(self, source: tuple[Any, Any], versions: list[int], names: list[str], block_size: int, bits: int,
                 tensors: list[list[Tensor]], call: tuple, state_check: Any) -> None:
        self.source, self.versions, self.names, self.block_size = source, versions, list(names), block_size
        self.state_check = state_check
        self.tensors = list(chain.from_iterable(tensors))
        # (as _kind_call read them: nothing ran in between)
        if _TENSOR_ADDRESS_READER is not None:
            self.addresses, self.ptrs = _C.TensorAddresses(_TENSOR_ADDRESS_READER, self.tensors), None
        else:
            self.addresses, self.ptrs = None, list(map(Tensor.data_ptr, self.tensors))
        self.unquantized = None if bits == 8 else list(chain.from_iterable(tensors[:len(names)]))
        self.dtype = _UNQUANTIZED_STATE_DTYPES.get(bits)
        self.lists = call[2:]  # the state, absmax, step, numel and schedule lists, as the core call takes them

    def holds(self, source: tuple[Any, Any], versions: list[int], names: list[str], block_size: int,
              state_check: Any) -> bool:
        """Whether the state dicts are the ones gathered, unchanged, for the same state names and block size, and
        the state check's cache entry for the kind (state_check) is the one they were checked under."""
        return (source[0] is self.source[0] and source[1] is self.source[1] and versions == self.versions
                and names == self.names and block_size == self.block_size and state_check is self.state_check)

    def call(self, param_ptrs: list[int], grads: list[Tensor]) -> tuple | None:
        """The core call's lists with these parameter addresses and gradients, or None if a state tensor has
        moved or (fp32, bf16) changed dtype since it was gathered: the caller then gathers and checks anew."""
        if not (self.addresses.unchanged() if self.addresses is not None
                else list(map(Tensor.data_ptr, self.tensors)) == self.ptrs):
            return None
        if self.unquantized is not None and set(map(_dtype_of, self.unquantized)) - {self.dtype}:
            return None
        return (param_ptrs, _addresses_of(grads), *self.lists)


def _all_on(device: torch.device, tensors: list[Tensor]) -> bool:
    """Whether all tensors are on `device`. On CUDA by their device index (Tensor.get_device, an int: reading
    Tensor.device makes a torch.device per tensor, which made it the dearest check of an at-once step): CPU and
    meta tensors give -1, never a CUDA index; on the CPU by Tensor.is_cpu. Not told apart: another indexed device
    type with the same index (an out-of-tree backend in the same process)."""
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
        # (mapping, its count, the state dicts, whether all are dicts or defaultdicts)
        self.states: tuple[Any, int, list[dict[str, Any]], bool] | None = None
        self.kinds_by_storage: dict[tuple[Any, Any], list[tuple[tuple[torch.dtype, int], list[int]]]] = {}

    def kinds(self, state_bits: int, min_8bit_size: int) -> list[tuple[tuple[torch.dtype, int], list[int]]]:
        """The parameters' kinds, (dtype, storage bits), in the order they first appear, each with the positions of
        its parameters: what one core call takes. Worked out once per storage option values (valid ones,
        _check_storage_options): they depend on nothing else but the dtypes and element counts read here (working
        them out is a Python loop over the parameters, where a group mixes kinds)."""
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
    otherwise). torch's TensorGuards, which torch.compile made to check its inputs at every call, in C++: cheaper a
    tensor than reading any one of those properties through map (docs/optim.md). None where this
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


def _dict_versions_serve() -> bool:
    """Whether this torch's dict_version (a private API; PEP 509's tag, which later Pythons may keep no more) gives
    a dict a new value at every change that can put another object in it or take one out, made through Python or
    C (dict.__setitem__ on the base class): checked once, at import."""
    if _dict_version is None:
        return False
    try:
        d: dict[Any, Any] = {"a": object(), "b": object()}
        changes = [
            lambda: d.__setitem__("a", object()),  # replaced
            lambda: d.__setitem__("c", object()),  # added
            lambda: dict.__setitem__(d, "c", object()),
            lambda: d.__delitem__("c"),
            lambda: d.pop("b"),
            lambda: d.setdefault("b", object()),
            lambda: d.update(b=object()),
            lambda: d.__ior__({"a": object()}),
            lambda: d.popitem(),
            lambda: d.clear(),
        ]
        versions = [_dict_version(d)]
        for change in changes:
            change()
            versions.append(_dict_version(d))
        return all(type(v) is int for v in versions) and len(set(versions)) == len(versions)
    except Exception:  # another signature, or anything else: not used
        return False


_DICT_VERSIONS_SERVE = _dict_versions_serve()


def _tensor_address_reader() -> int | None:
    """The address of the C function with which torch's compiled code reads Tensor.data_ptr() from a tensor's
    Python object (a private torch API: checked once, at import, on tiny CPU tensors, rather than trusted), for
    _C.TensorAddresses and _C.tensor_addresses to read addresses through; None where it does not serve (then
    Tensor.data_ptr is read through map)."""
    if type(_data_ptr_function) is not int or not hasattr(_C, "TensorAddresses"):
        return None
    try:
        def zeros(n: int, dtype: torch.dtype = torch.float32) -> Tensor:  # (whatever default device was set)
            return torch.zeros(n, dtype=dtype, device="cpu")

        tensors = [zeros(4), zeros(8, torch.uint8)[3:], torch.nn.Parameter(zeros(2)), zeros(0)]
        if _C.tensor_addresses(_data_ptr_function, tensors) != list(map(Tensor.data_ptr, tensors)):
            return None
        watched = _C.TensorAddresses(_data_ptr_function, tensors)
        if watched.addresses != list(map(Tensor.data_ptr, tensors)) or not watched.unchanged():
            return None
        tensors[1].data = zeros(5, torch.uint8)  # moved: `.data = ...`
        if watched.unchanged():
            return None
        watched = _C.TensorAddresses(_data_ptr_function, tensors)
        tensors[0].set_(zeros(4).untyped_storage())  # moved: set_
        return _data_ptr_function if not watched.unchanged() else None
    except Exception:  # another signature, or anything else: not used
        return None


_TENSOR_ADDRESS_READER = _tensor_address_reader()


def _addresses_of(tensors: list[Tensor]) -> list[int]:
    """Each tensor's data_ptr(), in order: read in C++ where torch's reader serves; where it refuses a tensor (one
    without storage), through Tensor.data_ptr, which then raises torch's own error."""
    if _TENSOR_ADDRESS_READER is not None:
        try:
            return _C.tensor_addresses(_TENSOR_ADDRESS_READER, tensors)
        except ValueError:
            pass
    return list(map(Tensor.data_ptr, tensors))
