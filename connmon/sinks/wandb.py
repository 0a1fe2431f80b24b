"""Weights & Biases extras: step metric, histograms, figures, alerts. The only module importing wandb.

Every call is guarded: a W&B problem (no run, a disabled run, a failed upload) is reported once and the training
run goes on; scalars reach every Lightning logger elsewhere regardless.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from torch import Tensor

STEP = "trainer/global_step"  # the step key Lightning's WandbLogger logs with


class WandbSink:
    """Writes connmon's W&B-only panels (rank zero only) to a run, or to the run of a Lightning ``WandbLogger``.

    Args:
        run: a ``wandb`` run, or anything with the run as ``.experiment`` (Lightning's ``WandbLogger``), read lazily.
        step_key: the step metric the run's charts use (Lightning: ``trainer/global_step``; the Hugging Face
            Trainer: ``train/global_step``): it is defined for ``<prefix>connmon/*`` and logged in every row.
            None: rows are logged with ``run.log(..., step=step)`` (a plain loop logging with ``step=`` itself).
        prefix: prepended to every key (the Hugging Face Trainer writes ``train/<key>``).
        row_offset: the trainer's row of a step's values is ``step + row_offset``, ``step`` the optimizer steps taken
            before the forward they read (the Hugging Face Trainer logs that forward's loss one row later: 1).

    Examples:
        >>> import wandb
        >>> from connmon.sinks.wandb import WandbSink
        >>> run = wandb.init(mode="disabled")  # a doctest writes no run
        >>> sink = WandbSink(run)
        >>> sink.histograms(0, {"connmon/head_isometry_gap_hist/L00": [0.1, 0.2]})
        >>> run.finish()  # else the next WandbLogger would reuse this run
    """

    def __init__(self, run: Any, step_key: str | None = STEP, prefix: str = "", row_offset: int = 0) -> None:
        self.source = run
        self.step_key = step_key
        self.prefix = prefix
        self.row_offset = row_offset
        self._warned = False
        self._defined = False

    def _run(self) -> Any:
        run = getattr(self.source, "experiment", self.source)
        if not self._defined and self.step_key is not None:
            run.define_metric(self.step_key)
            run.define_metric(f"{self.prefix}connmon/*", step_metric=self.step_key)
        self._defined = True
        return run

    def _log(self, step: int, payload: Mapping[str, Any]) -> None:
        row = {f"{self.prefix}{key}": value for key, value in payload.items()}
        step += self.row_offset
        if self.step_key is None:
            self._run().log(row, step=step)
        else:
            self._run().log({**row, self.step_key: step})

    def _guard(self, what: str, fn: Any) -> None:
        try:
            fn()
        except Exception as error:  # W&B must never end a training run
            if not self._warned:
                warnings.warn(f"connmon: could not write {what} to W&B ({type(error).__name__}: {error})", stacklevel=3)
                self._warned = True

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        """Log scalar values at ``step``."""
        self._guard("scalars", lambda: self._log(step, values))

    def histograms(self, step: int, values: Mapping[str, Tensor | list[float]]) -> None:
        """Log one ``wandb.Histogram`` per key at ``step``."""
        import wandb

        def histogram(v: Tensor | list[float]) -> Any:  # no more bins than values: 4 heads are 4 bars, not 64
            numbers = _numbers(v)
            return wandb.Histogram(numbers, num_bins=min(64, max(len(numbers), 1)))

        self._guard("histograms", lambda: self._log(step, {k: histogram(v) for k, v in values.items()}))

    def figures(self, step: int, figures: Mapping[str, Any]) -> None:
        """Log matplotlib figures as images at ``step``."""
        import wandb

        self._guard("figures", lambda: self._log(step, {key: wandb.Image(fig) for key, fig in figures.items()}))

    def alert(self, title: str, text: str, level: str, wait_duration: float) -> None:
        """``run.alert(title, text, level, wait_duration)``; level is ``"INFO"``, ``"WARN"`` or ``"ERROR"``."""
        import wandb

        def send() -> None:
            self._run().alert(title=title, text=text, level=wandb.AlertLevel(level), wait_duration=wait_duration)  # type: ignore[attr-defined]

        self._guard("an alert", send)


def find_sink(source: Any, step_key: str | None = STEP, prefix: str = "", row_offset: int = 0) -> WandbSink | None:
    """The W&B sink of an entry point, or None: every entry point finds its run here.

    Args:
        source: a sequence of Lightning loggers (its first ``WandbLogger``, read lazily: the run opens when the
            logger does), or a ``wandb`` run, or None.
        step_key: as :class:`WandbSink`'s.
        prefix: as :class:`WandbSink`'s.
        row_offset: as :class:`WandbSink`'s.

    Examples:
        >>> from lightning.pytorch.loggers import CSVLogger
        >>> from connmon.sinks.wandb import find_sink
        >>> find_sink([CSVLogger("/tmp/logs")]) is None
        True
    """
    if isinstance(source, (list, tuple)):
        from lightning.pytorch.loggers import WandbLogger

        source = next((logger for logger in source if isinstance(logger, WandbLogger)), None)
    return None if source is None else WandbSink(source, step_key=step_key, prefix=prefix, row_offset=row_offset)


def _numbers(values: Tensor | list[float]) -> list[float]:
    if isinstance(values, Tensor):
        values = values.detach().cpu().double().reshape(-1)
        return [v for v in values.tolist() if v == v]  # drop NaN
    return list(values)
