"""The curvature against the edge of stability: the Lanczos solve on Hessian products, :func:`sharpness_ratio`."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from connmon._linalg.lanczos import largest_eigenvalue
from connmon._options import check_int
from connmon.curvature.geometry import root_step, step_geometry
from connmon.curvature.lockstep import PeerFailure
from connmon.curvature.products import (
    GRADIENT_CHANGE,
    PRODUCTS,
    DoubleBackwardProducts,
    GradientDifferenceProducts,
    Products,
    coarsest_dtype,
    scalar_loss,
    step_weights,
)
from connmon.curvature.shards import Shards

Storage = Literal["device", "cpu"]


STORAGES: tuple[Storage, ...] = get_args(Storage)


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
            [root_step(size, p, dtype).to(where) for size, p in zip(geometry.step_sizes, params, strict=True)]
        )
        sizes = shards.sizes
        exact = products == "double_backward"
        inner = shards.dots if shards.world > 1 else None  # one process: the plain inner product, as before
        leaves = [t for t in model.parameters() if t.requires_grad] if model is not None else []
        kernels = sdpa_kernel(SDPBackend.MATH) if exact else contextlib.nullcontext()

        def solve(change: float | None, initial: float | None) -> tuple[float, bool, int, float]:
            if exact:
                hessian: Any = DoubleBackwardProducts(loss_fns, params, dtype, seed, weights=weights, shards=shards)
            else:
                hessian = GradientDifferenceProducts(
                    loss_fns,
                    params,
                    dtype,
                    seed,
                    relative_length=relative_length,
                    gradient_change=change,
                    storage=where,
                    initial_length=initial,
                    weights=weights,
                    shards=shards,
                    leaves=leaves,
                    model=model,
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

        with training_state_kept(model, device), kernels, torch.enable_grad():
            eigenvalue, converged, evaluations, length = solve(gradient_change, initial_length)
            if not exact and relative_length is None and noise_check:
                # Round-off divided by h inflates a reading; a real curvature does not change with h. From ratio 0.5
                # on (where a reading moves the cadence or an alert), a reading that falls by more than 10% at a 10x
                # larger gradient change was noise: the larger step's reading replaces it (at most twice, up to a
                # change of 0.1).
                change = gradient_change or GRADIENT_CHANGE[coarsest_dtype(params)]
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
    return Sharpness(
        eigenvalue / geometry.constant,
        eigenvalue,
        geometry.constant,
        converged,
        gradient_evaluations=evaluations,
        difference_length=length,
    )


@contextlib.contextmanager
def training_state_kept(model: nn.Module | None, device: torch.device) -> Iterator[None]:
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


def scalar_at(loss_fn: Callable[[], Tensor], seed: int) -> float:
    """The loss as a float64 number, its forward run with the random streams seeded by ``seed``."""
    torch.manual_seed(seed)
    return float(scalar_loss(loss_fn).detach().to(torch.float64))
