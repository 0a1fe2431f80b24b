"""The curvature along the optimizer's own update: :class:`UpdateProbe` (a difference or a secant of two gradients)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch
from torch import Tensor, nn

from connmon._collectives import local, process_count, sum_over_processes
from connmon._optimizer import unwrap_optimizer
from connmon.curvature.geometry import optimizer_kind, parameter_steps, widened
from connmon.curvature.lockstep import Lockstep, PeerFailure, release_gathered, settle
from connmon.curvature.ratio import scalar_at, training_state_kept

Reading = Literal["difference", "secant"]


READINGS: tuple[Reading, ...] = get_args(Reading)


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


@dataclass(frozen=True)
class CriticalSharpness:
    """How far the update the optimizer took stands from the step that would raise its batch's loss.

    Attributes:
        ratio: ``eta / eta_c``: the step taken over the smallest step along the same update that raises the loss
            (1: the step just raises it; above 1, past the edge along the update; the orientation of
            ``sharpness_ratio``). ``2 / eta_c`` is Kalra et al.'s critical sharpness (arXiv 2601.16979).
        critical_step: ``eta_c / eta``, where the loss along the update first rises above its value before the step
            (bounded to ``[1/64, 64]``: a loss that still falls at 64 steps reads ``ratio = 1/64``).
        forwards: the forward passes of the whole step's batch the line search took (the loss before the step
            included).
    """

    ratio: float
    critical_step: float
    forwards: int


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
                with _in_lockstep(lockstep, model):
                    losses.append(scalar_at(loss_fn, seed))
                    release_gathered(model)  # FSDP2's root keeps what it gathered: the next point gathers afresh
                    lockstep.check()
                    for p, saved in zip(self.params, self._before, strict=True):  # the parameters at theta - u
                        now = p.detach().clone()
                        p.copy_(saved)
                        saved.copy_(now)  # the probe's copy holds theta now
                    state = "before"
                    losses.append(scalar_at(loss_fn, seed))
                    release_gathered(model)  # FSDP2's root keeps what it gathered: the next point gathers afresh
                    lockstep.check()
                    for p, saved in zip(self.params, self._before, strict=True):  # theta + u = 2 theta - (theta - u)
                        p.neg_().add_(saved, alpha=2)
                    state = "ahead"
                    losses.append(scalar_at(loss_fn, seed))
                    release_gathered(model)  # FSDP2's root keeps what it gathered: the next point gathers afresh
                    lockstep.check()
            finally:
                if state != "now":
                    for p, saved in zip(self.params, self._before, strict=True):
                        p.copy_(saved)
                release_gathered(model)
                self._used = True
        now, before, ahead = losses
        return self._result(ahead + before - 2 * now, "difference")

    def critical(
        self,
        loss_fns: Sequence[Callable[[], Tensor]],
        *,
        weights: Sequence[float] | None = None,
        model: nn.Module | None = None,
        seed: int = 0,
        start: float = 1.0,
    ) -> CriticalSharpness:
        """``eta / eta_c`` by a line search of forwards along the update just taken, on the step's own batch.

        ``phi(t)`` is the weighted sum of ``loss_fns()`` (the step's micro-batches: ``weights`` as the training put on
        each, None for their mean) with the parameters at ``theta_before + t u``: ``t = 1`` is the step taken. Under
        ``torch.distributed`` it is the mean over every process (the global batch's loss; one all-reduce a forward),
        so every process brackets alike.
        ``eta_c / eta`` is the smallest ``t > 0`` where ``phi(t)`` rises above ``phi(0)``: bracketed from ``start``
        (the previous reading's, a warm start) by doubling or halving, then placed by the quadratic through
        ``phi(0)`` and the bracket's two ends (exact on a quadratic loss). Forwards only, under ``no_grad``, each
        with the random streams reseeded by ``seed`` (the training run's streams untouched, its buffers restored
        when ``model`` is given); the parameters are restored bitwise, also when a forward raises. It holds a second
        copy of the parameters while it runs. Call it after :meth:`stepped`, before the next ``optimizer.step()``.

        Raises:
            ValueError: if :meth:`stepped` was not called, the probe was read before, a loss is not a scalar, or
                ``start`` is not positive.

        Examples:
            >>> import torch
            >>> from connmon.curvature import UpdateProbe
            >>> w = torch.nn.Parameter(torch.tensor([1.0, 1.0]))
            >>> h = torch.tensor([1.0, 30.0])  # a quadratic: H = diag(1, 30)
            >>> loss_fn = lambda: 0.5 * (h * w * w).sum()
            >>> optimizer = torch.optim.SGD([w], lr=0.05)
            >>> loss_fn().backward()
            >>> probe = UpdateProbe(optimizer)
            >>> optimizer.step()
            >>> probe.stepped()
            >>> u = -0.05 * h * torch.tensor([1.0, 1.0])  # the step: eta / eta_c = u^T H u / (-2 g . u)
            >>> read = probe.critical([loss_fn])
            >>> round(read.ratio, 6), round(((h * u * u).sum() / (-2 * (h * u).sum())).item(), 6)
            (0.749195, 0.749195)
        """
        self._check()
        if not start > 0:
            raise ValueError(f"start must be a positive multiple of the step, got start={start!r}")
        from connmon.curvature.products import step_weights

        factors = step_weights(list(loss_fns), weights)
        device = self.params[0].device if self.params else torch.device("cpu")
        world = process_count()
        lockstep = Lockstep(world, local(self.params[0]).device if self.params else device)
        forwards = 0
        with training_state_kept(model, device), torch.no_grad():
            after = [p.detach().clone() for p in self.params]  # theta_before + u, put back at the end

            def phi(t: float) -> float:
                nonlocal forwards
                for p, before, now in zip(self.params, self._before, after, strict=True):
                    p.copy_(before + t * (now - before) if t != 1 else now)
                pairs = zip(loss_fns, factors, strict=True)
                value = sum(factor * scalar_at(loss_fn, seed) for loss_fn, factor in pairs)
                release_gathered(model)  # FSDP2's root keeps what it gathered: the next point gathers afresh
                lockstep.check()
                forwards += 1
                if world == 1:
                    return value
                total = torch.tensor([value], dtype=torch.float64, device=local(self.params[0]).device)
                return float(sum_over_processes(total)[0]) / world  # the global batch's: every process decides alike

            try:
                with _in_lockstep(lockstep, model):
                    rise = _line_search(phi, start)
            finally:
                for p, now in zip(self.params, after, strict=True):
                    p.copy_(now)
                release_gathered(model)  # FSDP2: the next training forward gathers the restored shards
                self._used = True
        return CriticalSharpness(1 / rise, rise, forwards)

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


@contextlib.contextmanager
def _in_lockstep(lockstep: Lockstep, model: nn.Module | None) -> Iterator[None]:
    """Forwards of a reading: a failure on one process stops all (none waits in a collective), FSDP2 settled."""
    try:
        with lockstep.armed(model):
            yield
    except PeerFailure:
        settle(model)
        raise
    except Exception:
        settle(model)
        lockstep.announce()
        raise


SHORTEST_STEP, LONGEST_STEP = 1 / 64, 64.0  # the line search's bounds, in multiples of the step taken


def _line_search(phi: Callable[[float], float], start: float) -> float:
    """The smallest ``t > 0`` where ``phi(t) > phi(0)``: bracketed by doubling or halving from ``start``, then placed.

    Within the bracket ``[t1, t2]`` (``phi(t1) <= phi(0) < phi(t2)``) the root of the quadratic ``a t + b t^2``
    through ``(0, 0)``, ``(t1, f1)`` and ``(t2, f2)`` (``f = phi - phi(0)``), or the chord's where that quadratic does
    not open upward. Bounded to :data:`SHORTEST_STEP` and :data:`LONGEST_STEP`.
    """
    base = phi(0.0)
    t = min(max(start, SHORTEST_STEP), LONGEST_STEP)
    f = phi(t) - base
    if f > 0:  # the crossing is below t: halve until the loss no longer rises
        high, f_high = t, f
        while True:
            t /= 2
            if t < SHORTEST_STEP:
                return SHORTEST_STEP
            f = phi(t) - base
            if not f > 0:
                low, f_low = t, f
                break
            high, f_high = t, f
    else:  # double until it rises
        low, f_low = t, f
        while True:
            t *= 2
            if t > LONGEST_STEP:
                return LONGEST_STEP
            f = phi(t) - base
            if f > 0:
                high, f_high = t, f
                break
            low, f_low = t, f
    if not (math.isfinite(f_low) and math.isfinite(f_high)):
        return high  # a non-finite loss at the bracket's top: the rise is there
    b = (f_high / high - f_low / low) / (high - low)
    a = f_low / low - b * low
    if b > 0 and a < 0:
        return min(max(-a / b, low), high)
    return low + (high - low) * (-f_low) / (f_high - f_low) if f_high != f_low else high


def _grad_square(params: list[Tensor]) -> float:
    sums = _Sums(1)
    with torch.no_grad():
        for p in params:
            if p.grad is not None:
                sums.add(p, widened(local(p.grad)).square().sum(dtype=torch.float64))
    return sums.total()[0]


class _Sums:
    """Sums over parameters kept on their device (one host copy at the end), added across the shards of sharded ones.

    A sharded parameter (a DTensor with a ``Shard`` placement, as FSDP2 and tensor parallelism make) contributes its
    local shard; those parts are summed across the processes of its 1-D device mesh. Replicated parameters (DDP, and a
    ``Replicate`` DTensor such as a row-parallel layer's bias) hold the same values everywhere and are not.
    """

    def __init__(self, count: int) -> None:
        self.plain: list[Tensor | float] = [0.0] * count
        self.sharded: list[Tensor | float] = [0.0] * count
        self.group: Any = None

    def add(self, p: Tensor, *values: Tensor | float) -> None:
        target = self.plain  # a replicated DTensor (a row-parallel layer's bias) holds its whole value everywhere
        if hasattr(p, "device_mesh") and any(placement.is_shard() for placement in getattr(p, "placements", ())):
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
