"""StopRun: the ``"stop"`` action, a stop request when an alert reaches a level, agreed by every process."""

from __future__ import annotations

from typing import ClassVar

from connmon._options import check_choice
from connmon._ranks import warn_rank_zero
from connmon.alerts.action import AlertAction, Alerted
from connmon.alerts.rules import LEVELS, Level

__all__ = ["StopRun"]


class StopRun(AlertAction):
    """Asks the run to stop when an alert is at ``level`` or above (every process decides alike, ``agree``).

    The entry point carries the request out its trainer's way and says it once (:meth:`say`).

    Args:
        level: the lowest alert level that stops the run.

    Examples:
        >>> from connmon.alerts import Alert
        >>> from connmon.alerts.action import Alerted
        >>> from connmon.alerts.stop import StopRun
        >>> stop = StopRun("ERROR")
        >>> stop.answer(Alerted([Alert("edge", "x", 5, 1.3, 1.3, 1.0, None, "WARN")], step=5)); stop.requested
        False
        >>> stop.answer(Alerted([Alert("nan", "x", 6, float("nan"), 0.0, 0.0, None, "ERROR")], step=6)); stop.requested
        True
    """

    name: ClassVar[str] = "stop"

    def __init__(self, level: Level = "ERROR") -> None:
        check_choice("stop_level", level, LEVELS)
        self.level = level
        self.requested = False  # the latest sample's alerts ask the run to stop

    def answer(self, alerted: Alerted) -> None:
        """Whether this sample's alerts stop the run, agreed across processes."""
        threshold = LEVELS.index(self.level)
        self.requested = alerted.agree(any(LEVELS.index(alert.level) >= threshold for alert in alerted.alerts))

    def say(self, owner: str, step: int) -> None:
        """The one line the entry point that stops its trainer says (rank zero)."""
        warn_rank_zero(f"{owner} stops the run at step {step} (an alert at level >= {self.level})")
