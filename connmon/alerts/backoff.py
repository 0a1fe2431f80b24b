"""Acting on the curvature warning before the spike: scale the learning rate down when the edge rule fires.

The scale is applied inside ``optimizer.step()`` only: a step pre-hook multiplies every parameter group's ``lr`` by
it and the step post-hook puts the group's own value back. A learning-rate scheduler, which reads and writes
``group["lr"]`` between steps, never sees the scale, so none can undo it (``LambdaLR``, ``OneCycleLR``, Lightning's
scheduler configuration, the Hugging Face Trainer's), and a run on which no back-off fired is never touched: with a
scale of 1 the hooks do nothing. The curvature readings (:mod:`connmon.curvature`) read the rate the step applies:
:meth:`LearningRateBackoff.pending_scale`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch.utils.hooks import RemovableHandle

from connmon import keys
from connmon._copying import CopiesDetached
from connmon._optimizer import unwrap_optimizer
from connmon._options import check_number
from connmon._ranks import warn_rank_zero
from connmon.alerts.action import AlertAction, Alerted


class LearningRateBackoff(CopiesDetached, AlertAction):
    """Scales every parameter group's learning rate by ``factor`` when one of ``rules`` alerts.

    At most once per ``cooldown`` steps; the scale multiplies (two back-offs: ``factor ** 2``). The decision comes
    from the alerts, which come from synced values, so every process scales at the same step.

    Args:
        factor: the scale each back-off multiplies in, in (0, 1).
        cooldown: steps after a back-off during which another alert does not scale again.
        rules: the names of the rules that back off (default: the edge-of-stability rules).

    Raises:
        ValueError: for a factor outside (0, 1), a negative cooldown, or rules that are not names.

    Examples:
        >>> import torch
        >>> from connmon.alerts.backoff import LearningRateBackoff
        >>> weight = torch.nn.Parameter(torch.ones(2))
        >>> optimizer = torch.optim.SGD([weight], lr=0.1)
        >>> backoff = LearningRateBackoff(factor=0.5, cooldown=10)
        >>> backoff.attach([optimizer])
        >>> backoff.fire(step=3), backoff.fire(step=5), backoff.scale
        (True, False, 0.5)
        >>> weight.grad = torch.ones(2)
        >>> optimizer.step()  # a step of lr 0.05; the group still says 0.1
        >>> weight.tolist(), optimizer.param_groups[0]["lr"]
        ([0.95, 0.95], 0.1)
    """

    _not_copied = (("_handles", list), ("_optimizers", list), ("_saved", dict))  # a copy is attached to nothing
    name: ClassVar[str] = "backoff"
    state_key: ClassVar[str | None] = "backoff"

    def __init__(
        self,
        factor: float = 0.5,
        cooldown: int = 100,
        rules: Sequence[str] = (keys.EDGE_RULE, keys.LOGIT_EDGE_RULE, keys.PAST_EDGE_RULE),
    ) -> None:
        check_number("factor", factor, low=0, high=1, low_open=True, high_open=True)
        check_number("cooldown", cooldown, low=0, integer=True)
        if isinstance(rules, str) or not all(isinstance(rule, str) for rule in rules):
            raise ValueError(f"rules must be a list of rule names, got rules={rules!r}")
        self.factor, self.cooldown, self.rules = float(factor), cooldown, tuple(rules)
        self.scale = 1.0
        self.last_step: int | None = None
        self._handles: list[RemovableHandle] = []
        self._saved: dict[int, list[tuple[dict, Any]]] = {}  # per optimizer inside its step: (group, its own lr)
        self._optimizers: list[torch.optim.Optimizer] = []

    def attach(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        """Apply the scale inside each optimizer's steps from now on (attaching again replaces the hooks)."""
        self.detach()
        for optimizer in optimizers:
            optimizer = unwrap_optimizer(optimizer)
            self._handles.append(optimizer.register_step_pre_hook(self._scale))
            self._handles.append(optimizer.register_step_post_hook(self._restore))
            self._optimizers.append(optimizer)

    def detach(self) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles, self._optimizers = [], []

    def pending_scale(self, optimizer: Any) -> float:
        """The factor this back-off applies to ``optimizer``'s rates at its next step (1.0: none, or not attached).

        Inside the step, where the groups already hold the scaled rate, it is 1.0: ``group["lr"] * pending_scale`` is
        the rate the step applies, before, during and after it. The curvature is read at that rate
        (``connmon.curvature.sharpness_ratio(..., lr_scale=...)``).

        Examples:
            >>> import torch
            >>> from connmon.alerts import LearningRateBackoff
            >>> optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
            >>> backoff = LearningRateBackoff(factor=0.5)
            >>> backoff.attach([optimizer])
            >>> backoff.pending_scale(optimizer), backoff.fire(step=0), backoff.pending_scale(optimizer)
            (1.0, True, 0.5)
        """
        optimizer = unwrap_optimizer(optimizer)
        if not any(optimizer is attached for attached in self._optimizers) or id(optimizer) in self._saved:
            return 1.0
        return self.scale

    def answer(self, alerted: Alerted) -> None:
        """Back off when one of :attr:`rules` alerted (outside the cooldown), and say it in one line."""
        fired = sorted({alert.rule for alert in alerted.alerts if alert.rule in self.rules})
        if fired and self.fire(alerted.step):
            warn_rank_zero(
                f"connmon: the learning rate is scaled by {self.factor:g} from step {alerted.step} on (now "
                f"{self.scale:g} of what the optimizer's groups and scheduler set): {', '.join(fired)}"
            )

    def fire(self, step: int) -> bool:
        """Back off at ``step`` unless within the cooldown of the last back-off; whether it did.

        An optimizer inside its step (an alert raised in its closure, as Lightning runs the forward and backward)
        takes the new scale at once: torch's optimizers read their rates after the closure.
        """
        if self.last_step is not None and step - self.last_step < self.cooldown:
            return False
        self.scale *= self.factor
        self.last_step = step
        for saved in self._saved.values():
            self._apply(saved)
        return True

    def state_dict(self) -> dict[str, Any]:
        """The scale and the step of the last back-off (a resumed run keeps both)."""
        return {"scale": self.scale, "last_step": self.last_step}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved."""
        self.scale = float(state_dict.get("scale", 1.0))
        self.last_step = state_dict.get("last_step")

    def _scale(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._restore(optimizer, args, kwargs)  # a step that raised left its post-hook unrun
        self._saved[id(optimizer)] = [(group, group["lr"]) for group in optimizer.param_groups]
        self._apply(self._saved[id(optimizer)])

    def _apply(self, saved: list[tuple[dict, Any]]) -> None:
        """Each group's own rate times the scale (a scale of 1 leaves the groups untouched)."""
        if self.scale != 1.0:
            for group, lr in saved:
                group["lr"] = lr * self.scale

    def _restore(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for group, lr in self._saved.pop(id(optimizer), ()):
            group["lr"] = lr
