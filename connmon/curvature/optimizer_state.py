"""What the optimizer's own state says after each step, read in one ``torch._foreach`` pass: free per-step signals.

For Adam and AdamW, with ``m_hat = m / (1 - beta1^t)`` and ``v_hat = v / (1 - beta2^t)`` each coordinate's
bias-corrected moments and ``u = m_hat / (sqrt(v_hat) + eps)`` its normalized update:

* ``update_rms``: the root mean square of ``u`` over every coordinate the optimizer updates (near 1 when each
  gradient keeps its sign, smaller when it is noise);
* ``stale_second_moment``: the share of coordinates where ``|u| > 1``: ``|m_hat| > sqrt(v_hat) + eps``, the second
  moment out of date against the gradients the first moment already holds (Wortsman et al. 2023b; Molybog et al.
  2023): such a coordinate's update is larger than Adam's bound of one;
* ``update_to_weight``: ``||lr u|| / ||theta||`` over every parameter (the decoupled decay left out).

For SGD with momentum (its buffer is the update direction) only ``update_to_weight`` applies. A parameter sharded over
processes (a DTensor: FSDP2, tensor parallelism) adds its local part; a replicated one (DDP, or a norm beside tensor
parallel weights) adds its part once over all processes; the sums cross processes in one all-reduce, so every process
reads the whole model's values.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from connmon import keys
from connmon._collectives import is_distributed, local, process_count, sum_over_processes
from connmon._optimizer import unwrap_optimizer

__all__ = ["OPTIMIZER_SIGNALS", "OptimizerSignalWindow", "optimizer_signals"]

OPTIMIZER_SIGNALS = ("update_rms", "stale_second_moment", "update_to_weight")
SIGNAL_KEYS = dict(
    zip(OPTIMIZER_SIGNALS, (keys.UPDATE_RMS, keys.STALE_SECOND_MOMENT, keys.UPDATE_TO_WEIGHT), strict=True)
)


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

    def __init__(self) -> None:
        self.largest: dict[str, float] = {}

    def read(self, optimizer: torch.optim.Optimizer) -> dict[str, float]:
        """This step's signals as ``connmon/<signal>`` (a collective under ``torch.distributed``), folded in."""
        values = {SIGNAL_KEYS[name]: value for name, value in optimizer_signals(optimizer).items()}
        for key, value in values.items():
            kept = self.largest.get(key)
            self.largest[key] = value if kept is None or not value <= kept else kept  # NaN is kept: it says most
        return values

    def take(self) -> dict[str, float]:
        """The largest of each signal since the last call (empty when no step was read), and a fresh window."""
        largest, self.largest = self.largest, {}
        return largest

    def state_dict(self) -> dict[str, float]:
        """The window not logged yet."""
        return dict(self.largest)

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore what :meth:`state_dict` saved."""
        self.largest = dict(state)


@torch.no_grad()
def optimizer_signals(optimizer: torch.optim.Optimizer) -> dict[str, float]:
    """The optimizer's state after a step, as :data:`OPTIMIZER_SIGNALS` (those its kind has; empty for another kind).

    Every process must call it at the same step under ``torch.distributed`` (one all-reduce of five sums).

    Examples:
        >>> import torch
        >>> from connmon.curvature.optimizer_state import optimizer_signals
        >>> weight = torch.nn.Parameter(torch.ones(4))
        >>> optimizer = torch.optim.Adam([weight], lr=0.1)
        >>> weight.grad = torch.tensor([1.0, -1.0, 2.0, -2.0])
        >>> optimizer.step()
        >>> {k: round(v, 3) for k, v in optimizer_signals(optimizer).items()}
        {'update_rms': 1.0, 'stale_second_moment': 0.0, 'update_to_weight': 0.1}
    """
    optimizer = unwrap_optimizer(optimizer)
    adam = isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW))
    if not adam and not isinstance(optimizer, torch.optim.SGD):
        return {}
    processes = process_count()
    sums: list[Tensor] = []  # per group: [sum (lr u)^2, sum u^2, coordinates, stale coordinates, sum theta^2]
    for group in optimizer.param_groups:
        params = [p for p in group["params"] if _has_state(optimizer.state.get(p, {}), adam)]
        if not params:
            continue
        state = [optimizer.state[p] for p in params]
        weights = [local(p.detach()).float() for p in params]
        device = weights[0].device
        share = torch.tensor([1.0 if _sharded(p) else 1.0 / processes for p in params], device=device)
        if adam:
            beta1, beta2 = group["betas"]
            steps = [float(s["step"]) for s in state]
            # u = m_hat / (sqrt(v_hat) + eps) = m / (c1 sqrt(v) / sqrt(c2) + c1 eps), c = 1 - beta^t: one buffer made
            denominator = torch._foreach_sqrt([local(s["exp_avg_sq"]).float() for s in state])
            scales = [(1 - beta1**t) / math.sqrt(1 - beta2**t) for t in steps]
            torch._foreach_mul_(denominator, scales)
            torch._foreach_add_(denominator, [(1 - beta1**t) * float(group["eps"]) for t in steps])
            u = list(torch._foreach_div([local(s["exp_avg"]).float() for s in state], denominator))
        else:
            u = [local(s["momentum_buffer"]).float() for s in state]
        squares = torch.stack(torch._foreach_norm(u)).square()
        if adam:
            torch._foreach_abs_(u)
            stale = torch.stack([torch.count_nonzero(t > 1) for t in u]).float()
        else:
            stale = torch.zeros(len(params), device=device)
        counts = torch.tensor([float(t.numel()) for t in u], device=device)
        theta = torch.stack(torch._foreach_norm(weights)).square()
        lr = float(group["lr"])
        parts = torch.stack([squares * lr**2, squares, counts, stale, theta])
        sums.append((parts * share).sum(1))
    if not sums:
        return {}
    total = torch.stack(sums).sum(0)
    if is_distributed():
        sum_over_processes(total)
    update, squares, count, stale, theta = total.tolist()
    values = {"update_to_weight": math.sqrt(update / theta) if theta > 0 else math.nan}
    if adam and count > 0:
        values = {"update_rms": math.sqrt(squares / count), "stale_second_moment": stale / count, **values}
    return values


def _has_state(state: dict, adam: bool) -> bool:
    """Whether a parameter's state holds what its signals read (Adam's moments, SGD's momentum buffer)."""
    if adam:
        return "exp_avg" in state and "exp_avg_sq" in state
    return state.get("momentum_buffer") is not None


def _sharded(parameter: Tensor) -> bool:
    """Whether each process holds only a part of ``parameter`` (a DTensor with a ``Shard`` placement)."""
    return any(placement.is_shard() for placement in getattr(parameter, "placements", ()))
