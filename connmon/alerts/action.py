"""AlertAction: the one interface every action that answers alerts implements.

An action answers a sample's alerts (:meth:`AlertAction.answer`: a warning, a W&B alert, a stop, a learning-rate
back-off, a restore point) and keeps its state in a checkpoint through :meth:`AlertAction.state_dict`.
:class:`connmon.alerts.AlertRunner` holds one per name in its ``actions`` and calls each in one order. The clips act
after every optimizer step instead, not on alerts: they are step actions (:mod:`connmon.alerts.step_clips`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

from connmon.alerts.rules import Alert

__all__ = ["AlertAction", "Alerted"]


@dataclasses.dataclass(frozen=True)
class Alerted:
    """What the actions answer: one sample's ``alerts`` at ``step``, the W&B sink (or None), the processes' ``agree``.

    ``agree(flag)`` is a decision every process takes together (any process's True is every process's).
    """

    alerts: Sequence[Alert]
    step: int
    wandb: Any = None
    agree: Callable[[bool], bool] = bool


class AlertAction:
    """One action of the alert runner: its ``name`` in ``actions``, its answer to alerts, its saved state.

    Examples:
        >>> from connmon.alerts.action import AlertAction, Alerted
        >>> class Count(AlertAction):
        ...     name = "count"
        ...     seen = 0
        ...     def answer(self, alerted):
        ...         self.seen += len(alerted.alerts)
        >>> action = Count()
        >>> action.answer(Alerted([], step=3)), action.seen, action.state_dict()
        (None, 0, None)
    """

    name: ClassVar[str]  # as in AlertRunner's actions
    state_key: ClassVar[str | None] = None  # its key in AlertRunner.state_dict (None: nothing to save)

    def answer(self, alerted: Alerted) -> None:
        """Act on one sample's alerts (every process calls it, with the same alerts)."""

    def state_dict(self) -> dict[str, Any] | None:
        """What a checkpoint keeps of the action (None: nothing)."""
        return None

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved."""
