"""DriftAlert: runs alert rules on every sample of a ConnectionMonitor and acts on what they raise."""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

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
from connmon.callbacks.connection_monitor import ConnectionMonitor
from connmon.callbacks.sharpness_monitor import SharpnessMonitor
from connmon.sinks.wandb import find_sink


class DriftAlert(Callback):
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
        self._listening: ConnectionMonitor | None = None
        self._listening_curvature: SharpnessMonitor | None = None
        self._wandb: Any = None
        self._step_at_batch_start = -1
        self._restore_root = "connmon_restore_points"

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

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Listen to the trainer's ConnectionMonitor and SharpnessMonitor (warn if neither) and find a WandbLogger."""
        monitors = [cb for cb in trainer.callbacks if isinstance(cb, ConnectionMonitor)]
        curvature = [cb for cb in trainer.callbacks if isinstance(cb, SharpnessMonitor)]
        if not monitors and not curvature:
            rank_zero_warn("DriftAlert watches the values of a ConnectionMonitor, and the Trainer has none: add one")
        if monitors and self._listening is not monitors[0]:
            monitors[0].add_listener(self._on_sample)
            self._listening = monitors[0]
        if monitors:  # the regime rules' early samples, whatever the monitor's cadence
            sampler = monitors[0].monitor
            sampler.extra_steps = self.rules.regime_steps(sampler.options.every_n_steps)
            sampler.qk_clip = self.runner.qk_clip  # read and applied where the logits are: the monitor's steps
            sampler.transport_clip = self.runner.transport_clip
        if curvature and self._listening_curvature is not curvature[0]:
            curvature[0].add_listener(self._on_curvature)
            self._listening_curvature = curvature[0]
        if self.runner.restore_points is not None:
            self._restore_root = trainer.strategy.broadcast(_restore_root(trainer))
        self._wandb = find_sink(trainer.loggers) if "wandb" in self.runner.actions else None

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """With ``"backoff"``: scale the learning rate inside the optimizers' steps once a back-off fired."""
        self.runner.attach(trainer.optimizers, "DriftAlert")

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        """Note the step, to save a restore point only once the optimizer has stepped (after a whole batch)."""
        self._step_at_batch_start = trainer.global_step

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """With ``"checkpoint"``: save the restore point an alert asked for, once the optimizer stepped."""
        self._save_restore_point(trainer)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Remove the back-off's optimizer hooks."""
        self.runner.detach()

    def state_dict(self) -> dict[str, Any]:
        """The rules' state, the alert count and the back-off's scale."""
        return self.runner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved."""
        self.runner.load_state_dict(state_dict)

    def _on_sample(self, trainer: Trainer, step: int, values: dict[str, float]) -> None:
        self._run(trainer, step, {**_logged_scalars(trainer), **values})
        self._save_restore_point(trainer)  # the monitor's samples end in its on_train_batch_end, before or after ours

    def _on_curvature(self, trainer: Trainer, step: int, values: dict[str, float]) -> None:
        self._run(trainer, step, values)
        if self._listening_curvature is not None:
            self._listening_curvature.sampler.hold_for(self.rules)

    def _run(self, trainer: Trainer, step: int, values: dict[str, float]) -> None:
        alerts, stop = self.runner.run(values, step, wandb=self._wandb)
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(self.runner.counts(alerts), step=step)
        points = self.runner.restore_points
        if points is not None and trainer.strategy.reduce_boolean_decision(points.due is not None, all=False):
            points.due = step if points.due is None else points.due
        if "stop" in self.runner.actions and trainer.strategy.reduce_boolean_decision(stop, all=False):
            trainer.should_stop = True
            self.runner.say_stop("DriftAlert", step)

    def _save_restore_point(self, trainer: Trainer) -> None:
        points = self.runner.restore_points
        if points is None or points.due is None or trainer.global_step == self._step_at_batch_start:
            return  # nothing asked, or inside a step (its first micro-batches): after the optimizer steps
        if trainer.sanity_checking or trainer.state.fn != "fit":
            return
        step = trainer.global_step
        path = trainer.strategy.broadcast(points.path(step, root=self._restore_root))  # rank zero's name everywhere
        points.save_due(step, path, trainer.save_checkpoint, trainer.strategy.remove_checkpoint, owner="DriftAlert")


def _restore_root(trainer: Trainer) -> str:
    """Where ModelCheckpoint would save, with ``connmon_restore_points`` for ``checkpoints``."""
    if not trainer.loggers:
        return os.path.join(trainer.default_root_dir, "connmon_restore_points")
    logger = trainer.loggers[0]
    version = logger.version if isinstance(logger.version, str) else f"version_{logger.version}"
    save_dir = logger.save_dir if logger.save_dir is not None else trainer.default_root_dir
    return os.path.join(save_dir, str(logger.name), version, "connmon_restore_points")


def _logged_scalars(trainer: Trainer) -> dict[str, float]:
    """The LightningModule's own logged scalars (``self.log``: loss, grad norm, ...) as floats, for the rules."""
    scalars = {}
    for key, value in trainer.callback_metrics.items():
        if isinstance(value, Tensor) and value.numel() == 1:
            scalars[key] = float(value.item())
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            scalars[key] = float(value)
    return scalars
