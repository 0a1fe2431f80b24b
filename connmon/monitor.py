"""Monitor: the coordinator behind every entry point, over the run's parts; and the plain-PyTorch-loop API.

A run's parts are its attention samplers (:class:`connmon.attention_sampler.AttentionSampler`), its curvature
sampler (:class:`connmon.curvature.sampler.SharpnessSampler`), its per-step signals
(:class:`connmon.step_signals.StepSignals`: the clips, the optimizer's state) and the alert runner with its actions
(:class:`connmon.alerts.AlertRunner`). The
:class:`Monitor` takes one event protocol from every entry point (:meth:`Monitor.step_start`,
:meth:`Monitor.read_forward`, :meth:`Monitor.forward_end`, :meth:`Monitor.before_optimizer_step`,
:meth:`Monitor.after_optimizer_step`, :meth:`Monitor.step_end`, :meth:`Monitor.model_updated`), drives the parts
from it, logs what they measure, shows it to the rules, and answers each step with a :class:`StepOutcome` (the values
logged, a stop, a restore point due) that the entry point carries out its trainer's way. Lightning's
:class:`connmon.callbacks.ConnectionMonitor`, the Hugging Face
:class:`connmon.integrations.transformers.ConnectionMonitorCallback` and plain loops (:meth:`Monitor.step`) only
translate their trainer's events into it.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal, NamedTuple, get_args

import torch
from torch import nn
from typing_extensions import Unpack

from connmon._collectives import joins_seen, process_count, processes_in_step, watch_joins
from connmon._copying import CopiesDetached
from connmon._cost import CostClock, cost_line, overhead_values
from connmon._optimizer import unwrap_optimizer
from connmon._options import check_callable, check_choice
from connmon._probe import device_of, read_beside
from connmon._ranks import is_rank_zero, warn_rank_zero
from connmon._saved_state import checked_state
from connmon.alerts.runner import AlertRunner
from connmon.attention_sampler import AttentionSampler
from connmon.curvature.sampler import SharpnessSampler
from connmon.sampling import DIAGNOSTICS, OPTION_NAMES, Diagnostic, SamplingKeywords, SamplingOptions, sampling_options
from connmon.step_options import StepOptions
from connmon.step_signals import StepSignals, TrainerValues

__all__ = ["DIAGNOSTICS", "SAMPLING_OPTIONS", "Diagnostic", "LogFn", "Monitor", "SamplingOptions", "StepOutcome"]

_LOG = logging.getLogger(__name__)
LogFn = Callable[..., Any]  # called as log(values, step=step)
SAMPLING_OPTIONS = OPTION_NAMES  # the sampling options every entry point takes with the same names and defaults
Listener = Callable[[int, dict[str, float]], None]
ListenedTo = Literal["attention", "curvature"]


class RestorePointWriter(NamedTuple):
    """Where and how an entry point's trainer saves a restore point now (:meth:`Monitor.carry_out`).

    ``write(path)`` saves it (the trainer's own checkpoint), ``remove(path)`` removes one beyond ``keep`` (None: the
    trainer rotates its own), ``saves`` the verb of the line that says where ("saved", or "saves" for one the
    trainer writes at the end of the step).
    """

    path: str
    write: Callable[[str], Any]
    remove: Callable[[str], Any] | None = None
    saves: str = "saved"


class StepOutcome(NamedTuple):
    """What a step's end asks of the entry point: the values logged, a stop, a restore point to save.

    ``stop`` is the step of the alert that asked the run to stop (None: go on); ``restore_point`` the step of the
    alert that asked for a restore point not saved yet (None: none due). Every process gets the same outcome.
    """

    values: dict[str, float]
    stop: int | None
    restore_point: int | None


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
    (:meth:`connmon.alerts.RuleSet.regime_steps`, the sampler's ``extra_steps``). Every ``logit_every_n_steps``-th step
    each head's max logit over the step's whole batch is read (:mod:`connmon.capture.max_logit`), logged at the next
    sample as ``connmon/step_max_logit/L<ll>`` and shown to ``alerts`` per head; with their ``"qk_clip"`` action it
    is read every step and the heads above the threshold are clipped after the optimizer step; with their
    ``"transport_clip"`` action (an experiment) each head's ``O_h V_h`` is held near a scaled isometry. A
    ``torch.compile``'d model (or one with a compiled part, in every entry point) keeps its graph as compiled: its
    sampled batch is read beside it by one more forward of the original module (eval mode, ``no_grad``), so
    training stays bitwise unchanged.

    The monitor is the coordinator of a run's parts: its attention samplers
    (:class:`connmon.attention_sampler.AttentionSampler`), the curvature sampler, the optimizer's state and the
    alert rules with their actions. Every entry point drives it through one event protocol, :meth:`step_start`,
    :meth:`read_forward`, :meth:`forward_end`, :meth:`before_optimizer_step`, :meth:`after_optimizer_step`,
    :meth:`step_end` and :meth:`model_updated`; :meth:`step` is that protocol for a plain loop.

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
        wandb: a W&B run (``wandb.init(...)``) for histograms, figures and alerts, logged with ``step=step``; or the
            :class:`connmon.sinks.wandb.WandbSink` an entry point found (:func:`connmon.sinks.wandb.find_sink`).
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
        attention: True to read the attention with ``options``; False to read none (the curvature and the rules
            only); or the attention samplers to coordinate (each with its own options: how Lightning composes
            several ``ConnectionMonitor``).
        step_options: how often the per-step signals are read (:class:`connmon.step_options.StepOptions`: the max
            logits, the optimizer's state) for every sampler; None: those of ``options`` (how Lightning hands the
            options its callbacks set together, :func:`connmon.step_options.run_step_options`).
        trainer_values: the trainer's own latest values (``trainer_values()``: its loss, gradient norm, ... as it
            logged them), shown to ``alerts`` beside every sample's values, the mean over processes
            (:meth:`connmon.step_signals.StepSignals.trainer_values`); how an entry point hands its trainer's. A plain
            loop passes them to :meth:`step` instead.
        optimizer_hook: read the curvature in ``optimizer``'s step pre-hook (a plain loop); False for an entry point
            that calls :meth:`before_optimizer_step` from its trainer's own pre-step event.
        agree: a decision every process takes together (a trainer's any-process reduction, Lightning's
            ``strategy.reduce_boolean_decision``): the alerts' stop and restore point; the default ``bool`` holds
            where the values the rules read are synced (a plain loop).

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
        ("_pre_hook", lambda: None), ("_beside", lambda: None),
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
        loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
        options: SamplingOptions | None = None,
        owner: str = "connmon.Monitor",
        log_on_every_rank: bool = False,
        attention: bool | Sequence[AttentionSampler] = True,
        step_options: StepOptions | None = None,
        trainer_values: TrainerValues | None = None,
        optimizer_hook: bool = True,
        agree: Callable[[bool], bool] = bool,
        **sampling: Unpack[SamplingKeywords],
    ) -> None:
        if model is not None and not isinstance(model, nn.Module):
            raise ValueError(f"model must be a torch.nn.Module or None, got {type(model).__name__}: {model!r:.60}")
        options = sampling_options(options, owner, **sampling)
        check_callable("loss_fn", loss_fn, optional=True, signature="loss_fn(model, batch)")
        check_callable("log", log, optional=True, signature="log(values, step=step)")
        if isinstance(attention, bool):
            samplers = [AttentionSampler(options, owner)] if attention else []
        else:
            samplers = list(attention)
            if not all(isinstance(sampler, AttentionSampler) for sampler in samplers):
                raise ValueError("attention must be True, False, or a list of connmon AttentionSampler objects")
            options = samplers[0].options if samplers else options
        self.options = options
        self.attention_samplers = samplers
        self.optimizer_hook = optimizer_hook
        self.owner = owner
        self.agree = agree
        step_options = step_options if step_options is not None else options.step_options()
        if not isinstance(step_options, StepOptions):
            raise ValueError(
                f"step_options must be a connmon.step_options.StepOptions, got {type(step_options).__name__}"
            )
        for sampler in samplers:
            sampler.logit_every_n_steps = step_options.logit_every_n_steps
        self.signals = StepSignals(step_options, owner, trainer_values)  # before use(): it holds the clips
        self.use(alerts=alerts, sharpness=sharpness)
        if sharpness is not None and optimizer is None:
            raise ValueError("sharpness needs the optimizer it watches: pass optimizer=...")
        if sharpness is not None and sharpness.estimator != "secant" and loss_fn is None:
            raise ValueError(
                f"sharpness estimator={sharpness.estimator!r} reads a loss: pass loss_fn=... (and "
                "monitor.step(step, batch=batch)), or use estimator='secant'"
            )
        self._clock = CostClock("attention")  # a monitor without attention: its optimizer readings and clips
        self.log = log
        self.log_on_every_rank = log_on_every_rank
        self.sink: Any = None  # connmon.sinks.wandb.WandbSink for histograms, figures and W&B alerts
        if wandb is not None:
            from connmon.sinks.wandb import WandbSink

            self.sink = wandb if isinstance(wandb, WandbSink) else WandbSink(wandb, step_key=None)
        self.should_stop = False
        self._stop_step: int | None = None
        self._listeners: dict[str, list[tuple[Listener, AttentionSampler | None]]] = {"attention": [], "curvature": []}
        self.loss_fn = loss_fn
        self._model: nn.Module | None = None
        self._optimizer = unwrap_optimizer(optimizer) if optimizer is not None else None
        self._step_now = 0  # the step of the latest step_start: the one optimizer.step() completes
        self._begun: int | None = None  # the step begin_step last ran for
        self._pending: list[tuple[AttentionSampler, int]] = []  # the samples recorded and not finished yet
        self._forward_of: int | None = None  # the step whose forward step_start announced and forward_end not ended
        self._said_unentered = False  # monitor.step(...) called without `with` was said
        self._beside: contextlib.ExitStack | None = None  # a compiled model's reading beside its graph
        self._pre_hook: Any = None
        self._said_cost = False  # close() said what the run cost
        self._uneven_from: int | None = None  # the first step only some processes took (uneven inputs under Join)
        self._said_join: set[str] = set()  # what uneven inputs turned off, said once each
        if model is not None:
            self.attach(model)

    # --- the parts --------------------------------------------------------------------------------------------------

    def use(self, alerts: AlertRunner | None = None, sharpness: SharpnessSampler | None = None) -> None:
        """The run's alert rules and actions, and its curvature sampler (None: none); before :meth:`attach`."""
        if alerts is not None and not isinstance(alerts, AlertRunner):
            raise ValueError(f"alerts must be a connmon.alerts.AlertRunner or None, got {type(alerts).__name__}")
        if sharpness is not None and not isinstance(sharpness, SharpnessSampler):
            raise ValueError(
                "sharpness must be a connmon.curvature.sampler.SharpnessSampler or None, got "
                f"{type(sharpness).__name__}"
            )
        clips = [name for name in ("qk_clip", "transport_clip") if alerts is not None and name in alerts.actions]
        if clips and not self.attention_samplers:
            raise ValueError(
                f"the {' and '.join(repr(c) for c in clips)} action{'s' if len(clips) > 1 else ''} read each head's "
                "max logit from the attention, and this monitor reads none (attention=False; in Lightning: no "
                "ConnectionMonitor among the Trainer's callbacks): add a ConnectionMonitor, or drop "
                f"{' and '.join(repr(c) for c in clips)} from the actions"
            )
        self.alerts = alerts
        self.sharpness = sharpness
        self.signals.use(alerts)
        for sampler in self.attention_samplers:
            # sampled besides the cadence: what the alert rules that watch only a run's first steps need to compare
            every = sampler.options.every_n_steps
            sampler.extra_steps = alerts.rules.regime_steps(every) if alerts is not None else frozenset()
            sampler.reads_every_step = self.signals.clips is not None

    @property
    def attention_sampler(self) -> AttentionSampler | None:
        """The first attention sampler (the one the clip actions read), or None."""
        return self.attention_samplers[0] if self.attention_samplers else None

    @property
    def qk_clip(self) -> Any:
        """The ``"qk_clip"`` action (None: off, or turned off after it raised)."""
        return self.signals.clips.qk_clip if self.signals.clips is not None else None

    @property
    def transport_clip(self) -> Any:
        """The ``"transport_clip"`` action (None: off, or turned off after it raised)."""
        return self.signals.clips.transport_clip if self.signals.clips is not None else None

    # the first attention sampler's state, read as the monitor's (a plain loop has one)

    @property
    def clock(self) -> CostClock:
        """The attention's cost clock (the first sampler's)."""
        sampler = self.attention_sampler
        return sampler.clock if sampler is not None else self._clock

    @property
    def samples(self) -> int:
        """Attention samples taken this run (the first sampler's)."""
        return self.attention_sampler.samples if self.attention_sampler is not None else 0

    @property
    def last_values(self) -> dict[str, float]:
        """The values logged at the latest attention sample."""
        return self.attention_sampler.last_values if self.attention_sampler is not None else {}

    @property
    def is_armed(self) -> bool:
        """Whether a capture is armed now."""
        return any(sampler.is_armed for sampler in self.attention_samplers)

    # --- the plain-loop API ---------------------------------------------------------------------------------------

    def step(
        self,
        step: int,
        rule_values: Mapping[str, float] | None = None,
        batch: Any = None,
        loss_weight: float | None = None,
    ) -> contextlib.AbstractContextManager[bool]:
        """Wrap the forward of optimizer step ``step`` (the steps taken so far); yields whether it is sampled.

        On a sampled step the capture is armed for the block and the sample is measured and logged when it ends.
        If the block raises, every hook is removed and the partial sample is discarded (:meth:`discard`).
        ``rule_values`` (say, the previous step's ``{"loss": ..., "grad_norm": ...}``) are shown to the alert rules
        beside the samples' keys until the next :meth:`step` (the trainer's values of
        :class:`connmon.step_signals.StepSignals`, the mean over processes). ``batch`` is what ``loss_fn(model,
        batch)`` reads for a ``sharpness`` estimator that needs a loss. ``loss_weight`` is the factor the loop puts on
        this micro-batch's loss before its backward: None when each micro-batch's loss is its own mean and the loop
        divides it by the number of micro-batches (the step's loss is their mean), ``1.0`` when ``loss_fn`` already
        normalises it over the whole step (a token count of every micro-batch, as Hugging Face's
        ``num_items_in_batch``) and the loop sums them.
        Called without ``with`` it does nothing, and says so once.

        Raises:
            ValueError: for a ``step`` that is not an integer >= 0.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be the optimizer steps taken so far, an integer >= 0, got step={step!r}")
        return _StepBlock(self, self._step_block(step, rule_values, batch, loss_weight), step)

    @contextlib.contextmanager
    def _step_block(
        self, step: int, rule_values: Mapping[str, float] | None, batch: Any, loss_weight: float | None
    ) -> Iterator[bool]:
        model = self._model
        self._step_now = step
        self.signals.given = rule_values
        self.begin_step(step)
        if self.alerts is not None and self.alerts.restore_points is not None and not joins_seen():
            self.save_restore_point(step)  # under uneven inputs, after the optimizer step instead
        if model is not None and self.sharpness is not None:
            loss_fn = self.loss_fn
            loss = None if loss_fn is None or batch is None else lambda: loss_fn(model, batch)
            self.read_forward(step, loss, model, loss_weight)
        if model is not None:
            self.model_updated(step, model)  # a probe: the model after `step` optimizer steps
        sampled = model is not None and self.step_start(step, model)
        try:
            yield sampled
        except BaseException:
            self.forward_end(raised=True)
            raise
        self.forward_end()
        self.step_end(step)

    # --- the event protocol every entry point calls ---------------------------------------------------------------

    def step_start(self, step: int, model: nn.Module, first: bool = True) -> bool:
        """A forward of optimizer step ``step`` (the steps taken so far) begins; whether a sample records it.

        ``first``: the step's first micro-batch, whose forward a due sampler records (a compiled model's batch read
        beside its graph); every micro-batch's max logits are read. :meth:`forward_end` ends it.

        Raises:
            RuntimeError: the forward before it never ended (no :meth:`forward_end`), or a step's first forward
                while an earlier step's sample waits for its :meth:`step_end`: every hook is removed and the
                samples not finished are dropped first, so no reading mixes two steps.
        """
        if self._forward_of is not None:
            self._out_of_order(f"step_start({step})", f"forward_end() after the forward of step {self._forward_of}")
        waiting = sorted({at for _, at in self._pending if at != step})
        if first and waiting:
            self._out_of_order(f"step_start({step})", f"step_end({waiting[0]})")
        self._forward_of = step
        self._step_now = step
        if first:
            self.begin_step(step)
        sampled = False
        for sampler in self.attention_samplers:
            forward = sampler.start_forward(step, model, first)
            if forward.armed:
                self._pending.append((sampler, step))
            elif forward.beside is not None:
                if self._beside is None:
                    self._beside = contextlib.ExitStack()
                self._beside.enter_context(read_beside(forward.beside, self._reader(sampler, step, model)))
            sampled = sampled or forward.armed or forward.beside is not None
        return sampled

    def _reader(
        self, sampler: AttentionSampler, step: int, model: nn.Module
    ) -> Callable[[nn.Module, Callable[[nn.Module], Any]], None]:
        """What reads a compiled part's batch beside its graph: ``model`` armed, the part's original module run."""

        def read(original: nn.Module, forward: Callable[[nn.Module], Any]) -> None:
            if sampler.record(model, lambda _: forward(original)):
                self._pending.append((sampler, step))

        return read

    def forward_end(self, raised: bool = False) -> None:
        """The forward :meth:`step_start` announced ended (``raised``: its partial samples are discarded).

        A no-op when none is open (an entry point may end a forward twice).
        """
        self._forward_of = None
        for sampler in self.attention_samplers:
            sampler.end_forward(discard=raised and any(sampler is pending for pending, _ in self._pending))
        if raised:
            self._drop()
        elif self._beside is not None:
            stack, self._beside = self._beside, None
            stack.close()

    def step_end(self, step: int) -> StepOutcome:
        """The sampled forwards of step ``step`` are over: their samples are measured, logged and shown to the rules.

        Every process must call it on the same steps (the accumulators sync across processes). The trainer's own
        values (``trainer_values``) are shown to the alert rules beside the sample's keys; they are not logged. Returns
        what the entry point carries out: the values logged, a stop, a restore point due.

        Raises:
            RuntimeError: the step's forward never ended (no :meth:`forward_end`): every hook is removed and its
                sample dropped first.
        """
        if self._forward_of is not None:
            self._out_of_order(f"step_end({step})", f"forward_end() after the forward of step {self._forward_of}")
        pending, self._pending = self._pending, []
        values: dict[str, float] = {}
        if pending and not self.every_process_in_step():
            for sampler, _ in pending:
                sampler.discard()
            return self.outcome(values)
        for sampler, sampled_step in pending:
            values.update(self.finish(sampled_step, sampler))
        return self.outcome(values)

    def _out_of_order(self, event: str, missing: str) -> None:
        """An event came before the one it needs: every hook removed, the samples not finished dropped; the error."""
        self._forward_of = None
        self.discard()
        self.unwatch_logits()
        raise RuntimeError(
            f"{self.owner}: {event} came before {missing}. Each forward of a step is announced by step_start() and "
            "ended by forward_end(); step_end() follows the step's last forward (docs/integrations.md). Every hook "
            "connmon added is removed and the samples not finished are dropped"
        )

    def carry_out(
        self,
        outcome: StepOutcome,
        step: int,
        *,
        owner: str,
        stop: Callable[[], bool],
        restore_point: Callable[[], RestorePointWriter | None] | None = None,
    ) -> None:
        """Carry out a step's outcome the entry point's way, the same in every entry point: its restore point, its stop.

        ``step`` is the optimizer steps the trainer has taken (the restore point is of that state). ``restore_point()``
        says where and how the trainer saves one now (None: not now, and the request waits); ``stop()`` asks the
        trainer to stop, returning False when it was stopping already (then nothing is said). Every process calls it
        with the same outcome.

        Examples:
            >>> import warnings
            >>> import connmon
            >>> from connmon.alerts import AlertRunner
            >>> from connmon.monitor import StepOutcome
            >>> monitor, stopped = connmon.Monitor(alerts=AlertRunner([])), []
            >>> with warnings.catch_warnings(record=True) as said:
            ...     monitor.carry_out(StepOutcome({}, stop=7, restore_point=None), 8, owner="my loop",
            ...                       stop=lambda: stopped.append(8) or True)
            >>> stopped, str(said[0].message)
            ([8], 'my loop stops the run at step 7 (an alert at level >= ERROR)')
        """
        alerts = self.alerts
        if alerts is None:
            return
        points = alerts.restore_points
        if points is not None and outcome.restore_point is not None and restore_point is not None:
            writer = restore_point()
            if writer is not None:
                points.save_due(step, writer.path, writer.write, writer.remove, owner=owner, saves=writer.saves)
        if outcome.stop is not None and stop():
            alerts.say_stop(owner, outcome.stop)

    def model_updated(self, steps_taken: int, model: nn.Module) -> StepOutcome:
        """The model after ``steps_taken`` optimizer steps: a sampler with a ``probe`` due then records it now."""
        values: dict[str, float] = {}
        for sampler in self.attention_samplers:
            if sampler.options.probe is not None and joins_seen():
                self._say_uneven("probe", "a probe is not recorded: its forward would count as a step of the Join")
                continue
            if sampler.options.probe is not None and sampler.due(steps_taken) and sampler.record(model):
                values.update(self.finish(steps_taken, sampler))
        return self.outcome(values)

    def outcome(self, values: dict[str, float] | None = None) -> StepOutcome:
        """What the entry point is asked to do now: stop (the alert's step), save a restore point (its step)."""
        points = self.alerts.restore_points if self.alerts is not None else None
        due = points.due if points is not None else None
        return StepOutcome(values or {}, self._stop_step if self.should_stop else None, due)

    def disarm(self) -> None:
        """Remove the capture's hooks (a no-op when not armed)."""
        for sampler in self.attention_samplers:
            sampler.disarm()

    def discard(self) -> None:
        """Disarm and forget the samples being recorded (a forward that raised): nothing of them is logged or kept."""
        self._drop()
        for sampler in self.attention_samplers:
            sampler.discard()

    def _drop(self) -> None:
        """Every capture disarmed, a compiled model's reading removed, the samples not finished forgotten."""
        self._pending, self._forward_of = [], None
        self.disarm()
        if self._beside is not None:
            stack, self._beside = self._beside, None
            stack.close()

    def due(self, step: int) -> bool:
        """Whether any attention sampler samples optimizer step ``step``."""
        return any(sampler.due(step) for sampler in self.attention_samplers)

    def unwatch_logits(self) -> None:
        """Remove the max logits' hooks (a no-op when none)."""
        for sampler in self.attention_samplers:
            sampler.unwatch_logits()

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
        if points is None:
            return None
        return points.save_loop_point(step, self._model, self._optimizer, self.state_dict, owner=self.owner)

    # --- the model and the optimizers -------------------------------------------------------------------------------

    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> bool:
        """Find ``model``'s attention layers and build the accumulators on its device; False (and one warning) if none.

        Called by the constructor with a model. Calling it again builds fresh accumulators (the cadence is kept; the
        time-drift references restart unless :meth:`load_state_dict` gave some). ``optimizer``, if given, replaces
        the constructor's (a trainer that builds its optimizer later); with one, the curvature sampler and the
        back-off watch it (:meth:`attach_optimizers`). A model without readable attention keeps the curvature and
        the rules on it.
        """
        self._drop()
        self._model = model
        self._begun, self._said_cost = None, False
        watch_joins()
        found = [sampler.attach(model) for sampler in self.attention_samplers]
        optimizer = optimizer if optimizer is not None else self._optimizer
        if optimizer is not None:
            self.attach_optimizers([optimizer])
        elif self.optimizer_hook:  # a plain loop gave none: the back-off says it has nothing to act on
            self.attach_optimizers([])
        return bool(found) and any(found)

    def attach_optimizers(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """The curvature sampler and the alerts' back-off watch the training's optimizers (after :meth:`attach`).

        The sampler reads one optimizer (with more, it is off with one warning). With ``optimizer_hook`` its reading
        before each step runs in the optimizer's step pre-hook; an entry point whose trainer steps in a closure calls
        :meth:`before_optimizer_step` itself.
        """
        optimizers = [unwrap_optimizer(optimizer) for optimizer in optimizers]
        self._optimizer = optimizers[0] if len(optimizers) == 1 else None
        self._remove_optimizer_hooks()
        sampler = self.attention_sampler
        # with no optimizer known, a step's max logits are read (and clipped) at the next step's start and at close()
        reads_logits = sampler is not None and sampler.logits is not None
        self.signals.attach(optimizers, reads_logits, self._after_optimizer_step)
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
        if self.signals.clips is not None and not optimizers and self.optimizer_hook:
            warn_rank_zero(
                f"{self.owner}: no optimizer was given (optimizer=...), so the clip actions act at each step's start "
                "on the step before (the last at close()) and cannot tell a step the optimizer skipped (a "
                "GradScaler's inf step), which they clip too; pass optimizer=... to clip right after each step"
            )

    def _remove_optimizer_hooks(self) -> None:
        if self._pre_hook is not None:
            self._pre_hook.remove()
        self._pre_hook = None
        self.signals.detach()

    def close(self, steps_taken: int | None = None) -> None:
        """The run is over: every hook removed (the capture's, the max logits', the optimizer's), what it cost said.

        The cost clocks stop and :meth:`cost_summary` is said at INFO level on rank zero (``logging`` logger
        ``connmon.monitor``), once per :meth:`attach`; with ``steps_taken`` (the optimizer steps the run took) the
        final ``connmon/overhead...`` values are logged once more at that step. Every entry point ends a run here.
        """
        self._drop()
        self.unwatch_logits()
        if self.qk_clip is not None and not self._reads_after_step():  # no optimizer's hook: the last clip is now
            with self.clock.measuring():
                self._clip(None)
        self._remove_optimizer_hooks()
        if self.sharpness is not None:
            self.sharpness.detach()
        if self.alerts is not None:
            self.alerts.detach()
        for sampler in self.attention_samplers:
            sampler.close()
        if self._said_cost:
            return
        self._said_cost = True
        clocks = self._clocks()
        timed = [clock for clock in clocks if clock.sections]
        if steps_taken is not None and timed:
            self._emit(steps_taken, {k: v for clock in timed for k, v in overhead_values(clock).items()})
        if is_rank_zero():
            _LOG.info("connmon: %s", cost_line(self.owner, clocks))

    def _clocks(self) -> list[CostClock]:
        """Every part's cost clock: the attention samplers' (or the monitor's own), the curvature sampler's."""
        clocks = [sampler.clock for sampler in self.attention_samplers] or [self._clock]
        return clocks + ([self.sharpness.clock] if self.sharpness is not None else [])

    def cost_summary(self) -> str:
        """What the monitor (and its ``sharpness``) cost so far, in one line.

        Examples:
            >>> import connmon
            >>> connmon.Monitor(every_n_steps=10).cost_summary()
            'connmon.Monitor cost nothing measurable (no sample was taken)'
        """
        return cost_line(self.owner, self._clocks())

    # --- the step's boundaries: max logits, clips, the optimizer's state, the curvature -----------------------------

    def begin_step(self, step: int) -> None:
        """Optimizer step ``step`` begins (its first micro-batch): decide whether this step's max logits are read.

        The per-head max logits of a step (every forward of it, MAX-reduced across processes: every process calls
        this at the same steps) join the window the rules see at the next sample. With an optimizer known they are
        read, and the clip actions act on them, right after the step's optimizer step, in the optimizer's step
        post-hook (:meth:`after_optimizer_step`), so the last step of a run is clipped too and a step the optimizer
        skipped (a GradScaler's inf step) is not. Without one (a plain loop given none) they are read here, on the
        step before, and at :meth:`close`. Called by :meth:`step_start`; a second call for the same step does nothing.
        """
        self._step_now = step
        if step == self._begun or not any(sampler.logits is not None for sampler in self.attention_samplers):
            return
        self._begun = step
        with self.clock.measuring():
            if joins_seen():  # no collective before the forward: a process out of data does not take this step
                if not self.signals.logits_after_step:
                    self._say_uneven("logits", "the per-step max logits and the clips need optimizer=... there")
                    for sampler in self.attention_samplers:
                        sampler.drop_step_logits()
            elif self._reads_after_step():
                self._read_step_logits()  # unread: the optimizer skipped that step, which is not clipped
            else:
                self._clip(step)
            threshold = self.qk_clip.threshold if self.qk_clip is not None else None
            for sampler in self.attention_samplers:
                sampler.begin_logits(step, threshold)

    def _reads_after_step(self) -> bool:
        """Whether each step's max logits are read in the optimizer's post-hook (for a clip; under uneven inputs)."""
        return self.signals.reads_after_step(uneven=joins_seen())

    def every_process_in_step(self) -> bool:
        """Whether every process took the current step's forward (no collective; False only for uneven inputs).

        Inside ``torch.distributed``'s ``Join`` (DDP's ``model.join()``, accelerate's ``join_uneven_inputs``) a
        process that ran out of data shadows only its joinables' collectives, so connmon reads nothing on a step
        only some processes took (said once): every value it logs is of steps every process took.
        """
        if not joins_seen():
            return True
        taken, count = processes_in_step(), process_count()
        if taken >= count:
            return True
        if self._uneven_from is None:
            self._uneven_from = self._step_now
            warnings.warn(
                f"{self.owner}: step {self._step_now} was taken by {taken} of {count} processes (uneven inputs under "
                "torch.distributed's Join): connmon reads nothing on the steps only some processes take, so every "
                "value it logs is of steps all of them took",
                stacklevel=2,
            )
        return False

    def _say_uneven(self, what: str, why: str) -> None:
        """Say once that uneven inputs (a ``Join``) turn ``what`` off, and ``why``."""
        if what not in self._said_join:
            self._said_join.add(what)
            warn_rank_zero(f"{self.owner}: under torch.distributed's Join (uneven inputs), {why}")

    def _read_step_logits(self) -> tuple[int, torch.Tensor] | None:
        """Every sampler's watched step folded into its window; the first sampler's ``(step, table)``, if read."""
        reads = [sampler.read_step_logits() for sampler in self.attention_samplers]
        first = self.attention_sampler
        if first is not None and first.nonfinite and self.alerts is not None:
            step = first.nonfinite_at  # a forward went non-finite: said at its own step, not at the next sample
            values, first.nonfinite = dict(first.nonfinite), {}
            values.update(self._run_rules(values, step))
            self._emit(step, values)
        return reads[0] if reads else None

    def _clip(self, steps_taken: int | None) -> None:
        """The clip actions on the step just read (the first sampler's layers), once ``steps_taken`` steps are taken."""
        read = self._read_step_logits()
        sampler = self.attention_sampler
        clips = self.signals.clips
        if clips is None or sampler is None or sampler.logits is None:
            return
        clips.act(steps_taken, read, sampler.logits, [layer.index for layer in sampler.selected])

    def _after_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.after_optimizer_step(optimizer)

    def after_optimizer_step(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Right after an optimizer step: its max logits read, the clip actions on them, the optimizer's state.

        The optimizer's step post-hook calls it (the monitor registers one when it reads max logits or
        ``optimizer_every_n_steps``). The state is read after every ``optimizer_every_n_steps``-th step (counted as
        the steps taken, the one just taken included; every process at the same steps) into the window logged at the
        next sample. Under uneven inputs, a restore point due is saved here (not at the next step's start).
        """
        if not self.every_process_in_step():
            for sampler in self.attention_samplers:
                sampler.drop_step_logits()
            return
        with self.clock.measuring():
            if self._reads_after_step() and self._begun is not None:
                self._clip(self._begun + 1)
            self.signals.read_optimizer(optimizer, self._step_now + 1)
        if joins_seen() and self.optimizer_hook:  # a plain loop: saved here, where every process is known to be
            self.save_restore_point(self._step_now + 1)

    def _before_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.before_optimizer_step(self._step_now)

    def before_optimizer_step(self, step: int) -> None:
        """After the backward of the step that follows ``step`` steps, before the optimizer steps: the curvature.

        The Lanczos and ``"secant"`` readings of a sampled step (:meth:`publish_curvature`). A plain loop's monitor
        calls it from the optimizer's step pre-hook; the Lightning and Hugging Face entry points from their
        trainer's pre-step event (``optimizer_hook=False``).
        """
        self._step_now = step
        if self.sharpness is None:
            return
        if not self.every_process_in_step():
            self.sharpness.skip_step(step)
            return
        self.publish_curvature(step, self.sharpness.before_step(step))

    def read_forward(
        self, step: int, loss: Callable[[], torch.Tensor] | None, model: nn.Module, loss_weight: float | None = None
    ) -> None:
        """Before a training forward after ``step`` steps: the curvature keeps its loss (or reads ``"difference"``).

        ``loss()`` is that micro-batch's scalar loss; ``loss_weight`` as in :meth:`step`.
        """
        if self.sharpness is None or not self.sharpness.reads_forward(step):
            return
        if joins_seen() and self.sharpness.estimator == "difference":  # it reads before the step's forward
            self.sharpness.turn_off("under torch.distributed's Join (uneven inputs) it would read before knowing "
                                    "whether every process takes the step; use another estimator")  # fmt: skip
            return
        self.publish_curvature(step, self.sharpness.before_forward(step, loss, model, loss_weight))

    # --- what the parts measured: rules, logs, listeners -------------------------------------------------------------

    def finish(self, step: int, sampler: AttentionSampler | None = None) -> dict[str, float]:
        """Sync, log and reset the sample just recorded (by ``sampler``, default the first), run the alert rules.

        Every process must call it on the same steps (the accumulators sync across processes). The trainer's own
        values (:meth:`connmon.step_signals.StepSignals.trainer_values`) are shown to the alert rules beside the
        sample's keys; they are not logged here. Returns the values logged.
        """
        sampler = sampler if sampler is not None else self.attention_sampler
        if sampler is None:
            return {}
        with sampler.clock.measuring(), torch.inference_mode(False):  # a sample under inference mode: normal states
            sample = sampler.measure(step)
            scalars = sample.scalars
            if sampler is self.attention_sampler:  # the clips act on the first sampler's layers
                scalars.update(self.signals.window(sampler.logits, [layer.index for layer in sampler.selected]))
            else:
                scalars.update(self.signals.optimizer_window())
            if self.alerts is not None:
                trainer = self.signals.trainer_values()
                scalars.update(self._run_rules({**trainer, **sample.heads, **scalars}, step))
            self._emit(step, scalars)
            if self.sink is not None and is_rank_zero():
                sampler.panels(self.sink, step, sample)
            sampler.sampled(step, sample)
            for listener, part in self._listeners["attention"]:
                if part is None or part is sampler:
                    listener(step, {**sample.heads, **scalars})
        sampler.weigh(step)
        return scalars

    def publish_curvature(self, step: int, values: dict[str, float] | None) -> None:
        """Log a curvature sample and show it to the alert rules (every process; logged on rank zero).

        A stop request sets :attr:`should_stop`; the sampler then waits while no rule over its values could fire.
        """
        if values is None:
            return
        values = {**values, **self.signals.optimizer_window()}
        if self.alerts is not None:
            values.update(self._run_rules({**self.signals.trainer_values(), **values}, step))
            if self.sharpness is not None:
                self.sharpness.hold_for(self.alerts.rules)
        self._emit(step, values, sink_scalars=True)
        for listener, _ in self._listeners["curvature"]:
            listener(step, values)

    def _run_rules(self, values: Mapping[str, float], step: int) -> dict[str, float]:
        """The alert rules on one sample's values (stop and restore point agreed by every process); the counts."""
        assert self.alerts is not None
        alerts, stop = self.alerts.run(values, step, wandb=self.sink, agree=self.agree)
        if stop and not self.should_stop:
            self.should_stop, self._stop_step = True, step
        return self.alerts.counts(alerts)

    def _emit(self, step: int, scalars: dict[str, float], sink_scalars: bool = False) -> None:
        """``log(values, step=step)`` on rank zero (every process with ``log_on_every_rank``), else the W&B run's."""
        if not (is_rank_zero() or self.log_on_every_rank):
            return
        try:
            if self.log is not None:
                self.log(dict(scalars), step=step)
            elif self.sink is not None and is_rank_zero():
                self.sink.scalars(step, scalars)
        except Exception as error:  # a logger must not end the training run
            warn_rank_zero(f"connmon: log(values, step={step}) raised {type(error).__name__}: {error}")

    def add_listener(
        self,
        listener: Listener,
        of: ListenedTo = "attention",
        sampler: AttentionSampler | None = None,
    ) -> None:
        """Call ``listener(step, values)`` on every process after each sample ``of`` attention or curvature is logged.

        ``values``: as logged (the alert counts included), and for an attention sample every head's max logit since
        the previous sample (``connmon/head_max_logit/L<ll>H<hh>``, for the alert rules; not logged). ``sampler``:
        only that attention sampler's samples (None: every one's).
        """
        check_choice("of", of, get_args(ListenedTo))
        self._listeners[of].append((listener, sampler))

    # --- the checkpoint -----------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Sampling cadence, each layer's previous sample (time drift), the curvature's and the alert rules' state."""
        return {
            **self.attention_state(),
            "alerts": self.alerts.state_dict() if self.alerts is not None else None,
            "sharpness": self.sharpness.state_dict() if self.sharpness is not None else None,
        }

    def attention_state(self, sampler: AttentionSampler | None = None) -> dict[str, Any]:
        """``sampler``'s part of :meth:`state_dict` (default the first's): its cadence, drift and max logits.

        The run's own windows (the optimizer's state, what QK-clip did since the last sample) ride with the first
        sampler's.
        """
        first = self.attention_sampler
        sampler = sampler if sampler is not None else first
        own = sampler.state_dict() if sampler is not None else {}
        logits = own.get("logits")
        signals = self.signals.state_dict() if sampler is first else {}
        if sampler is first and self.signals.clips is not None:
            logits = {**(logits or {}), "clip_window": signals["clip_window"]}
        return {
            "config": sampler.config() if sampler is not None else self._config(),
            "samples": own.get("samples", 0),
            "last_sampled_step": own.get("last_sampled_step", -1),
            "drift": own.get("drift"),
            "full_every_n_samples": own.get("full_every_n_samples", 1),
            "logits": logits,
            "optimizer_state": signals.get("optimizer_state"),
        }

    def _config(self) -> dict[str, Any]:
        return {"num_sequences": self.options.num_sequences, "max_tokens": self.options.max_tokens}

    def load_state_dict(self, state_dict: Mapping[str, Any], sampler: AttentionSampler | None = None) -> None:
        """Restore what :meth:`state_dict` saved (before or after :meth:`attach`).

        Each part is checked: one that is malformed, or time-drift references saved under another configuration
        (``num_sequences``, ``max_tokens``: walks of another shape), is not restored, and one warning says which and
        why.
        """
        first = self.attention_sampler
        sampler = sampler if sampler is not None else first
        config = sampler.config() if sampler is not None else self._config()
        checked = checked_state(state_dict, config, self.owner)
        if checked is None:
            return
        if sampler is not None:
            sampler.load_state_dict(checked)
        if self.sharpness is not None and checked.get("sharpness") is not None:
            self.sharpness.load_state_dict(checked["sharpness"])
        if self.alerts is not None and checked.get("alerts") is not None:
            self.alerts.load_state_dict(checked["alerts"])
        if sampler is first:
            self.load_run_state(checked)

    def load_run_state(self, state: Mapping[str, Any]) -> None:
        """The run's own windows from a saved state: what QK-clip did, the optimizer's state since the last sample."""
        clip_window = (state.get("logits") or {}).get("clip_window")
        self.signals.load_state_dict({"clip_window": clip_window, "optimizer_state": state.get("optimizer_state")})

    def reset(self) -> None:
        """Start the cadence and the time-drift references afresh (a new run)."""
        self.should_stop, self._stop_step, self._pending = False, None, []
        if self.sharpness is not None:
            self.sharpness.reset()
        for sampler in self.attention_samplers:
            sampler.reset()


class _StepBlock(contextlib.AbstractContextManager):
    """:meth:`Monitor.step`'s block; one left unentered (``monitor.step(3)`` without ``with``) says so once."""

    def __init__(self, monitor: Monitor, block: contextlib.AbstractContextManager[bool], step: int) -> None:
        self.monitor, self.block, self.step, self.entered = monitor, block, step, False

    def __enter__(self) -> bool:
        self.entered = True
        return self.block.__enter__()

    def __exit__(self, *raised: Any) -> bool | None:
        return self.block.__exit__(*raised)

    def __del__(self) -> None:
        monitor = self.monitor
        if self.entered or monitor._said_unentered:
            return
        monitor._said_unentered = True
        warnings.warn(
            f"{monitor.owner}: monitor.step({self.step}) was called without `with`, so it did nothing: write "
            "`with monitor.step(step):` around the step's forward",
            stacklevel=2,
        )
