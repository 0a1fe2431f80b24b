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

What ``U`` and ``c`` are, per optimizer (the state read is the optimizer's own, after its latest step; ``lr`` is the
rate the step applies, times ``lr_scale`` where something scales it inside the step, as a learning-rate back-off does):

* ``torch.optim.SGD``: ``U = lr (1 - dampening)`` with momentum (``lr`` without), ``c`` as above. ``weight_decay``
  adds ``weight_decay * I`` to ``H`` (it is part of the gradient).
* ``torch.optim.Adam`` and ``AdamW``: ``U = lr (1 - beta1) / (sqrt(v_hat) + eps)``, ``v_hat`` the bias-corrected
  second moment (its running maximum with ``amsgrad``), and ``c = 2 (1 + beta1)``. Adam's ``weight_decay`` adds
  ``weight_decay * I`` to ``H``; AdamW's decoupled decay, a contraction by ``1 - lr * weight_decay``, is left out (it
  only stabilizes). The first moment's bias correction is left out too: it is within 1% of 1 after 44 steps at
  ``beta1 = 0.9``.

``lambda_max`` is the algebraically largest eigenvalue (a negative curvature does not destabilize the step), the top
Ritz value of ``steps`` Lanczos steps with Hessian-vector products: a lower bound that converges from below. Each
product is by default a difference of two first-order gradients (one gradient of the batch's loss per step, through
the model's own kernels); the exact double-backward product is the reference (:mod:`connmon.curvature.products`).

Examples:
    >>> import torch
    >>> from connmon.curvature import sharpness_ratio
    >>> model = torch.nn.Linear(3, 1, bias=False)
    >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> x = torch.eye(3) * torch.tensor([[1.0], [2.0], [3.0]])  # loss = mean((x w)^2): H = diag(2, 8, 18) / 3
    >>> loss_fn = lambda: model(x).pow(2).mean()
    >>> result = sharpness_ratio(loss_fn, optimizer, steps=3)
    >>> round(result.ratio, 4)  # lr * 18 / 3 / 2
    0.3
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from connmon._moved import renamed_keywords, renamed_name
from connmon._optimizer import unwrap_optimizer
from connmon._options import check_int
from connmon.curvature.lockstep import Lockstep, PeerFailure, settle
from connmon.curvature.products import (
    GRADIENT_CHANGE,
    PRODUCTS,
    DoubleBackwardProducts,
    GradientDifferenceProducts,
    Products,
    scalar_loss,
    step_weights,
)
from connmon.curvature.shards import Shards
from connmon.functional._linalg.lanczos import largest_eigenvalue

__all__ = [
    "READINGS",
    "Reading",
    "Sharpness",
    "StepGeometry",
    "UpdateProbe",
    "UpdateSharpness",
    "check_optimizer",
    "sharpness_ratio",
    "step_geometry",
]

Storage = Literal["device", "cpu"]
STORAGES: tuple[Storage, ...] = ("device", "cpu")
NOISE_CHECK_FROM = 0.5  # gradient differences: a ratio from which a reading is checked at a larger step
_TOL = 1e-3  # Ritz residual, relative, below which the top value counts as converged


@dataclass(frozen=True)
class Sharpness:
    """One estimate of the curvature against the edge of stability.

    Attributes:
        ratio: ``lambda_max(U^1/2 H U^1/2) / c``: below 1 the step is stable on the quadratic model, 1 is the edge.
        eigenvalue: ``lambda_max(U^1/2 H U^1/2)``, the curvature in units of the step.
        constant: ``c``, the momentum's stability constant.
        converged: whether the Lanczos residual of the top Ritz value is within 1e-3 of it.
        gradient_evaluations: passes through the loss's backward it took: ``steps + 1`` gradients with gradient
            differences; one gradient with its graph and ``steps`` double backward products (each about twice a
            gradient's cost) with double backward.
        difference_length: the gradient differences' last ``||h w|| / ||theta||`` (NaN with double backward), where
            the next reading's search for its length may start (``initial_length``).
    """

    ratio: float
    eigenvalue: float
    constant: float
    converged: bool
    gradient_evaluations: int = 0
    difference_length: float = math.nan

    @property
    def step(self) -> float:
        """Deprecated: :attr:`difference_length` (a step is an optimizer step in connmon)."""
        renamed_name("Sharpness.step", "Sharpness.difference_length")
        return self.difference_length


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
    sizes, constant = _step_sizes(optimizer, lr_scale, measured_only)
    params, step_sizes, decay = [], [], []
    for p, size, wd in sizes:
        params.append(p)
        step_sizes.append(size)
        decay.append(wd)
    if not params and _kind(optimizer) == "adam":
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
    _kind(optimizer)


def _kind(optimizer: torch.optim.Optimizer) -> str:
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


def _step_sizes(
    optimizer: torch.optim.Optimizer, lr_scale: float = 1.0, measured_only: bool = False
) -> tuple[Iterator[tuple[Tensor, Tensor | float, float]], float]:
    """``(parameter, U, coupled weight decay)`` one parameter at a time (no list of ``U``), and ``c``.

    ``lr_scale`` multiplies every group's ``lr``: the rate the step applies where a back-off scales it.
    ``measured_only``: see :func:`step_geometry`.
    """
    optimizer = unwrap_optimizer(optimizer)
    if _kind(optimizer) == "sgd":
        return _sgd_sizes(optimizer, lr_scale), _sgd_constant(optimizer)
    return _adam_sizes(optimizer, lr_scale, measured_only), _adam_constant(optimizer)


@renamed_keywords(relative_step="relative_length", initial_step="initial_length")  # 0.1.0's names
def sharpness_ratio(
    loss_fn: Callable[[], Tensor] | Sequence[Callable[[], Tensor]],
    optimizer: torch.optim.Optimizer,
    *,
    steps: int = 20,
    model: nn.Module | None = None,
    seed: int = 0,
    products: Products = "gradient_difference",
    relative_length: float | None = None,
    gradient_change: float | None = None,
    initial_length: float | None = None,
    storage: Storage = "device",
    noise_check: bool = True,
    weights: Sequence[float] | None = None,
    lr_scale: float = 1.0,
    eps_dominated: Literal["exclude", "keep"] = "exclude",
) -> Sharpness:
    """``lambda_max(U^1/2 H U^1/2) / c`` on the loss ``loss_fn()``: 1 is the optimizer's edge of stability.

    ``steps`` Lanczos steps, each one Hessian-vector product (:mod:`connmon.curvature.products` has both ways of
    taking it):

    * ``products="gradient_difference"`` (the default): ``H w ~= (g(theta + h w) - g(theta)) / h`` from first-order
      gradients, through the model's own kernels (fused or flash SDPA, compiled graphs): ``steps + 1`` gradient
      evaluations of the loss (and one per product retaken with a corrected step). The parameters are written from
      a saved copy for each product and copied back after it, bitwise. By default ``h`` is set so that the gradient
      changes by a measured fraction of its norm (``1e-3`` in float32;
      :data:`connmon.curvature.products.GRADIENT_CHANGE`); with ``relative_length``, so that
      ``||h w|| = relative_length ||theta||``.
    * ``products="double_backward"``: the exact products by double backward through one graph, SDPA held to its math
      kernel (the fused kernels have no double backward): the reference.

    ``loss_fn`` may be a sequence of losses, one per micro-batch of an accumulated step: the step's loss is their
    mean, or ``sum(weights[i] * loss_fn[i]())`` with ``weights`` (the factor the training step puts on each: ``1`` for
    a loss a trainer already normalised over the whole step, as Hugging Face's ``num_items_in_batch`` does).

    Every forward runs with gradients enabled inside :func:`torch.random.fork_rng`, reseeded with ``seed`` (dropout
    draws one mask for every product; the training run's random streams are untouched); ``.grad`` is not touched
    (:func:`torch.autograd.grad`), and ``model``'s buffers (batch-norm statistics) are restored afterwards when
    ``model`` is given. The Lanczos start vector comes from its own generator (``seed``), so every process draws the
    same one.

    Args:
        loss_fn: computes the scalar loss of a batch through the model (for example
            ``lambda: F.cross_entropy(model(x), y)``), or a sequence of them whose mean is the loss.
        optimizer: the optimizer that trains the model (see :func:`step_geometry`).
        steps: Lanczos steps (Hessian-vector products).
        model: the module whose buffers are restored after ``loss_fn`` (None: the buffers are not saved).
        seed: the start vector's and the forwards' seed.
        products: ``"gradient_difference"`` or ``"double_backward"``.
        relative_length: a fixed ``||h w|| / ||theta||`` for gradient differences (None: the gradient-change rule).
        gradient_change: the gradient-change rule's target ``||g(theta + h w) - g(theta)|| / ||g(theta)||`` (None:
            the measured one for the parameters' dtype).
        initial_length: where the gradient-change rule starts looking for the length, ``||h w|| / ||theta||``: a
            previous reading's :attr:`Sharpness.difference_length` saves the gradients of retaken products (None:
            ``1e-5``).
        storage: ``"device"``, or ``"cpu"`` to keep the solve's parameter-sized vectors (six with gradient
            differences) in host memory, the device holding only the gradient being taken.
        noise_check: with gradient differences, a reading of 0.5 or more is taken again at a 10x larger gradient
            change (up to twice); where it falls by more than 10% the first was round-off, and the lower reading
            stands (:data:`NOISE_CHECK_FROM`). It costs one more solve on such samples.
        weights: each micro-batch loss's factor in the step's loss (None: ``1 / len(loss_fn)``, their mean).
        lr_scale: the factor on every group's ``lr`` that the next step applies beyond it (a
            :class:`connmon.alerts.LearningRateBackoff`'s ``pending_scale(optimizer)``), so that the ratio is of the
            rate the step applies.
        eps_dominated: Adam's coordinates whose preconditioner is dominated by ``eps`` (``sqrt(v_hat) <= eps``: no
            gradient has given them a scale, as an attention key's bias): ``"exclude"`` (the default) reads without
            them, ``"keep"`` with their step ``lr (1 - beta1) / eps``, which multiplies a gradient difference's
            round-off there by ``1e5``-``1e7`` (see :func:`step_geometry`).

    Raises:
        ValueError: for an unsupported optimizer (see :func:`step_geometry`), ``steps < 1``, a loss that is not a
            scalar, parameters on several devices, or an unknown option.
        RuntimeError: from autograd, where the model has an operation without a double backward (double backward).

    Examples:
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
        >>> exact = sharpness_ratio(loss_fn, optimizer, model=model, products="double_backward")
        >>> 0 < result.ratio < 1, abs(result.ratio / exact.ratio - 1) < 1e-2, result.gradient_evaluations >= 21
        (True, True, True)
    """
    check_int("steps", steps)
    if products not in PRODUCTS:
        raise ValueError(f"products must be one of {PRODUCTS}, got products={products!r}")
    if storage not in STORAGES:
        raise ValueError(f"storage must be one of {STORAGES}, got storage={storage!r}")
    if eps_dominated not in ("exclude", "keep"):
        raise ValueError(f"eps_dominated must be 'exclude' or 'keep', got eps_dominated={eps_dominated!r}")
    for name, value in (("relative_length", relative_length), ("gradient_change", gradient_change),
                        ("initial_length", initial_length)):  # fmt: skip
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1):
            raise ValueError(f"{name} must be a number in (0, 1) or None, got {name}={value!r}")
    loss_fns = [loss_fn] if callable(loss_fn) else list(loss_fn)
    if not loss_fns or not all(callable(f) for f in loss_fns):
        raise ValueError("loss_fn must be a callable or a non-empty sequence of callables, each returning the loss")
    step_weights(loss_fns, weights)  # checked before any gradient is taken
    geometry = step_geometry(optimizer, lr_scale, measured_only=eps_dominated == "exclude")
    params = geometry.params
    shards = Shards(params)  # an unsupported layout is refused here, before any forward
    try:  # a failure on this process stops every process at its next checkpoint: none is left in a collective
        if shards.sharded and model is None:
            raise ValueError(
                "sharded parameters need model=...: a failed forward's gathered weights are freed through it"
            )
        devices = {p.device for p in params}
        if len(devices) != 1:
            raise ValueError(f"the parameters live on several devices ({sorted(map(str, devices))}); connmon needs one")
        device = devices.pop()
        where = torch.device("cpu") if storage == "cpu" else device
        dtype = torch.float64 if all(p.dtype == torch.float64 for p in params) else torch.float32
        scale = torch.cat(
            [_root(size, p, dtype).to(where) for size, p in zip(geometry.step_sizes, params, strict=True)]
        )
        sizes = shards.sizes
        exact = products == "double_backward"
        inner = shards.dots if shards.world > 1 else None  # one process: the plain inner product, as before
        leaves = [t for t in model.parameters() if t.requires_grad] if model is not None else []
        kernels = sdpa_kernel(SDPBackend.MATH) if exact else contextlib.nullcontext()

        def solve(change: float | None, initial: float | None) -> tuple[float, bool, int, float]:
            if exact:
                hessian: Any = DoubleBackwardProducts(loss_fns, params, dtype, seed, weights, shards)
            else:
                hessian = GradientDifferenceProducts(
                    loss_fns,
                    params,
                    dtype,
                    seed,
                    relative_length,
                    change,
                    where,
                    initial,
                    weights,
                    shards,
                    leaves,
                    model,
                )

            def matvec(v: Tensor) -> Tensor:  # (1, N) -> U^1/2 (H + decay) U^1/2 v, no N-sized temporary held
                product = hessian(v[0], scale)
                for wd, out, part, root in zip(geometry.weight_decay, product.split(sizes), v[0].split(sizes),
                                               scale.split(sizes), strict=True):  # fmt: skip
                    if wd:
                        out.add_(part * root, alpha=wd)
                return product.mul_(scale).unsqueeze(0)

            start = shards.start(seed, dtype, where)  # the same global vector whatever the layout
            value, converged = largest_eigenvalue(matvec, start, steps, _TOL, dtype=dtype, inner=inner)
            return float(value[0]), bool(converged[0]), hessian.evaluations, hessian.settled_length

        with _training_state_kept(model, device), kernels, torch.enable_grad():
            eigenvalue, converged, evaluations, length = solve(gradient_change, initial_length)
            if not exact and relative_length is None and noise_check:
                # Round-off divided by h inflates a reading; a real curvature does not change with h. From ratio 0.5
                # on (where a reading moves the cadence or an alert), a reading that falls by more than 10% at a 10x
                # larger gradient change was noise: the larger step's reading replaces it (at most twice, up to a
                # change of 0.1).
                change = gradient_change or GRADIENT_CHANGE.get(params[0].dtype, GRADIENT_CHANGE[torch.float32])
                for _ in range(2):
                    change *= 10
                    if not (eigenvalue / geometry.constant >= NOISE_CHECK_FROM and change <= 0.1 + 1e-12):
                        break
                    again, again_converged, more, again_length = solve(change, length * 10 if length > 0 else None)
                    evaluations += more
                    if not again < 0.9 * eigenvalue:
                        break
                    eigenvalue, converged, length = again, again_converged, again_length / 10
    except PeerFailure:
        raise
    except Exception:
        shards.lockstep.announce()
        raise
    return Sharpness(eigenvalue / geometry.constant, eigenvalue, geometry.constant, converged, evaluations, length)


def _root(size: Tensor | float, p: Tensor, dtype: torch.dtype) -> Tensor:
    """``U^1/2`` of one parameter's local part, flattened."""
    if isinstance(size, Tensor):
        return _local(size).detach().to(dtype).reshape(-1).sqrt()
    return torch.full((_local(p).numel(),), math.sqrt(size), dtype=dtype, device=p.device)


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


Reading = Literal["difference", "secant"]
READINGS: tuple[Reading, ...] = ("difference", "secant")


@dataclass(frozen=True)
class UpdateSharpness:
    """The curvature along the optimizer's own update against the edge of stability.

    Attributes:
        ratio: ``R / c``: 1 is the edge of stability when the update lies along the top direction (past the edge it
            does: the iterates oscillate along it), below it otherwise.
        curvature: ``R = u^T (H + decay) u / u^T U^-1 u``, the Rayleigh quotient of ``U^1/2 (H + decay) U^1/2`` at
            ``U^-1/2 u``: a lower bound of what :func:`sharpness_ratio` estimates, times ``c``.
        constant: ``c``, the momentum's stability constant.
        reading: how ``u^T H u`` was read: ``"difference"`` (three forwards) or ``"secant"`` (two gradients).
    """

    ratio: float
    curvature: float
    constant: float
    reading: Reading


class UpdateProbe:
    """The curvature along one optimizer update ``u = theta_{t+1} - theta_t``, read without a double backward.

    Create it just before ``optimizer.step()`` (it copies the parameters the optimizer updates: one copy of them, the
    probe's only memory), call :meth:`stepped` just after, then read ``u^T H u`` one of two ways:

    * :meth:`difference`: three forwards of a loss, at ``theta_{t+1} - u``, ``theta_{t+1}`` and ``theta_{t+1} + u``,
      with ``u^T H u = L(theta + u) + L(theta - u) - 2 L(theta)`` (exact on a quadratic; the third-order term cancels).
      Run under ``no_grad`` on the model's own kernels, fused, flash or compiled alike, on a batch of your choice
      (the next one: the curvature where the next step is taken).
    * :meth:`secant`: after the next backward and before the next ``optimizer.step()``, from the gradient that
      backward left in ``.grad`` and the one :meth:`stepped` saw, ``u^T H u = u . (g_{t+1} - g_t)`` (exact on a
      quadratic with one batch). No forward at all; the two gradients are of different batches, so batch noise adds
      to it. ``g_t`` is the gradient in ``.grad`` when the probe is created: clipping it by its norm before the step
      is undone (clipping by value is not).

    The parameters are left exactly as they were (bitwise): the points are written into the parameters in place and
    the saved copy is written back. A probe reads once.

    Args:
        optimizer: an SGD, Adam or AdamW optimizer about to step (see :func:`step_geometry`).

    Raises:
        ValueError: for an optimizer without a known edge of stability.

    Examples:
        >>> import torch
        >>> from connmon.curvature import UpdateProbe
        >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
        <torch._C.Generator object at ...>
        >>> w = torch.nn.Parameter(torch.randn(3))
        >>> h = torch.tensor([1.0, 4.0, 9.0])
        >>> loss_fn = lambda: 0.5 * (h * w * w).sum()  # a quadratic: H = diag(1, 4, 9)
        >>> optimizer = torch.optim.SGD([w], lr=0.1)
        >>> loss_fn().backward()
        >>> probe = UpdateProbe(optimizer)
        >>> optimizer.step()
        >>> probe.stepped()
        >>> u = -0.1 * h * w.grad  # what plain SGD stepped: R = u^T H u / (u^T u / lr)
        >>> round(probe.difference(loss_fn).curvature / (0.1 * (h * u * u).sum() / (u * u).sum()).item(), 5)
        1.0
    """

    def __init__(self, optimizer: torch.optim.Optimizer, lr_scale: float = 1.0) -> None:
        optimizer = unwrap_optimizer(optimizer)
        _kind(optimizer)
        self.optimizer = optimizer
        self._lr_scale = lr_scale  # the factor the step about to be taken applies beyond every group's lr
        self.params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
        with torch.no_grad():
            self._before = [p.detach().clone() for p in self.params]
            self._grad_square = _grad_square(self.params)  # to undo a clipping by norm before the step
        self._norm: float | None = None  # u^T U^-1 u
        self._decay = 0.0  # u^T (wd I) u, coupled weight decay
        self._slope = math.nan  # g_t . u
        self._constant = math.nan
        self._used = False

    def stepped(self) -> None:
        """After ``optimizer.step()``: ``u``, ``u^T U^-1 u`` (the step sizes of the step just taken) and ``g_t . u``.

        Raises:
            ValueError: if the update is zero (a learning rate of 0, or every gradient None).
        """
        sizes, self._constant = _step_sizes(self.optimizer, self._lr_scale)
        index = {id(p): i for i, p in enumerate(self.params)}
        sums = _Sums(4)  # u^T U^-1 u, u^T u wd, g_t . u, |g_t|^2 (clipped, if it was)
        with torch.no_grad():
            for p, size, wd in sizes:
                u = self._update(index[id(p)])
                squares = u * u
                step_size = _local(size) if isinstance(size, Tensor) else size
                sums.add(p, (squares / step_size).sum(dtype=torch.float64), wd * squares.sum(dtype=torch.float64))
                if p.grad is not None:
                    grad = _wide(_local(p.grad))
                    sums.add(p, 0, 0, (grad * u).sum(dtype=torch.float64), grad.square().sum(dtype=torch.float64))
        norm, decay, slope, clipped = sums.total()
        if not norm > 0:
            raise ValueError("the optimizer's update is zero (learning rate 0, or no gradient): no direction to read")
        if self._grad_square > 0 and clipped > 0:
            slope *= math.sqrt(self._grad_square / clipped)  # g_t as the probe saw it, before any clipping by norm
        self._norm, self._decay, self._slope = norm, decay, slope

    def difference(
        self, loss_fn: Callable[[], Tensor], *, model: nn.Module | None = None, seed: int = 0
    ) -> UpdateSharpness:
        """``u^T H u`` from three forwards of ``loss_fn()`` at ``theta - u``, ``theta``, ``theta + u`` (``theta`` now).

        Each forward runs under ``no_grad`` with the random streams forked and reseeded with ``seed`` (one dropout
        mask for the three points; the training run's streams untouched) and ``model``'s buffers (batch-norm
        statistics) restored afterwards when ``model`` is given. The parameters are restored bitwise, also when
        ``loss_fn`` raises.

        Raises:
            ValueError: if :meth:`stepped` was not called, the probe was read before, or the loss is not a scalar.
        """
        self._check()
        device = self.params[0].device if self.params else torch.device("cpu")
        losses = []
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        lockstep = Lockstep(world, _local(self.params[0]).device if self.params else device)
        with _training_state_kept(model, device), torch.no_grad():
            state = "now"  # which point the parameters hold: now, before (theta - u), ahead (theta + u)
            try:
                with lockstep.armed(model):  # a failure on one process stops all: none waits in a gather
                    losses.append(_scalar(loss_fn, seed))
                    lockstep.check()
                    for p, saved in zip(self.params, self._before, strict=True):  # the parameters at theta - u
                        now = p.detach().clone()
                        p.copy_(saved)
                        saved.copy_(now)  # the probe's copy holds theta now
                    state = "before"
                    losses.append(_scalar(loss_fn, seed))
                    lockstep.check()
                    for p, saved in zip(self.params, self._before, strict=True):  # theta + u = 2 theta - (theta - u)
                        p.neg_().add_(saved, alpha=2)
                    state = "ahead"
                    losses.append(_scalar(loss_fn, seed))
                    lockstep.check()
            except PeerFailure:
                settle(model)
                raise
            except Exception:
                settle(model)
                lockstep.announce()
                raise
            finally:
                if state != "now":
                    for p, saved in zip(self.params, self._before, strict=True):
                        p.copy_(saved)
                self._used = True
        now, before, ahead = losses
        return self._result(ahead + before - 2 * now, "difference")

    def secant(self) -> UpdateSharpness:
        """``u^T H u = u . (g_{t+1} - g_t)``, with ``g_{t+1}`` the gradient in ``.grad`` now (after the next backward).

        Raises:
            ValueError: if :meth:`stepped` was not called, or the probe was read before.
        """
        self._check()
        sums = _Sums(1)
        with torch.no_grad():
            for i, p in enumerate(self.params):
                if p.grad is not None:
                    sums.add(p, (_wide(_local(p.grad)) * self._update(i)).sum(dtype=torch.float64))
        self._used = True
        (slope,) = sums.total()
        return self._result(slope - self._slope, "secant")

    def _update(self, i: int) -> Tensor:
        """``u`` of parameter ``i`` (its local shard), in float32 at least."""
        return _wide(_local(self.params[i]).detach()) - _wide(_local(self._before[i]))

    def _check(self) -> None:
        if self._norm is None:
            raise ValueError("call stepped() after optimizer.step() before reading the probe")
        if self._used:
            raise ValueError("this probe was read already: create one per optimizer step")

    def _result(self, curvature: float, reading: Reading) -> UpdateSharpness:
        assert self._norm is not None  # _check said so
        value = (curvature + self._decay) / self._norm
        return UpdateSharpness(value / self._constant, value, self._constant, reading)


def _grad_square(params: list[Tensor]) -> float:
    sums = _Sums(1)
    with torch.no_grad():
        for p in params:
            if p.grad is not None:
                sums.add(p, _wide(_local(p.grad)).square().sum(dtype=torch.float64))
    return sums.total()[0]


class _Sums:
    """Sums over parameters kept on their device (one host copy at the end), added across the shards of sharded ones.

    A sharded parameter (a DTensor, as FSDP2 makes) contributes its local shard; those parts are summed across the
    processes of its 1-D device mesh. Replicated parameters (DDP) hold the same values everywhere and are not.
    """

    def __init__(self, count: int) -> None:
        self.plain: list[Tensor | float] = [0.0] * count
        self.sharded: list[Tensor | float] = [0.0] * count
        self.group: Any = None

    def add(self, p: Tensor, *values: Tensor | float) -> None:
        target = self.plain
        if hasattr(p, "device_mesh"):
            mesh = p.device_mesh
            if mesh.ndim != 1:
                raise ValueError(f"parameters sharded over a {mesh.ndim}-D device mesh are not supported (1-D only)")
            self.group, target = mesh.get_group(), self.sharded
        for i, value in enumerate(values):
            target[i] = target[i] + value

    def total(self) -> list[float]:
        def stacked(values: list[Tensor | float]) -> Tensor:
            tensors = [v for v in values if isinstance(v, Tensor)]
            device = tensors[0].device if tensors else torch.device("cpu")
            return torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device) for v in values])

        plain = stacked(self.plain)
        if self.group is not None:
            sharded = stacked(self.sharded)
            torch.distributed.all_reduce(sharded, group=self.group)
            plain = plain.to(sharded.device) + sharded
        return plain.tolist()


def _wide(tensor: Tensor) -> Tensor:
    """float32 for half-precision tensors, the tensor itself otherwise."""
    return tensor.to(torch.promote_types(tensor.dtype, torch.float32))


def _local(tensor: Tensor) -> Tensor:
    """A sharded parameter's local shard (a DTensor's ``to_local()``), else the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _scalar(loss_fn: Callable[[], Tensor], seed: int) -> float:
    torch.manual_seed(seed)
    return float(scalar_loss(loss_fn).detach().to(torch.float64))
