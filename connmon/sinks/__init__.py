"""Where connmon's values go besides plain scalars (which reach any Lightning logger): W&B and figures.

:mod:`.wandb` writes histograms, figures and alerts to a W&B run, :mod:`.panels` says which for a sample,
:mod:`.workspace` saves a W&B workspace of connmon's panels, :mod:`.figures` draws the matplotlib figures.
"""

from connmon.sinks.figures import depth_figure, series_figure, spectra_figure, walks_figure

__all__ = ["depth_figure", "series_figure", "spectra_figure", "walks_figure"]
