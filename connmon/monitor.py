"""Monitor: the engine, trainer-agnostic, behind every entry point; and the plain-PyTorch-loop API.

Lightning's :class:`connmon.callbacks.ConnectionMonitor`, the Hugging Face
:class:`connmon.integrations.transformers.ConnectionMonitorCallback` and plain loops all sample through one
:class:`Monitor`: it finds the attention layers, arms the capture on a sampled step, streams the records into the
torchmetrics accumulators, syncs them across processes, logs ``connmon/<metric>/L<ll>`` and ``/all``, writes the
W&B histograms and figures, and runs the alert rules. No diagnostic is defined anywhere else.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import shutil
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal

import torch
from torch import Tensor, nn
from typing_extensions import Unpack

from connmon import keys
from connmon._budget import FullSampleBudget
from connmon._collectives import from_rank_zero, gathered_objects, is_distributed
from connmon._copying import CopiesDetached
from connmon._cost import CostClock, cost_line, overhead_values
from connmon._moved import renamed_name
from connmon._optimizer import unwrap_optimizer
from connmon._options import check_callable, check_choice
from connmon._probe import device_of, probing, read_beside, run_forward
from connmon._ranks import is_rank_zero, warn_rank_zero
from connmon._saved_state import checked_state
from connmon.alerts._head_rows import HeadClipCount
from connmon.alerts.restore import write_restore_point
from connmon.alerts.runner import AlertRunner
from connmon.capture import AttentionRecord, armed, attention_layers
from connmon.capture.max_logit import HeadMaxLogits, fused_path_modules
from connmon.capture.session import CaptureSession, Layer
from connmon.curvature.optimizer_state import OptimizerSignalWindow
from connmon.curvature.sampler import SharpnessSampler
from connmon.metrics import DriftMetrics, LayerwiseMean, SpectrumMetrics, TransportMetrics, WalkMetrics
from connmon.sampling import DIAGNOSTICS, OPTION_NAMES, Diagnostic, SamplingKeywords, SamplingOptions, sampling_options
from connmon.sinks.panels import write_panels

__all__ = ["DIAGNOSTICS", "SAMPLING_OPTIONS", "Diagnostic", "LogFn", "Monitor", "SamplingOptions"]

LogFn = Callable[..., Any]  # called as log(values, step=step)
LONG_SAMPLE_S = 2.0  # a sample that keeps the training waiting longer is said, once per run, with what it did
SAMPLING_OPTIONS = OPTION_NAMES  # the sampling options every entry point takes with the same names and defaults


class Monitor(CopiesDetached):
    """Reads every self-attention layer of ``model`` as a connection walk on every ``every_n_steps``-th step.

    In a plain PyTorch (or Accelerate) loop, wrap the forward of each step in :meth:`step`; on a sampled step the
    capture is armed for that forward only (no hook exists on other steps), the first ``num_sequences`` sequences of
    each layer are measured, and when the block ends the values are synced across processes (``torch.distributed``,
    if initialized; every process must call :meth:`step` with the same steps) and logged as
    ``connmon/<metric>/L<ll>`` and ``connmon/<metric>/all`` through ``log(values, step=step)`` on rank zero. The
    eigen- and SVD-bound diagnostics (the spectrum group and the edge isometry gap) run on every
    ``full_every_n_samples``-th sample, the first included. Pass the same ``step`` for every micro-batch of a
    gradient-accumulation step: only its first forward is sampled. With ``alerts`` whose rules watch only the first
    steps (``until=``), a sparse cadence also samples the steps those rules need
    (:meth:`connmon.alerts.RuleSet.regime_steps`, in :attr:`extra_steps`). Every ``logit_every_n_steps``-th step
    each head's max logit over the step's whole batch is read (:mod:`connmon.capture.max_logit`), logged at the next
    sample as ``connmon/step_max_logit/L<ll>`` and shown to ``alerts`` per head; with their ``"qk_clip"`` action it
    is read every step and the heads above the threshold are clipped after the optimizer step; with their
    ``"transport_clip"`` action (an experiment) each head's ``O_h V_h`` is held near a scaled isometry. A
    ``torch.compile``'d model keeps its graph as compiled: its sampled batch is read beside it by one more forward of
    the original module (eval mode, ``no_grad``), so training stays bitwise unchanged.

    Nothing the monitor does can end the run: a model without readable attention turns it off with one warning,
    a layer it cannot record exactly is skipped with one warning, W&B errors are reported once.

    Args:
        model: the model whose attention is read (None: call :meth:`attach` later).
        options: the sampling options (:class:`~connmon.sampling.SamplingOptions`: what is recorded and how often);
            a ``probe`` is recorded at the start of :meth:`step`, on the model after ``step`` optimizer steps.
        **sampling: the same options by keyword (``every_n_steps=100``, ``diagnostics=("walk",)``, ...), in place of
            those of ``options`` (typed by :class:`~connmon.sampling.SamplingKeywords` for editors).
        log: called as ``log(values, step=step)`` with a dict of floats on rank zero after each sample, e.g.
            ``wandb.log`` or ``accelerator.log``; None to log the scalars to ``wandb`` (or nowhere).
        wandb: a W&B run (``wandb.init(...)``) for histograms, figures and alerts, logged with ``step=step``.
        alerts: an :class:`connmon.alerts.AlertRunner` run on every sample; its stop requests set
            :attr:`should_stop`; with its ``"checkpoint"`` action, the restore point an alert asks for is saved at the
            start of the next :meth:`step` (:meth:`save_restore_point`).
        optimizer: the training's optimizer, for ``sharpness`` and for ``alerts`` with the ``"backoff"`` action.
        sharpness: a :class:`connmon.curvature.sampler.SharpnessSampler`: the curvature against the
            optimizer's edge of stability on its own cadence, logged and shown to ``alerts`` like the attention
            values (``connmon/sharpness_ratio`` with the Lanczos estimators, ``connmon/update_sharpness_ratio`` with
            an update estimator). It watches ``optimizer.step()`` through the optimizer's hooks: the Lanczos
            estimators read every batch the step's ``monitor.step(step, batch=...)`` blocks were given (its
            micro-batches) in the optimizer's step pre-hook, before the parameters move.
        loss_fn: ``loss_fn(model, batch)``, the batch's scalar loss, for a ``sharpness`` estimator that reads one
            (all but ``"secant"``); pass the batch as ``monitor.step(step, batch=batch)``. It runs inside
            ``optimizer.step()``, outside the training's autocast: wrap it in the same autocast to read in bf16.
        owner: the entry point named in warnings and in the cost line.
        log_on_every_rank: call ``log`` on every process (for a logger that picks rank zero itself), not only rank
            zero.
        attention: False to read no attention (the curvature and the rules only).
        optimizer_hook: read the curvature in ``optimizer``'s step pre-hook (a plain loop); False for an entry point
            that calls :meth:`before_optimizer_step` from its trainer's own pre-step event.

    Every sample's values include what the monitor costs, ``connmon/overhead/attention`` (its time over the
    training time since :meth:`attach`) and ``connmon/overhead`` (all connmon monitors running);
    :meth:`cost_summary` says it in one line.

    Raises:
        TypeError: for a keyword that is not a sampling option (the message names them).
        ValueError: for an invalid option (the message names the valid ones).

    Examples:
        >>> import torch
        >>> import connmon
        >>> layer = torch.nn.TransformerEncoderLayer(16, 2, dropout=0.0, batch_first=True)
        >>> model = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        >>> logged = {}
        >>> log = lambda values, step: logged.update(values)
        >>> monitor = connmon.Monitor(model, every_n_steps=2, diagnostics=("walk",), log=log)
        >>> for step in range(3):
        ...     with monitor.step(step):
        ...         loss = model(torch.randn(4, 6, 16)).pow(2).mean()
        ...     loss.backward()
        >>> monitor.samples, round(logged["connmon/stochasticity_gap/L00"], 6)
        (2, 0.0)
    """

    _not_copied = (
        ("_pre_hook", lambda: None), ("_post_hooks", list), ("_armed", lambda: None), ("_session", lambda: None),
    )  # fmt: skip  # hooks stay

    def __init__(
        self,
        model: nn.Module | None = None,
        *,
        log: LogFn | None = None,
        wandb: Any = None,
        alerts: AlertRunner | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        sharpness: SharpnessSampler | None = None,
        loss_fn: Callable[[nn.Module, Any], Tensor] | None = None,
        options: SamplingOptions | None = None,
        owner: str = "connmon.Monitor",
        log_on_every_rank: bool = False,
        attention: bool = True,
        optimizer_hook: bool = True,
        **sampling: Unpack[SamplingKeywords],
    ) -> None:
        if model is not None and not isinstance(model, nn.Module):
            raise ValueError(f"model must be a torch.nn.Module or None, got {type(model).__name__}: {model!r:.60}")
        options = sampling_options(options, owner, **sampling)
        check_callable("loss_fn", loss_fn, optional=True, signature="loss_fn(model, batch)")
        check_callable("log", log, optional=True, signature="log(values, step=step)")
        self.options = options
        self.attention = attention
        self.optimizer_hook = optimizer_hook
        self.agree: Callable[[bool], bool] = bool  # a decision every process takes together (the values are synced)
        self.use(alerts=alerts, sharpness=sharpness)
        if sharpness is not None and optimizer is None:
            raise ValueError("sharpness needs the optimizer it watches: pass optimizer=...")
        if sharpness is not None and sharpness.estimator != "secant" and loss_fn is None:
            raise ValueError(
                f"sharpness estimator={sharpness.estimator!r} reads a loss: pass loss_fn=... (and "
                "monitor.step(step, batch=batch)), or use estimator='secant'"
            )
        self.full_every_n_samples = options.full_every_n_samples  # the budget moves it: state, not an option
        self.clock = CostClock("attention")
        self.log = log
        self.log_on_every_rank = log_on_every_rank
        self.owner = owner
        self.sink: Any = None  # connmon.sinks.wandb.WandbSink for histograms, figures and W&B alerts
        if wandb is not None:
            from connmon.sinks.wandb import WandbSink

            self.sink = WandbSink(wandb, step_key=None)
        self.samples = 0
        self.last_sampled_step = -1
        self.last_values: dict[str, float] = {}
        self.should_stop = False
        self.selected: list[Layer] = []
        self._unarmed: list[Layer] = []
        self.metrics: dict[str, LayerwiseMean] = {}
        self._model: nn.Module | None = None
        self._armed: contextlib.ExitStack | None = None
        self._session: CaptureSession | None = None  # the armed capture's session
        self._pending_drift_state: dict | None = None
        self._drift_before: dict | None = None  # the time-drift references before the armed sample
        self._listeners: dict[str, list[Callable[[int, dict[str, float]], None]]] = {"attention": [], "curvature": []}
        budget = options.budget
        self._budget = None if budget is None else FullSampleBudget(budget, options.every_n_steps, owner)
        self._sample_began = 0.0  # the clock's spent seconds when the current sample was armed
        self._said_long = False  # a long sample was said (once per run)
        self._start_step: int | None = None  # the first step asked about since attach: where training time starts
        self.loss_fn = loss_fn
        self._optimizer = unwrap_optimizer(optimizer) if optimizer is not None else None
        self._step_now = 0  # the step of the latest monitor.step(): the one optimizer.step() completes
        self._pre_hook: Any = None
        self._post_hooks: list[Any] = []  # after each optimizer step: the clip actions, the optimizer's state
        self._clips_after_step = False  # the clip actions run in those hooks
        every = options.optimizer_every_n_steps
        self.optimizer_state = OptimizerSignalWindow() if every is not None else None  # its signals since the sample
        self.logits: HeadMaxLogits | None = None  # every head's max logit over the whole batch of a step
        self._transport_said_where = False  # the layers it cannot act on were named
        self._said_nonfinite_logit = False  # a head QK-clip left alone for a non-finite max logit was named
        self._logit_step: int | None = None  # the step whose forwards the logits read now
        self._begun: int | None = None  # the step begin_step last ran for
        self._said_at: dict[str, int] = {}  # the step of each clip action's last line
        self._logit_window: Tensor | None = None  # (layers, H): the max since the last sample, for the rules
        self._bound_window: Tensor | None = None  # (layers, H): the kernels' logsumexp bounds since the last sample
        self._clip_window: dict[str, Any] | None = None  # what QK-clip did since the last sample (_clip)
        self._pending_logits: dict | None = None  # a checkpoint's max logits, until attach builds the reader
        if model is not None:
            self.attach(model)

    def use(self, alerts: AlertRunner | None = None, sharpness: SharpnessSampler | None = None) -> None:
        """The run's alert rules and actions, and its curvature sampler (None: none); before :meth:`attach`.

        The constructor calls it; Lightning's callbacks hand their parts to their Trainer's one monitor this way.
        """
        if alerts is not None and not isinstance(alerts, AlertRunner):
            raise ValueError(f"alerts must be a connmon.alerts.AlertRunner or None, got {type(alerts).__name__}")
        if sharpness is not None and not isinstance(sharpness, SharpnessSampler):
            raise ValueError(
                "sharpness must be a connmon.curvature.sampler.SharpnessSampler or None, got "
                f"{type(sharpness).__name__}"
            )
        clips = [name for name in ("qk_clip", "transport_clip") if alerts is not None and name in alerts.actions]
        if clips and not self.attention:
            raise ValueError(
                f"the {' and '.join(repr(c) for c in clips)} action{'s' if len(clips) > 1 else ''} read each head's "
                "max logit from the attention, and this monitor reads none (attention=False; in Lightning: no "
                "ConnectionMonitor among the Trainer's callbacks): add a ConnectionMonitor, or drop "
                f"{' and '.join(repr(c) for c in clips)} from the actions"
            )
        self.alerts = alerts
        self.sharpness = sharpness
        # sampled besides the cadence: what the alert rules that watch only a run's first steps need to compare
        every = self.options.every_n_steps
        self.extra_steps = alerts.rules.regime_steps(every) if alerts is not None and self.attention else frozenset()
        self.qk_clip = alerts.qk_clip if alerts is not None else None
        self.transport_clip = alerts.transport_clip if alerts is not None else None

    # --- the plain-loop API ---------------------------------------------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        """Deprecated: an option read as the monitor's attribute (``monitor.every_n_steps``): read ``options``."""
        if name in OPTION_NAMES and "options" in self.__dict__:
            renamed_name(f"Monitor.{name}", f"Monitor.options.{name}", removed_in="0.2.0")
            return getattr(self.__dict__["options"], name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @contextlib.contextmanager
    def step(
        self,
        step: int,
        rule_values: Mapping[str, float] | None = None,
        batch: Any = None,
        loss_weight: float | None = None,
    ) -> Iterator[bool]:
        """Wrap the forward of optimizer step ``step`` (the steps taken so far); yields whether it is sampled.

        On a sampled step the capture is armed for the block and the sample is measured and logged when it ends.
        If the block raises, every hook is removed and the partial sample is discarded (:meth:`discard`).
        ``rule_values`` (say, the previous step's ``{"loss": ..., "grad_norm": ...}``) are shown to the alert
        rules beside the sample's keys. ``batch`` is what ``loss_fn(model, batch)`` reads for a ``sharpness``
        estimator that needs a loss. ``loss_weight`` is the factor the loop puts on this micro-batch's loss before
        its backward: None when each micro-batch's loss is its own mean and the loop divides it by the number of
        micro-batches (the step's loss is their mean), ``1.0`` when ``loss_fn`` already normalises it over the whole
        step (a token count of every micro-batch, as Hugging Face's ``num_items_in_batch``) and the loop sums them.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be the optimizer steps taken so far, an integer >= 0, got step={step!r}")
        model = self._model
        self._step_now = step
        self.begin_step(step)
        self.watch_logits()
        try:
            with self._step(step, model, rule_values, batch, loss_weight) as sampled:
                yield sampled
        finally:
            self.unwatch_logits()

    def watch_logits(self) -> None:
        """Read the per-head max logits of the forwards that follow (if this step's are read) until unwatched.

        The hooks exist only in between; the entry points call it and :meth:`unwatch_logits` around each micro-batch.
        """
        if self.logits is not None and self._logit_step is not None:
            self.logits.watch()

    def unwatch_logits(self) -> None:
        """Remove the max logits' hooks (a no-op when none)."""
        if self.logits is not None:
            self.logits.unwatch()

    @contextlib.contextmanager
    def _step(
        self, step: int, model: nn.Module | None, rule_values: Mapping[str, float] | None, batch: Any,
        loss_weight: float | None,
    ) -> Iterator[bool]:  # fmt: skip
        if (
            self.alerts is not None
            and self.alerts.restore_points is not None
            and self.alerts.restore_points.due is not None
        ):
            self.save_restore_point(step)
        if model is None:
            yield False
            return
        loss_fn = self.loss_fn
        if self.sharpness is not None:
            loss = None if loss_fn is None or batch is None else lambda: loss_fn(model, batch)
            self.read_forward(step, loss, model, loss_weight)
        sampled = self.due(step)
        if sampled and self.options.probe is not None:
            self.run_probe(model, step, rule_values)
            sampled = False
        if not sampled:
            yield False
            return
        if hasattr(model, "_orig_mod"):  # torch.compile'd: its graph stays as compiled, the batch is read beside it
            with read_beside(model, lambda original, forward: self.run_probe(original, step, rule_values, forward)):
                yield True
            return
        self.arm(model)
        try:
            yield True
        except BaseException:
            self.discard()
            raise
        self.disarm()
        self.finish(step, rule_values)

    def save_restore_point(self, step: int) -> str | None:
        """Save the restore point an alert asked for (the ``"checkpoint"`` action), as the state after ``step`` steps.

        :meth:`step` calls it at its start when one is due. With ``restore_points.save`` the path and step are handed
        to it on every process (save there whatever resumes your run: scheduler, data position, ...); without one,
        :func:`connmon.alerts.write_restore_point` writes the model, the optimizer and this monitor's state
        (a sharded model's with ``torch.distributed.checkpoint``, each process its shards), which
        :func:`connmon.alerts.load_restore_point` reads back. Older restore points beyond ``keep`` are
        removed (rank zero). A save that fails is reported and the run goes on. Returns the path, or None.

        Examples:
            >>> import warnings
            >>> import connmon
            >>> from connmon.alerts import AlertRunner, RestorePoints
            >>> saved = []
            >>> points = RestorePoints(save=lambda path, step: saved.append((path, step)))
            >>> monitor = connmon.Monitor(alerts=AlertRunner([], actions=("checkpoint",), restore_points=points))
            >>> points.due = 7  # what an alert at step 7 asks for
            >>> with warnings.catch_warnings(record=True):  # it says where, in one line
            ...     monitor.save_restore_point(8)
            'connmon_restore_points/step=8.ckpt'
            >>> saved, points.due
            ([('connmon_restore_points/step=8.ckpt', 8)], None)
        """
        points = self.alerts.restore_points if self.alerts is not None else None
        if points is None or points.due is None:
            return None

        def write(path: str) -> None:
            if points.save is not None:
                points.save(path, step)
            else:
                write_restore_point(path, step, self._model, self._optimizer, self.state_dict())

        return points.save_due(step, from_rank_zero(points.path(step)), write, _remove, owner=self.owner)

    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> bool:
        """Find ``model``'s attention layers and build the accumulators on its device; False (and one warning) if none.

        Called by the constructor with a model. Calling it again builds fresh accumulators (the cadence is kept; the
        time-drift references restart unless :meth:`load_state_dict` gave some). ``optimizer``, if given, replaces
        the constructor's (a trainer that builds its optimizer later); with one, the curvature sampler and the
        back-off watch it (:meth:`attach_optimizers`). A model without readable attention keeps the curvature and
        the rules on it.
        """
        self.disarm()
        self._model = model
        self.selected, self._unarmed, self.metrics = [], [], {}
        if self.logits is not None:
            self.logits.unwatch()
        self.logits = None
        found = self._find_layers(model) if self.attention else None
        if found is not None:
            self._build(model, found)
        optimizer = optimizer if optimizer is not None else self._optimizer
        if optimizer is not None:
            self.attach_optimizers([optimizer])
        elif self.optimizer_hook:  # a plain loop gave none: the back-off says it has nothing to act on
            self.attach_optimizers([])
        return found is not None

    def _find_layers(self, model: nn.Module) -> list[Layer] | None:
        try:
            return attention_layers(getattr(model, "_orig_mod", model))  # torch.compile: the layers of the original
        except ValueError as error:
            warn_rank_zero(f"{self.owner} is off for this run: {error}")
            return None

    def _build(self, model: nn.Module, found: list[Layer]) -> None:
        """The accumulators and the max-logit reader of the layers found, on the model's device."""
        self.selected = self._select(found)
        self._unarmed = [layer for layer in found if layer not in self.selected]  # their kernel calls stay theirs
        num_layers = len(found)
        groups = {
            "walk": lambda: WalkMetrics(num_layers),
            "transport": lambda: TransportMetrics(
                num_layers,
                edge_samples=self.options.edge_samples,
                edge_queries=self.options.edge_queries,
                edge_lanczos_steps=self.options.edge_lanczos_steps,
            ),
            "spectrum": lambda: SpectrumMetrics(num_layers, k=self.options.spectrum_k),
            "drift": lambda: DriftMetrics(num_layers),
        }
        self.metrics = {name: groups[name]() for name in self.options.diagnostics}
        if self.options.logit_every_n_steps is not None or self.qk_clip is not None or self.transport_clip is not None:
            modules, names = [layer.module for layer in self.selected], [layer.name for layer in self.selected]
            fused = fused_path_modules(getattr(model, "_orig_mod", model))
            self.logits = HeadMaxLogits(modules, names, clock=self.clock, fused=fused)
        self._logit_step, self._logit_window, self._bound_window, self._begun = None, None, None, None
        self._clip_window = None
        self._restore_logits()
        self.to(device_of(model))
        self.clock.start()
        self._start_step = None
        if self._budget is not None:
            self._budget.reset()
        if self._pending_drift_state is not None and "drift" in self.metrics:
            self.metrics["drift"].set_extra_state(self._pending_drift_state)
            self._pending_drift_state = None

    def attach_optimizers(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """The curvature sampler and the alerts' back-off watch the training's optimizers (after :meth:`attach`).

        The sampler reads one optimizer (with more, it is off with one warning). With ``optimizer_hook`` its reading
        before each step runs in the optimizer's step pre-hook; an entry point whose trainer steps in a closure calls
        :meth:`before_optimizer_step` itself.
        """
        optimizers = [unwrap_optimizer(optimizer) for optimizer in optimizers]
        self._optimizer = optimizers[0] if len(optimizers) == 1 else None
        self._remove_optimizer_hooks()
        self._clips_after_step = (
            bool(optimizers)
            and self.logits is not None
            and (self.qk_clip is not None or self.transport_clip is not None)
        )  # with no optimizer known, the clips run at the next step's start and at close()
        if self._clips_after_step or self.optimizer_state is not None:
            self._post_hooks = [
                optimizer.register_step_post_hook(self._after_optimizer_step) for optimizer in optimizers
            ]
        if self.sharpness is not None and self._optimizer is None:
            self.sharpness.turn_off(f"it needs exactly one optimizer, and the run has {len(optimizers)}")
        elif self.sharpness is not None and self._optimizer is not None:
            backoff = self.alerts.backoff if self.alerts is not None else None
            device = device_of(self._model) if self._model is not None else None
            self.sharpness.attach(self._optimizer, device, backoff=backoff)
            if self.optimizer_hook:
                self._pre_hook = self._optimizer.register_step_pre_hook(self._before_optimizer_step)
        if self.alerts is not None:
            self.alerts.attach(optimizers, self.owner)

    def _remove_optimizer_hooks(self) -> None:
        for handle in [self._pre_hook, *self._post_hooks]:
            if handle is not None:
                handle.remove()
        self._pre_hook, self._post_hooks, self._clips_after_step = None, [], False

    def to(self, device: torch.device | str) -> Monitor:
        """Move the accumulators to ``device`` (where the model lives)."""
        for metric in self.metrics.values():
            metric.to(device)
        self.clock.to(device)
        return self

    def close(self) -> None:
        """Remove every hook (the capture's, the max logits', the optimizer's) and stop the cost clocks (run over)."""
        self.disarm()
        if self.logits is not None:
            self.logits.unwatch()
        if self.qk_clip is not None and not self._clips_after_step:  # no optimizer's hook: the last clip is now
            with self.clock.measuring():
                self._read_step_logits(clip=True)
        self._remove_optimizer_hooks()
        if self.sharpness is not None:
            self.sharpness.detach()
        if self.alerts is not None:
            self.alerts.detach()
        self.clock.stop()

    def cost_summary(self) -> str:
        """What the monitor (and its ``sharpness``) cost so far, in one line.

        Examples:
            >>> import connmon
            >>> connmon.Monitor(every_n_steps=10).cost_summary()
            'connmon.Monitor cost nothing measurable (no sample was taken)'
        """
        return cost_line(self.owner, self.clock, self.sharpness)

    def state_dict(self) -> dict[str, Any]:
        """Sampling cadence, each layer's previous sample (time drift) and the alert rules' state."""
        drift = self.metrics.get("drift")
        return {
            "config": self._config(),
            "samples": self.samples,
            "last_sampled_step": self.last_sampled_step,
            "drift": drift.get_extra_state() if drift is not None else self._pending_drift_state,
            "alerts": self.alerts.state_dict() if self.alerts is not None else None,
            "full_every_n_samples": self.full_every_n_samples,
            "sharpness": self.sharpness.state_dict() if self.sharpness is not None else None,
            "logits": self._logit_state(),
            "optimizer_state": self.optimizer_state.state_dict() if self.optimizer_state is not None else None,
        }

    def _logit_state(self) -> dict[str, Any] | None:
        """The max logits not logged yet: the step being read, the window since the last sample, the running maxima."""
        if self.logits is None:
            return self._pending_logits
        window = None if self._logit_window is None else self._logit_window.tolist()
        bounds = None if self._bound_window is None else self._bound_window.tolist()
        clips = self._clip_window
        if clips is not None:
            clips = {**clips, "after": None if clips["after"] is None else clips["after"].tolist()}
        return {"step": self._logit_step, "window": window, "bound_window": bounds, "clip_window": clips,
                **self.logits.state_dict()}  # fmt: skip

    def _restore_logits(self) -> None:
        if self._pending_logits is None or self.logits is None:  # kept until attach builds the reader
            return
        state, self._pending_logits = self._pending_logits, None
        self.logits.load_state_dict(state)
        self._logit_step = state.get("step")
        window = state.get("window")
        device = device_of(self._model) if self._model is not None else torch.device("cpu")
        self._logit_window = None if window is None else torch.tensor(window, device=device)
        bounds = state.get("bound_window")
        self._bound_window = None if bounds is None else torch.tensor(bounds, device=device)
        clips = state.get("clip_window")
        if clips is not None:
            after = clips["after"]
            self._clip_window = {**clips, "after": None if after is None else torch.tensor(after, device=device)}

    def _config(self) -> dict[str, Any]:
        """What the time-drift references depend on: a checkpoint from another configuration cannot continue them."""
        return {"num_sequences": self.options.num_sequences, "max_tokens": self.options.max_tokens}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved (before or after :meth:`attach`).

        Each part is checked: one that is malformed, or time-drift references saved under another configuration
        (``num_sequences``, ``max_tokens``: walks of another shape), is not restored, and one warning says which and
        why.
        """
        checked = checked_state(state_dict, self._config(), self.owner)
        if checked is None:
            return
        state_dict = checked
        self.samples = state_dict.get("samples", 0)
        self.last_sampled_step = state_dict.get("last_sampled_step", -1)
        if (
            self.options.budget is not None and state_dict.get("full_every_n_samples") is not None
        ):  # the budget's choice
            self.full_every_n_samples = state_dict["full_every_n_samples"]
        if self.sharpness is not None and state_dict.get("sharpness") is not None:
            self.sharpness.load_state_dict(state_dict["sharpness"])
        drift_state = state_dict.get("drift")
        if drift_state is not None:
            if "drift" in self.metrics:
                self.metrics["drift"].set_extra_state(drift_state)
            else:
                self._pending_drift_state = drift_state
        if self.alerts is not None and state_dict.get("alerts") is not None:
            self.alerts.load_state_dict(state_dict["alerts"])
        if state_dict.get("logits") is not None:
            self._pending_logits = state_dict["logits"]
            self._restore_logits()
        if self.optimizer_state is not None and state_dict.get("optimizer_state") is not None:
            self.optimizer_state.load_state_dict(state_dict["optimizer_state"])

    def reset(self) -> None:
        """Start the cadence and the time-drift references afresh (a new run)."""
        self.samples, self.last_sampled_step, self._pending_drift_state = 0, -1, None
        self.should_stop = False
        if self.sharpness is not None:
            self.sharpness.reset()
        if self._model is not None:
            self.attach(self._model)  # fresh accumulators: no drift reference

    def add_listener(
        self, listener: Callable[[int, dict[str, float]], None], of: Literal["attention", "curvature"] = "attention"
    ) -> None:
        """Call ``listener(step, values)`` on every process after each sample ``of`` attention or curvature is logged.

        ``values``: as logged (the alert counts included), and for an attention sample every head's max logit since
        the previous sample (``connmon/head_max_logit/L<ll>H<hh>``, for the alert rules; not logged).
        """
        check_choice("of", of, ("attention", "curvature"))
        self._listeners[of].append(listener)

    def remove_listener(
        self, listener: Callable[[int, dict[str, float]], None], of: Literal["attention", "curvature"] = "attention"
    ) -> None:
        """Stop calling ``listener`` (added with :meth:`add_listener`); a no-op if it is not there."""
        check_choice("of", of, ("attention", "curvature"))
        if listener in self._listeners[of]:
            self._listeners[of].remove(listener)

    # --- the pieces the integrations drive ------------------------------------------------------------------------

    def begin_step(self, step: int) -> None:
        """Optimizer step ``step`` begins (its first micro-batch): decide whether this step's max logits are read.

        The per-head max logits of a step (every forward of it, MAX-reduced across processes: every process calls
        this at the same steps) join the window the rules see at the next sample. The clip actions act on them right
        after the step's optimizer step, in the optimizer's step post-hook (:meth:`after_optimizer_step`), so the
        last step of a run is clipped too and a step the optimizer skipped (a GradScaler's inf step) is not. Without
        a known optimizer (a plain loop given none) they act here, on the step before, and at :meth:`close`. Called
        by :meth:`step` and by the entry points; a second call for the same step does nothing.
        """
        self._step_now = step
        if self.logits is None or step == self._begun:
            return
        self._begun = step
        with self.clock.measuring():
            if self._clips_after_step:
                self._read_step_logits(clip=False)  # unread: the optimizer skipped that step, which is not clipped
            else:
                self._read_step_logits(clip=True)
                self._transport_due(step)
            every = self.options.logit_every_n_steps
            self.logits.exact = every is not None and step % every == 0  # elsewhere the kernels' logsumexp bound,
            # and exact for a call whose bound passes QK-clip's tau
            self.logits.threshold = self.qk_clip.threshold if self.qk_clip is not None else None
            self._logit_step = step

    def _after_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.after_optimizer_step(optimizer)

    def after_optimizer_step(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Right after an optimizer step: the clip actions on that step's max logits, and ``optimizer``'s state.

        The optimizer's step post-hook calls it (the monitor registers one for a clip action and for
        ``optimizer_every_n_steps``). The state is read after every ``optimizer_every_n_steps``-th step (counted as
        the steps taken, the one just taken included; every process at the same steps) into the window logged at the
        next sample.
        """
        with self.clock.measuring():
            if self._clips_after_step and self.logits is not None and self._begun is not None:
                self._read_step_logits(clip=True)
                self._transport_due(self._begun + 1)
            every = self.options.optimizer_every_n_steps
            if optimizer is None or self.optimizer_state is None or every is None or (self._step_now + 1) % every:
                return
            try:
                self.optimizer_state.read(optimizer)
            except Exception as error:  # a reading must not end the training run
                warn_rank_zero(
                    f"{self.owner}: reading the optimizer's state raised {type(error).__name__}: {error}; it is off "
                    "for this run"
                )
                self.optimizer_state = None

    def _read_step_logits(self, clip: bool) -> None:
        """Fold the watched step's max logits into the window; with ``clip``, the ``"qk_clip"`` action on them."""
        if self.logits is None or self._logit_step is None:
            return
        step, self._logit_step = self._logit_step, None
        table, bounds = self.logits.read_both()
        self._bound_window = _folded(self._bound_window, bounds)
        self._logit_window = _folded(self._logit_window, table)
        if table is None:
            return
        if clip and self.qk_clip is not None:
            self._clip(step, table)

    def _transport_due(self, steps_taken: int) -> None:
        """The ``"transport_clip"`` action, every ``transport_clip.every_n_steps`` optimizer steps."""
        transport = self.transport_clip
        if transport is not None and steps_taken % transport.every_n_steps == 0:
            self._clip_transport(steps_taken)

    def _clip(self, step: int, table: Tensor) -> None:
        """The ``"qk_clip"`` action on a step's table; one that raises is turned off, the run goes on."""
        assert self.logits is not None and self.qk_clip is not None
        layouts = [self.logits.layout(index) for index in range(len(self.logits.modules))]
        broken = torch.isnan(table) | torch.isposinf(table)
        if bool(broken.any()) and not self._said_nonfinite_logit:
            self._said_nonfinite_logit = True
            layer, head = (int(i) for i in torch.nonzero(broken)[0])
            warn_rank_zero(
                f"{self.owner}: step {step}: {self._head_place(layer, head)} has a non-finite max logit (an "
                "overflowed query or key); QK-clip leaves such a head alone (said once)"
            )
        try:
            clips = self.qk_clip.apply(self.logits.modules, table, layouts)
        except Exception as error:  # an action must not end the training run
            warn_rank_zero(f"{self.owner}: QK-clip raised {type(error).__name__}: {error}; it is off for this run")
            self.qk_clip = None
            return
        clips = self._model_clips(self.qk_clip, clips, [table.shape[1]] * len(layouts))
        self._note_clips(table, clips, [layout is not None and layout.query is not None and layout.key is not None
                                        for layout in layouts])  # fmt: skip
        if clips and is_rank_zero():
            self._say_clips(step, clips)

    def _note_clips(self, table: Tensor, clips: list[tuple], acted: list[bool]) -> None:
        """Fold a step's clips into the window logged at the next sample (per layer).

        The head clips, the smallest row scale ``sqrt(tau / S)``, and the max logit the step's batch has once clipped
        (``tau`` where a head was).
        """
        assert self.qk_clip is not None
        tau = self.qk_clip.threshold
        window = self._clip_window or {"clips": [0] * len(acted), "scale": [1.0] * len(acted), "after": None}
        for layer, _, logit in clips:
            window["clips"][layer] += 1
            window["scale"][layer] = min(window["scale"][layer], math.sqrt(tau / logit))
        over = torch.isfinite(table) & (table > tau) & torch.tensor(acted, device=table.device).unsqueeze(1)
        window["after"] = _folded(window["after"], torch.where(over, torch.full_like(table, tau), table))
        self._clip_window = window

    def _clip_transport(self, step: int) -> None:
        """The ``"transport_clip"`` action; one that raises is turned off, the run goes on."""
        assert self.logits is not None and self.transport_clip is not None
        layouts = [self.logits.layout(index) for index in range(len(self.logits.modules))]
        if not self._transport_said_where and not self.logits.layouts_pending():
            self._transport_said_where = True
            missing = [name for name, layout in zip(self.logits.names, layouts, strict=True)
                       if layout is None or layout.value is None or layout.output is None]  # fmt: skip
            if missing:
                warn_rank_zero(
                    f"{self.owner}: the transport clip does not act on {', '.join(missing[:4])}"
                    f"{f' and {len(missing) - 4} more' if len(missing) > 4 else ''}: their values or output are not "
                    "one projection's rows inside the attention module, or they call no scaled_dot_product_attention"
                )
        try:
            clips = self.transport_clip.apply(self.logits.modules, layouts)
        except Exception as error:  # an action must not end the training run
            warn_rank_zero(f"{self.owner}: the transport clip raised {type(error).__name__}: {error}; it is off now")
            self.transport_clip = None
            return
        counts = [0 if layout is None or layout.output is None else layout.output.rows.shape[0] for layout in layouts]
        clips = self._model_clips(self.transport_clip, clips, counts)
        if not clips or not is_rank_zero() or not self._may_say("transport_clip", step):
            return
        heads = ", ".join(
            f"{self._head_place(layer, head)} ({high:.3g}x / {low:.3g}x)" for layer, head, high, low in clips[:4]
        )
        more = f" and {len(clips) - 4} more" if len(clips) > 4 else ""
        warn_rank_zero(
            f"{self.owner}: transport clip at step {step}: {heads}{more} (largest / smallest singular value of O_h V_h "
            f"against their mean) clamped to within {self.transport_clip.factor:g}x of the mean "
            f"({self.transport_clip.clipped} head clips so far)"
        )

    def _model_clips(self, action: HeadClipCount, clips: list[tuple], heads: list[int]) -> list[tuple]:
        """A clip action's clips as the model's (under tensor parallelism a collective: every process calls it).

        Under tensor parallelism every process's clips, its heads numbered as the model's (process ``r``'s head ``h``
        of a layer is ``h`` plus the layer's heads on processes ``0..r-1``), and the action's count and latest clips
        set to them; elsewhere ``clips``. ``heads``: this process's head count of each layer.
        """
        assert self.logits is not None
        if not self.logits.tensor_parallel or not is_distributed():
            return clips
        parts = gathered_objects((clips, heads))
        whole: list[tuple] = []
        offset = [0] * len(heads)
        for part, counts in parts:
            whole += [(layer, head + offset[layer], *rest) for layer, head, *rest in part]
            offset = [a + b for a, b in zip(offset, counts, strict=True)]
        whole.sort(key=lambda clip: clip[:2])
        action.clipped += len(whole) - len(clips)
        action.last = whole
        return whole

    def _head_place(self, layer: int, head: int) -> str:
        """``L<ll> head <h>`` of head ``head`` of the ``layer``-th layer read, as the alerts and the keys name it."""
        return keys.head_place(self.selected[layer].index, head)

    def _may_say(self, action: str, step: int) -> bool:
        """At most one line per 100 steps for each clip action; True (and noted) when this step may say one."""
        said = self._said_at.get(action)
        if said is not None and step - said < 100:
            return False
        self._said_at[action] = step
        return True

    def _say_clips(self, step: int, clips: list[tuple[int, int, float]]) -> None:
        if self.qk_clip is None or self.logits is None or not self._may_say("qk_clip", step):
            return
        heads = ", ".join(f"{self._head_place(layer, head)} ({logit:.4g})" for layer, head, logit in clips[:4])
        more = f" and {len(clips) - 4} more" if len(clips) > 4 else ""
        warn_rank_zero(
            f"{self.owner}: QK-clip at step {step}: {heads}{more} above {self.qk_clip.threshold:g}, their query and "
            f"key rows scaled by sqrt(threshold / max logit) ({self.qk_clip.clipped} head clips so far)"
        )

    def due(self, step: int) -> bool:
        """Whether optimizer step ``step`` is sampled (a step is sampled once, however many micro-batches it has)."""
        if self._start_step is None:
            self._start_step = step
        cadence = step % self.options.every_n_steps == 0 or step in self.extra_steps
        return bool(self.selected) and cadence and step != self.last_sampled_step

    @property
    def is_armed(self) -> bool:
        """Whether a capture is armed now."""
        return self._armed is not None

    def arm(self, model: nn.Module) -> None:
        """Arm the capture on ``model`` until :meth:`disarm` (each layer is recorded once per arming)."""
        self.disarm()
        self._sample_began = self.clock.spent
        drift = self.metrics.get("drift")
        self._drift_before = drift.get_extra_state() if drift is not None else None  # for discard()
        with self.clock.measuring():
            stack = contextlib.ExitStack()
            self._session = stack.enter_context(
                armed(
                    model,
                    num_sequences=self.options.num_sequences,
                    max_tokens=self.options.max_tokens,
                    layers=self.selected,
                    unarmed=self._unarmed,
                    on_record=self._consume,
                    cost_clock=self.clock,
                    owner=self.owner,
                )
            )
        self._armed = stack

    def run_probe(
        self,
        model: nn.Module,
        step: int,
        rule_values: Mapping[str, float] | None = None,
        forward: Callable[[nn.Module], Any] | None = None,
    ) -> dict[str, float]:
        """Record the ``probe`` batch on ``model`` now and finish the sample as step ``step``; returns what was logged.

        The probe runs under ``no_grad`` in eval mode, on ``nn.MultiheadAttention``'s Python path (its output is
        connmon's own), and every module's mode is put back as it was. A probe forward that raises is reported once
        and the sample is discarded: the training run goes on. ``forward``, if given, runs the model instead of the
        probe (``forward(model)``): how :meth:`step` reads a compiled model's batch beside its graph.
        """
        with self.clock.measuring():  # the probe's forward is connmon's cost too
            try:
                with probing(model):
                    self.arm(model)
                    if forward is not None:
                        forward(model)
                    else:
                        run_forward(model, self.options.probe, self.options.probe_fn)
            except Exception as error:  # the user's training goes on whatever the probe hits
                self.discard()
                warn_rank_zero(f"{self.owner}: the probe forward raised {type(error).__name__}: {error}; no sample")
                return {}
            finally:
                self.disarm()
        return self.finish(step, rule_values)

    def discard(self) -> None:
        """Disarm and forget the sample being recorded (a forward that raised): nothing of it is logged or kept.

        The accumulators are reset and the time-drift references are those from before the sample was armed.
        """
        if self._armed is not None and self._session is not None:
            self._session.abandon()  # a layer the raise cut short is not reported as unreadable
        self.disarm()
        with torch.inference_mode(False):
            for metric in self.metrics.values():
                metric.reset()
        drift = self.metrics.get("drift")
        if drift is not None and self._drift_before is not None:
            drift.set_extra_state(self._drift_before)
        self._drift_before = None

    def disarm(self) -> None:
        """Remove the capture's hooks (a no-op when not armed)."""
        if self._armed is not None:
            stack, self._armed = self._armed, None
            with self.clock.measuring():
                stack.close()

    def finish(self, step: int, rule_values: Mapping[str, float] | None = None) -> dict[str, float]:
        """Sync, log and reset the sample just recorded, run the alert rules; returns the values logged.

        Every process must call it on the same steps (the accumulators sync across processes). ``rule_values``
        (the trainer's own loss, gradient norm, ...) are shown to the alert rules beside the sample's keys; they are
        not logged here.
        """
        with self.clock.measuring(), torch.inference_mode(False):  # a sample under inference mode keeps normal states
            scalars = self._finish(step, rule_values)
        self._say_if_long(step)
        if self._budget is not None:
            full, stride, began = self._is_full(self.samples - 1), self.full_every_n_samples, self._sample_began
            self.full_every_n_samples = self._budget.record(self.clock, step, full, began, stride) or stride
        return scalars

    def _say_if_long(self, step: int) -> None:
        """One line, the first time a sample took longer than ``LONG_SAMPLE_S``: how long, and what it was doing."""
        took = self.clock.spent - self._sample_began
        if took <= LONG_SAMPLE_S or self._said_long:
            return
        self._said_long = True
        costly = [name for group, name in (("spectrum", "the connection spectra"), ("transport", "the edge isometry "
                  "gaps")) if group in self.metrics]  # fmt: skip
        layers = f"{len(self.selected)} layer{'s' if len(self.selected) != 1 else ''}"
        if self._is_full(self.samples - 1) and costly:
            skip = self.full_every_n_samples - 1
            which = f"which the next {skip} samples skip" if skip else "which every sample computes"
            what = f"a full sample: {' and '.join(costly)} of {layers}, {which}"
            advice = "a larger full_every_n_samples, diagnostics without 'spectrum', or budget=0.01 spends less"
        else:
            what = f"a sample of {', '.join(self.options.diagnostics)} on {layers}"
            advice = "a smaller num_sequences or max_tokens, or a larger every_n_steps, spends less"
        warn_rank_zero(f"{self.owner}: the sample at step {step} took {took:.1f} s ({what}); {advice}")

    def _finish(self, step: int, rule_values: Mapping[str, float] | None) -> dict[str, float]:
        full = self._is_full()
        values: dict[str, Tensor] = {}
        broken: set[int] = set()
        for metric in self._active():
            values.update(metric.compute())  # syncs across processes
            counts = values.pop("nonfinite_layers").reshape(-1).tolist()  # torchmetrics squeezes a (1,) state
            broken |= {index for index, count in enumerate(counts) if count > 0}
        broken_layers = {layer.index for layer in self.selected if layer.index in broken}
        scalars = self._scalars(values, broken_layers)
        layers, heads = self._logit_values()
        scalars.update(layers)
        if self.optimizer_state is not None:
            scalars.update(self.optimizer_state.take())
        scalars.update(overhead_values(self.clock, step - (self._start_step if self._start_step is not None else step)))
        if self.alerts is not None:
            scalars.update(self._run_rules({**(rule_values or {}), **heads, **scalars}, step))
        self._emit(step, scalars, values, full, broken_layers)
        for metric in self.metrics.values():
            metric.reset()
        self.last_sampled_step = step
        self.samples += 1
        self.last_values = scalars
        for listener in self._listeners["attention"]:
            listener(step, {**heads, **scalars})
        return scalars

    # --- workers --------------------------------------------------------------------------------------------------

    def _select(self, found: list[Layer]) -> list[Layer]:
        if self.options.layers is None:
            return found
        if isinstance(self.options.layers, str):
            chosen = [layer for layer in found if re.search(self.options.layers, layer.name)]
        else:
            wanted = set(self.options.layers)
            chosen = [layer for layer in found if layer.name in wanted or layer.index in wanted]
        if not chosen:
            warn_rank_zero(
                f"{self.owner}: layers={self.options.layers!r} matches none of {[layer.name for layer in found]}; "
                "the monitor records nothing"
            )
        return chosen

    def _is_full(self, sample: int | None = None) -> bool:
        """Whether sample number ``sample`` (from 0; default the current one) computes the costly diagnostics too."""
        return (self.samples if sample is None else sample) % self.full_every_n_samples == 0

    def _active(self) -> list[LayerwiseMean]:
        full = self._is_full()
        if "transport" in self.metrics:
            self.metrics["transport"].measure_edges = full
        return [metric for name, metric in self.metrics.items() if full or name != "spectrum"]

    def _before_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.before_optimizer_step(self._step_now)

    def before_optimizer_step(self, step: int) -> None:
        """After the backward of the step that follows ``step`` steps, before the optimizer steps: the curvature.

        The Lanczos and ``"secant"`` readings of a sampled step (:meth:`publish_curvature`). A plain loop's monitor
        calls it from the optimizer's step pre-hook; the Lightning and Hugging Face entry points from their
        trainer's pre-step event (``optimizer_hook=False``).
        """
        self._step_now = step
        if self.sharpness is not None:
            self.publish_curvature(step, self.sharpness.before_step(step))

    def read_forward(
        self, step: int, loss: Callable[[], Tensor] | None, model: nn.Module, loss_weight: float | None = None
    ) -> None:
        """Before a training forward after ``step`` steps: the curvature keeps its loss (or reads ``"difference"``).

        ``loss()`` is that micro-batch's scalar loss; ``loss_weight`` as in :meth:`step`.
        """
        if self.sharpness is not None and self.sharpness.reads_forward(step):
            self.publish_curvature(step, self.sharpness.before_forward(step, loss, model, loss_weight))

    def publish_curvature(self, step: int, values: dict[str, float] | None) -> None:
        """Log a curvature sample and show it to the alert rules (every process; logged on rank zero).

        A stop request sets :attr:`should_stop`; the sampler then waits while no rule over its values could fire.
        """
        if values is None:
            return
        values = dict(values)
        if self.optimizer_state is not None:
            values.update(self.optimizer_state.take())
        if self.alerts is not None:
            values.update(self._run_rules(values, step))
            if self.sharpness is not None:
                self.sharpness.hold_for(self.alerts.rules)
        if is_rank_zero() or self.log_on_every_rank:
            try:
                if self.log is not None:
                    self.log(dict(values), step=step)
                elif self.sink is not None:
                    self.sink.scalars(step, values)
            except Exception as error:  # a logger must not end the training run
                warn_rank_zero(f"connmon: log(values, step={step}) raised {type(error).__name__}: {error}")
        for listener in self._listeners["curvature"]:
            listener(step, values)

    def _run_rules(self, values: Mapping[str, float], step: int) -> dict[str, float]:
        """The alert rules on one sample's values; the stop and restore-point requests agreed; the counts to log."""
        assert self.alerts is not None
        alerts, stop = self.alerts.run(values, step, wandb=self.sink)
        points = self.alerts.restore_points
        if points is not None and self.agree(points.due is not None):
            points.due = step if points.due is None else points.due  # asked on another process
        if "stop" in self.alerts.actions and self.agree(stop):
            self.should_stop = True
        return self.alerts.counts(alerts)

    def _logit_values(self) -> tuple[dict[str, float], dict[str, float]]:
        """The max-logit window since the last sample, per layer (logged) and per head (for the rules); then reset."""
        window, self._logit_window = self._logit_window, None
        bounds, self._bound_window = self._bound_window, None
        clipped, self._clip_window = self._clip_window, None
        layers: dict[str, float] = {}
        heads: dict[str, float] = {}
        if clipped is not None and self.logits is not None:
            after = self.logits.whole(clipped["after"]).tolist()
            for position, layer in enumerate(self.selected):
                layers[keys.metric_key(keys.QK_CLIPS, layer.index)] = float(clipped["clips"][position])
                layers[keys.metric_key(keys.QK_CLIP_SCALE, layer.index)] = clipped["scale"][position]
                kept = [value for value in after[position] if math.isfinite(value)]
                if kept:
                    layers[keys.metric_key(keys.LOGIT_AFTER_QK_CLIP, layer.index)] = max(kept)
        if bounds is not None and self.logits is not None:
            for layer, row in zip(self.selected, self.logits.whole(bounds).tolist(), strict=True):
                if any(math.isfinite(value) for value in row):
                    layers[keys.metric_key(keys.MAX_LOGIT_BOUND, layer.index)] = max(filter(math.isfinite, row))
        if window is None or self.logits is None:
            return layers, heads
        for layer, row in zip(self.selected, self.logits.whole(window).tolist(), strict=True):
            finite = {head: value for head, value in enumerate(row) if math.isfinite(value)}
            if finite:
                layers[keys.metric_key(keys.STEP_MAX_LOGIT, layer.index)] = max(finite.values())
                heads.update({keys.head_key(layer.index, head): value for head, value in finite.items()})
        return layers, heads

    def _consume(self, record: AttentionRecord) -> None:
        with torch.inference_mode(False):  # states stay normal tensors under a caller's inference mode
            for metric in self._active():
                metric.update(record)

    def _scalars(self, values: dict[str, Tensor], broken_layers: set[int]) -> dict[str, float]:
        """The values to log: finite ones, and NaN where a layer's forward went non-finite (never a missing value)."""
        scalars = {}
        for name, value in values.items():
            if name.endswith("/all"):
                scalars[f"{keys.PREFIX}{name}"] = value.item()
                continue
            per_layer = value.reshape(-1).tolist()  # one host copy per metric; a one-layer model's value is 0-dim
            for layer in self.selected:
                if math.isfinite(per_layer[layer.index]) or layer.index in broken_layers:
                    scalars[keys.metric_key(name, layer.index)] = per_layer[layer.index]
        return {k: v for k, v in scalars.items() if math.isfinite(v) or broken_layers}

    def _emit(
        self, step: int, scalars: dict[str, float], values: dict[str, Tensor], full: bool, broken_layers: set[int]
    ) -> None:
        rank_zero = is_rank_zero()
        if broken_layers and rank_zero:
            names = sorted(layer.name for layer in self.selected if layer.index in broken_layers)
            warn_rank_zero(
                f"{self.owner}: step {step}: non-finite attention, input or output in {', '.join(names)}; their "
                "values and every connmon/<metric>/all are logged as NaN (W&B, CSV and TensorBoard keep NaN; a logger "
                "that rejects NaN drops them)"
            )
        if self.log is not None and (rank_zero or self.log_on_every_rank):
            try:
                self.log(dict(scalars), step=step)
            except Exception as error:  # a logger must not end the training run
                warn_rank_zero(f"connmon: log(values, step={step}) raised {type(error).__name__}: {error}")
        if self.sink is not None and rank_zero:
            if self.log is None:
                self.sink.scalars(step, scalars)
            write_panels(self.sink, step, self.metrics, values, full=full, histograms=self.options.log_histograms,
                         figures=self.options.figures_every_n_samples is not None
                         and self.samples % self.options.figures_every_n_samples == 0)  # fmt: skip


def _folded(window: Tensor | None, table: Tensor | None) -> Tensor | None:
    """``window`` with ``table`` folded in (their max; ``table`` alone where the heads differ or none was kept)."""
    if table is None:
        return window
    return table if window is None or window.shape != table.shape else window.maximum(table)


def _remove(path: str) -> None:
    """Rank zero removes a restore point (a file, or a folder that a ``save`` hook wrote)."""
    if not is_rank_zero():
        return
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    with contextlib.suppress(OSError):
        os.remove(path)
