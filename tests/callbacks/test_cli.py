"""LightningCLI configures ConnectionMonitor from its typed arguments."""

import lightning as L
import pytest
from lightning.pytorch.cli import LightningCLI

from connmon.callbacks import ConnectionMonitor
from tests.callbacks.lightning_models import LitGPT


def cli(*arguments):
    return LightningCLI(LitGPT, L.LightningDataModule, run=False, args=["--trainer.logger=false", *arguments])


def test_lightning_cli_configures_the_monitor():
    built = cli(
        "--trainer.callbacks+=connmon.callbacks.ConnectionMonitor",
        "--trainer.callbacks.every_n_steps=7",
        "--trainer.callbacks.diagnostics=[walk, drift]",
        "--trainer.callbacks.layers=blocks\\.1\\.",
        "--trainer.callbacks.figures_every_n_samples=null",
    )
    (monitor,) = [c for c in built.trainer.callbacks if isinstance(c, ConnectionMonitor)]
    options = monitor.options
    assert (options.every_n_steps, options.diagnostics, options.layers) == (7, ("walk", "drift"), "blocks\\.1\\.")
    assert options.figures_every_n_samples is None


def test_lightning_cli_rejects_an_unknown_diagnostic():
    with pytest.raises(SystemExit):  # jsonargparse checks the Literal type and prints the valid values
        cli("--trainer.callbacks+=connmon.callbacks.ConnectionMonitor", "--trainer.callbacks.diagnostics=[walks]")
