"""The curvature along the optimizer's own update: :class:`UpdateProbe` (a difference or a secant of two gradients)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

from connmon._collectives import local, process_count, sum_over_processes
from connmon._optimizer import unwrap_optimizer
from connmon.curvature.geometry import optimizer_kind, parameter_steps, widened
from connmon.curvature.lockstep import Lockstep, PeerFailure, settle
from connmon.curvature.ratio import scalar_at, training_state_kept

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
        optimizer_kind(optimizer)
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
        sizes, self._constant = parameter_steps(self.optimizer, self._lr_scale)
        index = {id(p): i for i, p in enumerate(self.params)}
        sums = _Sums(4)  # u^T U^-1 u, u^T u wd, g_t . u, |g_t|^2 (clipped, if it was)
        with torch.no_grad():
            for p, size, wd in sizes:
                u = self._update(index[id(p)])
                squares = u * u
                step_size = local(size) if isinstance(size, Tensor) else size
                sums.add(p, (squares / step_size).sum(dtype=torch.float64), wd * squares.sum(dtype=torch.float64))
                if p.grad is not None:
                    grad = widened(local(p.grad))
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
        world = process_count()
        lockstep = Lockstep(world, local(self.params[0]).device if self.params else device)
        with training_state_kept(model, device), torch.no_grad():
            state = "now"  # which point the parameters hold: now, before (theta - u), ahead (theta + u)
            try:
                with lockstep.armed(model):  # a failure on one process stops all: none waits in a gather
                    losses.append(scalar_at(loss_fn, seed))
                    lockstep.check()
                    for p, saved in zip(self.params, self._before, strict=True):  # the parameters at theta - u
                        now = p.detach().clone()
                        p.copy_(saved)
                        saved.copy_(now)  # the probe's copy holds theta now
                    state = "before"
                    losses.append(scalar_at(loss_fn, seed))
                    lockstep.check()
                    for p, saved in zip(self.params, self._before, strict=True):  # theta + u = 2 theta - (theta - u)
                        p.neg_().add_(saved, alpha=2)
                    state = "ahead"
                    losses.append(scalar_at(loss_fn, seed))
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
                    sums.add(p, (widened(local(p.grad)) * self._update(i)).sum(dtype=torch.float64))
        self._used = True
        (slope,) = sums.total()
        return self._result(slope - self._slope, "secant")

    def _update(self, i: int) -> Tensor:
        """``u`` of parameter ``i`` (its local shard), in float32 at least."""
        return widened(local(self.params[i]).detach()) - widened(local(self._before[i]))

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
                sums.add(p, widened(local(p.grad)).square().sum(dtype=torch.float64))
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
            sum_over_processes(sharded, self.group)
            plain = plain.to(sharded.device) + sharded
        return plain.tolist()
