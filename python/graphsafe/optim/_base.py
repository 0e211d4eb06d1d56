"""The shared machinery of graphsafe's optimizers: device-resident lr and step, one core call per bucket
of parameters (same device and dtype), fp32 states, state_dict round trips.

Why lr and step are tensors: a step captured in a CUDA graph reads them from device memory on every
replay, so torch.optim.lr_scheduler schedulers (which fill_ a tensor lr in place) keep working, and no
value is ever read back to the host. Other hyperparameters (betas, eps, weight_decay, ...) are passed by
value: a captured graph keeps the values it was captured with.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from typing import Any, Callable, Iterable

import torch
from torch import Tensor

from .. import _C

_PARAM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Algorithms whose step needs scratch memory (per-chunk norms of LAMB and LARS); for the others the core's
# optim_workspace_bytes is 0 and is not asked (a test checks the two agree).
_NEEDS_WORKSPACE = frozenset({"lamb", "lars"})


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _lr_tensor(lr: float | Tensor, device: torch.device) -> Tensor:
    if isinstance(lr, Tensor):
        if lr.numel() != 1:
            raise ValueError(f"lr must be a number or a one-element tensor, got a tensor of shape {tuple(lr.shape)}")
        return lr.detach().to(device=device, dtype=torch.float32, copy=True).reshape(())
    return torch.tensor(float(lr), dtype=torch.float32, device=device)


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
    ) -> None:
        if state_bits == 8:
            raise NotImplementedError("state_bits=8 (8-bit blockwise states) is not available yet; use state_bits=32")
        if state_bits != 32:
            raise ValueError(f"state_bits must be 32 or 8, got {state_bits}")
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        lr = defaults["lr"]
        if isinstance(lr, Tensor) and lr.numel() != 1:
            raise ValueError("lr must be a number or a one-element tensor")
        if (float(lr) if not isinstance(lr, Tensor) else float(lr.detach().cpu())) < 0.0:
            raise ValueError(f"Invalid learning rate: {float(lr)}")
        defaults = dict(defaults, skip_zeros=bool(skip_zeros), state_bits=state_bits, block_size=block_size)
        super().__init__(params, defaults)
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
        """Names of the fp32 states the algorithm keeps per parameter, in the core's order."""
        raise NotImplementedError

    def _initial_state_value(self, group: dict[str, Any], name: str) -> float:
        return 0.0

    # ---- checks ----

    def _check_group(self, group: dict[str, Any]) -> None:
        if isinstance(group["lr"], Tensor):
            if group["lr"].numel() != 1:
                raise ValueError("lr must be a number or a one-element tensor")
        elif float(group["lr"]) < 0.0:
            raise ValueError(f"Invalid learning rate: {group['lr']}")
        _C.optim_validate(self.algorithm, self._core_options(group))
        for p in group["params"]:
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
        super().add_param_group(param_group)
        if hasattr(self, "_initialised"):
            group = self.param_groups[-1]
            self._check_group(group)
            group["lr"] = _lr_tensor(group["lr"], self._group_device(group))

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._initialised = True

    # ---- the step ----

    def _state_of(self, group: dict[str, Any], p: Tensor, names: list[str]) -> dict[str, Tensor]:
        """p's state, created on its first step. A state an option turns on later (e.g. SGD momentum set
        after the first step) starts from its initial value (zeros; torch's SGD would start the buffer as a
        copy of the gradient, which differs only when dampening != 0)."""
        state = self.state[p]
        if len(state) != len(names) + 1:
            state.setdefault("step", torch.zeros((), dtype=torch.float32, device=p.device))
            for name in names:
                if name not in state:
                    state[name] = torch.full_like(p, self._initial_state_value(group, name), dtype=torch.float32)
        return state

    def _reject_grad(self, p: Tensor, g: Tensor) -> None:
        """Raises the clear error for a gradient the core cannot take."""
        name = type(self).__name__
        if g.is_sparse or g.layout != torch.strided:
            raise RuntimeError(f"{name} does not support sparse gradients; use a dense gradient (graphsafe.nn.Embedding gives one)")
        if g.is_complex() or p.is_complex():
            raise RuntimeError(f"{name} does not support complex parameters or gradients")
        if g.dtype != p.dtype:
            raise TypeError(f"{name}: gradient dtype {g.dtype} differs from its parameter's {p.dtype}")
        if g.device != p.device:
            raise ValueError(f"{name}: gradient on {g.device} but its parameter on {p.device}")
        raise ValueError(f"{name}: gradient shape {tuple(g.shape)} differs from its parameter's {tuple(p.shape)}")

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            buckets: dict[tuple[torch.device, torch.dtype], list[Tensor]] = defaultdict(list)
            for p in group["params"]:
                if p.grad is not None:
                    buckets[(p.device, p.dtype)].append(p)
            for (device, dtype), params in buckets.items():
                self._step_bucket(group, device, dtype, params)
        return loss

    def _step_bucket(self, group: dict[str, Any], device: torch.device, dtype: torch.dtype, params: list[Tensor]) -> None:
        options = self._core_options(group)
        # Validated before anything changes (a rejected step changes nothing); once per group while its
        # options stay the same. The entry holds the group itself, so its id cannot be reused meanwhile.
        validated = self.__dict__.setdefault("_validated_options", {})
        seen = validated.get(id(group))
        if seen is None or seen[0] is not group or seen[1] != options:
            _C.optim_validate(self.algorithm, options)
            validated[id(group)] = (group, options)
        names = self._state_names(group)
        # One pass over the parameters gathers what the core needs. This runs for every parameter on every
        # step, so the common case costs one combined test per gradient.
        if dtype not in _PARAM_DTYPES:  # a parameter's dtype changed after construction (p.data = ...)
            if dtype.is_complex:
                raise RuntimeError(f"{type(self).__name__} does not support complex parameters or gradients")
            raise TypeError(f"{type(self).__name__}: parameters must be float32, float16 or bfloat16, got {dtype}")
        param_ptrs, grad_ptrs, state_ptrs, step_ptrs, numels, contiguous_copies = [], [], [], [], [], []
        all_states, state_len = self.state, len(names) + 1  # a parameter's state: its step and named states
        for p in params:
            g = p.grad
            if not (g.layout is torch.strided and g.dtype is dtype and g.shape == p.shape and g.device == device):
                self._reject_grad(p, g)
            if not g.is_contiguous():
                g = g.contiguous()
                contiguous_copies.append(g)  # alive until the core call has been issued
            state = all_states[p]
            if len(state) != state_len:
                state = self._state_of(group, p, names)
            param_ptrs.append(p.data_ptr())
            grad_ptrs.append(g.data_ptr())
            state_ptrs.append([state[n].data_ptr() for n in names])
            step_ptrs.append(state["step"].data_ptr())
            numels.append(p.numel())
        lr = group["lr"]
        if not isinstance(lr, Tensor) or lr.device != device:
            if not isinstance(lr, Tensor) and float(lr) < 0.0:
                raise ValueError(f"Invalid learning rate: {lr}")
            group["lr"] = lr = _lr_tensor(lr, device)  # a float set by hand: back to a device tensor (eager only)
        workspace_bytes = (_C.optim_workspace_bytes(device.type, self.algorithm, options, numels)
                           if self.algorithm in _NEEDS_WORKSPACE else 0)
        workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=device) if workspace_bytes else None
        _C.optim_step(
            device.type,
            device.index or 0,
            torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0,
            self.algorithm,
            options,
            _dtype_name(dtype),
            lr.data_ptr(),
            param_ptrs,
            grad_ptrs,
            state_ptrs,
            step_ptrs,
            numels,
            workspace.data_ptr() if workspace is not None else 0,
            workspace_bytes,
            increment_steps=True,  # the core adds 1 to every step first (one launch on CUDA)
        )

    # ---- persistence ----

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state_dict from any graphsafe optimizer of the same algorithm, on any device.

        Unlike torch.optim.Optimizer.load_state_dict, states stay fp32 for fp16/bf16 parameters (a
        torch.optim state_dict's half states are widened) and move to their parameter's device; lr moves
        with its group. A state of the wrong shape raises ValueError.
        """
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
        state: defaultdict[Tensor, dict[str, Any]] = defaultdict(dict)
        for saved_id, values in state_dict["state"].items():
            if saved_id not in id_to_param:
                continue
            p = id_to_param[saved_id]
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
            new.update({
                k: v.detach().to(device=device, copy=True) if isinstance(v, Tensor) else copy.deepcopy(v)
                for k, v in saved.items()
                if k != "params"
            })
            new["params"] = group["params"]
            new["lr"] = _lr_tensor(new["lr"], device)
            groups.append(new)
        self.__setstate__({"state": state, "param_groups": groups})
        self._conform_loaded_state()

    def _conform_loaded_state(self) -> None:
        """The core writes states through raw addresses, so every loaded state must be what the kernels
        expect: fp32 (a torch.optim state_dict keeps bf16/fp16 states for half parameters: widened here),
        contiguous, the parameter's shape, on its device; step a 0-d fp32 tensor there."""
        for group in self.param_groups:
            names = self._state_names(group)
            for p in group["params"]:
                state = self.state.get(p)
                if not state:
                    continue
                step = state.get("step", 0.0)
                state["step"] = torch.as_tensor(step, dtype=torch.float32).detach().to(p.device).reshape(()).clone()
                for name in names:
                    if name not in state:
                        continue
                    value = state[name]
                    if not isinstance(value, Tensor) or value.shape != p.shape:
                        raise ValueError(
                            f"{type(self).__name__}.load_state_dict: state '{name}' has shape "
                            f"{tuple(getattr(value, 'shape', ()))}, its parameter {tuple(p.shape)}"
                        )
                    state[name] = value.detach().to(device=p.device, dtype=torch.float32).contiguous()
