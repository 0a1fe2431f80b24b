"""What a Lightning callback of connmon says at the end of a fit about its cost."""

from __future__ import annotations

from lightning.pytorch import Trainer
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities import rank_zero_info

from connmon import keys
from connmon._cost import CostClock, summary


def say_cost(trainer: Trainer, clock: CostClock, owner: str) -> None:
    """The cost line at the end of a fit: rank zero's console, and ``connmon/overhead/<part>`` in the W&B summary."""
    clock.stop()
    if not trainer.is_global_zero:
        return
    rank_zero_info(f"connmon: {summary(clock, owner)}")
    if clock.sections:
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                try:
                    logger.experiment.summary[keys.overhead_key(clock.part)] = clock.fraction
                except Exception:  # a W&B error must not end the run
                    pass
