"""SharpnessMonitor: the curvature against the optimizer's edge of stability every N optimizer steps (opt-in)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from connmon._options import check_int
from connmon.capture import paused
from connmon.curvature import sharpness_ratio

RATIO_KEY = "connmon/sharpness_ratio"
EIGENVALUE_KEY = "connmon/sharpness_eigenvalue"


class SharpnessMonitor(Callback):
    """Logs how close the optimizer's step is to its edge of stability, every ``every_n_steps`` optimizer steps.

    Before the optimizer step that follows every ``every_n_steps``-th one, it computes
    :func:`connmon.curvature.sharpness_ratio` on the batch that step is about to train on (``loss_fn(pl_module,
    batch)``, its first micro-batch under gradient accumulation), with the parameters, optimizer state and learning
    rate that step will use: the stability of the step about to be taken. (The batch just trained on reads 5-25%
    higher while the run is healthy and lower once it is past the edge: on three diverging runs it first read above 1
    twice in a row 10-50 steps later than the next batch; ``python benchmarks/bench_sharpness.py --batch-choice``.)
    It logs ``connmon/sharpness_ratio`` (1 is the edge of stability: on the quadratic model the steps oscillate with
    a growing amplitude past it) and ``connmon/sharpness_eigenvalue`` (``lambda_max(U^1/2 H U^1/2)``) to every
    logger at ``trainer.global_step``. Under DDP each process measures its
    own batch and the values are averaged (the mean of the processes' top eigenvalues is at least the top eigenvalue
    of their mean Hessian, so it errs towards an early warning). :class:`DriftAlert` sees the values on the steps
    they are measured; its default rules alert when the ratio is above 1 on two samples in a row
    (:func:`connmon.alerts.edge_of_stability_rule`).

    Nothing of the training run changes: the estimate uses :func:`torch.autograd.grad` (``.grad`` untouched), forks
    the random streams, restores the module's buffers, and runs SDPA's math kernel (the fused kernels have no double
    backward). It costs about ``lanczos_steps + 1`` double backward passes of one batch per sample: measure it with
    ``python benchmarks/bench_overhead.py``. An optimizer without a known edge of stability (see
    :func:`connmon.curvature.step_geometry`), a model with an operation without a double backward (a compiled
    model, a flash-attention kernel), running out of memory or any other error turns the monitor off for the run
    with one warning that says why, on every process alike; the training run goes on.

    Args:
        loss_fn: the batch's scalar loss, ``loss_fn(pl_module, batch)`` (for example
            ``lambda module, batch: F.cross_entropy(module(batch[0]), batch[1])``). It is called once per sample,
            outside ``training_step``, so that a ``training_step`` that logs or updates metrics is not run twice, and
            before it: it sees the batch as the dataloader gave it (on the model's device). A capture that a
            :class:`ConnectionMonitor` armed for the same step records nothing of these forwards.
        every_n_steps: sample every this many optimizer steps (after step ``every_n_steps``, ``2 every_n_steps``,
            ...; logged at that step).
        lanczos_steps: Hessian-vector products per sample (see :func:`connmon.curvature.sharpness_ratio`).

    Raises:
        ValueError: for a ``loss_fn`` that is not callable or a count below 1.

    Example:
        >>> import lightning as L
        >>> import torch.nn.functional as F
        >>> from connmon.callbacks import DriftAlert, SharpnessMonitor
        >>> loss_fn = lambda module, batch: F.cross_entropy(module(batch[0]).flatten(0, 1), batch[1].flatten())
        >>> callbacks = [SharpnessMonitor(loss_fn, every_n_steps=40), DriftAlert()]
        >>> trainer = L.Trainer(callbacks=callbacks, logger=False, enable_progress_bar=False)
    """

    def __init__(
        self, loss_fn: Callable[[LightningModule, Any], Tensor], every_n_steps: int = 40, lanczos_steps: int = 8
    ) -> None:
        if not callable(loss_fn):
            raise ValueError(f"loss_fn must be callable as loss_fn(pl_module, batch), got loss_fn={loss_fn!r}")
        check_int("every_n_steps", every_n_steps)
        check_int("lanczos_steps", lanczos_steps)
        self.loss_fn, self.every_n_steps, self.lanczos_steps = loss_fn, every_n_steps, lanczos_steps
        self.off: str | None = None  # why the monitor is off for this run, if it is
        self.samples = 0
        self.last_values: dict[str, float] = {}
        self._last_step: int | None = None  # the step last measured (once, however many micro-batches)
        self._listeners: list[Callable[[Trainer, int, dict[str, float]], None]] = []

    def add_listener(self, listener: Callable[[Trainer, int, dict[str, float]], None]) -> None:
        """Call ``listener(trainer, step, values)`` on every process after each sample is logged (synced values)."""
        self._listeners.append(listener)

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """On fit: start on, unless the strategy shards the parameters (FSDP, DeepSpeed), which is not supported."""
        if stage != "fit":
            return
        self.off, self.samples, self.last_values, self._last_step = None, 0, {}, None
        strategy = trainer.strategy
        plain = isinstance(strategy, (SingleDeviceStrategy, DDPStrategy)) and "DeepSpeed" not in type(strategy).__name__
        if not plain:
            self._turn_off(f"the {type(strategy).__name__} shards or wraps the parameters; single-device and DDP only")

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        """On the first micro-batch after every ``every_n_steps``-th optimizer step: measure, sync, log, notify."""
        step = trainer.global_step
        if self.off is not None or step == 0 or step % self.every_n_steps or step == self._last_step:
            return
        self._last_step = step
        ratio, constant, failure = self._measure(trainer, pl_module, batch)
        measured = failure is None
        total = torch.tensor([ratio if measured else 0.0, float(measured), float(not measured)],
                             dtype=torch.float64, device=pl_module.device)  # fmt: skip
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(total)  # every process takes part in exactly one reduction per sample
        summed, count, failed = total.tolist()
        if failed:
            self._turn_off(failure or "it failed on another process (that process's warning says why)")
            return
        ratio = summed / count
        values = {RATIO_KEY: ratio, EIGENVALUE_KEY: ratio * constant}
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(values, step=step)
        self.samples += 1
        self.last_values = values
        for listener in self._listeners:
            listener(trainer, step, values)

    def _measure(self, trainer: Trainer, pl_module: LightningModule, batch: Any) -> tuple[float, float, str | None]:
        """This process's ratio and stability constant, or the reason it could not measure them."""
        if len(trainer.optimizers) != 1:
            return math.nan, math.nan, f"it needs exactly one optimizer, and the run has {len(trainer.optimizers)}"
        try:
            with trainer.precision_plugin.train_step_context(), paused():
                result = sharpness_ratio(
                    lambda: self.loss_fn(pl_module, batch),
                    trainer.optimizers[0],
                    steps=self.lanczos_steps,
                    model=pl_module,
                    seed=trainer.global_step,
                )
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()
            return math.nan, math.nan, "it ran out of memory (it holds a double-backward graph of one batch)"
        except Exception as error:  # never end the training run
            return math.nan, math.nan, f"{type(error).__name__}: {error}"
        return result.ratio, result.constant, None

    def _turn_off(self, why: str) -> None:
        self.off = why
        rank_zero_warn(f"SharpnessMonitor is off for the rest of this run: {why}")
