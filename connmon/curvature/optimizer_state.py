"""What the optimizer's own state says after each step, read in one ``torch._foreach`` pass: free per-step signals.

For Adam and AdamW, with ``m_hat = m / (1 - beta1^t)`` and ``v_hat = v / (1 - beta2^t)`` each coordinate's
bias-corrected moments and ``u = m_hat / (sqrt(v_hat) + eps)`` its normalized update:

* ``update_rms``: the root mean square of ``u`` over every coordinate the optimizer updates (near 1 when each
  gradient keeps its sign, smaller when it is noise);
* ``stale_second_moment``: the share of coordinates where ``|u| > 1``: ``|m_hat| > sqrt(v_hat) + eps``, the second
  moment out of date against the gradients the first moment already holds (Wortsman et al. 2023b; Molybog et al.
  2023): such a coordinate's update is larger than Adam's bound of one;
* ``update_to_weight``: ``||lr u|| / ||theta||`` over every parameter (the decoupled decay left out);
* ``gradient_to_second_moment``: ``sum g^2 / sum v_hat`` over every coordinate, ``g`` the gradient the step read and
  ``v_hat`` its second moment after the step (this gradient included): how far the second moment stands from the
  gradients it divides now (Bai et al. 2026's decoupling; low when ``v_hat`` holds the memory of larger gradients,
  a stale second moment). Logged as its median over the readings of the last :data:`MEDIAN_STEPS` steps.

``amsgrad`` divides by the running maximum of ``v_hat``, and so does the reading. RMSprop and Adagrad give
``update_rms`` (of their normalized step ``g / (sqrt(v) + eps)``, RMSprop's momentum aside) and ``update_to_weight``;
SGD with momentum (its buffer is the update direction; Nesterov's step is ``g + momentum * buffer``) only
``update_to_weight``. Coupled weight decay is solved for from the parameters after the step. Another kind of
optimizer is said once and read not at all (:func:`unread_reason`). A parameter sharded over
processes (a DTensor: FSDP2, tensor parallelism) adds its local part; a replicated one (DDP, or a norm beside tensor
parallel weights) adds its part once over all processes; the sums cross processes in one all-reduce, so every process
reads the whole model's values.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

import torch
from torch import Tensor

from connmon import keys
from connmon._collectives import is_distributed, local, process_count, sum_over_processes
from connmon._optimizer import unwrap_optimizer
from connmon._ranks import warn_rank_zero

__all__ = ["OPTIMIZER_SIGNALS", "READ_KINDS", "OptimizerSignalWindow", "optimizer_signals", "unread_reason"]

OPTIMIZER_SIGNALS = ("update_rms", "stale_second_moment", "update_to_weight", "gradient_to_second_moment")
SIGNAL_KEYS = dict(zip(OPTIMIZER_SIGNALS, (keys.UPDATE_RMS, keys.STALE_SECOND_MOMENT, keys.UPDATE_TO_WEIGHT,
                                           keys.GRADIENT_TO_SECOND_MOMENT), strict=True))  # fmt: skip
MEDIAN_STEPS = 50  # gradient_to_second_moment is logged as its median over the readings of this many steps


class OptimizerSignalWindow:
    """Every step's :func:`optimizer_signals`, kept as the largest of each since they were last taken.

    A monitor reads it after each optimizer step (:meth:`read`) and logs what :meth:`take` returns at its next
    sample, as ``connmon/<signal>``: a spike between two samples is not averaged away.

    Examples:
        >>> import torch
        >>> from connmon.curvature.optimizer_state import OptimizerSignalWindow
        >>> weight = torch.nn.Parameter(torch.ones(2))
        >>> optimizer = torch.optim.SGD([weight], lr=0.01, momentum=0.9)
        >>> window = OptimizerSignalWindow()
        >>> for gradient in (3.0, -3.0, 0.0):  # update-to-weight 0.031, 0.003, 0.003
        ...     weight.grad = torch.full((2,), gradient)
        ...     optimizer.step()
        ...     _ = window.read(optimizer)
        >>> {k: round(v, 3) for k, v in window.take().items()}, window.take()
        ({'connmon/update_to_weight': 0.031}, {})
    """

    def __init__(self, owner: str = "connmon") -> None:
        self.largest: dict[str, float] = {}
        self.recent: list[tuple[int, float]] = []  # (step, gradient_to_second_moment) of the last MEDIAN_STEPS steps
        self._fresh = False  # one was read since the last take()
        self.owner = owner  # named in what it says
        self._said: set[str] = set()  # an optimizer kind it cannot read, a non-finite update: each said once

    def read(self, optimizer: torch.optim.Optimizer, step: int | None = None) -> dict[str, float]:
        """This step's signals as ``connmon/<signal>`` (a collective under ``torch.distributed``), folded in.

        A non-finite value is kept over any later finite one until :meth:`take` (and said once, with ``step``, the
        steps taken); an optimizer kind it cannot read is said once (:func:`unread_reason`).
        """
        reason = unread_reason(optimizer)
        if reason is not None:
            self._say("unread", f"{self.owner}: {reason}")
            return {}
        values = {SIGNAL_KEYS[name]: value for name, value in optimizer_signals(optimizer).items()}
        ratio = values.get(keys.GRADIENT_TO_SECOND_MOMENT)
        if ratio is not None:  # a level read over many steps, not a spike: kept apart
            now = step if step is not None else (self.recent[-1][0] + 1 if self.recent else 0)
            self.recent = [(at, kept) for at, kept in self.recent if at > now - MEDIAN_STEPS] + [(now, ratio)]
            self._fresh = True
        for key, value in values.items():
            if key == keys.GRADIENT_TO_SECOND_MOMENT:
                continue
            kept = self.largest.get(key)
            if kept is None or math.isnan(value) or (not math.isnan(kept) and value > kept):
                self.largest[key] = value
            if not math.isfinite(value):
                after = f" after step {step}" if step is not None else ""
                self._say("nonfinite", f"{self.owner}: the optimizer's update is non-finite{after} ({key} {value}); "
                                       "the window logged at the next sample keeps it (said once)")  # fmt: skip
        return values

    def _say(self, what: str, line: str) -> None:
        if what not in self._said:
            self._said.add(what)
            warn_rank_zero(line)

    def take(self) -> dict[str, float]:
        """The largest of each signal since the last call (empty when no step was read), and a fresh window.

        ``gradient_to_second_moment`` is the median of its readings over the last :data:`MEDIAN_STEPS` steps (a
        level, read alike whenever the samples come), when one was read since the last call.
        """
        largest, self.largest = self.largest, {}
        if self.recent and self._fresh:
            largest[keys.GRADIENT_TO_SECOND_MOMENT] = statistics.median(value for _, value in self.recent)
        self._fresh = False
        return largest

    def state_dict(self) -> dict[str, Any]:
        """The window not logged yet: the largest of each signal, and the readings the median is taken over."""
        return {**self.largest, "recent": [list(pair) for pair in self.recent], "fresh": self._fresh}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved."""
        state = dict(state)
        self.recent = [(int(at), float(value)) for at, value in state.pop("recent", [])]
        self._fresh = bool(state.pop("fresh", False))
        self.largest = {key: float(value) for key, value in state.items()}


READ_KINDS = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.RMSprop, torch.optim.Adagrad)


@torch.no_grad()
def optimizer_signals(optimizer: torch.optim.Optimizer) -> dict[str, float]:
    """The update the optimizer just took, read from its state, as :data:`OPTIMIZER_SIGNALS` (those its kind has).

    Adam and AdamW (``amsgrad`` too: it divides by the running maximum of ``v``) give all three; RMSprop and Adagrad
    ``update_rms`` (of their normalized step ``g / (sqrt(v) + eps)``; with RMSprop's momentum, only
    ``update_to_weight``) and ``update_to_weight``; SGD with momentum (Nesterov's too: ``g + momentum * buffer``)
    ``update_to_weight``. Empty for another kind (:func:`unread_reason` says why) and before the first step. Read in
    the optimizer's step post-hook, before the gradients are cleared (Nesterov and RMSprop without momentum read them).
    Every process must call it at the same step under ``torch.distributed`` (one all-reduce of five sums).

    Examples:
        >>> import torch
        >>> from connmon.curvature.optimizer_state import optimizer_signals
        >>> weight = torch.nn.Parameter(torch.ones(4))
        >>> optimizer = torch.optim.Adam([weight], lr=0.1)
        >>> weight.grad = torch.tensor([1.0, -1.0, 2.0, -2.0])
        >>> optimizer.step()
        >>> {k: round(v, 3) for k, v in optimizer_signals(optimizer).items()}
        {'update_rms': 1.0, 'stale_second_moment': 0.0, 'update_to_weight': 0.1, 'gradient_to_second_moment': 1.0}
    """
    optimizer = unwrap_optimizer(optimizer)
    if not isinstance(optimizer, READ_KINDS):
        return {}
    adam = isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW))
    processes = process_count()
    sums: list[Tensor] = []  # per group: sum (lr u)^2, sum u^2, coordinates, stale ones, sum theta^2, g^2, v_hat
    normalized = adam  # whether u is a normalized step whose RMS is read
    for group in optimizer.param_groups:
        params = [p for p in group["params"] if _has_state(optimizer, p, group)]
        if not params:
            continue
        state = [optimizer.state[p] for p in params]
        weights = [local(p.detach()).float() for p in params]
        device = weights[0].device
        share = torch.tensor([1.0 if _sharded(p) else 1.0 / processes for p in params], device=device)
        u, lr, group_normalized = _update(optimizer, group, params, state=state, weights=weights)
        normalized = normalized or group_normalized
        squares = torch.stack(torch._foreach_norm(u)).square()
        zeros = torch.zeros(len(params), device=device)
        stale, gradient, second = zeros, zeros, zeros
        if adam:
            stale = torch.stack([torch.count_nonzero(t.abs() > 1) for t in u]).float()
            gradient = torch.stack([_gradient(p).square().sum() if p.grad is not None else zeros[0] for p in params])
            beta2 = group["betas"][1]
            second = torch.stack([local(s["exp_avg_sq"]).float().sum() / (1 - beta2 ** float(s["step"]))
                                  for s in state])  # fmt: skip
        counts = torch.tensor([float(t.numel()) for t in u], device=device)
        theta = torch.stack(torch._foreach_norm(weights)).square()
        lrs = torch.tensor(lr, device=device).square()
        parts = torch.stack([squares * lrs, squares, counts, stale, theta, gradient, second])
        sums.append((parts * share).sum(1))
    if not sums:
        return {}
    total = torch.stack(sums).sum(0)
    if is_distributed():
        sum_over_processes(total)
    update, squares, count, stale, theta, gradient, second = total.tolist()
    values = {"update_to_weight": math.sqrt(update / theta) if theta > 0 else math.nan}
    if normalized and count > 0:
        values = {"update_rms": math.sqrt(squares / count), **values}
    if adam and count > 0:
        values = {"update_rms": values["update_rms"], "stale_second_moment": stale / count, **values}
        if second > 0:
            values["gradient_to_second_moment"] = gradient / second
    return values


def unread_reason(optimizer: Any) -> str | None:
    """Why :func:`optimizer_signals` reads nothing of ``optimizer``'s kind (None: it reads it).

    Examples:
        >>> import torch
        >>> from connmon.curvature.optimizer_state import unread_reason
        >>> weight = torch.nn.Parameter(torch.ones(2))
        >>> unread_reason(torch.optim.Adam([weight])) is None
        True
        >>> unread_reason(torch.optim.Adamax([weight]))  # doctest: +ELLIPSIS
        'connmon reads the update of Adam, AdamW, SGD, RMSprop and Adagrad from their state; Adamax is none of them...'
    """
    optimizer = unwrap_optimizer(optimizer)
    if isinstance(optimizer, READ_KINDS):
        return None
    names = ", ".join(kind.__name__ for kind in READ_KINDS[:-1]) + f" and {READ_KINDS[-1].__name__}"
    return (
        f"connmon reads the update of {names} from their state; {type(optimizer).__name__} is none of them, so no "
        "update_rms, stale_second_moment or update_to_weight is logged for it"
    )


def _update(
    optimizer: torch.optim.Optimizer, group: dict, params: list[Tensor], state: list[dict], weights: list[Tensor]
) -> tuple[list[Tensor], list[float], bool]:
    """Each parameter's step ``u`` (the parameter moved by ``lr * u``, decoupled decay aside), its ``lr``, normalized?

    Coupled weight decay (SGD's, RMSprop's, Adagrad's) entered the step with the parameter before it, ``theta +
    lr u``; it is solved for from the parameter after it.
    """
    lr = float(group["lr"])
    decay = float(group.get("weight_decay", 0.0))
    sign = -1.0 if group.get("maximize", False) else 1.0
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        beta1, beta2 = group["betas"]
        steps = [float(s["step"]) for s in state]
        # u = m_hat / (sqrt(v_hat) + eps) = m / (c1 sqrt(v) / sqrt(c2) + c1 eps), c = 1 - beta^t: one buffer made
        second = "max_exp_avg_sq" if group.get("amsgrad", False) else "exp_avg_sq"
        denominator = torch._foreach_sqrt([local(s[second]).float() for s in state])
        torch._foreach_mul_(denominator, [(1 - beta1**t) / math.sqrt(1 - beta2**t) for t in steps])
        torch._foreach_add_(denominator, [(1 - beta1**t) * float(group["eps"]) for t in steps])
        return (
            list(torch._foreach_div([local(s["exp_avg"]).float() for s in state], denominator)),
            [lr] * len(params),
            True,
        )
    if isinstance(optimizer, torch.optim.SGD):
        buffers = [local(s["momentum_buffer"]).float() for s in state]
        if not group.get("nesterov", False):
            return buffers, [lr] * len(params), False
        # the step was g + decay theta_before + momentum buffer, theta_before = theta + lr u
        momentum = float(group["momentum"])
        taken = [(_gradient(p) * sign + b * momentum + w * decay) / (1 - lr * decay)
                 for p, b, w in zip(params, buffers, weights, strict=True)]  # fmt: skip
        return taken, [lr] * len(params), False
    if isinstance(optimizer, torch.optim.RMSprop):
        if group.get("momentum", 0) > 0:
            return [local(s["momentum_buffer"]).float() for s in state], [lr] * len(params), False
        average = [local(s["square_avg"]).float() for s in state]
        if group.get("centered", False):
            average = [a - local(s["grad_avg"]).float().square() for a, s in zip(average, state, strict=True)]
        root = [a.sqrt() + float(group["eps"]) for a in average]
        u = [(sign * _gradient(p) + decay * w) / (r - lr * decay)
             for p, w, r in zip(params, weights, root, strict=True)]  # fmt: skip
        return u, [lr] * len(params), True
    # Adagrad: lr decayed by its step count; its sum already holds this step's gradient
    rates = [lr / (1 + (float(s["step"]) - 1) * float(group.get("lr_decay", 0.0))) for s in state]
    root = [local(s["sum"]).float().sqrt() + float(group["eps"]) for s in state]
    u = [(sign * _gradient(p) + decay * w) / (r - rate * decay)
         for p, w, r, rate in zip(params, weights, root, rates, strict=True)]  # fmt: skip
    return u, rates, True


def _gradient(parameter: Tensor) -> Tensor:
    """The gradient the step just read (this process's part), in float32; its parameters have one (``_has_state``)."""
    assert parameter.grad is not None
    return local(parameter.grad).float()


def _has_state(optimizer: torch.optim.Optimizer, parameter: Tensor, group: dict) -> bool:
    """Whether ``parameter`` stepped and its state holds what its update is read from."""
    state = optimizer.state.get(parameter, {})
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return "exp_avg" in state and "exp_avg_sq" in state
    if isinstance(optimizer, torch.optim.SGD):
        has_buffer = state.get("momentum_buffer") is not None
        return has_buffer and (not group.get("nesterov", False) or parameter.grad is not None)
    if isinstance(optimizer, torch.optim.RMSprop) and group.get("momentum", 0) > 0:
        return state.get("momentum_buffer") is not None
    stepped = bool(state) and float(state.get("step", 0)) > 0  # Adagrad's state exists from its construction
    return stepped and parameter.grad is not None  # RMSprop, Adagrad: this step's gradient is read


def _sharded(parameter: Tensor) -> bool:
    """Whether each process holds only a part of ``parameter`` (a DTensor with a ``Shard`` placement)."""
    return any(placement.is_shard() for placement in getattr(parameter, "placements", ()))
