"""One :class:`connmon.Monitor` per Lightning ``Trainer``, over the parts connmon's callbacks bring.

``ConnectionMonitor`` brings an attention sampler (several compose: each samples on its own cadence, every one's
values go to the rules), ``SharpnessMonitor`` the curvature sampler, ``DriftAlert`` the rules and actions. Each
callback registers its part in ``setup`` and forwards every trainer event to the run (:class:`RunPart`); the run
translates the events of the first registered callback into the monitor's protocol, once per event, and carries out
each step's :class:`connmon.monitor.StepOutcome` the Lightning way (``trainer.should_stop``,
``trainer.save_checkpoint``). No callback looks another up.
"""

from __future__ import annotations

import abc
import os
import weakref
from collections.abc import Callable
from functools import partial
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from connmon.alerts.runner import AlertRunner
from connmon.attention_sampler import AttentionSampler
from connmon.curvature.sampler import SharpnessSampler
from connmon.monitor import Monitor, RestorePointWriter, StepOutcome
from connmon.sinks.wandb import find_sink
from connmon.step_options import StepOptions, run_step_options

_RUNS: weakref.WeakKeyDictionary[Trainer, LightningRun] = weakref.WeakKeyDictionary()
Listener = Callable[[int, dict[str, float]], None]


def run_of(trainer: Trainer) -> LightningRun:
    """The run of ``trainer``'s current fit (made at the first callback's ``setup``; one per process)."""
    run = _RUNS.get(trainer)
    if run is None:
        run = _RUNS[trainer] = LightningRun(trainer)
    return run


def running(trainer: Trainer | None) -> LightningRun | None:
    """The run of ``trainer``'s fit if one is under way (None outside a fit)."""
    return _RUNS.get(trainer) if trainer is not None else None


class LightningRun:
    """The parts registered for one fit, the monitor over them, and what only a Lightning trainer does for it.

    The monitor logs to every logger of the trainer; a stop becomes ``trainer.should_stop``; a restore point is
    ``trainer.save_checkpoint`` once the optimizer stepped.
    """

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.samplers: list[tuple[AttentionSampler, Listener, dict[str, Any] | None]] = []
        self.sharpness: SharpnessSampler | None = None
        self.loss_fn: Callable[..., Tensor] | None = None
        self.alerts: AlertRunner | None = None
        self.monitor: Monitor | None = None  # put together at the fit's start
        self._driver: Callback | None = None  # the callback whose events the run translates (the first registered)
        self._parts: list[RunPart] = []  # every callback registered
        self._curvature_listener: Listener | None = None
        self._sharpness_steps: StepOptions | None = None
        self._saved_signals: dict[str, Any] | None = None
        self._started = False
        self._ended = False
        self._step_at_batch_start = -1
        self._first_micro_batch = True  # the next batch starts an optimizer step
        self._restore_root = "connmon_restore_points"

    # --- registration (each callback's setup) ---------------------------------------------------------------------

    def add_attention(
        self, caller: Callback, sampler: AttentionSampler, listener: Listener, saved: dict[str, Any] | None
    ) -> None:
        """A ``ConnectionMonitor``'s sampler, its ``listener(step, values)`` and the run state it loaded (if any)."""
        self._join(caller)
        if all(known is not sampler for known, _, _ in self.samplers):
            self.samplers.append((sampler, listener, saved))

    def add_sharpness(
        self,
        caller: Callback,
        sampler: SharpnessSampler,
        listener: Listener,
        loss_fn: Callable[..., Tensor] | None,
        step_options: StepOptions,
        saved_signals: dict[str, Any] | None = None,
    ) -> None:
        """A ``SharpnessMonitor``'s sampler, ``listener(step, values)`` of each sample, loss and step options.

        ``saved_signals``: the step signals' window it loaded (it saves them where no ``ConnectionMonitor`` does:
        :meth:`signals_state`).
        """
        self._join(caller)
        self.sharpness, self._curvature_listener, self.loss_fn = sampler, listener, loss_fn
        self._sharpness_steps = step_options
        self.load_signals(saved_signals)

    def add_alerts(self, caller: Callback, runner: AlertRunner) -> None:
        """A ``DriftAlert``'s rules and actions."""
        self._join(caller)
        self.alerts = runner

    def _join(self, caller: Callback) -> None:
        if self._driver is None:
            self._driver = caller
        if isinstance(caller, RunPart) and all(part is not caller for part in self._parts):
            self._parts.append(caller)

    def drives(self, caller: Callback) -> bool:
        """Whether ``caller``'s events are the ones the run translates (the first callback registered)."""
        return caller is self._driver and self.monitor is not None and not self._ended

    # --- the fit ----------------------------------------------------------------------------------------------------

    def begin(self, trainer: Trainer, pl_module: LightningModule) -> Monitor:
        """At the fit's start (every callback's ``on_fit_start``; the first call does it): the monitor, attached."""
        if self.monitor is not None:
            return self.monitor
        if self.alerts is not None and not self.samplers and self.sharpness is None:
            rank_zero_warn("DriftAlert watches the values of a ConnectionMonitor, and the Trainer has none: add one")
        owner = "ConnectionMonitor" if self.samplers else "SharpnessMonitor"
        steps: list[tuple[str, StepOptions]] = [("ConnectionMonitor", each.options) for each, _, _ in self.samplers]
        if self._sharpness_steps is not None:
            steps.append(("SharpnessMonitor", self._sharpness_steps))
        monitor = Monitor(
            log=self.log,
            wandb=find_sink(trainer.loggers),
            owner=owner,
            attention=[sampler for sampler, _, _ in self.samplers],
            step_options=run_step_options(steps),
            trainer_values=lambda: trainer.callback_metrics,
            optimizer_hook=False,
            agree=lambda flag: trainer.strategy.reduce_boolean_decision(flag, all=False),
        )
        monitor.use(alerts=self.alerts, sharpness=self.sharpness)
        if self.alerts is not None and self.alerts.restore_points is not None:
            self._restore_root = trainer.strategy.broadcast(_restore_root(trainer))
        for sampler, listener, saved in self.samplers:
            monitor.add_listener(listener, sampler=sampler)
            if saved is not None and sampler is monitor.attention_sampler:
                monitor.load_run_state(saved)
        if self._curvature_listener is not None:
            monitor.add_listener(self._curvature_listener, of="curvature")
        self.monitor = monitor
        self.load_signals(self._saved_signals)
        if monitor.attach(pl_module) and not trainer.loggers:
            rank_zero_warn("ConnectionMonitor: no logger is attached, so its values are computed but not logged")
        return monitor

    def start(self, trainer: Trainer) -> None:
        """The optimizers exist (``on_train_start``): the curvature, the back-off and the clips watch them."""
        if self.monitor is None or self._started:
            return
        self._started = True
        self.monitor.attach_optimizers(trainer.optimizers)

    def epoch_started(self, caller: Callback) -> None:
        """An epoch's first batch starts an optimizer step (Lightning steps on an epoch's last batch)."""
        if self.drives(caller):
            self._first_micro_batch = True

    def batch_started(self, caller: Callback, trainer: Trainer, pl_module: LightningModule, batch: Any) -> None:
        """A micro-batch's forward begins: the curvature keeps its loss, the capture arms on a sampled step."""
        if not self.drives(caller):
            return
        assert self.monitor is not None
        step = self._step_at_batch_start = trainer.global_step
        if self.sharpness is not None and self.sharpness.reads_forward(step):
            with trainer.precision_plugin.train_step_context():
                loss = partial(self.loss_fn, pl_module, batch) if self.loss_fn is not None else None
                self.monitor.read_forward(step, loss, pl_module)
        self.monitor.step_start(step, pl_module, first=self._first_micro_batch)

    def before_optimizer_step(self, caller: Callback, trainer: Trainer) -> None:
        """After the backward, before the step: the step's sample ends, then the curvature's readings."""
        if self.drives(caller):
            assert self.monitor is not None
            self.monitor.forward_end()
            self.monitor.step_end(trainer.global_step)
            with trainer.precision_plugin.train_step_context():
                self.monitor.before_optimizer_step(trainer.global_step)

    def batch_ended(self, caller: Callback, trainer: Trainer, pl_module: LightningModule) -> None:
        """A micro-batch ended; once the optimizer stepped: a probe, a stop, a restore point."""
        if not self.drives(caller):
            return
        assert self.monitor is not None
        stepped = trainer.global_step != self._step_at_batch_start  # Lightning's own count: the optimizer stepped
        self._first_micro_batch = stepped
        self.monitor.forward_end()
        if not stepped:
            return
        self.monitor.step_end(self._step_at_batch_start)  # an optimizer that gave no pre-step event
        self._carry_out(trainer, self.monitor.model_updated(trainer.global_step, pl_module))

    def finish(self, caller: Callback, trainer: Trainer) -> None:
        """Training is over (``on_train_end``, loggers still open): what the run cost, logged and said once."""
        if self.drives(caller):
            assert self.monitor is not None
            self.monitor.close(trainer.global_step)

    def end(self, failed: bool = False) -> None:
        """The fit is over (``teardown``) or ``failed`` (``on_exception``): every hook goes, a failed sample too."""
        if self._ended:
            return
        self._ended = True
        if self.monitor is not None:
            if failed:
                self.monitor.discard()
            self.monitor.close()
            for part in self._parts:
                part.keep_state(self)
        _RUNS.pop(self.trainer, None)

    def load_signals(self, state: dict[str, Any] | None) -> None:
        """The step signals' window a ``SharpnessMonitor`` loaded (:meth:`signals_state`), into the run's monitor.

        Kept until the monitor is put together (Lightning loads a checkpoint's callback states after ``setup``).
        """
        self._saved_signals = state
        if state is not None and self.monitor is not None and not self.samplers:
            self.monitor.signals.load_state_dict(state)
            self._saved_signals = None

    def signals_state(self) -> dict[str, Any] | None:
        """The step signals' window not logged yet, for a ``SharpnessMonitor`` to save.

        None where a ``ConnectionMonitor`` saves it (with its own state) or no monitor runs.
        """
        if self.monitor is None or self.samplers:
            return None
        return self.monitor.signals.state_dict()

    # --- what the monitor calls and asks for --------------------------------------------------------------------------

    def log(self, values: dict[str, float], step: int) -> None:
        """Every logger of the trainer (the monitor calls it on rank zero)."""
        for logger in self.trainer.loggers:
            logger.log_metrics(values, step=step)

    def _carry_out(self, trainer: Trainer, outcome: StepOutcome) -> None:
        """A stop becomes ``trainer.should_stop``; a restore point due is saved once the optimizer stepped."""
        assert self.monitor is not None

        def stop() -> bool:
            stopping, trainer.should_stop = trainer.should_stop, True
            return not stopping

        def restore_point() -> RestorePointWriter | None:
            points = self.alerts.restore_points if self.alerts is not None else None
            if points is None or trainer.global_step == self._step_at_batch_start:
                return None  # inside a step (its first micro-batches): after the optimizer steps
            if trainer.sanity_checking or trainer.state.fn != "fit":
                return None
            path = trainer.strategy.broadcast(points.path(trainer.global_step, root=self._restore_root))  # rank 0's
            return RestorePointWriter(path, trainer.save_checkpoint, trainer.strategy.remove_checkpoint)

        self.monitor.carry_out(outcome, trainer.global_step, owner="DriftAlert", stop=stop, restore_point=restore_point)


class RunPart(Callback, abc.ABC):
    """A connmon callback: one part of its Trainer's run, forwarding every trainer event to it.

    A subclass registers its part in :meth:`join` (called by ``setup`` on fit); the run translates the events of
    the first part registered into its monitor's protocol.
    """

    @abc.abstractmethod
    def join(self, run: LightningRun, trainer: Trainer) -> None:
        """Register this callback's part with ``run`` (``setup`` on fit)."""

    def keep_state(self, run: LightningRun) -> None:
        """The fit is over: keep what :meth:`state_dict` saves of ``run`` (a checkpoint saved after the fit)."""

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """On fit: join the Trainer's run."""
        if stage == "fit":
            self.join(run_of(trainer), trainer)

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """The run's monitor is put together and finds the attention layers where the model now lives."""
        run_of(trainer).begin(trainer, pl_module)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """The optimizers exist: the curvature, the back-off, the clips and the optimizer's state watch them."""
        run_of(trainer).start(trainer)

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """An epoch's first batch starts an optimizer step."""
        run_of(trainer).epoch_started(self)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        """A micro-batch begins (the run's :meth:`LightningRun.batch_started`)."""
        run_of(trainer).batch_started(self, trainer, pl_module, batch)

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        """After the backward, before the optimizer steps (the run's curvature readings)."""
        run_of(trainer).before_optimizer_step(self, trainer)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """A micro-batch ended (the run's :meth:`LightningRun.batch_ended`)."""
        run_of(trainer).batch_ended(self, trainer, pl_module)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Training is over: the run logs and says what connmon cost (:meth:`LightningRun.finish`)."""
        run = running(trainer)
        if run is not None:
            run.finish(self, trainer)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        """Remove every hook and forget a partial sample if the run fails."""
        run = running(trainer)
        if run is not None:
            run.end(failed=True)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Remove every hook at the end of the fit."""
        run = running(trainer)
        if stage == "fit" and run is not None:
            run.end()


def _restore_root(trainer: Trainer) -> str:
    """Where ModelCheckpoint would save, with ``connmon_restore_points`` for ``checkpoints``."""
    if not trainer.loggers:
        return os.path.join(trainer.default_root_dir, "connmon_restore_points")
    logger = trainer.loggers[0]
    version = logger.version if isinstance(logger.version, str) else f"version_{logger.version}"
    save_dir = logger.save_dir if logger.save_dir is not None else trainer.default_root_dir
    return os.path.join(save_dir, str(logger.name), version, "connmon_restore_points")
