"""Curvature against the optimizer's edge of stability: the one warning that is about the update, not the attention.

On a quadratic with Hessian ``H``, an optimizer that steps by ``U`` times its momentum buffer (``U`` diagonal: the
learning rate times the optimizer's preconditioner) is stable exactly when ``lambda_max(U^1/2 H U^1/2) < c``, with
``c`` the momentum's constant: ``2 (1 + beta)`` for heavy-ball momentum (``2`` without), ``2 (1 + beta) / (1 + 2 beta)``
for Nesterov's. Past it, the top direction oscillates with a growing amplitude. :func:`sharpness_ratio` returns
``lambda_max(U^1/2 H U^1/2) / c`` for the loss of one batch, with ``H`` the Hessian of that loss in the parameters the
optimizer updates, so 1 is the edge of stability whatever the model, optimizer or learning rate (Cohen et al. 2021,
*Gradient descent on neural networks typically occurs at the edge of stability*; 2022, *Adaptive gradient methods at
the edge of stability*). For Adam, with one learning rate, the ratio is ``lr * lambda_max(P^-1 H) / ((2 + 2 beta1) /
(1 - beta1))``, Cohen et al.'s preconditioned sharpness against its threshold.

What ``U`` and ``c`` are, per optimizer (the state read is the optimizer's own, after its latest step):

* ``torch.optim.SGD``: ``U = lr (1 - dampening)`` with momentum (``lr`` without), ``c`` as above. ``weight_decay``
  adds ``weight_decay * I`` to ``H`` (it is part of the gradient).
* ``torch.optim.Adam`` and ``AdamW``: ``U = lr (1 - beta1) / (sqrt(v_hat) + eps)``, ``v_hat`` the bias-corrected
  second moment (its running maximum with ``amsgrad``), and ``c = 2 (1 + beta1)``. Adam's ``weight_decay`` adds
  ``weight_decay * I`` to ``H``; AdamW's decoupled decay, a contraction by ``1 - lr * weight_decay``, is left out (it
  only stabilizes). The first moment's bias correction is left out too: it is within 1% of 1 after 44 steps at
  ``beta1 = 0.9``.

``lambda_max`` is the algebraically largest eigenvalue (a negative curvature does not destabilize the step), the top
Ritz value of ``steps`` Lanczos steps with Hessian-vector products (double backward): a lower bound that converges
from below. Each step costs about one double backward of the batch's loss.

Example:
    >>> import torch
    >>> from connmon.curvature import sharpness_ratio
    >>> model = torch.nn.Linear(3, 1, bias=False)
    >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> x = torch.eye(3) * torch.tensor([[1.0], [2.0], [3.0]])  # loss = mean((x w)^2): H = diag(2, 8, 18) / 3
    >>> loss_fn = lambda: model(x).pow(2).mean()
    >>> result = sharpness_ratio(loss_fn, optimizer, steps=3)
    >>> round(result.ratio, 6)  # lr * 18 / 3 / 2
    0.3
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from connmon._options import check_int
from connmon.functional._lanczos import largest_eigenvalue

__all__ = ["Sharpness", "StepGeometry", "sharpness_ratio", "step_geometry"]

_TOL = 1e-3  # Ritz residual, relative, below which the top value counts as converged


@dataclass(frozen=True)
class Sharpness:
    """One estimate of the curvature against the edge of stability.

    Attributes:
        ratio: ``lambda_max(U^1/2 H U^1/2) / c``: below 1 the step is stable on the quadratic model, 1 is the edge.
        eigenvalue: ``lambda_max(U^1/2 H U^1/2)``, the curvature in units of the step.
        constant: ``c``, the momentum's stability constant.
        converged: whether the Lanczos residual of the top Ritz value is within 1e-3 of it.
    """

    ratio: float
    eigenvalue: float
    constant: float
    converged: bool


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


def step_geometry(optimizer: torch.optim.Optimizer) -> StepGeometry:
    """The step sizes ``U``, coupled weight decay and stability constant ``c`` of ``optimizer`` after its latest step.

    Raises:
        ValueError: for an optimizer other than SGD, Adam and AdamW (or a subclass), ``maximize=True``, different
            momenta across parameter groups, or Adam before its first step (no second moment yet).

    Example:
        >>> import torch
        >>> from connmon.curvature import step_geometry
        >>> w = torch.nn.Parameter(torch.zeros(2))
        >>> geometry = step_geometry(torch.optim.SGD([w], lr=0.1, momentum=0.9, nesterov=True))
        >>> geometry.step_sizes, round(geometry.constant, 4)  # 2 (1 + 0.9) / (1 + 1.8)
        ([0.1], 1.3571)
    """
    groups = optimizer.param_groups
    if any(group.get("maximize", False) for group in groups):
        raise ValueError("maximize=True is not supported: the edge of stability is stated for a minimized loss")
    if isinstance(optimizer, torch.optim.SGD):
        return _sgd(optimizer)
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return _adam(optimizer)
    raise ValueError(
        f"{type(optimizer).__name__} is not supported: connmon knows the edge of stability of SGD (with or without "
        "momentum), Adam and AdamW"
    )


def _one(groups: list[dict], key: str) -> object:
    values = {str(group[key]) for group in groups}
    if len(values) > 1:
        raise ValueError(f"parameter groups with different {key} ({sorted(values)}) have no single edge of stability")
    return groups[0][key]


def _sgd(optimizer: torch.optim.SGD) -> StepGeometry:
    groups = optimizer.param_groups
    beta, nesterov = float(_one(groups, "momentum")), bool(_one(groups, "nesterov"))
    constant = 2 * (1 + beta) / (1 + 2 * beta) if nesterov else 2 * (1 + beta)
    params, sizes, decay = [], [], []
    for group in groups:
        dampening = group["dampening"] if beta else 0.0
        for p in group["params"]:
            if p.requires_grad:
                params.append(p)
                sizes.append(float(group["lr"]) * (1 - dampening))
                decay.append(float(group["weight_decay"]))
    return StepGeometry(params, sizes, decay, constant)


def _adam(optimizer: torch.optim.Adam | torch.optim.AdamW) -> StepGeometry:
    groups = optimizer.param_groups
    beta1, beta2 = (float(b) for b in _one(groups, "betas"))
    coupled = not isinstance(optimizer, torch.optim.AdamW) and not any(g.get("decoupled_weight_decay") for g in groups)
    params, sizes, decay = [], [], []
    for group in groups:
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            if not p.requires_grad or "exp_avg_sq" not in state:
                continue  # a parameter the optimizer has not moved yet: not part of the step
            second = state["max_exp_avg_sq"] if group.get("amsgrad") else state["exp_avg_sq"]
            v_hat = second / (1 - beta2 ** float(state["step"]))
            params.append(p)
            sizes.append(float(group["lr"]) * (1 - beta1) / (v_hat.sqrt() + group["eps"]))
            decay.append(float(group["weight_decay"]) if coupled else 0.0)
    if not params:
        raise ValueError(f"{type(optimizer).__name__} has not stepped yet: there is no preconditioner to measure with")
    return StepGeometry(params, sizes, decay, 2 * (1 + beta1))


def sharpness_ratio(
    loss_fn: Callable[[], Tensor],
    optimizer: torch.optim.Optimizer,
    *,
    steps: int = 20,
    model: nn.Module | None = None,
    seed: int = 0,
) -> Sharpness:
    """``lambda_max(U^1/2 H U^1/2) / c`` on the loss ``loss_fn()``: 1 is the optimizer's edge of stability.

    ``loss_fn`` is called once, with gradients enabled and SDPA restricted to its math kernel (the fused kernels have
    no double backward), inside :func:`torch.random.fork_rng`, so dropout draws the same mask for every
    Hessian-vector product and the training run's random stream is untouched. Nothing of the training state changes:
    the products go through :func:`torch.autograd.grad` (``.grad`` is not touched), and ``model``'s buffers (batch-norm
    statistics) are restored afterwards when ``model`` is given. The Lanczos start vector comes from its own generator
    (``seed``), so every process draws the same one.

    Args:
        loss_fn: computes the scalar loss of a batch through the model (for example
            ``lambda: F.cross_entropy(model(x), y)``).
        optimizer: the optimizer that trains the model (see :func:`step_geometry`).
        steps: Lanczos steps (Hessian-vector products).
        model: the module whose buffers are restored after ``loss_fn`` (None: the buffers are not saved).
        seed: the start vector's seed.

    Raises:
        ValueError: for an unsupported optimizer (see :func:`step_geometry`), ``steps < 1``, a loss that is not a
            scalar, or parameters on several devices.
        RuntimeError: from autograd, where the model has an operation without a double backward.

    Example:
        >>> import torch
        >>> from connmon.curvature import sharpness_ratio
        >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
        <torch._C.Generator object at ...>
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        >>> optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        >>> x, y = torch.randn(32, 8), torch.randn(32, 1)
        >>> loss_fn = lambda: torch.nn.functional.mse_loss(model(x), y)
        >>> loss_fn().backward()
        >>> optimizer.step()
        >>> result = sharpness_ratio(loss_fn, optimizer, model=model)
        >>> 0 < result.ratio < 1, result.converged
        (True, True)
    """
    check_int("steps", steps)
    geometry = step_geometry(optimizer)
    params = geometry.params
    devices = {p.device for p in params}
    if len(devices) != 1:
        raise ValueError(f"the parameters live on several devices ({sorted(map(str, devices))}); connmon needs one")
    device = devices.pop()
    dtype = torch.float64 if all(p.dtype == torch.float64 for p in params) else torch.float32
    scale = torch.cat([_root(size, p, dtype) for size, p in zip(geometry.step_sizes, params, strict=True)])
    decay = torch.cat([torch.full((p.numel(),), wd, dtype=dtype, device=device) for wd, p in zip(
        geometry.weight_decay, params, strict=True)])  # fmt: skip
    sizes = [p.numel() for p in params]

    with _training_state_kept(model, device), sdpa_kernel(SDPBackend.MATH), torch.enable_grad():
        loss = loss_fn()
        if not isinstance(loss, Tensor) or loss.numel() != 1:
            raise ValueError(f"loss_fn must return a scalar tensor, got {_describe(loss)}")
        grads = torch.autograd.grad(loss.reshape(()), params, create_graph=True, allow_unused=True)
        live = [i for i, g in enumerate(grads) if g is not None and g.requires_grad]  # the rest: H is 0 there

        def matvec(v: Tensor) -> Tensor:  # (1, N) -> U^1/2 (H + decay) U^1/2 v
            u = v[0] * scale
            parts = u.split(sizes)
            hessian = torch.zeros_like(u)
            if live:
                products = torch.autograd.grad(
                    [grads[i] for i in live],
                    [params[i] for i in live],
                    grad_outputs=[parts[i].view_as(params[i]).to(params[i].dtype) for i in live],
                    retain_graph=True,
                    allow_unused=True,
                )
                pieces = [torch.zeros(n, dtype=dtype, device=device) for n in sizes]
                for i, product in zip(live, products, strict=True):
                    if product is not None:
                        pieces[i] = product.reshape(-1).to(dtype)
                hessian = torch.cat(pieces)
            return ((hessian + decay * u) * scale).unsqueeze(0)

        generator = torch.Generator().manual_seed(seed)
        start = torch.randn(1, scale.numel(), generator=generator, dtype=dtype).to(device)
        value, converged = largest_eigenvalue(matvec, start, steps, _TOL, dtype=dtype)
    eigenvalue = float(value[0])
    return Sharpness(eigenvalue / geometry.constant, eigenvalue, geometry.constant, bool(converged[0]))


def _root(size: Tensor | float, p: Tensor, dtype: torch.dtype) -> Tensor:
    """``U^1/2`` of one parameter, flattened."""
    if isinstance(size, Tensor):
        return size.detach().to(dtype).reshape(-1).sqrt()
    return torch.full((p.numel(),), math.sqrt(size), dtype=dtype, device=p.device)


def _describe(value: object) -> str:
    if isinstance(value, Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return type(value).__name__


@contextlib.contextmanager
def _training_state_kept(model: nn.Module | None, device: torch.device) -> Iterator[None]:
    """Restore the random streams and ``model``'s buffers (batch-norm statistics) after the block."""
    buffers = [(b, b.detach().clone()) for b in model.buffers()] if model is not None else []
    accelerator = [] if device.type == "cpu" else [device]
    try:
        with torch.random.fork_rng(devices=accelerator, device_type=device.type if accelerator else "cuda"):
            yield
    finally:
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
