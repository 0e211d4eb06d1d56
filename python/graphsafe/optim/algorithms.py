"""The optimizers. Adam, AdamW, SGD, RMSprop and Adagrad take the numerical options of their torch.optim
namesakes and give the same numbers; Lion, LAMB, LARS and AdEMAMix follow their papers, AdamWScheduleFree the
schedulefree package (docs/optim.md has every formula). All add skip_zeros, state_bits, block_size and
min_8bit_size.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ._base import GraphsafeOptimizer
from ._shards import local_of

__all__ = ["Adam", "AdamW", "SGD", "RMSprop", "Adagrad", "Lion", "LAMB", "LARS", "AdEMAMix", "AdamWScheduleFree"]


def _flag(value: Any) -> float:
    return 1.0 if value else 0.0


def _betas(betas: Any, count: int) -> tuple[float, ...]:
    """betas as a tuple of `count` numbers, or ValueError (their ranges are the core's to check). The steps
    unpack a group's betas directly and call this only when that fails, for its message."""
    try:
        values = tuple(betas)
    except TypeError:
        values = None
    if values is None or len(values) != count:
        names = ", ".join(f"beta{i + 1}" for i in range(count))
        raise ValueError(f"expected {('two', 'three')[count - 2]} betas ({names}), got {betas!r}")
    return values


def _two_betas(group: dict[str, Any]) -> tuple[float, float]:
    """A group's two betas: unpacked directly (every step reads them), _betas' message when that fails."""
    try:
        beta1, beta2 = group["betas"]
    except (TypeError, ValueError):
        beta1, beta2 = _betas(group["betas"], 2)
    return beta1, beta2


def _reject_differentiable(name: str, differentiable: bool) -> None:
    if differentiable:
        raise NotImplementedError(f"{name}(differentiable=True) is not supported: graphsafe's step is not differentiable")


class Adam(GraphsafeOptimizer):
    """torch.optim.Adam's numerics (decoupled_weight_decay=True gives AdamW's), capturable, with skip_zeros.

    foreach, fused and capturable are accepted for compatibility; graphsafe's step is always one fused,
    capturable launch per device and dtype.
    """

    algorithm = "adam"

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, *,
                 foreach=None, maximize=False, capturable=False, differentiable=False, fused=None,
                 decoupled_weight_decay=False, skip_zeros=False, state_bits=32, block_size=256,
                 min_8bit_size=4096):
        _reject_differentiable(type(self).__name__, differentiable)
        if decoupled_weight_decay:
            self.algorithm = "adamw"
        defaults = dict(lr=lr, betas=_betas(betas, 2), eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        maximize=maximize)
        super().__init__(params, defaults, skip_zeros=skip_zeros, state_bits=state_bits, block_size=block_size,
                         min_8bit_size=min_8bit_size)

    def _options(self, group):
        beta1, beta2 = _two_betas(group)
        return dict(beta1=float(beta1), beta2=float(beta2), eps=float(group["eps"]),
                    weight_decay=float(group["weight_decay"]), amsgrad=_flag(group["amsgrad"]))



class AdamW(Adam):
    """torch.optim.AdamW's numerics (decoupled weight decay), capturable, with skip_zeros."""

    algorithm = "adamw"

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
                 maximize=False, foreach=None, capturable=False, differentiable=False, fused=None,
                 skip_zeros=False, state_bits=32, block_size=256,
                 min_8bit_size=4096):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         maximize=maximize, differentiable=differentiable, decoupled_weight_decay=True,
                         skip_zeros=skip_zeros, state_bits=state_bits, block_size=block_size,
                         min_8bit_size=min_8bit_size)


class SGD(GraphsafeOptimizer):
    """torch.optim.SGD's numerics (momentum, dampening, nesterov, weight_decay, maximize), with skip_zeros."""

    algorithm = "sgd"

    def __init__(self, params, lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, *,
                 maximize=False, foreach=None, differentiable=False, fused=None,
                 skip_zeros=False, state_bits=32, block_size=256,
                 min_8bit_size=4096):
        _reject_differentiable(type(self).__name__, differentiable)
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                        nesterov=nesterov, maximize=maximize)
        super().__init__(params, defaults, skip_zeros=skip_zeros, state_bits=state_bits, block_size=block_size,
                         min_8bit_size=min_8bit_size)

    def _options(self, group):
        return dict(momentum=float(group["momentum"]), dampening=float(group["dampening"]),
                    weight_decay=float(group["weight_decay"]), nesterov=_flag(group["nesterov"]))

    def _step_of_loaded_state(self, state):
        # SGD's rule reads the step only to start the momentum buffer from the first gradient (step 1), as torch
        # does when it has no buffer; torch.optim.SGD saves no step. A saved buffer means a step was taken: 1
        # continues from it exactly as torch does; without one the next step is the first.
        return 1.0 if state.get("momentum_buffer") is not None else 0.0


class RMSprop(GraphsafeOptimizer):
    """torch.optim.RMSprop's numerics (alpha, centered, momentum, weight_decay, maximize), with skip_zeros."""

    algorithm = "rmsprop"

    def __init__(self, params, lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0.0, momentum=0.0, centered=False,
                 capturable=False, foreach=None, maximize=False, differentiable=False, *,
                 skip_zeros=False, state_bits=32, block_size=256,
                 min_8bit_size=4096):
        _reject_differentiable(type(self).__name__, differentiable)
        defaults = dict(lr=lr, alpha=alpha, eps=eps, weight_decay=weight_decay, momentum=momentum,
                        centered=centered, maximize=maximize)
        super().__init__(params, defaults, skip_zeros=skip_zeros, state_bits=state_bits, block_size=block_size,
                         min_8bit_size=min_8bit_size)

    def _options(self, group):
        return dict(alpha=float(group["alpha"]), eps=float(group["eps"]), weight_decay=float(group["weight_decay"]),
                    momentum=float(group["momentum"]), centered=_flag(group["centered"]))



class Adagrad(GraphsafeOptimizer):
    """torch.optim.Adagrad's numerics (lr_decay, initial_accumulator_value, weight_decay, maximize)."""

    algorithm = "adagrad"

    def __init__(self, params, lr=1e-2, lr_decay=0.0, weight_decay=0.0, initial_accumulator_value=0.0, eps=1e-10,
                 foreach=None, *, maximize=False, differentiable=False, fused=None,
                 skip_zeros=False, state_bits=32, block_size=256,
                 min_8bit_size=4096):
        _reject_differentiable(type(self).__name__, differentiable)
        defaults = dict(lr=lr, lr_decay=lr_decay, eps=eps, weight_decay=weight_decay,
                        initial_accumulator_value=initial_accumulator_value, maximize=maximize)
        super().__init__(params, defaults, skip_zeros=skip_zeros, state_bits=state_bits, block_size=block_size,
                         min_8bit_size=min_8bit_size)

    def _options(self, group):
        # Not a core option (it only fills new states), so checked here, wherever the options are read: at
        # construction, add_param_group, load_state_dict and every step.
        if not float(group["initial_accumulator_value"]) >= 0.0:
            raise ValueError(f"Invalid initial_accumulator_value value: {group['initial_accumulator_value']}")
        return dict(lr_decay=float(group["lr_decay"]), eps=float(group["eps"]),
                    weight_decay=float(group["weight_decay"]))

    def _initial_state_value(self, group, name):
        return float(group["initial_accumulator_value"])


class Lion(GraphsafeOptimizer):
    """Lion (Chen et al. 2023): p -= lr * (sign(b1*m + (1-b1)*g) + wd*p); m = b2*m + (1-b2)*g."""

    algorithm = "lion"

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, *, maximize=False,
                 skip_zeros=False, state_bits=32, block_size=256,
                 min_8bit_size=4096):
        defaults = dict(lr=lr, betas=_betas(betas, 2), weight_decay=weight_decay, maximize=maximize)
        super().__init__(params, defaults, skip_zeros=skip_zeros, state_bits=state_bits, block_size=block_size,
                         min_8bit_size=min_8bit_size)

    def _options(self, group):
        beta1, beta2 = _two_betas(group)
        return dict(beta1=float(beta1), beta2=float(beta2), weight_decay=float(group["weight_decay"]))



class LAMB(GraphsafeOptimizer):
    """LAMB (You et al. 2019): Adam's direction plus decoupled weight decay, scaled per tensor by
    ||p|| / ||direction||; the norms are reduced on the device in a fixed order."""

    algorithm = "lamb"

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0, bias_correction=True, *,
                 maximize=False, skip_zeros=False, state_bits=32, block_size=256,
                 min_8bit_size=4096):
        defaults = dict(lr=lr, betas=_betas(betas, 2), eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction, maximize=maximize)
        super().__init__(params, defaults, skip_zeros=skip_zeros, state_bits=state_bits, block_size=block_size,
                         min_8bit_size=min_8bit_size)

    def _options(self, group):
        beta1, beta2 = _two_betas(group)
        return dict(beta1=float(beta1), beta2=float(beta2), eps=float(group["eps"]),
                    weight_decay=float(group["weight_decay"]), bias_correction=_flag(group["bias_correction"]))



class LARS(GraphsafeOptimizer):
    """LARS (You et al. 2017): local lr = trust_coefficient * ||w|| / (||g|| + wd*||w|| + eps);
    v = momentum*v + lr*local_lr*(g + wd*w); w -= v. Norms reduced on the device in a fixed order."""

    algorithm = "lars"

    def __init__(self, params, lr=1e-1, momentum=0.9, weight_decay=0.0, trust_coefficient=0.001, eps=1e-8, *,
                 maximize=False, skip_zeros=False, state_bits=32, block_size=256,
                 min_8bit_size=4096):
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, trust_coefficient=trust_coefficient,
                        eps=eps, maximize=maximize)
        super().__init__(params, defaults, skip_zeros=skip_zeros, state_bits=state_bits, block_size=block_size,
                         min_8bit_size=min_8bit_size)

    def _options(self, group):
        return dict(momentum=float(group["momentum"]), weight_decay=float(group["weight_decay"]),
                    trust_coefficient=float(group["trust_coefficient"]), eps=float(group["eps"]))



class AdEMAMix(GraphsafeOptimizer):
    """AdEMAMix (Pagliardini et al. 2024): Adam with a second, slow EMA of the gradient mixed in by alpha;
    alpha and beta3 warm up over t_alpha and t_beta3 steps (None: no warm-up)."""

    algorithm = "ademamix"

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999, 0.9999), alpha=5.0, t_alpha=None, t_beta3=None,
                 eps=1e-8, weight_decay=0.0, *, maximize=False, skip_zeros=False, state_bits=32, block_size=256,
                 min_8bit_size=4096):
        defaults = dict(lr=lr, betas=_betas(betas, 3), alpha=alpha, t_alpha=t_alpha, t_beta3=t_beta3, eps=eps,
                        weight_decay=weight_decay, maximize=maximize)
        super().__init__(params, defaults, skip_zeros=skip_zeros, state_bits=state_bits, block_size=block_size,
                         min_8bit_size=min_8bit_size)

    def _options(self, group):
        try:
            beta1, beta2, beta3 = group["betas"]
        except (TypeError, ValueError):
            beta1, beta2, beta3 = _betas(group["betas"], 3)
        return dict(beta1=float(beta1), beta2=float(beta2), beta3=float(beta3), mix_alpha=float(group["alpha"]),
                    alpha_warmup=float(group["t_alpha"] or 0), beta3_warmup=float(group["t_beta3"] or 0),
                    eps=float(group["eps"]), weight_decay=float(group["weight_decay"]))



class AdamWScheduleFree(GraphsafeOptimizer):
    """Schedule-Free AdamW (Defazio et al. 2024, "The Road Less Scheduled"): the schedulefree package's
    AdamWScheduleFree, capturable. No lr schedule is needed; warmup_steps gives a linear warm-up, r and
    weight_lr_power the weights of the average.

    While training the parameters hold y, where gradients are taken; the model is meant to be evaluated (and
    saved) at x, the average. As with the package, call `optimizer.train()` before training and
    `optimizer.eval()` before evaluating or saving: they move the parameters between y and x. A step in eval
    mode raises (a captured step, replayed, does not check). The package keeps its weight sums per param group
    on the host; here each parameter keeps them on its device (state 'weight_sum' and 'lr_max', beside 'step'),
    so that nothing is read back. A parameter without a gradient in a step does not advance its sums, as it does
    not advance its step (the package advances its group's). state_bits 32 or 16: z, an iterate of the
    parameter's scale moved by lr-sized steps, would lose those steps in 8-bit codes.
    """

    algorithm = "adamw_schedulefree"

    def __init__(self, params, lr=0.0025, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, warmup_steps=0, r=0.0,
                 weight_lr_power=2.0, *, maximize=False, foreach=None, skip_zeros=False, state_bits=32,
                 block_size=256, min_8bit_size=4096):
        defaults = dict(lr=lr, betas=_betas(betas, 2), eps=eps, weight_decay=weight_decay, warmup_steps=warmup_steps,
                        r=r, weight_lr_power=weight_lr_power, maximize=maximize, train_mode=False)
        super().__init__(params, defaults, skip_zeros=skip_zeros, state_bits=state_bits, block_size=block_size,
                         min_8bit_size=min_8bit_size)

    def _options(self, group):
        beta1, beta2 = _two_betas(group)
        if not float(beta1) > 0.0:  # (eval() divides by it; the core takes [0, 1))
            raise ValueError(f"invalid optimizer hyperparameter: betas[0] must be in (0, 1) for "
                             f"{type(self).__name__}, got {beta1!r}")
        return dict(beta1=float(beta1), beta2=float(beta2), eps=float(group["eps"]),
                    weight_decay=float(group["weight_decay"]), warmup_steps=float(group["warmup_steps"]),
                    r=float(group["r"]), weight_lr_power=float(group["weight_lr_power"]))

    @torch.no_grad()
    def train(self) -> None:
        """Moves every parameter from x to y (p = lerp(p, z, 1 - beta1)) unless its group is in train mode."""
        self._switch_mode(train=True)

    @torch.no_grad()
    def eval(self) -> None:
        """Moves every parameter from y to x (p = lerp(p, z, 1 - 1/beta1)) unless its group is in eval mode."""
        self._switch_mode(train=False)

    def _switch_mode(self, train: bool) -> None:
        for group in self.param_groups:
            if bool(group["train_mode"]) == train:
                continue
            beta1 = float(self._options(group)["beta1"])
            weight = 1.0 - beta1 if train else 1.0 - 1.0 / beta1
            for p in group["params"]:
                z = self.state[p].get("z") if p in self.state else None
                if z is not None:
                    _lerp_in_place(local_of(p), z, weight)  # (a DTensor parameter: its local shard)
            group["train_mode"] = train

    def _step_groups(self) -> None:
        for group in self.param_groups:
            if not group["train_mode"]:
                raise RuntimeError(f"{type(self).__name__}: step called in eval mode; call optimizer.train() before "
                                   "training and optimizer.eval() before evaluating, as with the schedulefree package")
        super()._step_groups()


def _lerp_in_place(p: Tensor, end: Tensor, weight: float) -> None:
    """p = torch.lerp(p, end, weight) in fp32, rounded once to p's dtype; written out as separate operations
    (torch's formula: p + weight * (end - p) for |weight| < 0.5, else end - (end - p) * (1 - weight)), each
    rounded once, so that the CPU and CUDA give the same bits (a fused lerp may contract into multiply-adds)."""
    start, end = p.detach().float(), end.detach().float()
    if abs(weight) < 0.5:
        p.copy_(start + (end - start) * weight)
    else:
        p.copy_(end - (end - start) * (1.0 - weight))
