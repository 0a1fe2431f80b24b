"""ConnectionMonitor: samples every self-attention layer every N optimizer steps and logs its geometry."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from typing_extensions import Unpack

from connmon._copying import CopiesDetached
from connmon._saved_state import checked_state
from connmon.attention_sampler import AttentionSampler
from connmon.callbacks._run import LightningRun, RunPart, running
from connmon.sampling import SamplingKeywords, SamplingOptions, sampling_options


class ConnectionMonitor(CopiesDetached, RunPart):
    """Reads every self-attention layer as a connection walk every ``every_n_steps`` optimizer steps.

    On a sampled step the capture is armed (hooks exist on no other step), the first ``num_sequences`` sequences of
    each layer are recorded and streamed into torchmetrics accumulators (synced across processes), and the
    per-layer values are logged as ``connmon/<metric>/L<ll>`` plus ``connmon/<metric>/all`` at
    ``trainer.global_step`` to every attached logger. The eigen- and SVD-bound diagnostics (the spectrum group and
    the edge isometry gap, about 90% of a full sample's cost) run on every ``full_every_n_samples``-th sample, the
    first included; the others (walk, head and OV transport, drift) on every sample. With a ``WandbLogger`` it
    also logs histograms of per-head isometry gaps and of connection-spectrum moduli, and every
    ``figures_every_n_samples`` samples a figure of the spectra and of the gaps across depth. Nothing it does can
    end the run: a layer it cannot read is skipped with one warning. Several ConnectionMonitors in one Trainer (say,
    other layers or another cadence) compose: each samples on its own options, and the rules of a DriftAlert see
    every one's values; the clip actions act on the first one's layers.

    Args:
        options: the sampling options (:class:`~connmon.sampling.SamplingOptions`: what is recorded and how often);
            on a gradient-accumulation step the first micro-batch is sampled; ``probe_fn`` gets the LightningModule.
            With the defaults the full diagnostics are logged every 2500 steps, the rest every 100: a full sample
            costs about 9x a light one (benchmarks/README.md).
        **sampling: the same options by keyword (``every_n_steps=50``, ``diagnostics=("walk",)``, ...), in place of
            those of ``options`` (typed by :class:`~connmon.sampling.SamplingKeywords` for editors).

    Every sample also logs what the monitor costs: ``connmon/overhead/attention`` (its time, synchronized on
    accelerators, over the training time) and ``connmon/overhead`` (every connmon monitor of the run); the end of
    training logs them once more and says them in one line (:meth:`connmon.Monitor.close`).

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
        self.sampler = AttentionSampler(options, owner="ConnectionMonitor")
        self._trainer: Trainer | None = None
        self._restored = False  # load_state_dict ran since the last fit began: keep its state
        self._saved_run: dict[str, Any] | None = None  # the run's windows a loaded checkpoint holds
        self._ended_run: dict[str, Any] | None = None  # state_dict() of the fit that ended, for a save after it
        self._listeners: list[Callable[[Trainer, int, dict[str, float]], None]] = []

    @property
    def options(self) -> SamplingOptions:
        """The sampling options, as given (``monitor.options.every_n_steps``, ...)."""
        return self.sampler.options

    @property
    def samples(self) -> int:
        """Samples taken this run."""
        return self.sampler.samples

    @property
    def last_sampled_step(self) -> int:
        """The step of the latest sample (-1 before the first)."""
        return self.sampler.last_sampled_step

    @property
    def state_key(self) -> str:
        """Unique per configuration, so that several monitors (say, different layers or cadences) coexist."""
        return self._generate_state_key(
            every_n_steps=self.options.every_n_steps, layers=self.options.layers, diagnostics=self.options.diagnostics
        )

    # --- Lightning hooks (the trainer's events go to the run: connmon.callbacks._run.RunPart) -------------------------

    def join(self, run: LightningRun, trainer: Trainer) -> None:
        """On fit: start afresh (unless a checkpoint was loaded) and bring the sampler to the Trainer's run.

        ``validate``, ``test`` and ``predict`` leave the training state (cadence, drift references) alone: the monitor
        samples training only.
        """
        if not self._restored:
            self.sampler.reset()
            self._saved_run = None
        self._restored, self._ended_run = False, None
        self._trainer = trainer
        run.add_attention(self, self.sampler, self._notify, self._saved_run)
        self._saved_run = None

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Remove every hook at the end of the run."""
        super().teardown(trainer, pl_module, stage)
        if stage == "fit":
            self._restored = False  # the next fit starts afresh unless a checkpoint is loaded into it
            self._trainer = None

    def keep_state(self, run: LightningRun) -> None:
        """The fit is over: what :meth:`state_dict` saves of it, kept for a checkpoint saved after it."""
        if run.monitor is not None:
            self._ended_run = run.monitor.attention_state(self.sampler)

    def state_dict(self) -> dict[str, Any]:
        """Sampling cadence and the previous sample of each layer (so a resumed run continues its time drift).

        The first ConnectionMonitor of a fit also keeps the run's windows not logged yet (the optimizer's state,
        what QK-clip did); DriftAlert and SharpnessMonitor save their own parts.
        """
        run = running(self._trainer)
        if run is not None and run.monitor is not None:
            return run.monitor.attention_state(self.sampler)
        kept = self._saved_run if self._saved_run is not None else self._ended_run  # loaded, or of the fit that ended
        if kept is not None:
            return kept
        return {"config": self.sampler.config(), **self.sampler.state_dict(), "optimizer_state": None}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved."""
        self._restored, self._ended_run = True, None
        checked = checked_state(state_dict, self.sampler.config(), "ConnectionMonitor")
        if checked is None:
            return
        self.sampler.load_state_dict(checked)
        self._saved_run = checked
        run = running(self._trainer)
        if run is not None and run.monitor is not None and run.monitor.attention_sampler is self.sampler:
            run.monitor.load_run_state(checked)
            self._saved_run = None
        elif run is not None:
            run.samplers = [(s, lis, checked if s is self.sampler else saved) for s, lis, saved in run.samplers]

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
