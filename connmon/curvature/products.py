"""Hessian-vector products of a loss in the parameters an optimizer updates, two ways, for Lanczos.

:func:`connmon.curvature.sharpness_ratio` runs Lanczos on ``U^1/2 (H + decay) U^1/2`` (``U`` the optimizer's step
sizes, see :mod:`connmon.curvature`); each Lanczos step asks for one product ``H w``, ``w = U^1/2 v``. Both ways read
the loss as a weighted sum of one or more losses (the micro-batches of an accumulated step, each with the factor
the training step puts on it: ``1 / k`` for a per-micro-batch mean, ``1`` for a loss already normalised over the whole
step), with the random streams
reseeded before every forward (one dropout mask for every product) and ``.grad`` never touched
(:func:`torch.autograd.grad`).

* :class:`GradientDifferenceProducts` (``"gradient_difference"``): ``H w ~= (g(theta + h w) - g(theta)) / h`` from
  first-order gradients only, so it runs through whatever the model's forward runs (fused and flash SDPA kernels,
  compiled graphs) and holds no graph between products. Its forwards run in the parameters' dtype with autocast
  off: a difference of two bf16 gradients is round-off, so under bf16 autocast the reading is of the float32 loss
  (twice the activation memory of a bf16 forward); float32 and float64 parameters only. ``h`` comes from a measured
  rule: the gradient should change by a fixed fraction of its norm (:data:`GRADIENT_CHANGE`,
  ``benchmarks/bench_sharpness.py --step-size``). The parameters are written as ``theta + h w`` from a saved copy and
  copied back after every product (bitwise, never an add-and-subtract). It costs one gradient of the loss per
  product, plus one at ``theta`` (and one per retaken product when the step had to be corrected).
* :class:`DoubleBackwardProducts` (``"double_backward"``): the exact product by double backward through one graph
  kept for the whole solve, SDPA held to its math kernel (the fused kernels have no double backward). The reference
  the other is tested against.

Parameter-sized buffers a gradient-difference solve holds beside the model and its ``.grad``: the parameter copy,
``g(theta)``, the step-size root ``U^1/2``, and Lanczos's three vectors (six), plus the gradient of the product being
taken while it is taken. With ``storage="cpu"`` all six live in host memory and only that gradient is on the device.
"""

from __future__ import annotations

import contextlib
import functools
import math
import operator
from collections.abc import Callable, Iterator, Sequence
from typing import Literal, get_args

import torch
from torch import Tensor

from connmon.curvature.lockstep import settle
from connmon.curvature.shards import Shards, local

Products = Literal["gradient_difference", "double_backward"]
PRODUCTS: tuple[Products, ...] = get_args(Products)

# The difference length: the gradient changes by GRADIENT_CHANGE times its norm, by the parameters' dtype (the
# forwards run in it: autocast is off for them). benchmarks/README.md, bench_sharpness.py --step-size: the ratio
# against double backward on the instability suite's model, healthy and near divergence; under bf16 autocast no target
# read within 15%. FIRST_LENGTH (||h w|| / ||theta||) starts the search.
GRADIENT_CHANGE = {torch.float64: 1e-7, torch.float32: 1e-3}
FIRST_LENGTH = 1e-5
_SLACK = 4.0  # a product whose gradient change is further than this factor from the target is taken again
_RETAKES = 2
_SHORTEST, _LONGEST = 1e-9, 1e-1  # bounds of ||h w|| / ||theta||


def coarsest_dtype(params: Sequence[Tensor]) -> torch.dtype:
    """The least precise dtype of ``params`` (every one counts), which sets the difference length.

    Raises:
        ValueError: where any parameter is of a dtype a gradient difference cannot resolve (float16, bfloat16),
            naming how many are.

    Examples:
        >>> import torch
        >>> from connmon.curvature.products import coarsest_dtype
        >>> coarsest_dtype([torch.zeros(2, dtype=torch.float64), torch.zeros(2)])
        torch.float32
    """
    counts: dict[torch.dtype, int] = {}
    for p in params:
        counts[p.dtype] = counts.get(p.dtype, 0) + 1
    coarse = {dtype: n for dtype, n in counts.items() if dtype not in GRADIENT_CHANGE}
    if coarse:
        which = ", ".join(f"{n} of the {len(params)} parameters are {dtype}" for dtype, n in coarse.items())
        raise ValueError(
            f"{which}: a difference of two gradients at that precision is round-off (bf16 resolves 4e-3 of a "
            "weight, float16 5e-4); train with float32 weights (mixed precision: autocast, under which the reading "
            "computes in float32), or use the double-backward products"
        )
    return torch.float32 if torch.float32 in counts else torch.float64


def scalar_loss(loss_fn: Callable[[], Tensor]) -> Tensor:
    """``loss_fn()`` as a 0-d tensor, or a ValueError that says what it returned."""
    loss = loss_fn()
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        described = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, Tensor) else type(loss).__name__
        raise ValueError(f"loss_fn must return a scalar tensor, got {described}")
    return loss.reshape(())


def step_weights(loss_fns: Sequence[object], weights: Sequence[float] | None) -> list[float]:
    """Each micro-batch loss's factor in the step's loss: ``weights``, or ``1 / k`` for ``k`` losses (their mean).

    Raises:
        ValueError: if ``weights`` does not give one finite number per loss.

    Examples:
        >>> from connmon.curvature.products import step_weights
        >>> step_weights([None] * 4, None), step_weights([None] * 2, [1.0, 1.0])
        ([0.25, 0.25, 0.25, 0.25], [1.0, 1.0])
    """
    if weights is None:
        return [1 / len(loss_fns)] * len(loss_fns)
    weights = [float(w) for w in weights]
    if len(weights) != len(loss_fns) or not all(math.isfinite(w) for w in weights):
        raise ValueError(f"weights must be one finite number per loss ({len(loss_fns)}), got weights={weights!r}")
    return weights


class GradientDifferenceProducts:
    """``w -> H w`` by forward differences of first-order gradients (see the module docstring).

    The length ``h`` along ``w``: with ``relative_length`` given, ``||h w|| = relative_length ||theta||``. By default it
    is set so that the gradient changes by ``gradient_change ||g(theta)||`` (:data:`GRADIENT_CHANGE`, by compute dtype):
    far enough above the gradient's round-off that the difference is not noise, and no further, so the product stays
    local where the curvature is sharp. The length found for one product starts the next; a product whose gradient
    change is more than a factor :data:`_SLACK` off the target is taken again with the corrected length (each retake is
    one more gradient, counted in :attr:`evaluations`).

    Args:
        loss_fns: the losses whose weighted sum is read (one per micro-batch).
        weights: each loss's factor in the sum (None: ``1 / len(loss_fns)``, their mean).
        params: the parameters (plain tensors or parameters of one device).
        dtype: the dtype of the flat vectors (float32 or float64).
        seed: the random streams' seed before every forward.
        relative_length: a fixed ``||h w|| / ||theta||``; None: the gradient-change rule.
        gradient_change: the rule's target (None: :data:`GRADIENT_CHANGE` for the parameters' dtype).
        initial_length: where the rule's search starts, ``||h w|| / ||theta||`` (a previous solve's
            :attr:`settled_length`;
            None: :data:`FIRST_LENGTH`).
        storage: the device of the flat vectors (the parameters' own by default; ``"cpu"`` to keep them off it).
        shards: the parameters' layout across processes (:class:`connmon.curvature.shards.Shards`; None: found here).
        leaves: every other tensor whose ``.grad`` a backward may touch (the model's other trainable parameters):
            with sharded parameters the gradients are taken by the model's own backward (FSDP2 reduces them there),
            and each of these ``.grad`` is put back as it was, with the parameters'.
        model: the model, needed with sharded parameters: a forward that raises leaves FSDP2's gathered weights in
            it, which are freed (``reshard``) so that the next forward gathers the restored shards.
    """

    def __init__(
        self,
        loss_fns: Sequence[Callable[[], Tensor]],
        params: list[Tensor],
        dtype: torch.dtype,
        seed: int,
        relative_length: float | None = None,
        gradient_change: float | None = None,
        storage: torch.device | None = None,
        initial_length: float | None = None,
        weights: Sequence[float] | None = None,
        shards: Shards | None = None,
        leaves: Sequence[Tensor] = (),
        model: torch.nn.Module | None = None,
    ) -> None:
        self.loss_fns, self.params, self.dtype, self.seed = list(loss_fns), params, dtype, seed
        self.weights = step_weights(self.loss_fns, weights)
        self.storage = storage if storage is not None else params[0].device
        self.shards = shards if shards is not None else Shards(params)
        self.sizes = self.shards.sizes
        mine = {id(p) for p in params}
        self.leaves = [*params, *(t for t in leaves if id(t) not in mine)]
        self.model = model
        self.evaluations = 0  # gradients of the step's whole loss taken
        self.fixed_length = relative_length
        self.target = gradient_change or GRADIENT_CHANGE[coarsest_dtype(params)]
        reason = _low_precision_policy(model)
        if reason is not None:
            raise ValueError(reason)
        with torch.no_grad():
            self.saved = [p.detach().clone() for p in params]
            theta = math.sqrt(self.shards.squares([local(p).detach() for p in params]))
        self.theta_norm = theta if theta > 0 else 1.0
        self.base = self._gradient()
        self.base_norm = self._norm(self.base)
        self.length = (
            relative_length or initial_length or FIRST_LENGTH
        ) * self.theta_norm  # ||h w||, product to product

    def __call__(self, v: Tensor, scale: Tensor) -> Tensor:
        """``H w`` for ``w = scale * v`` (flat, ``dtype``, on the storage device), ``w`` never held whole."""
        w_norm = math.sqrt(self.shards.squares([a * b for a, b in _pieces(v, scale, self.sizes)]))
        if not w_norm > 0:
            return torch.zeros_like(v)
        for attempt in range(_RETAKES + 1):
            h = self.length / w_norm
            difference = self._gradient_at(v, scale, h).sub_(self.base)
            change = self._norm(difference) / self.base_norm if self.base_norm > 0 else 0.0
            if self.fixed_length is not None or not math.isfinite(change) or change <= 0:
                break
            factor = self.target / change
            self.length = min(max(self.length * factor, _SHORTEST * self.theta_norm), _LONGEST * self.theta_norm)
            if 1 / _SLACK <= factor <= _SLACK or attempt == _RETAKES:
                break
        return difference.div_(h)

    @property
    def settled_length(self) -> float:
        """``||h w|| / ||theta||`` the rule settled on (what the next solve may start from)."""
        return self.length / self.theta_norm

    def restore(self) -> None:
        """The parameters back to the saved copy, bitwise."""
        with torch.no_grad():
            for p, saved in zip(self.params, self.saved, strict=True):
                local(p).copy_(local(saved))

    def _norm(self, flat: Tensor) -> float:
        return math.sqrt(self.shards.dots(flat.unsqueeze(0), flat.unsqueeze(0))[0].item())

    def _gradient_at(self, v: Tensor, scale: Tensor, h: float) -> Tensor:
        """The gradient at ``theta + h scale v``, the parameters copied back after it (also when it raises)."""
        try:
            with torch.no_grad():
                for p, saved, (a, b) in zip(self.params, self.saved, _pieces(v, scale, self.sizes), strict=True):
                    part = local(p)  # a shard is written in its own storage, which the model's forward gathers
                    part.copy_(local(saved) + (h * a * b).view_as(part).to(device=part.device, dtype=part.dtype))
            return self._gradient()
        finally:
            self.restore()

    def _gradient(self) -> Tensor:
        """The step's loss's gradient over the global batch, flat (local parts; one buffer).

        Across processes the plain parameters' parts are averaged (one all-reduce); a failure on any process stops
        every process at its next checkpoint (:mod:`connmon.curvature.lockstep`).
        """
        flat = torch.zeros(sum(self.sizes), dtype=self.dtype, device=self.storage)
        self._add_gradient(flat)
        self.shards.average_plain(flat)
        self.evaluations += 1
        return flat

    def _add_gradient(self, flat: Tensor) -> None:
        """The micro-batches' weighted gradients (local parts) added into ``flat``.

        Plain parameters: :func:`torch.autograd.grad`, ``.grad`` untouched. Sharded ones: the model's own backward,
        which reduces the shards' gradients across processes (FSDP2 averages them), with every ``.grad`` it may
        touch set aside before and put back after, bitwise (the same tensors).
        """
        lockstep = self.shards.lockstep
        if not self.shards.sharded:
            for loss_fn, weight in zip(self.loss_fns, self.weights, strict=True):
                torch.manual_seed(self.seed)
                with lockstep.armed(self.model), _autocast_inside(self.model), torch.enable_grad(), \
                        torch.autocast(self.params[0].device.type, enabled=False):  # fmt: skip
                    loss = scalar_loss(loss_fn)
                    lockstep.check()
                    grads = torch.autograd.grad(loss, self.params, allow_unused=True)
                for part, grad in zip(flat.split(self.sizes), grads, strict=True):
                    if grad is not None:
                        part.add_(grad.reshape(-1).to(device=self.storage, dtype=self.dtype), alpha=weight)
                del grads
            return
        kept: list[Tensor | None] = [t.grad for t in self.leaves]
        try:
            for t in self.leaves:
                t.grad = None
            with lockstep.armed(self.model), _autocast_inside(self.model):
                for loss_fn, weight in zip(self.loss_fns, self.weights, strict=True):
                    torch.manual_seed(self.seed)
                    with torch.enable_grad(), torch.autocast(self.params[0].device.type, enabled=False):
                        loss = scalar_loss(loss_fn) * weight
                        lockstep.check()  # the forward is done everywhere before any process's backward
                        loss.backward()
                    lockstep.check()
            for part, p in zip(flat.split(self.sizes), self.params, strict=True):
                if p.grad is not None:
                    part.copy_(local(p.grad).reshape(-1))
        except BaseException:
            settle(self.model)  # a forward or backward cut short leaves FSDP2 mid-iteration, gathered (perturbed)
            raise
        finally:
            for t, old in zip(self.leaves, kept, strict=True):
                t.grad = old


class DoubleBackwardProducts:
    """``w -> H w`` exactly, by double backward through one graph of the step's loss (see the module docstring)."""

    def __init__(
        self,
        loss_fns: Sequence[Callable[[], Tensor]],
        params: list[Tensor],
        dtype: torch.dtype,
        seed: int,
        weights: Sequence[float] | None = None,
        shards: Shards | None = None,
    ) -> None:
        self.shards = shards if shards is not None else Shards(params)
        if self.shards.sharded:
            raise ValueError(
                "exact products by double backward need unsharded parameters (FSDP2 has no double backward): use the "
                "gradient-difference products"
            )
        self.params, self.dtype = params, dtype
        self.sizes = [p.numel() for p in params]
        self.evaluations = 1
        torch.manual_seed(seed)
        with torch.enable_grad():
            pairs = zip(loss_fns, step_weights(loss_fns, weights), strict=True)
            loss = functools.reduce(operator.add, [weight * scalar_loss(loss_fn) for loss_fn, weight in pairs])
            grads = torch.autograd.grad(loss, params, create_graph=True, allow_unused=True)
        self.grads = grads
        self.live = [i for i, g in enumerate(grads) if g is not None and g.requires_grad]  # the rest: H is 0 there

    def __call__(self, v: Tensor, scale: Tensor) -> Tensor:
        """``H w`` for ``w = scale * v`` (flat, ``dtype``, on ``v``'s device)."""
        parts = [(a * b).view_as(p).to(p) for (a, b), p in zip(_pieces(v, scale, self.sizes), self.params, strict=True)]
        pieces = [torch.zeros(n, dtype=self.dtype, device=v.device) for n in self.sizes]
        if self.live:
            products = torch.autograd.grad(
                [self.grads[i] for i in self.live],
                [self.params[i] for i in self.live],
                grad_outputs=[parts[i] for i in self.live],
                retain_graph=True,
                allow_unused=True,
            )
            for i, product in zip(self.live, products, strict=True):
                if product is not None:
                    pieces[i] = product.reshape(-1).to(device=v.device, dtype=self.dtype)
        self.evaluations += 1
        product = torch.cat(pieces)
        self.shards.average_plain(product)  # under DDP: the global batch's Hessian, the mean of the processes'
        return product

    settled_length = math.nan  # no difference: the products are exact

    def restore(self) -> None:
        """Nothing to restore: the parameters are never written."""


def _low_precision_policy(model: torch.nn.Module | None) -> str | None:
    """Why ``model`` computes its forward below float32 whatever autocast says (FSDP2's policy), or None."""
    for module in model.modules() if model is not None else ():
        get_state = getattr(module, "_get_fsdp_state", None)  # FSDP2's module
        state = get_state() if callable(get_state) else None
        policy = getattr(state, "_mp_policy", None)
        dtype = getattr(policy, "param_dtype", None)
        if dtype is not None and dtype not in GRADIENT_CHANGE:
            return (
                f"FSDP2's MixedPrecisionPolicy(param_dtype={dtype}) gathers the weights in {dtype} for every forward: "
                "a difference of two such gradients is round-off (it read 56% low on the suite's model), and the "
                "policy cannot be lifted for the reading; keep param_dtype=None (float32 forwards, or autocast, "
                "under which the reading computes in float32) to read the curvature"
            )
        reduced = getattr(policy, "reduce_dtype", None)
        if reduced is not None and reduced not in GRADIENT_CHANGE:
            return (
                f"FSDP2's MixedPrecisionPolicy(reduce_dtype={reduced}) reduces every gradient in {reduced}: a "
                "difference of two such gradients is round-off; keep reduce_dtype=None or torch.float32 to read the "
                "curvature"
            )
    return None


@contextlib.contextmanager
def _autocast_inside(model: torch.nn.Module | None) -> Iterator[None]:
    """Refuse a forward of ``model`` that runs under autocast the loss function turned on (a ValueError)."""
    if model is None:
        yield
        return

    def check(module: torch.nn.Module, args: object) -> None:
        device = next((p.device.type for p in module.parameters()), "cpu")
        if torch.is_autocast_enabled(device):
            raise ValueError(
                f"the loss function runs the model under autocast ({torch.get_autocast_dtype(device)}): a difference "
                "of two low-precision gradients is round-off; leave autocast out of loss_fn (the reading turns the "
                "training's autocast off itself and computes in float32)"
            )

    handle = model.register_forward_pre_hook(check, prepend=True)
    try:
        yield
    finally:
        handle.remove()


def _pieces(v: Tensor, scale: Tensor, sizes: list[int]) -> zip:
    """``(v, scale)`` one parameter's slice at a time."""
    return zip(v.split(sizes), scale.split(sizes), strict=True)
