"""One :class:`connmon.Monitor` per Lightning ``Trainer``: the parts connmon's callbacks bring, put together once.

``ConnectionMonitor`` brings the attention sampling (its monitor becomes the run's), ``SharpnessMonitor`` the
curvature sampler, ``DriftAlert`` the rules and actions. Each callback registers its part in ``setup`` and forwards
its own trainer events to the run's monitor; the monitor runs curvature, rules, actions and logging as it does for
every entry point. No callback looks another up.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from connmon.alerts.runner import AlertRunner
from connmon.curvature.sampler import SharpnessSampler
from connmon.monitor import Monitor
from connmon.sinks.wandb import find_sink

_RUNS: weakref.WeakKeyDictionary[Trainer, LightningRun] = weakref.WeakKeyDictionary()


def run_of(trainer: Trainer) -> LightningRun:
    """The run of ``trainer``'s current fit (made at the first callback's ``setup``; one per process)."""
    run = _RUNS.get(trainer)
    if run is None:
        run = _RUNS[trainer] = LightningRun(trainer)
    return run


class LightningRun:
    """The parts registered for one fit, the one monitor they make, and what only a Lightning trainer does for it.

    The run's monitor is the first registered ``ConnectionMonitor``'s (a further one samples on its own, without
    the rules), else a monitor that reads no attention. It logs to every logger of the trainer; a stop request
    becomes ``trainer.should_stop``; a restore point is ``trainer.save_checkpoint`` once the optimizer stepped.
    """

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.attention: list[Monitor] = []
        self.sharpness: SharpnessSampler | None = None
        self.alerts: AlertRunner | None = None
        self.monitor: Monitor | None = None  # put together at the fit's start
        self._started = False
        self._ended = False
        self._step_at_batch_start = -1
        self._restore_root = "connmon_restore_points"
        self._curvature_listener: Callable[[int, dict[str, float]], None] | None = None

    # --- registration (each callback's setup) ---------------------------------------------------------------------

    def add_attention(self, monitor: Monitor) -> None:
        """A ``ConnectionMonitor``'s monitor; the first one is the run's."""
        if all(known is not monitor for known in self.attention):
            monitor.log = self.log
            self.attention.append(monitor)

    def add_sharpness(self, sampler: SharpnessSampler, listener: Callable[[int, dict[str, float]], None]) -> None:
        """A ``SharpnessMonitor``'s sampler, and its ``listener(step, values)`` of every curvature sample."""
        self.sharpness = sampler
        self._curvature_listener = listener

    def add_alerts(self, runner: AlertRunner) -> None:
        """A ``DriftAlert``'s rules and actions."""
        self.alerts = runner

    # --- the fit ----------------------------------------------------------------------------------------------------

    def begin(self, trainer: Trainer, pl_module: LightningModule) -> Monitor:
        """At the fit's start (every callback's ``on_fit_start``; the first call does it): the monitor, attached."""
        if self.monitor is not None:
            return self.monitor
        if self.alerts is not None and not self.attention and self.sharpness is None:
            rank_zero_warn("DriftAlert watches the values of a ConnectionMonitor, and the Trainer has none: add one")
        if self.attention:
            monitor = self.attention[0]
        else:
            monitor = Monitor(owner="SharpnessMonitor", log=self.log, attention=False, optimizer_hook=False)
        monitor.use(alerts=self.alerts, sharpness=self.sharpness)
        monitor.agree = lambda flag: trainer.strategy.reduce_boolean_decision(flag, all=False)
        sink = find_sink(trainer.loggers)
        for each in {*self.attention, monitor}:
            each.sink = sink
        if self.alerts is not None and self.alerts.restore_points is not None:
            self._restore_root = trainer.strategy.broadcast(_restore_root(trainer))
        monitor.add_listener(self._after_rules)
        monitor.add_listener(self._after_rules, of="curvature")
        if self._curvature_listener is not None:
            monitor.add_listener(self._curvature_listener, of="curvature")
        self.monitor = monitor
        for each in self.attention:
            if each.attach(pl_module) and not trainer.loggers and each is monitor:
                rank_zero_warn("ConnectionMonitor: no logger is attached, so its values are computed but not logged")
        if not self.attention:
            monitor.attach(pl_module)
        return monitor

    def start(self, trainer: Trainer) -> None:
        """The optimizers exist (``on_train_start``): the curvature and the back-off watch them."""
        if self.monitor is None or self._started:
            return
        self._started = True
        self.monitor.attach_optimizers(trainer.optimizers)

    def batch_started(self, trainer: Trainer) -> None:
        """Note the step, to act only once the optimizer has stepped."""
        self._step_at_batch_start = trainer.global_step

    def batch_ended(self, trainer: Trainer) -> None:
        """Once the optimizer stepped: a restore point an alert asked for is saved."""
        self._save_restore_point(trainer)

    def end(self, failed: bool = False) -> None:
        """The fit is over (``teardown``) or ``failed`` (``on_exception``): every hook goes, the parts go back.

        A failed fit's partial sample is forgotten.
        """
        if self._ended:
            return
        self._ended = True
        for monitor in self.attention:
            if failed:
                monitor.discard()
            monitor.close()
            monitor.log = None
        if self.monitor is not None:
            if not self.attention:  # the run's own curvature-only monitor: closed nowhere else
                self.monitor.close()
            self.monitor.use()
            self.monitor.agree = bool
            self.monitor.remove_listener(self._after_rules)
            self.monitor.remove_listener(self._after_rules, of="curvature")
            if self._curvature_listener is not None:
                self.monitor.remove_listener(self._curvature_listener, of="curvature")
        _RUNS.pop(self.trainer, None)

    # --- what the monitor calls ---------------------------------------------------------------------------------------

    def log(self, values: dict[str, float], step: int) -> None:
        """Every logger of the trainer (the monitor calls it on rank zero)."""
        for logger in self.trainer.loggers:
            logger.log_metrics(values, step=step)

    def rule_values(self) -> dict[str, float]:
        """The LightningModule's own logged scalars (``self.log``: loss, grad norm, ...) for the rules, if any."""
        if self.alerts is None:
            return {}
        scalars = {}
        for key, value in self.trainer.callback_metrics.items():
            if isinstance(value, Tensor) and value.numel() == 1:
                scalars[key] = float(value.item())
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                scalars[key] = float(value)
        return scalars

    def _after_rules(self, step: int, values: dict[str, float]) -> None:
        trainer = self.trainer
        if self.monitor is None or self.alerts is None:
            return
        if self.monitor.should_stop and not trainer.should_stop:
            trainer.should_stop = True
            self.alerts.say_stop("DriftAlert", step)
        self._save_restore_point(trainer)  # a sample ends in its callback's on_train_batch_end, before or after ours

    def _save_restore_point(self, trainer: Trainer) -> None:
        points = self.alerts.restore_points if self.alerts is not None else None
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
