"""WandbAlerts: the ``"wandb"`` action, each alert a W&B ``run.alert`` on rank zero."""

from __future__ import annotations

from typing import ClassVar

from connmon._options import check_number
from connmon._ranks import is_rank_zero
from connmon.alerts.action import AlertAction, Alerted

__all__ = ["WandbAlerts"]


class WandbAlerts(AlertAction):
    """Each alert as a W&B alert (title, text, level), when the run has a W&B sink; rank zero only.

    Args:
        wait_duration: seconds W&B waits before sending another alert with the same title.

    Examples:
        >>> from connmon.alerts import Alert
        >>> from connmon.alerts.action import Alerted
        >>> from connmon.alerts.wandb_alerts import WandbAlerts
        >>> class Sink:
        ...     def alert(self, title, text, level, wait):
        ...         print(level, wait)
        >>> alert = Alert("edge", "connmon/sharpness_ratio", 120, 1.3, 1.3, 1.0, None, "WARN")
        >>> WandbAlerts(wait_duration=60).answer(Alerted([alert], step=120, wandb=Sink()))
        WARN 60.0
    """

    name: ClassVar[str] = "wandb"

    def __init__(self, wait_duration: float = 300.0) -> None:
        check_number("wait_duration", wait_duration, low=0)
        self.wait_duration = float(wait_duration)

    def answer(self, alerted: Alerted) -> None:
        """One W&B alert per alert (rank zero, with a sink)."""
        if alerted.wandb is None or not is_rank_zero():
            return
        for alert in alerted.alerts:
            alerted.wandb.alert(alert.title, alert.text, alert.level, self.wait_duration)
