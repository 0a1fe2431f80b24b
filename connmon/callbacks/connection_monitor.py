"""ConnectionMonitor: samples every self-attention layer every N optimizer steps and logs its geometry."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import Unpack

from connmon._copying import CopiesDetached
from connmon._moved import renamed_name
from connmon.callbacks._cost import say_cost
from connmon.callbacks._run import run_of
from connmon.monitor import SAMPLING_OPTIONS, Monitor
from connmon.sampling import SamplingKeywords, SamplingOptions, sampling_options


class ConnectionMonitor(CopiesDetached, Callback):
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
        options: the sampling options (:class:`~connmon.sampling.SamplingOptions`: what is recorded and how often);
            on a gradient-accumulation step the first micro-batch is sampled; ``probe_fn`` gets the LightningModule.
            With the defaults the full diagnostics are logged every 2500 steps, the rest every 100: a full sample
            costs about 9x a light one (benchmarks/README.md).
        **sampling: the same options by keyword (``every_n_steps=50``, ``diagnostics=("walk",)``, ...), in place of
            those of ``options`` (typed by :class:`~connmon.sampling.SamplingKeywords` for editors).

    Every sample also logs what the monitor costs: ``connmon/overhead/attention`` (its time, synchronized on
    accelerators, over the training time) and ``connmon/overhead`` (every connmon monitor of the run); the end of
    the fit says it in one line (and in the W&B run's summary).

    Raises:
        TypeError: for a keyword that is not a sampling option (the message names them).
        ValueError: for an invalid option (the message names the valid ones).

    Examples:
        >>> import lightning as L
        >>> from connmon.callbacks import ConnectionMonitor
        >>> monitor = ConnectionMonitor(every_n_steps=50, diagnostics=("walk", "transport"))
        >>> trainer = L.Trainer(callbacks=[monitor], logger=False, enable_progress_bar=False)
    """

    _not_copied = (("_trainer", lambda: None),)  # set again by setup (ddp_spawn pickles the callbacks)

    def __init__(self, *, options: SamplingOptions | None = None, **sampling: Unpack[SamplingKeywords]) -> None:
        options = sampling_options(options, "ConnectionMonitor", **sampling)
        self.monitor = Monitor(options=options, owner="ConnectionMonitor", optimizer_hook=False)
        self._trainer: Trainer | None = None
        self._sample_step = -1
        self._step_at_batch_start = 0
        self._first_micro_batch = True  # the next batch starts an optimizer step
        self._restored = False  # load_state_dict ran since the last fit began: keep its state
        self._listeners: list[Callable[[Trainer, int, dict[str, float]], None]] = []
        self.monitor.add_listener(self._notify)

    @property
    def options(self) -> SamplingOptions:
        """The sampling options, as given (``monitor.options.every_n_steps``, ...)."""
        return self.monitor.options

    @property
    def samples(self) -> int:
        """Samples taken this run."""
        return self.monitor.samples

    @property
    def last_sampled_step(self) -> int:
        """The step of the latest sample (-1 before the first)."""
        return self.monitor.last_sampled_step

    def __getattr__(self, name: str) -> Any:
        """Deprecated: an option read as the callback's attribute (``monitor.every_n_steps``): read ``options``."""
        if name in SAMPLING_OPTIONS:
            renamed_name(f"ConnectionMonitor.{name}", f"ConnectionMonitor.options.{name}", removed_in="0.2.0")
            return getattr(self.__dict__["monitor"].options, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def state_key(self) -> str:
        """Unique per configuration, so that several monitors (say, different layers or cadences) coexist."""
        return self._generate_state_key(
            every_n_steps=self.options.every_n_steps, layers=self.options.layers, diagnostics=self.options.diagnostics
        )

    # --- Lightning hooks ------------------------------------------------------------------------------------------

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """On fit: join the Trainer's run and start afresh (unless a checkpoint was loaded).

        The run's monitor is this one's (a second ConnectionMonitor samples beside it, without the rules).
        ``validate``, ``test`` and ``predict`` leave the training state (cadence, drift references) alone: the monitor
        samples training only.
        """
        if stage != "fit":
            return
        if not self._restored:
            self.monitor.reset()
        self._restored = False
        self._first_micro_batch = True
        self._trainer = trainer
        run_of(trainer).add_attention(self.monitor)

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Find the attention layers where the model now lives (an unreadable model: off, with one warning)."""
        run_of(trainer).begin(trainer, pl_module)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """The optimizers exist: the run's monitor reads their state after each step (and the clips act there)."""
        run_of(trainer).start(trainer)

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """An epoch's first batch starts an optimizer step (Lightning steps on an epoch's last batch)."""
        self._first_micro_batch = True

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        """Arm the capture on the first micro-batch of a sampled optimizer step (training-forward mode)."""
        self._step_at_batch_start = trainer.global_step
        if self._first_micro_batch:
            self.monitor.begin_step(trainer.global_step)  # the last step's max logits: QK-clip acts now
        self.monitor.watch_logits()
        if self.options.probe is None and self._first_micro_batch and self.monitor.due(trainer.global_step):
            self._sample_step = trainer.global_step  # the step whose forward is recorded
            self.monitor.arm(pl_module)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Disarm and log the training-forward sample; in probe mode, run the probe after a sampled step."""
        stepped = trainer.global_step != self._step_at_batch_start  # Lightning's own count: the optimizer stepped
        self._first_micro_batch = stepped
        self.monitor.unwatch_logits()
        if self.monitor.is_armed:
            self.monitor.disarm()
            self.monitor.finish(self._sample_step, run_of(trainer).rule_values())
            return
        if self.options.probe is not None and stepped and self.monitor.due(trainer.global_step):
            # the model after global_step optimizer steps
            self.monitor.run_probe(pl_module, trainer.global_step, run_of(trainer).rule_values())

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Say what the monitor cost (console, and the W&B run's summary)."""
        say_cost(trainer, self.monitor.clock, "ConnectionMonitor")

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        """Remove every hook and forget a partial sample if the run fails."""
        run_of(trainer).end(failed=True)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Remove every hook at the end of the run."""
        if stage == "fit":
            run_of(trainer).end()
            self._restored = False  # the next fit starts afresh unless a checkpoint is loaded into it
            self._trainer = None

    def state_dict(self) -> dict[str, Any]:
        """Sampling cadence and the previous sample of each layer (so a resumed run continues its time drift)."""
        state = self.monitor.state_dict()
        state.pop("alerts")  # DriftAlert saves its own
        state["sharpness"] = None  # and SharpnessMonitor its own
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved."""
        self._restored = True
        self.monitor.load_state_dict(state_dict)

    def add_listener(self, listener: Callable[[Trainer, int, dict[str, float]], None]) -> None:
        """Call ``listener(trainer, step, values)`` on every process after each sample is logged.

        ``values`` maps every logged key to a float: the finite values of the selected layers and the ``/all`` means,
        and NaN for every key of a layer whose forward went non-finite (its ``/all`` means are NaN too). A value not
        measured on this sample (nothing to compare with, a layer skipped at run time) is absent. The values are the
        synced ones, equal on every process, and the alert counts when a DriftAlert runs rules on them.
        """
        self._listeners.append(listener)

    # --- workers --------------------------------------------------------------------------------------------------

    def _notify(self, step: int, values: dict[str, float]) -> None:
        trainer = self._trainer
        if trainer is None:
            return
        for listener in self._listeners:
            listener(trainer, step, values)
