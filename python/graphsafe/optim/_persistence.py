"""load_state_dict: a checkpoint of any graphsafe optimizer of the same algorithm (or a torch.optim one), checked
whole before anything changes, its states converted to this optimizer's storage."""

from __future__ import annotations

import copy
from collections import defaultdict
from typing import Any

from torch import Tensor

from .. import _C
from .._tensor_checks import require_readable
from ..distributed.shard_views import is_dtensor
from ._learning_rate import _lr_tensor
from ._shards import localized_state, shareable_state
from ._state_storage import _StateMap

# Group options that say how states are stored; load_state_dict keeps the loading optimizer's.
_STORAGE_OPTIONS = ("state_bits", "block_size", "min_8bit_size")


class _Persistence:
    """GraphsafeOptimizer's state_dict and its loading. Reads the optimizer's param_groups, state, algorithm,
    __setstate__, _group_device, _check_group, _state_names, _core_options, _bits_of and _state_of."""

    def state_dict(self) -> dict[str, Any]:
        """torch.optim.Optimizer.state_dict(); a DTensor parameter's element-wise states as DTensors of its layout
        (8-bit ones as their fp32 values: _shards.py), as torch.optim's are under FSDP2, so that
        torch.distributed.checkpoint saves every rank's shard."""
        state_dict = super().state_dict()
        index = 0
        for group in self.param_groups:
            for p in group["params"]:
                if is_dtensor(p) and index in state_dict["state"]:
                    state_dict["state"][index] = shareable_state(self, group, p, state_dict["state"][index])
                index += 1
        return state_dict

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
            if is_dtensor(p):  # to this rank's shard (DTensors of p's layout, or whole tensors)
                names = {s["name"] for s in _C.optim_algorithms()[self.algorithm]["states"]}
                values = localized_state(owner, p, values, names)
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
