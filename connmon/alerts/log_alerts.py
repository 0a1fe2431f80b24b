"""LogAlerts: the ``"log"`` action, each alert a warning with its evidence on rank zero."""

from __future__ import annotations

from typing import ClassVar

from connmon._ranks import is_rank_zero, warn_rank_zero
from connmon.alerts.action import AlertAction, Alerted

__all__ = ["LogAlerts"]


class LogAlerts(AlertAction):
    """Each alert as one rank-zero warning: ``<title> [<level>]: <text>`` (the key, value, baseline and step).

    Examples:
        >>> import warnings
        >>> from connmon.alerts import Alert
        >>> from connmon.alerts.action import Alerted
        >>> from connmon.alerts.log_alerts import LogAlerts
        >>> alert = Alert("edge", "connmon/sharpness_ratio", 120, 1.3, 1.3, 1.0, None, "WARN")
        >>> with warnings.catch_warnings(record=True) as said:
        ...     warnings.simplefilter("always")
        ...     LogAlerts().answer(Alerted([alert], step=120))
        >>> str(said[0].message).startswith(alert.title)
        True
    """

    name: ClassVar[str] = "log"

    def answer(self, alerted: Alerted) -> None:
        """Warn once per alert (rank zero)."""
        if is_rank_zero():
            for alert in alerted.alerts:
                warn_rank_zero(f"{alert.title} [{alert.level}]: {alert.text}")
