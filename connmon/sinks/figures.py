"""Matplotlib figures: connection spectra in the complex plane, per-layer curves across depth, walk heatmaps, series."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from matplotlib import colormaps
from matplotlib.colors import PowerNorm
from matplotlib.figure import Figure  # the object API: no pyplot state, no GUI backend, nothing to close
from matplotlib.ticker import MaxNLocator
from torch import Tensor


def spectra_figure(spectra: Mapping[int, Tensor], title: str = "walk part of the connection spectra") -> Figure:
    """Eigenvalues (of the walk part) of ``M / s`` per layer in the complex plane, with the unit circle.

    Args:
        spectra: layer index -> ``(B_s, k)`` complex eigenvalues.
        title: figure title.

    Returns:
        A matplotlib Figure (``fig.savefig(path)`` writes it).

    Examples:
        >>> import torch
        >>> from connmon.sinks import spectra_figure
        >>> fig = spectra_figure({0: torch.tensor([[1.0 + 0.5j, 0.2 - 0.1j]])})
        >>> len(fig.axes)
        1
    """
    fig = Figure(figsize=(6.5, 5), layout="constrained")
    ax = fig.subplots()
    circle = np.exp(1j * np.linspace(0, 2 * np.pi, 200))
    ax.plot(circle.real, circle.imag, color="0.75", lw=1, label="|lambda| = 1")
    colors = colormaps["viridis"](np.linspace(0, 1, max(len(spectra), 1)))
    for color, (index, values) in zip(colors, sorted(spectra.items()), strict=False):
        points = values.detach().cpu().numpy().ravel()
        ax.scatter(points.real, points.imag, s=14, color=color, label=f"L{index:02d}")
    ax.set(xlabel="Re lambda", ylabel="Im lambda", aspect="equal", adjustable="datalim")
    ax.set_title(f"{title}\nevery recorded sequence (the logged radius is their mean)", fontsize="medium")
    fig.legend(loc="outside right upper", fontsize="small")  # beside the plane, never over its points
    return fig


def depth_figure(values: Mapping[str, Tensor], title: str = "gaps across depth") -> Figure:
    """Per-layer curves (one per metric) against layer index.

    Args:
        values: metric name -> ``(L,)`` per-layer values (NaN for layers not captured).
        title: figure title.

    Returns:
        A matplotlib Figure.

    Examples:
        >>> import torch
        >>> from connmon.sinks import depth_figure
        >>> fig = depth_figure({"ov_isometry_gap": torch.tensor([0.5, 0.6, 0.55])})
        >>> fig.axes[0].get_xlabel()
        'layer'
    """
    fig = Figure(figsize=(6, 4), layout="constrained")
    ax = fig.subplots()
    for name, per_layer in values.items():
        y = per_layer.detach().cpu().double().reshape(-1).numpy()  # a one-layer model: 0-dim from torchmetrics
        if np.isfinite(y).any():  # an empty series stays out of the plot and its legend
            ax.plot(np.arange(len(y)), y, marker="o", label=name)
    ax.set(xlabel="layer", ylabel="value", title=title)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if ax.lines:  # below the axes, where it covers no line
        fig.legend(fontsize="small", loc="outside lower center", ncols=min(len(ax.lines), 3))
    return fig


def walks_figure(walks: Mapping[int, Tensor], title: str = "walk matrices P (first sequence)") -> Figure:
    """One heatmap per layer of a walk matrix ``P`` (rows: queries, columns: keys), on a power scale.

    Attention mass is heavy-tailed: on a linear scale a few large entries hide the rest, so the colours follow
    ``P_ij ** 0.3`` (the colour bar reads in ``P_ij``).

    Args:
        walks: layer index -> ``(n, n)`` walk matrix.
        title: figure title.

    Returns:
        A matplotlib Figure.

    Examples:
        >>> import torch
        >>> from connmon.sinks import walks_figure
        >>> fig = walks_figure({0: torch.eye(4), 1: torch.full((4, 4), 0.25)})
        >>> len(fig.axes)  # two heatmaps and one colour bar
        3
    """
    count = max(len(walks), 1)
    columns = min(count, 4)
    rows = -(-count // columns)
    fig = Figure(figsize=(3 * columns + 0.6, 3 * rows), layout="constrained")
    axes = np.atleast_1d(fig.subplots(rows, columns)).ravel()
    image = None
    for ax, (index, walk) in zip(axes, sorted(walks.items()), strict=False):
        norm = PowerNorm(gamma=0.3, vmin=0.0, vmax=1.0)
        image = ax.imshow(walk.detach().cpu().double().numpy(), cmap="magma", norm=norm)
        ax.set_title(f"L{index:02d}")
        for axis in (ax.xaxis, ax.yaxis):  # token positions: whole numbers, few enough not to run together
            axis.set_major_locator(MaxNLocator(nbins=5, integer=True))
        ax.tick_params(labelsize="small")
    for ax in axes[len(walks) :]:
        ax.set_axis_off()
    if image is not None:  # one colour bar with ticks spread along the power scale, not crowded at its top
        bar = fig.colorbar(image, ax=axes.tolist(), shrink=0.8, label="P_ij (power scale)")
        bar.set_ticks([0.0, 0.001, 0.01, 0.05, 0.2, 0.5, 1.0], labels=["0", "0.001", "0.01", "0.05", "0.2", "0.5", "1"])
    fig.supxlabel("key")  # once for the grid: per-panel labels ran into the titles of the row below
    fig.supylabel("query")
    fig.suptitle(title)
    return fig


def series_figure(series: Mapping[str, tuple[list[int], list[float]]], title: str = "connmon over training") -> Figure:
    """One panel per logged key: its values against the trainer step.

    A key with a single value is drawn as one marker and its title says so (``1 sample, step N``): a lone point is
    never passed off as a trend. ``reconstruction_error`` (round-off, about 1e-7) is drawn on a log axis.

    Args:
        series: key -> (steps, values).
        title: figure title.

    Returns:
        A matplotlib Figure.

    Examples:
        >>> from connmon.sinks import series_figure
        >>> fig = series_figure({"connmon/attention_entropy/all": ([0, 100], [3.1, 2.7])})
        >>> fig.axes[0].get_title()
        'connmon/attention_entropy/all'
    """
    count = max(len(series), 1)
    columns = min(count, 3)
    rows = -(-count // columns)
    fig = Figure(figsize=(4.5 * columns, 2.8 * rows), layout="constrained")
    axes = np.atleast_1d(fig.subplots(rows, columns)).ravel()
    for ax, (key, (steps, values)) in zip(axes, sorted(series.items()), strict=False):
        ax.plot(steps, values, marker="o" if len(steps) == 1 else ".", lw=1)
        ax.ticklabel_format(axis="y", useOffset=False)
        finite = [v for v in values if np.isfinite(v)]
        if "reconstruction_error" in key and finite and min(finite) > 0:  # round-off near 1e-7: a log axis shows it
            ax.set_yscale("log")
        elif finite and max(finite) - min(finite) <= 1e-6 * max(1.0, *map(abs, finite)):  # round-off, not a trend
            middle, pad = (max(finite) + min(finite)) / 2, max(1.0, *map(abs, finite)) * 0.05
            ax.set_ylim(middle - pad, middle + pad)
        ax.set_title(key if len(steps) != 1 else f"{key} (1 sample, step {steps[0]})", fontsize="small")
        ax.set(xlabel="step", ylabel=key.split("/")[1] if key.count("/") >= 1 else key)
    for ax in axes[len(series) :]:
        ax.set_axis_off()
    fig.suptitle(title)
    return fig
