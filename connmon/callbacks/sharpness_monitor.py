"""SharpnessMonitor: the curvature against the optimizer's edge of stability every N optimizer steps (opt-in)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, SingleDeviceStrategy
from torch import Tensor
from typing_extensions import Unpack

from connmon._options import check_callable
from connmon.callbacks._run import LightningRun, RunPart, running
from connmon.curvature.sampler import EIGENVALUE_KEY, RATIO_KEY, Estimator, SharpnessKeywords, SharpnessSampler
from connmon.step_options import STEP_OPTION_NAMES, StepKeywords, StepOptions

__all__ = ["EIGENVALUE_KEY", "RATIO_KEY", "SharpnessMonitor", "SharpnessMonitorKeywords"]


class SharpnessMonitorKeywords(SharpnessKeywords, StepKeywords, total=False):
    """:class:`SharpnessMonitor`'s keywords: the curvature sampler's options and the run's step options."""


class SharpnessMonitor(RunPart):
    """Logs how close the optimizer's step is to its edge of stability, on a cadence that follows it.

    The estimate is :class:`connmon.curvature.sampler.SharpnessSampler`'s (the same in every entry point):

    * ``estimator="finite_difference_lanczos"`` (the default): the top of the preconditioned Hessian's spectrum
      (:func:`connmon.curvature.sharpness_ratio`) by ``lanczos_steps`` Lanczos steps whose Hessian products are
      differences of first-order gradients, through the model's own kernels (fused and flash SDPA, compiled
      models, bf16 autocast): ``lanczos_steps + 1`` gradients of the sampled step's whole batch (every micro-batch of
      an accumulated step), read after its backward and before its optimizer step. It logs
      ``connmon/sharpness_ratio`` (1 is the edge of stability: on the quadratic model the steps oscillate with a
      growing amplitude past it) and ``connmon/sharpness_eigenvalue``. :class:`DriftAlert` sees the ratio on the
      steps it is measured; its default rules alert when it is above 1 on two samples in a row from step 20 on
      (:func:`connmon.alerts.edge_of_stability_rule`).
    * ``estimator="exact_lanczos"``: the same with exact products by double backward through SDPA's math kernel (the
      reference: about twice the time, a double-backward graph's memory, no compiled models).
    * ``estimator="difference"`` and ``"secant"``: the curvature along the optimizer's own update
      (:class:`connmon.curvature.UpdateProbe`), logged as ``connmon/update_sharpness_ratio`` and
      ``connmon/update_sharpness_eigenvalue``: a lower bound of the Lanczos ratio that, on the instability suite,
      read 2-30% of it and never crossed the edge before a divergence, so no default rule watches it.

    With ``cadence="adaptive"`` (the default) ``every_n_steps`` is the densest interval, kept while the ratio is at
    least 0.5; from 0.25 the next sample comes ``3 every_n_steps`` later, below it ``8 every_n_steps`` later
    (:func:`connmon.curvature.sampler.adaptive_interval`); ``cadence="fixed"`` samples every ``every_n_steps``.
    ``budget=0.05`` (the default) holds the readings to 5% of the training's passes over its batches, the first
    reading included: a Lanczos sample of about 11 gradients comes at most once every 220 steps on average
    (``budget=None``: no limit). Every sample logs the interval it chose (``connmon/curvature_interval``), what the
    readings cost in passes of a step's batch per training step (``connmon/overhead/curvature_gradients``) and in time
    (``connmon/overhead/curvature``, synchronized on accelerators, and ``connmon/overhead`` for every connmon monitor
    of the run); the end of training logs them once more and says them in one line. Under DDP and FSDP2 the reading
    is of the global batch the step trains on (the processes' gradients averaged in every product, as the strategy
    averages the training's), the same on every process.

    Nothing of the training run changes: parameters, gradients, optimizer state, random streams and buffers are
    bitwise as they were. Every estimator but ``"exact_lanczos"`` also runs under FSDP2
    (``ModelParallelStrategy``): the Lanczos vectors are held as each process's shards, their inner products added
    across processes. An optimizer without a known edge of stability (see
    :func:`connmon.curvature.step_geometry`), another sharding strategy (FSDP1, DeepSpeed), running out of memory or any
    other error turns the monitor off for the run with one warning that says why, on every process alike; the
    training run goes on.

    Args:
        loss_fn: the batch's scalar loss, ``loss_fn(pl_module, batch)`` (for example
            ``lambda module, batch: F.cross_entropy(module(batch[0]), batch[1])``); needed by every estimator but
            ``"secant"``. It is called outside ``training_step``, on the batch as the dataloader gave it (on the
            model's device), in the trainer's precision context (autocast under ``bf16-mixed``). A capture that a
            :class:`ConnectionMonitor` armed for the same step records nothing of these forwards.
        **options: the :class:`~connmon.curvature.sampler.SharpnessSampler`'s options by keyword (``every_n_steps``,
            ``estimator``, ``lanczos_steps``, ``budget``, ``cadence``, ``storage``), documented, defaulted and checked
            there once; and the run's step options (:class:`~connmon.step_options.StepOptions`:
            ``optimizer_every_n_steps``, ``logit_every_n_steps``), so a run without a ``ConnectionMonitor`` sets how
            often the optimizer's state is read (logged with each curvature sample). Typed by
            :class:`SharpnessMonitorKeywords` for editors.

    Raises:
        TypeError: for a keyword that is not one of the sampler's or the step options.
        ValueError: for a ``loss_fn`` that is not callable, an estimator that needs one and has none, or an invalid
            option.

    Examples:
        >>> import lightning as L
        >>> from connmon.callbacks import DriftAlert, SharpnessMonitor
        >>> import torch.nn.functional as F
        >>> loss_fn = lambda module, batch: F.cross_entropy(module(batch[0]).flatten(0, 1), batch[1].flatten())
        >>> callbacks = [SharpnessMonitor(loss_fn), DriftAlert()]
        >>> trainer = L.Trainer(callbacks=callbacks, logger=False, enable_progress_bar=False)
    """

    def __init__(
        self,
        loss_fn: Callable[[LightningModule, Any], Tensor] | None = None,
        **options: Unpack[SharpnessMonitorKeywords],
    ) -> None:
        check_callable("loss_fn", loss_fn, optional=True, signature="loss_fn(pl_module, batch)")
        keywords: dict[str, Any] = dict(options)
        steps = {name: keywords.pop(name) for name in STEP_OPTION_NAMES if name in keywords}
        self.step_options = StepOptions(**steps)
        self.sampler = SharpnessSampler(**keywords, owner="SharpnessMonitor")
        estimator = self.sampler.estimator
        if loss_fn is None and estimator != "secant":
            raise ValueError(f"estimator={estimator!r} reads a loss: pass loss_fn=..., or use estimator='secant'")
        self.loss_fn = loss_fn
        self._restored = False  # load_state_dict ran since the last fit began: keep its state
        self._saved_signals: dict[str, Any] | None = None  # the run's step-signal window it loaded
        self._ended_signals: dict[str, Any] | None = None  # the window of the fit that ended, for a save after it
        self._listeners: list[Callable[[Trainer, int, dict[str, float]], None]] = []
        self._trainer: Trainer | None = None

    @property
    def every_n_steps(self) -> int:
        """The densest interval (the budget may hold a reading back beyond it)."""
        return self.sampler.every_n_steps

    @property
    def estimator(self) -> Estimator:
        """How the curvature is read."""
        return self.sampler.estimator

    @property
    def off(self) -> str | None:
        """Why the monitor is off for this run, or None."""
        return self.sampler.off

    @property
    def samples(self) -> int:
        """Samples taken in this run."""
        return self.sampler.samples

    @property
    def last_values(self) -> dict[str, float]:
        """The values of the latest sample, as logged."""
        return self.sampler.last_values

    def add_listener(self, listener: Callable[[Trainer, int, dict[str, float]], None]) -> None:
        """Call ``listener(trainer, step, values)`` on every process after each sample is logged (synced values)."""
        self._listeners.append(listener)

    def join(self, run: LightningRun, trainer: Trainer) -> None:
        """On fit: start afresh (unless a checkpoint was loaded) and bring the sampler to the Trainer's run.

        A sharding strategy other than FSDP2 turns the sampler off with one warning.
        """
        if not self._restored:
            self.sampler.reset()
        self._restored, self._ended_signals = False, None
        self._trainer = trainer
        saved, self._saved_signals = self._saved_signals, None
        run.add_sharpness(self, self.sampler, self._notify, loss_fn=self.loss_fn, step_options=self.step_options,
                          saved_signals=saved)  # fmt: skip
        strategy = trainer.strategy
        plain = isinstance(strategy, (SingleDeviceStrategy, DDPStrategy)) and "DeepSpeed" not in type(strategy).__name__
        fsdp2 = isinstance(strategy, ModelParallelStrategy)  # DTensor parameters: every estimator reads their shards
        if not plain and not (fsdp2 and self.sampler.estimator != "exact_lanczos"):
            supported = "single-device, DDP, and ModelParallelStrategy (FSDP2) with every estimator but 'lanczos'"
            self.sampler.turn_off(f"the {type(strategy).__name__} shards or wraps the parameters; {supported}")

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        """Remove the optimizer hook if the run fails."""
        super().on_exception(trainer, pl_module, exception)
        self.sampler.detach()

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Remove the optimizer hook and drop any parameter copy."""
        super().teardown(trainer, pl_module, stage)
        if stage == "fit":
            self.sampler.detach()
            self._restored = False
            self._trainer = None

    def keep_state(self, run: LightningRun) -> None:
        """The fit is over: the step signals' window it saves (:meth:`state_dict`), kept for a save after it."""
        self._ended_signals = run.signals_state()

    def state_dict(self) -> dict[str, Any]:
        """The sampler's state (:meth:`connmon.curvature.sampler.SharpnessSampler.state_dict`).

        In a run without a ``ConnectionMonitor``, also the step signals' window not logged yet (the optimizer's state
        since the last sample), so a resumed run logs what the uninterrupted one does.
        """
        state = self.sampler.state_dict()
        run = running(self._trainer)
        signals = run.signals_state() if run is not None else (self._saved_signals or self._ended_signals)
        return {**state, "step_signals": signals} if signals is not None else state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved."""
        self._restored, self._ended_signals = True, None
        state = dict(state_dict)
        signals = state.pop("step_signals", None)
        self.sampler.load_state_dict(state)
        run = running(self._trainer)
        if run is not None:  # loaded into a fit under way (Lightning's ckpt_path): the run keeps it
            run.load_signals(signals)
        else:
            self._saved_signals = signals

    def _notify(self, step: int, values: dict[str, float]) -> None:
        trainer = self._trainer
        if trainer is None:
            return
        for listener in self._listeners:
            listener(trainer, step, {k: values[k] for k in self.sampler.reading_keys() if k in values})
