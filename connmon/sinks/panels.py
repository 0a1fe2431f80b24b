"""The W&B-only panels of a sample: per-head and per-eigenvalue histograms, the spectra and depth figures."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from connmon import keys


def write_panels(
    sink: Any, step: int, metrics: Mapping[str, Any], values: Mapping[str, Tensor], *, full: bool, histograms: bool,
    figures: bool,
) -> None:  # fmt: skip
    """Write a sample's histograms (``histograms``) and figures (``figures``) to a :class:`~connmon.sinks.wandb.WandbSink`.

    Args:
        sink: the W&B sink (rank zero).
        step: the sample's step.
        metrics: the monitor's accumulators by group (``"transport"``, ``"spectrum"``, ...), after ``compute``.
        values: the values computed, ``<metric>`` -> per-layer tensor (``/all`` keys are skipped).
        full: whether this sample computed the spectrum (else its spectra are from an earlier sample: not written).
        histograms: write the per-head isometry gaps and the spectra's moduli as histograms.
        figures: write the spectra and the gaps-by-depth figures.

    Examples:
        >>> import torch
        >>> from connmon.sinks.panels import write_panels
        >>> class Sink:
        ...     def histograms(self, step, values): print(sorted(values))
        >>> transport = type("T", (), {"last_head_gaps": {0: torch.tensor([0.1, 0.2])}})()
        >>> write_panels(Sink(), 4, {"transport": transport}, {}, full=False, histograms=True, figures=False)
        ['connmon/head_isometry_gap_hist/L00']
    """  # noqa: E501
    transport = metrics.get("transport")
    spectrum = metrics.get("spectrum") if full else None
    if histograms:
        written = {}
        for index, gaps in getattr(transport, "last_head_gaps", {}).items():
            written[f"{keys.HEAD_ISOMETRY_GAP_HIST}/L{index:02d}"] = gaps
        for index, eigenvalues in getattr(spectrum, "last_spectra", {}).items():
            written[f"{keys.SPECTRUM_MODULUS_HIST}/L{index:02d}"] = eigenvalues.abs()
        if written:
            sink.histograms(step, written)
    if figures:
        from connmon.sinks.figures import depth_figure, spectra_figure

        drawn = {}
        if spectrum is not None and spectrum.last_spectra:
            drawn[f"{keys.FIGURES}/spectra"] = spectra_figure(
                spectrum.last_spectra, f"walk part of the connection spectra, step {step}"
            )
        depth = {k: v for k, v in values.items() if k.endswith("isometry_gap") and not k.endswith("/all")}
        if depth:
            drawn[f"{keys.FIGURES}/gaps_by_depth"] = depth_figure(depth, f"gaps across depth, step {step}")
        if drawn:
            sink.figures(step, drawn)
