"""ConnectionMonitor: samples every self-attention layer every N optimizer steps and logs its geometry."""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import WandbLogger  # imports wandb only when a run starts
from lightning.pytorch.utilities import rank_zero_only, rank_zero_warn
from torch import Tensor

from connmon.capture import AttentionRecord, armed, attention_layers
from connmon.capture.session import Layer
from connmon.loggers.figures import depth_figure, spectra_figure
from connmon.metrics import DriftMetrics, LayerwiseMean, SpectrumMetrics, TransportMetrics, WalkMetrics

Diagnostic = Literal["walk", "transport", "spectrum", "drift"]
DIAGNOSTICS: tuple[Diagnostic, ...] = ("walk", "transport", "spectrum", "drift")


class ConnectionMonitor(Callback):
    """Reads every self-attention layer as a connection walk every ``every_n_steps`` optimizer steps.

    On a sampled step the capture is armed (hooks exist on no other step), the first ``num_sequences`` sequences of
    each layer are recorded and streamed into torchmetrics accumulators (synced across processes), and the
    per-layer values are logged as ``connmon/<metric>/L<ll>`` plus ``connmon/<metric>/all`` at
    ``trainer.global_step`` to every attached logger. The eigen- and SVD-bound diagnostics (the spectrum group and
    the edge isometry gap, about 90% of a full sample's cost) run on every ``full_every_n_samples``-th sample, the
    first included; the others (walk, head and OV transport, drift) on every sample. With a ``WandbLogger`` it
    also logs histograms of per-head isometry gaps and of connection-spectrum moduli, and every
    ``figures_every_n_samples`` samples a figure of the spectra and of the gaps across depth. Nothing it does can
    end the run: a layer it cannot read is skipped with one warning.

    Args:
        every_n_steps: sample every this many optimizer steps (with gradient accumulation, once per optimizer step,
            on its first micro-batch).
        num_sequences: sequences recorded per sampled step (per process).
        max_tokens: tokens recorded per sequence (see :func:`connmon.capture`); None for all.
        layers: which attention layers: None for all, a regex on module names, or a list of names or indices.
        diagnostics: groups to compute: ``"walk"``, ``"transport"``, ``"spectrum"``, ``"drift"``.
        spectrum_k: eigenvalues of ``M / s`` per layer (histograms, figures, spectral radius).
        probe: None to record the training forward of sampled steps; or a fixed batch, run under ``no_grad`` in eval
            mode on every process at sampled steps (train mode restored), so that time drift compares like with like.
        probe_fn: how to run the probe, ``probe_fn(pl_module, probe)``; default ``pl_module(probe)``
            (``pl_module(*probe)`` for a tuple, ``pl_module(**probe)`` for a dict).
        log_histograms: log W&B histograms (with a ``WandbLogger``).
        figures_every_n_samples: log W&B figures every this many samples; None for never.
        edge_samples: keys per query for ``edge_isometry_gap`` (None: every key).
        edge_queries: query rows for ``edge_isometry_gap`` (None: every row; both None and
            ``edge_lanczos_steps=None``: exact, costly).
        edge_lanczos_steps: Lanczos steps per sampled edge for its gap (None: one ``d x d`` decomposition per edge);
            see :func:`connmon.functional.edge_isometry_gap`.
        full_every_n_samples: compute the spectrum group and ``edge_isometry_gap`` on every this-many-th sample
            (1: on every sample). With the defaults they are logged every 2500 steps, the rest every 100: a full sample
            costs about 9x a light one (benchmarks/README.md).

    Raises:
        ValueError: for an invalid option (the message names the valid ones).

    Example:
        >>> import lightning as L
        >>> from connmon.callbacks import ConnectionMonitor
        >>> monitor = ConnectionMonitor(every_n_steps=50, diagnostics=("walk", "transport"))
        >>> trainer = L.Trainer(callbacks=[monitor], logger=False, enable_progress_bar=False)
    """

    def __init__(
        self,
        every_n_steps: int = 100,
        num_sequences: int = 2,
        max_tokens: int | None = 256,
        layers: str | Sequence[str | int] | None = None,
        diagnostics: Sequence[Diagnostic] = DIAGNOSTICS,
        spectrum_k: int = 8,
        probe: Any = None,
        probe_fn: Callable[[LightningModule, Any], Any] | None = None,
        log_histograms: bool = True,
        figures_every_n_samples: int | None = 10,
        edge_samples: int | None = 1,
        edge_queries: int | None = 16,
        full_every_n_samples: int = 25,
        edge_lanczos_steps: int | None = 32,
    ) -> None:
        _check_int("every_n_steps", every_n_steps)
        _check_int("num_sequences", num_sequences)
        _check_int("max_tokens", max_tokens, optional=True)
        _check_int("spectrum_k", spectrum_k)
        _check_int("figures_every_n_samples", figures_every_n_samples, optional=True)
        _check_int("edge_samples", edge_samples, optional=True)
        _check_int("edge_queries", edge_queries, optional=True)
        _check_int("edge_lanczos_steps", edge_lanczos_steps, optional=True)
        _check_int("full_every_n_samples", full_every_n_samples)
        diagnostics = (diagnostics,) if isinstance(diagnostics, str) else diagnostics
        if not isinstance(diagnostics, Sequence) or not diagnostics or any(d not in DIAGNOSTICS for d in diagnostics):
            raise ValueError(
                f"diagnostics must be a non-empty subset of {DIAGNOSTICS}, got diagnostics={diagnostics!r}"
            )
        if isinstance(layers, str):
            try:
                re.compile(layers)
            except re.error as error:
                raise ValueError(f"layers={layers!r} is not a valid regular expression: {error}") from None
        elif layers is not None and (
            not isinstance(layers, Sequence)
            or not all(isinstance(x, (str, int)) and not isinstance(x, bool) for x in layers)
        ):
            raise ValueError(
                "layers must be None (all), a regular expression on module names, or a list of names and indices, "
                f"got layers={layers!r}"
            )
        if not isinstance(log_histograms, bool):
            raise ValueError(f"log_histograms must be True or False, got log_histograms={log_histograms!r}")
        if probe_fn is not None and not callable(probe_fn):
            raise ValueError(f"probe_fn must be callable, got probe_fn={probe_fn!r}")
        if probe_fn is not None and probe is None:
            raise ValueError("probe_fn needs a probe batch: pass probe=... too")
        self.every_n_steps = every_n_steps
        self.num_sequences = num_sequences
        self.max_tokens = max_tokens
        self.layers = layers if layers is None or isinstance(layers, str) else list(layers)
        self.diagnostics = tuple(diagnostics)
        self.spectrum_k = spectrum_k
        self.probe = probe
        self.probe_fn = probe_fn
        self.log_histograms = log_histograms
        self.figures_every_n_samples = figures_every_n_samples
        self.edge_samples = edge_samples
        self.edge_queries = edge_queries
        self.edge_lanczos_steps = edge_lanczos_steps
        self.full_every_n_samples = full_every_n_samples
        self.samples = 0
        self.last_sampled_step = -1
        self._layers: list[Layer] = []
        self._metrics: dict[str, LayerwiseMean] = {}
        self._armed: contextlib.ExitStack | None = None
        self._wandb: Any = None
        self._pending_drift_state: dict | None = None
        self._sample_step = -1
        self._step_at_batch_start = 0
        self._first_micro_batch = True  # the next batch starts an optimizer step
        self._restored = False  # load_state_dict ran since the last fit began: keep its state
        self._listeners: list[Callable[[Trainer, int, dict[str, float]], None]] = []

    @property
    def state_key(self) -> str:
        """Unique per configuration, so that several monitors (say, different layers or cadences) coexist."""
        return self._generate_state_key(
            every_n_steps=self.every_n_steps, layers=self.layers, diagnostics=self.diagnostics
        )

    # --- Lightning hooks ------------------------------------------------------------------------------------------

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """On fit: find the attention layers and the loggers, and start afresh (unless a checkpoint was loaded).

        An unreadable model disables the monitor with one warning. ``validate``, ``test`` and ``predict`` leave the
        training state (cadence, drift references) alone: the monitor samples training only.
        """
        if stage != "fit":
            return
        if not self._restored:
            self.samples, self.last_sampled_step, self._pending_drift_state = 0, -1, None
        self._restored = False
        self._first_micro_batch = True
        try:
            found = attention_layers(pl_module)
        except ValueError as error:
            rank_zero_warn(f"ConnectionMonitor is off for this run: {error}")
            self._layers = []
            return
        self._layers = self._select(found)
        num_layers = len(found)
        groups = {
            "walk": lambda: WalkMetrics(num_layers),
            "transport": lambda: TransportMetrics(
                num_layers,
                edge_samples=self.edge_samples,
                edge_queries=self.edge_queries,
                edge_lanczos_steps=self.edge_lanczos_steps,
            ),
            "spectrum": lambda: SpectrumMetrics(num_layers, k=self.spectrum_k),
            "drift": lambda: DriftMetrics(num_layers),
        }
        self._metrics = {name: groups[name]().to(pl_module.device) for name in self.diagnostics}
        if self._pending_drift_state is not None and "drift" in self._metrics:
            self._metrics["drift"].set_extra_state(self._pending_drift_state)
            self._pending_drift_state = None
        if not trainer.loggers:
            rank_zero_warn("ConnectionMonitor: no logger is attached, so its values are computed but not logged")
        self._wandb = self._wandb_sink(trainer)

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Put the accumulators where the model now lives (the strategy moves it after ``setup``)."""
        for metric in self._metrics.values():
            metric.to(pl_module.device)

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """An epoch's first batch starts an optimizer step (Lightning steps on an epoch's last batch)."""
        self._first_micro_batch = True

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        """Arm the capture on the first micro-batch of a sampled optimizer step (training-forward mode)."""
        self._step_at_batch_start = trainer.global_step
        if self.probe is None and self._first_micro_batch and self._due(trainer.global_step):
            self._sample_step = trainer.global_step  # the step whose forward is recorded
            self._arm(pl_module)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Disarm and log the training-forward sample; in probe mode, run the probe after a sampled step."""
        stepped = trainer.global_step != self._step_at_batch_start  # Lightning's own count: the optimizer stepped
        self._first_micro_batch = stepped
        if self._armed is not None:
            self._disarm()
            self._finish_sample(trainer, self._sample_step)
            return
        if self.probe is not None and stepped and self._due(trainer.global_step):
            self._run_probe(pl_module)  # the model after global_step optimizer steps
            self._finish_sample(trainer, trainer.global_step)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        """Remove every hook if the run fails."""
        self._disarm()

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Remove every hook at the end of the run."""
        self._disarm()
        if stage == "fit":
            self._restored = False  # the next fit starts afresh unless a checkpoint is loaded into it

    def state_dict(self) -> dict[str, Any]:
        """Sampling cadence and the previous sample of each layer (so a resumed run continues its time drift)."""
        drift = self._metrics.get("drift")
        return {
            "samples": self.samples,
            "last_sampled_step": self.last_sampled_step,
            "drift": drift.get_extra_state() if drift is not None else self._pending_drift_state,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved."""
        self._restored = True
        self.samples = state_dict.get("samples", 0)
        self.last_sampled_step = state_dict.get("last_sampled_step", -1)
        drift_state = state_dict.get("drift")
        if drift_state is not None:
            if "drift" in self._metrics:
                self._metrics["drift"].set_extra_state(drift_state)
            else:
                self._pending_drift_state = drift_state  # applied in setup()

    def add_listener(self, listener: Callable[[Trainer, int, dict[str, float]], None]) -> None:
        """Call ``listener(trainer, step, values)`` on every process after each sample is logged.

        ``values`` maps every logged key to a float: the finite values of the selected layers and the ``/all`` means,
        and NaN for every key of a layer whose forward went non-finite (its ``/all`` means are NaN too). A value not
        measured on this sample (nothing to compare with, a layer skipped at run time) is absent. The values are the
        synced ones, equal on every process. DriftAlert listens here.
        """
        self._listeners.append(listener)

    # --- workers --------------------------------------------------------------------------------------------------

    def _select(self, found: list[Layer]) -> list[Layer]:
        if self.layers is None:
            return found
        if isinstance(self.layers, str):
            chosen = [layer for layer in found if re.search(self.layers, layer.name)]
        else:
            wanted = set(self.layers)
            chosen = [layer for layer in found if layer.name in wanted or layer.index in wanted]
        if not chosen:
            rank_zero_warn(
                f"ConnectionMonitor: layers={self.layers!r} matches none of {[layer.name for layer in found]}; "
                "the monitor records nothing"
            )
        return chosen

    def _due(self, step: int) -> bool:
        return bool(self._layers) and step % self.every_n_steps == 0 and step != self.last_sampled_step

    def _arm(self, pl_module: LightningModule) -> None:
        stack = contextlib.ExitStack()
        stack.enter_context(
            armed(
                pl_module,
                num_sequences=self.num_sequences,
                max_tokens=self.max_tokens,
                layers=self._layers,
                on_record=self._consume,
            )
        )
        self._armed = stack

    def _disarm(self) -> None:
        if self._armed is not None:
            stack, self._armed = self._armed, None
            stack.close()

    def _run_probe(self, pl_module: LightningModule) -> None:
        was_training = pl_module.training
        pl_module.eval()
        try:
            self._arm(pl_module)
            with torch.no_grad():
                probe = _to_device(self.probe, pl_module.device)
                if self.probe_fn is not None:
                    self.probe_fn(pl_module, probe)
                elif isinstance(probe, dict):
                    pl_module(**probe)
                elif isinstance(probe, tuple):
                    pl_module(*probe)
                else:
                    pl_module(probe)
        finally:
            self._disarm()
            pl_module.train(was_training)

    def _is_full(self) -> bool:
        """Whether the current sample (number ``self.samples``, from 0) computes the costly diagnostics too."""
        return self.samples % self.full_every_n_samples == 0

    def _active(self) -> list[LayerwiseMean]:
        full = self._is_full()
        if "transport" in self._metrics:
            self._metrics["transport"].measure_edges = full
        return [metric for name, metric in self._metrics.items() if full or name != "spectrum"]

    def _consume(self, record: AttentionRecord) -> None:
        for metric in self._active():
            metric.update(record)

    def _finish_sample(self, trainer: Trainer, step: int) -> None:
        full = self._is_full()
        values: dict[str, Tensor] = {}
        broken: set[int] = set()
        for metric in self._active():
            values.update(metric.compute())  # syncs across processes: every rank reaches this on a sampled step
            counts = values.pop("nonfinite_layers").reshape(-1).tolist()  # torchmetrics squeezes a (1,) state
            broken |= {index for index, count in enumerate(counts) if count > 0}
        broken_layers = {layer.index for layer in self._layers if layer.index in broken}
        scalars = self._scalars(values, broken_layers)
        self._log(trainer, step, scalars, values, full, broken_layers)
        for metric in self._metrics.values():
            metric.reset()
        self.last_sampled_step = step
        self.samples += 1
        for listener in self._listeners:
            listener(trainer, step, scalars)

    def _scalars(self, values: dict[str, Tensor], broken_layers: set[int]) -> dict[str, float]:
        """The values to log: finite ones, and NaN where a layer's forward went non-finite (never a missing value)."""
        scalars = {}
        for name, value in values.items():
            if name.endswith("/all"):
                scalars[f"connmon/{name}"] = value.item()
                continue
            per_layer = value.reshape(-1).tolist()  # one host copy per metric; a one-layer model's value is 0-dim
            for layer in self._layers:
                if math.isfinite(per_layer[layer.index]) or layer.index in broken_layers:
                    scalars[f"connmon/{name}/L{layer.index:02d}"] = per_layer[layer.index]
        return {k: v for k, v in scalars.items() if math.isfinite(v) or broken_layers}

    @rank_zero_only
    def _log(
        self,
        trainer: Trainer,
        step: int,
        scalars: dict[str, float],
        values: dict[str, Tensor],
        full: bool,
        broken_layers: set[int],
    ) -> None:
        if broken_layers:
            names = sorted(layer.name for layer in self._layers if layer.index in broken_layers)
            rank_zero_warn(
                f"ConnectionMonitor: step {step}: non-finite attention, input or output in {', '.join(names)}; their "
                "values and every connmon/<metric>/all are logged as NaN (W&B, CSV and TensorBoard keep NaN; a logger "
                "that rejects NaN drops them)"
            )
        for logger in trainer.loggers:
            logger.log_metrics(scalars, step=step)
        if self._wandb is not None:
            self._log_wandb(step, values, full)

    def _log_wandb(self, step: int, values: dict[str, Tensor], full: bool) -> None:
        transport = self._metrics.get("transport")
        spectrum = self._metrics.get("spectrum") if full else None  # its spectra are from an earlier sample
        if self.log_histograms:
            histograms = {}
            for index, gaps in getattr(transport, "last_head_gaps", {}).items():
                histograms[f"connmon/head_isometry_gap_hist/L{index:02d}"] = gaps
            for index, eigenvalues in getattr(spectrum, "last_spectra", {}).items():
                histograms[f"connmon/spectrum_modulus_hist/L{index:02d}"] = eigenvalues.abs()
            if histograms:
                self._wandb.histograms(step, histograms)
        if self.figures_every_n_samples is not None and self.samples % self.figures_every_n_samples == 0:
            figures = {}
            if spectrum is not None and spectrum.last_spectra:
                figures["connmon/figures/spectra"] = spectra_figure(spectrum.last_spectra, f"step {step}")
            depth = {k: v for k, v in values.items() if k.endswith("isometry_gap") and not k.endswith("/all")}
            if depth:
                figures["connmon/figures/gaps_by_depth"] = depth_figure(depth, f"step {step}")
            if figures:
                self._wandb.figures(step, figures)

    @staticmethod
    def _wandb_sink(trainer: Trainer) -> Any:
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                from connmon.loggers.wandb import WandbSink

                return WandbSink(logger)
        return None


def _check_int(name: str, value: object, *, optional: bool = False) -> None:
    """An integer option >= 1 (or None where ``optional``); the error names the valid values and the one seen."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        valid = "an integer >= 1" + (" or None" if optional else "")
        raise ValueError(f"{name} must be {valid}, got {name}={value!r}")


def _to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, Tensor):
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: _to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_device(v, device) for v in batch)
    return batch
