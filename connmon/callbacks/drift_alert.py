"""DriftAlert: runs alert rules on every sample of a ConnectionMonitor and acts on what they raise."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from lightning.pytorch import LightningModule, Trainer

from connmon.alerts import (
    DEFAULT_ACTIONS,
    Action,
    Alert,
    AlertRunner,
    AllOf,
    LearningRateBackoff,
    Level,
    QKClip,
    RestorePoints,
    Rule,
    RuleSet,
    TransportClip,
)
from connmon.callbacks._run import LightningRun, RunPart


class DriftAlert(RunPart):
    """Raises alerts when the values a :class:`ConnectionMonitor` (or a :class:`SharpnessMonitor`) computes drift.

    On every sample of the monitor (every process, synced values) the rules run; each alert is

    * ``"log"``: a rank-zero warning with the evidence (key, value, baseline, step);
    * ``"wandb"``: a W&B ``run.alert`` (title, text, level, ``wait_duration``) when a ``WandbLogger`` is attached;
    * ``"stop"``: if its level is at least ``stop_level``, the run stops (``trainer.should_stop``), decided the
      same way on every process through ``strategy.reduce_boolean_decision``;
    * ``"backoff"`` (opt-in): when the edge-of-stability rule fires, every parameter group's learning rate is
      scaled by ``backoff.factor`` inside the optimizer's steps (a scheduler never undoes it), with a cooldown, the
      same on every process, saved in checkpoints, logged as ``connmon/lr_scale`` and said in one line
      (:class:`connmon.alerts.LearningRateBackoff`);
    * ``"checkpoint"`` (opt-in): at an alert of level ``restore_points.level`` or above (default ``"WARN"``), a
      restore point: ``trainer.save_checkpoint`` at the end of that optimizer step, to
      ``connmon_restore_points/step=<N>.ckpt`` beside ModelCheckpoint's ``checkpoints`` directory (the first
      logger's ``<save_dir>/<name>/<version>``, else ``default_root_dir``) or in ``restore_points.dirpath``, the last
      ``restore_points.keep`` (3) kept, the path said in one line. It is a complete Lightning checkpoint:
      ``trainer.fit(model, ckpt_path=path)`` resumes from it (:class:`connmon.alerts.RestorePoints`);
    * passed to ``on_alert(alert)`` if given (on every process; an exception there is reported, not raised).

    Rules see the monitor's keys and the LightningModule's own logged scalars (``trainer.callback_metrics``, what
    ``self.log`` wrote: ``"train_loss"``, a gradient norm, ...) at the monitor's sample, so one rule set can combine a
    loss spike with a geometric signal (:class:`connmon.alerts.AllOf`). Under DDP, log those with ``sync_dist=True``
    so every process sees the same values. Alerts are also logged to every logger as ``connmon/alerts/count`` (this
    sample) and ``connmon/alerts/total``. The rules' state (baselines, cooldowns, counts) is saved in checkpoints,
    so a resumed run neither re-learns nor re-alerts. The default rules and how they were chosen are in
    :func:`connmon.alerts.default_rules`. A :class:`SharpnessMonitor`'s samples are shown to the rules on their own
    steps, its keys only, so a rule over ``connmon/sharpness_ratio`` sees each measurement once.

    An alert can come no sooner than the monitors' next sample. The default rules read every head's max logit over
    the whole batch of every step (the ConnectionMonitor's ``logit_every_n_steps``) and, for the edge rules, a
    :class:`SharpnessMonitor`'s curvature (their leads and false alarms on the mechanisms benchmark:
    docs/monitoring.md). A rule that watches only a run's first steps (``until=``) gets the samples it needs: a
    sparse ConnectionMonitor also samples them (:meth:`connmon.alerts.RuleSet.regime_steps`). By default an
    ``ERROR`` alert (non-finite attention) stops the run.

    Args:
        rules: the rules; None for :func:`connmon.alerts.default_rules`.
        actions: any of ``"log"``, ``"wandb"``, ``"stop"``, ``"backoff"``, ``"checkpoint"``, ``"qk_clip"``,
            ``"transport_clip"`` (the trainer's ConnectionMonitor applies the clips after the optimizer steps).
        stop_level: the lowest level that stops the run (with ``"stop"`` in ``actions``).
        on_alert: called with every :class:`connmon.alerts.Alert`.
        wait_duration: seconds W&B waits before sending another alert with the same title.
        history: how many recent alerts ``self.alerts`` keeps.
        backoff: the :class:`connmon.alerts.LearningRateBackoff` of ``"backoff"`` (None: factor 0.5, cooldown 100).
        restore_points: the :class:`connmon.alerts.RestorePoints` of ``"checkpoint"`` (None: level ``"WARN"``, 3
            kept, beside ModelCheckpoint's directory).
        qk_clip: the :class:`connmon.alerts.QKClip` of ``"qk_clip"`` (None: threshold 100).
        transport_clip: the :class:`connmon.alerts.TransportClip` of ``"transport_clip"`` (None: factor 2).

    Raises:
        ValueError: for an unknown action or level, or duplicate rule names.

    Examples:
        >>> import lightning as L
        >>> from connmon.callbacks import ConnectionMonitor, DriftAlert
        >>> monitor = ConnectionMonitor(every_n_steps=5, diagnostics=("walk",))
        >>> callbacks = [monitor, DriftAlert(actions=("log", "stop"))]
        >>> trainer = L.Trainer(callbacks=callbacks, logger=False, enable_progress_bar=False)
    """

    def __init__(
        self,
        rules: Sequence[Rule | AllOf] | None = None,
        actions: Sequence[Action] = DEFAULT_ACTIONS,
        stop_level: Level = "ERROR",
        on_alert: Callable[[Alert], Any] | None = None,
        wait_duration: float = 300.0,
        history: int = 100,
        backoff: LearningRateBackoff | None = None,
        restore_points: RestorePoints | None = None,
        qk_clip: QKClip | None = None,
        transport_clip: TransportClip | None = None,
    ) -> None:
        self.runner = AlertRunner(
            rules, actions, stop_level, on_alert, wait_duration, history, backoff, restore_points, qk_clip,
            transport_clip,
        )  # fmt: skip

    @property
    def rules(self) -> RuleSet:
        """The rules and their state."""
        return self.runner.rules

    @property
    def alerts(self) -> deque[Alert]:
        """The most recent alerts."""
        return self.runner.alerts

    @property
    def total(self) -> int:
        """Alerts raised so far in this run (a resumed run included)."""
        return self.runner.total

    def join(self, run: LightningRun, trainer: Trainer) -> None:
        """On fit: hand the rules and actions to the Trainer's run (its monitor runs them on every sample)."""
        run.add_alerts(self, self.runner)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        """Remove the back-off's optimizer hooks if the run fails."""
        super().on_exception(trainer, pl_module, exception)
        self.runner.detach()

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Remove the back-off's optimizer hooks."""
        super().teardown(trainer, pl_module, stage)
        self.runner.detach()

    def state_dict(self) -> dict[str, Any]:
        """The rules' state, the alert count and the back-off's scale."""
        return self.runner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved."""
        self.runner.load_state_dict(state_dict)
