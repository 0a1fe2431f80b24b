"""AttentionSampler: a run's attention part, as :class:`connmon.curvature.sampler.SharpnessSampler` is its curvature.

Its cadence, the capture it arms on a sampled step, the torchmetrics accumulators the records stream into, the
values they sync to, and every head's max logit over each step's whole batch. It logs nothing and runs no rule:
:class:`connmon.Monitor`, the coordinator, hands its values to the rules, the actions and the loggers.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from connmon import keys
from connmon._budget import FullSampleBudget
from connmon._copying import CopiesDetached
from connmon._cost import CostClock, overhead_values
from connmon._probe import device_of, probing, run_forward
from connmon._ranks import is_rank_zero, warn_rank_zero
from connmon.capture import AttentionRecord, armed, attention_layers
from connmon.capture.max_logit import HeadMaxLogits, fused_path_modules
from connmon.capture.session import CaptureSession, Layer
from connmon.metrics import DriftMetrics, LayerwiseMean, SpectrumMetrics, TransportMetrics, WalkMetrics
from connmon.sampling import SamplingOptions
from connmon.sinks.panels import write_panels

__all__ = ["AttentionSampler", "Sample"]

LONG_SAMPLE_S = 2.0  # a sample that keeps the training waiting longer is said, once per run, with what it did


class Sample:
    """One attention sample's synced values: ``scalars`` to log, ``tensors`` for the W&B panels, ``heads`` per head.

    ``heads`` maps ``connmon/head_max_logit/L<ll>H<hh>`` to each head's max logit since the previous sample (for the
    alert rules; not logged).
    """

    def __init__(self, scalars: dict[str, float], tensors: dict[str, Tensor], heads: dict[str, float], full: bool):
        self.scalars, self.tensors, self.heads, self.full = scalars, tensors, heads, full


class Forward(NamedTuple):
    """What :meth:`AttentionSampler.start_forward` did: ``armed`` the capture, or left a compiled part ``beside``."""

    armed: bool
    beside: nn.Module | None


class AttentionSampler(CopiesDetached):
    """Samples every self-attention layer of a model on its cadence and reads each step's per-head max logits.

    On a due step :meth:`arm` puts the capture on the model for one forward (no hook exists on other steps) and
    :meth:`measure` syncs what it recorded across processes; the eigen- and SVD-bound diagnostics run on every
    ``full_every_n_samples``-th sample. Every :attr:`logit_every_n_steps`-th step (every step when ``reads_every_step``,
    for a clip action) each head's max logit over the step's forwards is read into a window the next sample shows the
    rules. :class:`connmon.Monitor` drives it; nothing here logs, runs a rule or acts.

    Args:
        options: what is recorded and how often (:class:`~connmon.sampling.SamplingOptions`).
        owner: the entry point named in warnings.

    Examples:
        >>> import torch
        >>> from connmon.attention_sampler import AttentionSampler
        >>> from connmon.sampling import SamplingOptions
        >>> layer = torch.nn.TransformerEncoderLayer(16, 2, dropout=0.0, batch_first=True)
        >>> model = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        >>> sampler = AttentionSampler(SamplingOptions(diagnostics=("walk",)), owner="example")
        >>> sampler.attach(model), sampler.due(0)
        (True, True)
        >>> sampler.arm(model)
        >>> _ = model(torch.randn(2, 5, 16))
        >>> sampler.disarm()
        >>> sample = sampler.measure(step=0)
        >>> sampler.sampled(0, sample)
        >>> sampler.samples, round(sample.scalars["connmon/stochasticity_gap/L00"], 6)
        (1, 0.0)
    """

    _not_copied = (("_armed", lambda: None), ("_session", lambda: None))  # hooks stay

    def __init__(self, options: SamplingOptions, owner: str) -> None:
        self.options = options
        self.owner = owner
        self.clock = CostClock("attention")
        self.full_every_n_samples = options.full_every_n_samples  # the budget moves it: state, not an option
        budget = options.budget
        self._budget = None if budget is None else FullSampleBudget(budget, options.every_n_steps, owner)
        self.extra_steps: frozenset[int] = frozenset()  # sampled besides the cadence (what early rules compare)
        self.reads_every_step = False  # a clip action acts on every step's max logits
        self.logit_every_n_steps = options.logit_every_n_steps  # the run's step options set it (StepSignals)
        self.samples = 0
        self.last_sampled_step = -1
        self.last_values: dict[str, float] = {}
        self.selected: list[Layer] = []
        self._unarmed: list[Layer] = []
        self.metrics: dict[str, LayerwiseMean] = {}
        self.model: nn.Module | None = None
        self.logits: HeadMaxLogits | None = None  # every head's max logit over the whole batch of a step
        self._armed: contextlib.ExitStack | None = None
        self._session: CaptureSession | None = None  # the armed capture's session
        self._pending_drift_state: dict | None = None
        self._drift_before: dict | None = None  # the time-drift references before the armed sample
        self._sample_began = 0.0  # the clock's spent seconds when the current sample was armed
        self._said_long = False  # a long sample was said (once per run)
        self._start_step: int | None = None  # the first step asked about since attach: where training time starts
        self._logit_step: int | None = None  # the step whose forwards the logits read now
        self.nonfinite: dict[str, float] = {}  # the latest step's non-finite max logits (NaN, overflow), per layer
        self.nonfinite_at = -1  # that step
        self._logit_window: Tensor | None = None  # (layers, H): the max since the last sample, for the rules
        self._bound_window: Tensor | None = None  # (layers, H): the kernels' logsumexp bounds since the last sample
        self._pending_logits: dict | None = None  # a checkpoint's max logits, until attach builds the reader

    # --- the model ----------------------------------------------------------------------------------------------

    def attach(self, model: nn.Module) -> bool:
        """Find ``model``'s attention layers and build the accumulators on its device; False (and one warning) if none.

        Calling it again builds fresh accumulators (the cadence is kept; the time-drift references restart unless
        :meth:`load_state_dict` gave some).
        """
        self.disarm()
        self.model = model
        self.selected, self._unarmed, self.metrics = [], [], {}
        if self.logits is not None:
            self.logits.unwatch()
        self.logits = None
        try:
            found = attention_layers(getattr(model, "_orig_mod", model))  # torch.compile: the original's layers
        except ValueError as error:
            warn_rank_zero(f"{self.owner} is off for this run: {error}")
            return False
        self._build(model, found)
        return True

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
        if self.logit_every_n_steps is not None or self.reads_every_step:
            modules, names = [layer.module for layer in self.selected], [layer.name for layer in self.selected]
            fused = fused_path_modules(getattr(model, "_orig_mod", model))
            self.logits = HeadMaxLogits(modules, names, clock=self.clock, fused=fused)
        self._logit_step, self._logit_window, self._bound_window = None, None, None
        self._restore_logits()
        self.to(device_of(model))
        self.clock.start()
        self._start_step = None
        if self._budget is not None:
            self._budget.reset()
        if self._pending_drift_state is not None and "drift" in self.metrics:
            self.metrics["drift"].set_extra_state(self._pending_drift_state)
            self._pending_drift_state = None

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

    def to(self, device: torch.device | str) -> AttentionSampler:
        """Move the accumulators to ``device`` (where the model lives)."""
        for metric in self.metrics.values():
            metric.to(device)
        self.clock.to(device)
        return self

    # --- the cadence and the capture ----------------------------------------------------------------------------

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

    def start_forward(self, step: int, model: nn.Module, first: bool) -> Forward:
        """A forward of step ``step`` begins: its max logits are watched; a due step's ``first`` forward is recorded.

        The capture is armed on ``model`` (``armed``), or, where the layers sit inside a compiled part, that part is
        returned (``beside``) for the caller to read its batch beside the graph with :meth:`record`. A sampler with a
        ``probe`` records only the probe (:meth:`record`). :meth:`end_forward` ends it.
        """
        beside, armed_now = None, False
        if first and self.options.probe is None and self.due(step):
            beside = self.compiled_part(model)
            if beside is None:
                self.arm(model)
                armed_now = True
        self.watch_logits()
        return Forward(armed_now, beside)

    def end_forward(self, discard: bool = False) -> None:
        """The forward ended: the max logits' hooks and the capture's removed (``discard``: its sample forgotten)."""
        self.unwatch_logits()
        if discard:
            self.discard()
        else:
            self.disarm()

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

    def disarm(self) -> None:
        """Remove the capture's hooks (a no-op when not armed)."""
        if self._armed is not None:
            stack, self._armed = self._armed, None
            with self.clock.measuring():
                stack.close()

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

    def record(self, model: nn.Module, forward: Callable[[nn.Module], Any] | None = None) -> bool:
        """Record one forward of ``model`` now: ``forward(model)``, else the ``probe``; False (said once) if it raised.

        It runs under ``no_grad`` in eval mode, on ``nn.MultiheadAttention``'s Python path, and every module's mode is
        put back as it was; a forward that raises is reported and its partial sample discarded.
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
                return False
            finally:
                self.disarm()
        return True

    def _consume(self, record: AttentionRecord) -> None:
        with torch.inference_mode(False):  # states stay normal tensors under a caller's inference mode
            for metric in self._active():
                metric.update(record)

    def _is_full(self, sample: int | None = None) -> bool:
        """Whether sample number ``sample`` (from 0; default the current one) computes the costly diagnostics too."""
        return (self.samples if sample is None else sample) % self.full_every_n_samples == 0

    def _active(self) -> list[LayerwiseMean]:
        full = self._is_full()
        if "transport" in self.metrics:
            self.metrics["transport"].measure_edges = full
        return [metric for name, metric in self.metrics.items() if full or name != "spectrum"]

    # --- the values -------------------------------------------------------------------------------------------------

    def measure(self, step: int) -> Sample:
        """The recorded sample's values, synced across processes (every process calls it on the same steps).

        The capture is disarmed first. The per-layer and ``/all`` scalars (NaN where a layer's forward went non-finite,
        said once per sample), the max-logit window since the last sample, and what the sampler has cost
        (:func:`connmon._cost.overhead_values`) over the steps since it started.
        """
        self.disarm()
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
        began = self._start_step if self._start_step is not None else step
        scalars.update(overhead_values(self.clock, step - began))
        if broken_layers and is_rank_zero():
            names = sorted(layer.name for layer in self.selected if layer.index in broken_layers)
            warn_rank_zero(
                f"{self.owner}: step {step}: non-finite attention, input or output in {', '.join(names)}; their "
                "values and every connmon/<metric>/all are logged as NaN (W&B, CSV and TensorBoard keep NaN; a logger "
                "that rejects NaN drops them)"
            )
        return Sample(scalars, values, heads, full)

    def sampled(self, step: int, sample: Sample) -> None:
        """The sample of ``step`` is logged: reset the accumulators, count it, let the budget weigh its cost."""
        for metric in self.metrics.values():
            metric.reset()
        self.last_sampled_step = step
        self.samples += 1
        self.last_values = sample.scalars

    def weigh(self, step: int) -> None:
        """After a sample: say a long one (once per run) and let the budget set ``full_every_n_samples``."""
        self._say_if_long(step)
        if self._budget is not None:
            full, stride, began = self._is_full(self.samples - 1), self.full_every_n_samples, self._sample_began
            self.full_every_n_samples = self._budget.record(self.clock, step, full, began, stride=stride) or stride

    def panels(self, sink: Any, step: int, sample: Sample) -> None:
        """The W&B histograms and figures of ``sample`` (rank zero)."""
        figures = self.options.figures_every_n_samples
        write_panels(sink, step, self.metrics, sample.tensors, full=sample.full, histograms=self.options.log_histograms,
                     figures=figures is not None and self.samples % figures == 0)  # fmt: skip

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
            fewer = " or ".join(f"without {group!r}" for group in ("spectrum", "transport") if group in self.metrics)
            advice = f"a larger full_every_n_samples, diagnostics {fewer}, or budget=0.01 spends less"
        else:
            what = f"a sample of {', '.join(self.options.diagnostics)} on {layers}"
            advice = "a smaller num_sequences or max_tokens, or a larger every_n_steps, spends less"
        warn_rank_zero(f"{self.owner}: the sample at step {step} took {took:.1f} s ({what}); {advice}")

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

    # --- each step's max logits --------------------------------------------------------------------------------------

    def begin_logits(self, step: int, threshold: float | None) -> None:
        """Read step ``step``'s max logits: exactly on ``logit_every_n_steps`` steps, else the kernels' bound.

        A call whose bound passes ``threshold`` (QK-clip's tau) is read exactly too.
        """
        if self.logits is None:
            return
        every = self.logit_every_n_steps
        self.logits.exact = every is not None and step % every == 0
        self.logits.threshold = threshold
        self._logit_step = step

    def watch_logits(self) -> None:
        """Read the per-head max logits of the forwards that follow (if this step's are read) until unwatched."""
        if self.logits is not None and self._logit_step is not None:
            self.logits.watch()

    def unwatch_logits(self) -> None:
        """Remove the max logits' hooks (a no-op when none)."""
        if self.logits is not None:
            self.logits.unwatch()

    def drop_step_logits(self) -> None:
        """Forget the watched step's max logits unread (no collective): a step not every process took."""
        if self.logits is not None:
            self.logits.drop()
        self._logit_step = None

    def read_step_logits(self) -> tuple[int, Tensor] | None:
        """Fold the watched step's max logits into the window; the step and its table (None if none was read).

        A collective under ``torch.distributed`` (the max over every process's batch): every process calls it.
        """
        if self.logits is None or self._logit_step is None:
            return None
        step, self._logit_step = self._logit_step, None
        table, bounds = self.logits.read_both()
        self._bound_window = _folded(self._bound_window, bounds)
        self._logit_window = _folded(self._logit_window, table)
        self.nonfinite, self.nonfinite_at = {}, step
        if not self.logits.tensor_parallel:  # each process its own heads there: the sample says it, alike everywhere
            for metric, read in ((keys.MAX_LOGIT_BOUND, bounds), (keys.STEP_MAX_LOGIT, table)):
                rows = read.tolist() if read is not None else []
                for layer, row in zip(self.selected, rows, strict=False):
                    value = _layer_max(row)
                    if value is not None and not math.isfinite(value):
                        self.nonfinite[keys.metric_key(metric, layer.index)] = value
        return None if table is None else (step, table)

    def _logit_values(self) -> tuple[dict[str, float], dict[str, float]]:
        """The max-logit window since the last sample, per layer (logged) and per head (for the rules); then reset."""
        window, self._logit_window = self._logit_window, None
        bounds, self._bound_window = self._bound_window, None
        layers: dict[str, float] = {}
        heads: dict[str, float] = {}
        if bounds is not None and self.logits is not None:
            for layer, row in zip(self.selected, self.logits.whole(bounds).tolist(), strict=True):
                value = _layer_max(row)
                if value is not None:
                    layers[keys.metric_key(keys.MAX_LOGIT_BOUND, layer.index)] = value
        if window is None or self.logits is None:
            return layers, heads
        for layer, row in zip(self.selected, self.logits.whole(window).tolist(), strict=True):
            read = {head: value for head, value in enumerate(row) if value != -math.inf}  # -inf: not read
            value = _layer_max(row)
            if value is not None:
                layers[keys.metric_key(keys.STEP_MAX_LOGIT, layer.index)] = value
                heads.update({keys.head_key(layer.index, head): value for head, value in read.items()})
        return layers, heads

    def compiled_part(self, model: nn.Module) -> nn.Module | None:
        """The ``torch.compile``'d module whose graph holds the layers read (``model`` or a part of it), or None."""
        if hasattr(model, "_orig_mod"):
            return model
        layers = {id(layer.module) for layer in self.selected}
        for module in model.modules():
            original = getattr(module, "_orig_mod", None)
            if isinstance(original, nn.Module) and any(id(inner) in layers for inner in original.modules()):
                return module
        return None

    # --- the run's end and its checkpoint ---------------------------------------------------------------------------

    def close(self) -> None:
        """Remove every hook (the capture's, the max logits') and stop the cost clock."""
        self.disarm()
        self.unwatch_logits()
        self.clock.stop()

    def reset(self) -> None:
        """Start the cadence and the time-drift references afresh (a new run)."""
        self.samples, self.last_sampled_step, self._pending_drift_state = 0, -1, None
        if self.model is not None:
            self.attach(self.model)  # fresh accumulators: no drift reference

    def config(self) -> dict[str, Any]:
        """What the time-drift references depend on: a checkpoint from another configuration cannot continue them."""
        return {"num_sequences": self.options.num_sequences, "max_tokens": self.options.max_tokens}

    def state_dict(self) -> dict[str, Any]:
        """The cadence, each layer's previous sample (time drift), the budget's choice and the unlogged max logits."""
        drift = self.metrics.get("drift")
        return {
            "samples": self.samples,
            "last_sampled_step": self.last_sampled_step,
            "drift": drift.get_extra_state() if drift is not None else self._pending_drift_state,
            "full_every_n_samples": self.full_every_n_samples,
            "logits": self._logit_state(),
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved (before or after :meth:`attach`; checked by the caller)."""
        self.samples = state_dict.get("samples", 0)
        self.last_sampled_step = state_dict.get("last_sampled_step", -1)
        if self.options.budget is not None and state_dict.get("full_every_n_samples") is not None:
            self.full_every_n_samples = state_dict["full_every_n_samples"]  # the budget's choice
        drift_state = state_dict.get("drift")
        if drift_state is not None:
            if "drift" in self.metrics:
                self.metrics["drift"].set_extra_state(drift_state)
            else:
                self._pending_drift_state = drift_state
        if state_dict.get("logits") is not None:
            self._pending_logits = state_dict["logits"]
            self._restore_logits()

    def _logit_state(self) -> dict[str, Any] | None:
        """The max logits not logged yet: the step being read, the window since the last sample, the running maxima."""
        if self.logits is None:
            return self._pending_logits
        window = None if self._logit_window is None else self._logit_window.tolist()
        bounds = None if self._bound_window is None else self._bound_window.tolist()
        return {"step": self._logit_step, "window": window, "bound_window": bounds, **self.logits.state_dict()}

    def _restore_logits(self) -> None:
        if self._pending_logits is None or self.logits is None:  # kept until attach builds the reader
            return
        state, self._pending_logits = self._pending_logits, None
        self.logits.load_state_dict(state)
        self._logit_step = state.get("step")
        window = state.get("window")
        self._logit_window = None if window is None else torch.tensor(window, device=self.device)
        bounds = state.get("bound_window")
        self._bound_window = None if bounds is None else torch.tensor(bounds, device=self.device)

    @property
    def device(self) -> torch.device:
        """Where the model lives (the CPU before :meth:`attach`)."""
        return device_of(self.model) if self.model is not None else torch.device("cpu")


def _layer_max(row: list[float]) -> float | None:
    """A layer's largest over its heads read (``-inf``: a head not read); NaN where any is NaN; None if none read."""
    read = [value for value in row if value != -math.inf]
    if not read:
        return None
    return math.nan if any(math.isnan(value) for value in read) else max(read)


def _folded(window: Tensor | None, table: Tensor | None) -> Tensor | None:
    """``window`` with ``table`` folded in (their max; ``table`` alone where the heads differ or none was kept)."""
    if table is None:
        return window
    return table if window is None or window.shape != table.shape else window.maximum(table)
