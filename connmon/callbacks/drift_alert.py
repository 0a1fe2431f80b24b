"""DriftAlert: runs alert rules on every sample of a ConnectionMonitor and acts on what they raise."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Literal

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities import rank_zero_only, rank_zero_warn

from connmon.alerts import LEVELS, Alert, Level, Rule, RuleSet, default_rules
from connmon.callbacks.connection_monitor import ConnectionMonitor

Action = Literal["log", "wandb", "stop"]
ACTIONS: tuple[Action, ...] = ("log", "wandb", "stop")


class DriftAlert(Callback):
    """Raises alerts when the values a :class:`ConnectionMonitor` computes drift, and acts on them.

    On every sample of the monitor (every process, synced values) the rules run; each alert is

    * ``"log"``: a rank-zero warning with the evidence (key, value, baseline, step);
    * ``"wandb"``: a W&B ``run.alert`` (title, text, level, ``wait_duration``) when a ``WandbLogger`` is attached;
    * ``"stop"``: if its level is at least ``stop_level``, the run stops (``trainer.should_stop``), decided the
      same way on every process through ``strategy.reduce_boolean_decision``;
    * passed to ``on_alert(alert)`` if given (on every process; an exception there is reported, not raised).

    Alerts are also logged to every logger as ``connmon/alerts/count`` (this sample) and ``connmon/alerts/total``.
    The rules' state (baselines, cooldowns, counts) is saved in checkpoints, so a resumed run neither re-learns
    nor re-alerts. The default rules and how they were chosen are in :func:`connmon.alerts.default_rules`.

    An alert can come no sooner than the monitor's next sample. On the instability suite of benchmarks/README.md
    the attention signals warned 30-50 steps before divergence, so alerting wants a dense, light monitor, such as
    ``ConnectionMonitor(every_n_steps=5, diagnostics=("walk",))`` (the walk group holds entropy and max logit).

    Args:
        rules: the rules; None for :func:`connmon.alerts.default_rules`.
        actions: any of ``"log"``, ``"wandb"``, ``"stop"``.
        stop_level: the lowest level that stops the run (with ``"stop"`` in ``actions``).
        on_alert: called with every :class:`connmon.alerts.Alert`.
        wait_duration: seconds W&B waits before sending another alert with the same title.
        history: how many recent alerts ``self.alerts`` keeps.

    Raises:
        ValueError: for an unknown action or level, or duplicate rule names.

    Example:
        >>> import lightning as L
        >>> from connmon.callbacks import ConnectionMonitor, DriftAlert
        >>> monitor = ConnectionMonitor(every_n_steps=5, diagnostics=("walk",))
        >>> callbacks = [monitor, DriftAlert(actions=("log", "stop"))]
        >>> trainer = L.Trainer(callbacks=callbacks, logger=False, enable_progress_bar=False)
    """

    def __init__(
        self,
        rules: Sequence[Rule] | None = None,
        actions: Sequence[Action] = ACTIONS,
        stop_level: Level = "ERROR",
        on_alert: Callable[[Alert], Any] | None = None,
        wait_duration: float = 300.0,
        history: int = 100,
    ) -> None:
        unknown = [a for a in actions if a not in ACTIONS]
        if unknown:
            raise ValueError(f"actions must be a subset of {ACTIONS}, got {tuple(actions)}")
        if stop_level not in LEVELS:
            raise ValueError(f"stop_level must be one of {LEVELS}, got stop_level={stop_level!r}")
        if history < 0:
            raise ValueError(f"history must be >= 0, got history={history}")
        self.rules = RuleSet(default_rules() if rules is None else rules)
        self.actions = tuple(actions)
        self.stop_level = stop_level
        self.on_alert = on_alert
        self.wait_duration = wait_duration
        self.alerts: deque[Alert] = deque(maxlen=history)
        self.total = 0
        self._listening: ConnectionMonitor | None = None
        self._wandb: Any = None

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Listen to the trainer's ConnectionMonitor (warn if there is none) and find a WandbLogger."""
        monitors = [cb for cb in trainer.callbacks if isinstance(cb, ConnectionMonitor)]
        if not monitors:
            rank_zero_warn("DriftAlert watches the values of a ConnectionMonitor, and the Trainer has none: add one")
        elif self._listening is not monitors[0]:
            monitors[0].add_listener(self._on_sample)
            self._listening = monitors[0]
        self._wandb = None
        if "wandb" in self.actions:
            for logger in trainer.loggers:
                if isinstance(logger, WandbLogger):
                    from connmon.loggers.wandb import WandbSink

                    self._wandb = WandbSink(logger)
                    break

    def state_dict(self) -> dict[str, Any]:
        """The rules' state and the alert count."""
        return {"rules": self.rules.state_dict(), "total": self.total}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved."""
        self.rules.load_state_dict(state_dict.get("rules", {}))
        self.total = state_dict.get("total", 0)

    def _on_sample(self, trainer: Trainer, step: int, values: dict[str, float]) -> None:
        alerts = self.rules.update(values, step)
        self.total += len(alerts)
        self.alerts.extend(alerts)
        self._report(trainer, step, alerts)
        for alert in alerts:
            if self.on_alert is not None:
                try:
                    self.on_alert(alert)
                except Exception as error:  # a user's handler must not end the training run
                    rank_zero_warn(f"DriftAlert: on_alert raised {type(error).__name__}: {error}; the run goes on")
        if "stop" in self.actions:
            stop = any(LEVELS.index(a.level) >= LEVELS.index(self.stop_level) for a in alerts)
            if trainer.strategy.reduce_boolean_decision(stop, all=False):
                trainer.should_stop = True
                rank_zero_warn(f"DriftAlert stops the run at step {step} (an alert at level >= {self.stop_level})")

    @rank_zero_only
    def _report(self, trainer: Trainer, step: int, alerts: list[Alert]) -> None:
        for logger in trainer.loggers:
            logger.log_metrics({"connmon/alerts/count": len(alerts), "connmon/alerts/total": self.total}, step=step)
        for alert in alerts:
            if "log" in self.actions:
                rank_zero_warn(f"{alert.title} [{alert.level}]: {alert.text}")
            if self._wandb is not None:
                self._wandb.alert(alert.title, alert.text, alert.level, self.wait_duration)
