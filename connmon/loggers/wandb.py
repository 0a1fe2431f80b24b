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
    """Writes connmon's W&B-only panels to the run of a Lightning ``WandbLogger`` (rank zero only).

    Args:
        logger: a ``lightning.pytorch.loggers.WandbLogger``.

    Example:
        >>> from lightning.pytorch.loggers import WandbLogger
        >>> from connmon.loggers.wandb import WandbSink
        >>> sink = WandbSink(WandbLogger(mode="disabled"))  # a doctest writes no run
        >>> sink.histograms(0, {"connmon/head_isometry_gap_hist/L00": [0.1, 0.2]})
    """

    def __init__(self, logger: Any) -> None:
        self.logger = logger
        self._warned = False
        self._defined = False

    def _run(self) -> Any:
        run = self.logger.experiment
        if not self._defined:
            run.define_metric(STEP)
            run.define_metric("connmon/*", step_metric=STEP)
            self._defined = True
        return run

    def _guard(self, what: str, fn: Any) -> None:
        try:
            fn()
        except Exception as error:  # W&B must never end a training run
            if not self._warned:
                warnings.warn(f"connmon: could not write {what} to W&B ({type(error).__name__}: {error})", stacklevel=3)
                self._warned = True

    def histograms(self, step: int, values: Mapping[str, Tensor | list[float]]) -> None:
        """Log one ``wandb.Histogram`` per key at ``step``."""
        import wandb

        def log() -> None:
            payload = {key: wandb.Histogram(_numbers(v)) for key, v in values.items()}
            self._run().log({**payload, STEP: step})

        self._guard("histograms", log)

    def figures(self, step: int, figures: Mapping[str, Any]) -> None:
        """Log matplotlib figures as images at ``step``."""
        import wandb

        def log() -> None:
            self._run().log({**{key: wandb.Image(fig) for key, fig in figures.items()}, STEP: step})

        self._guard("figures", log)

    def alert(self, title: str, text: str, level: str, wait_duration: float) -> None:
        """``run.alert(title, text, level, wait_duration)``; level is ``"INFO"``, ``"WARN"`` or ``"ERROR"``."""
        import wandb

        def send() -> None:
            self._run().alert(title=title, text=text, level=wandb.AlertLevel(level), wait_duration=wait_duration)

        self._guard("an alert", send)


def _numbers(values: Tensor | list[float]) -> list[float]:
    if isinstance(values, Tensor):
        values = values.detach().cpu().double().reshape(-1)
        return [v for v in values.tolist() if v == v]  # drop NaN
    return list(values)
