"""DriftAlert: runs alert rules on every sample of a ConnectionMonitor and acts on what they raise."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from typing_extensions import Unpack

from connmon.alerts import Alert, AlertRunner, AllOf, Rule, RuleSet
from connmon.alerts.runner import AlertOptions
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
        runner: an :class:`connmon.alerts.AlertRunner` to run, in place of ``rules`` and ``**options``.
        **options: the runner's options by keyword, declared, defaulted and checked once by
            :class:`connmon.alerts.AlertRunner` (typed by :class:`connmon.alerts.runner.AlertOptions`):
            ``actions`` (any of ``"log"``, ``"wandb"``, ``"stop"``, ``"backoff"``, ``"checkpoint"``, ``"qk_clip"``,
            ``"transport_clip"``; the trainer's ConnectionMonitor applies the clips after the optimizer steps),
            ``stop_level``, ``on_alert``, ``wait_duration``, ``history``, ``backoff``, ``restore_points``,
            ``qk_clip``, ``transport_clip``.

    Raises:
        TypeError: for a keyword that is not one of the runner's options.
        ValueError: for an unknown action or level, duplicate rule names, or a ``runner`` given with ``rules`` or
            options.

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
        *,
        runner: AlertRunner | None = None,
        **options: Unpack[AlertOptions],
    ) -> None:
        if runner is not None and (rules is not None or options):
            raise ValueError(
                "DriftAlert takes its rules and actions either as runner=AlertRunner(...) or as rules= and keywords, "
                f"not both (given: runner and {['rules'] * (rules is not None) + sorted(options)})"
            )
        if runner is not None and not isinstance(runner, AlertRunner):
            raise ValueError(f"runner must be a connmon.alerts.AlertRunner or None, got {type(runner).__name__}")
        self.runner = runner if runner is not None else AlertRunner(rules, **options)

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
