"""Logger-specific sinks. Plain scalars go through any Lightning logger; W&B extras live in :mod:`.wandb`."""

from connmon.loggers.figures import depth_figure, series_figure, spectra_figure, walks_figure

__all__ = ["depth_figure", "series_figure", "spectra_figure", "walks_figure"]
