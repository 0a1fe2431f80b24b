"""The optimizer's step geometry: each parameter's step size ``U`` and the edge constant ``c`` (SGD, Adam, AdamW)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from connmon._collectives import local
from connmon._optimizer import unwrap_optimizer


@dataclass(frozen=True)
class StepGeometry:
    """What an optimizer's step is on a quadratic: per-parameter step sizes, coupled weight decay, the constant ``c``.

    Attributes:
        params: the parameters it updates (those with state, or every one for plain SGD).
        step_sizes: ``U`` per parameter (tensors shaped like them, or floats).
        weight_decay: the coupled weight decay per parameter, added to ``H``.
        constant: ``c``.
    """

    params: list[Tensor]
    step_sizes: list[Tensor | float]
    weight_decay: list[float]
    constant: float


def step_geometry(optimizer: torch.optim.Optimizer, lr_scale: float = 1.0, measured_only: bool = False) -> StepGeometry:
    """The step sizes ``U``, coupled weight decay and stability constant ``c`` of ``optimizer`` after its latest step.

    ``measured_only`` (Adam, AdamW): ``U = 0`` where the preconditioner is dominated by ``eps``
    (``sqrt(v_hat) <= eps``): no gradient has given those coordinates a scale (an attention key's bias, whose gradient
    is analytically zero: softmax ignores a shift shared by all keys), and their step ``lr (1 - beta1) / eps`` would
    multiply the round-off of a gradient difference by ``1e5``-``1e7`` (:func:`sharpness_ratio` reads without them).

    Raises:
        ValueError: for an optimizer other than SGD, Adam and AdamW (or a subclass), ``maximize=True``, different
            momenta across parameter groups, or Adam before its first step (no second moment yet).

    Examples:
        >>> import torch
        >>> from connmon.curvature import step_geometry
        >>> w = torch.nn.Parameter(torch.zeros(2))
        >>> geometry = step_geometry(torch.optim.SGD([w], lr=0.1, momentum=0.9, nesterov=True))
        >>> geometry.step_sizes, round(geometry.constant, 4)  # 2 (1 + 0.9) / (1 + 1.8)
        ([0.1], 1.3571)
    """
    optimizer = unwrap_optimizer(optimizer)
    sizes, constant = parameter_steps(optimizer, lr_scale, measured_only)
    params, step_sizes, decay = [], [], []
    for p, size, wd in sizes:
        params.append(p)
        step_sizes.append(size)
        decay.append(wd)
    if not params and optimizer_kind(optimizer) == "adam":
        raise ValueError(f"{type(optimizer).__name__} has not stepped yet: there is no preconditioner to measure with")
    return StepGeometry(params, step_sizes, decay, constant)


def _one(groups: list[dict], key: str) -> Any:
    values = {str(group[key]) for group in groups}
    if len(values) > 1:
        raise ValueError(f"parameter groups with different {key} ({sorted(values)}) have no single edge of stability")
    return groups[0][key]


def _sgd_constant(optimizer: torch.optim.Optimizer) -> float:
    beta, nesterov = float(_one(optimizer.param_groups, "momentum")), bool(_one(optimizer.param_groups, "nesterov"))
    return 2 * (1 + beta) / (1 + 2 * beta) if nesterov else 2 * (1 + beta)


def _sgd_sizes(optimizer: torch.optim.Optimizer, scale: float) -> Iterator[tuple[Tensor, float, float]]:
    beta = float(_one(optimizer.param_groups, "momentum"))
    for group in optimizer.param_groups:
        dampening = group["dampening"] if beta else 0.0
        for p in group["params"]:
            if p.requires_grad:
                yield p, float(group["lr"]) * scale * (1 - dampening), float(group["weight_decay"])


def _adam_constant(optimizer: torch.optim.Optimizer) -> float:
    return 2 * (1 + float(_one(optimizer.param_groups, "betas")[0]))


def _adam_sizes(
    optimizer: torch.optim.Optimizer, scale: float, measured_only: bool = False
) -> Iterator[tuple[Tensor, Tensor, float]]:
    groups = optimizer.param_groups
    beta1, beta2 = (float(b) for b in _one(groups, "betas"))
    coupled = not isinstance(optimizer, torch.optim.AdamW) and not any(g.get("decoupled_weight_decay") for g in groups)
    for group in groups:
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            if not p.requires_grad or "exp_avg_sq" not in state:
                continue  # a parameter the optimizer has not moved yet: not part of the step
            second = state["max_exp_avg_sq"] if group.get("amsgrad") else state["exp_avg_sq"]
            root = (second / (1 - beta2 ** float(state["step"]))).sqrt()
            size = float(group["lr"]) * scale * (1 - beta1) / (root + group["eps"])
            if measured_only:
                size = size.masked_fill(root <= group["eps"], 0.0)
            yield p, size, (float(group["weight_decay"]) if coupled else 0.0)


def check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Whether connmon knows ``optimizer``'s edge of stability: a ValueError that says why not, else nothing.

    Examples:
        >>> import torch
        >>> from connmon.curvature import check_optimizer
        >>> check_optimizer(torch.optim.Adagrad([torch.nn.Parameter(torch.zeros(1))]))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: Adagrad is not supported: connmon knows the edge of stability of SGD (with or without ...
    """
    optimizer_kind(optimizer)


def optimizer_kind(optimizer: torch.optim.Optimizer) -> str:
    """``"sgd"`` or ``"adam"``, or a ValueError naming what is supported."""
    optimizer = unwrap_optimizer(optimizer)
    if any(group.get("maximize", False) for group in optimizer.param_groups):
        raise ValueError("maximize=True is not supported: the edge of stability is stated for a minimized loss")
    if isinstance(optimizer, torch.optim.SGD):
        return "sgd"
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return "adam"
    raise ValueError(
        f"{type(optimizer).__name__} is not supported: connmon knows the edge of stability of SGD (with or without "
        "momentum), Adam and AdamW"
    )


def parameter_steps(
    optimizer: torch.optim.Optimizer, lr_scale: float = 1.0, measured_only: bool = False
) -> tuple[Iterator[tuple[Tensor, Tensor | float, float]], float]:
    """``(parameter, U, coupled weight decay)`` one parameter at a time (no list of ``U``), and ``c``.

    ``lr_scale`` multiplies every group's ``lr``: the rate the step applies where a back-off scales it.
    ``measured_only``: see :func:`step_geometry`.
    """
    optimizer = unwrap_optimizer(optimizer)
    if optimizer_kind(optimizer) == "sgd":
        return _sgd_sizes(optimizer, lr_scale), _sgd_constant(optimizer)
    return _adam_sizes(optimizer, lr_scale, measured_only), _adam_constant(optimizer)


def root_step(size: Tensor | float, p: Tensor, dtype: torch.dtype) -> Tensor:
    """``U^1/2`` of one parameter's local part, flattened."""
    if isinstance(size, Tensor):
        return local(size).detach().to(dtype).reshape(-1).sqrt()
    return torch.full((local(p).numel(),), math.sqrt(size), dtype=dtype, device=p.device)


def widened(tensor: Tensor) -> Tensor:
    """float32 for half-precision tensors, the tensor itself otherwise."""
    return tensor.to(torch.promote_types(tensor.dtype, torch.float32))
