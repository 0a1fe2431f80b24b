"""Figures say true things: labelled axes, integer layers, no empty legend entry, no lone point shown as a trend."""

import itertools

import torch

from connmon.sinks import depth_figure, series_figure, spectra_figure, walks_figure


def test_depth_figure_has_integer_layer_ticks_and_leaves_empty_series_out():
    fig = depth_figure(
        {"ov_isometry_gap": torch.tensor([0.5, 0.6, 0.55]), "depth_drift": torch.full((3,), float("nan"))}
    )
    ax = fig.axes[0]
    assert [line.get_label() for line in ax.lines] == ["ov_isometry_gap"]
    assert ax.get_legend() is None  # the figure's legend, below the axes: it covers no line
    assert [text.get_text() for text in fig.legends[0].get_texts()] == ["ov_isometry_gap"]
    ticks = [t for t in ax.get_xticks() if 0 <= t <= 2]
    assert all(float(t).is_integer() for t in ticks)
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("layer", "value")


def test_a_single_sample_is_labelled_as_one():
    fig = series_figure(
        {
            "connmon/connection_spectral_radius/all": ([25], [0.8]),
            "connmon/attention_entropy/all": ([0, 25], [3.0, 2.5]),
        }
    )
    titles = sorted(ax.get_title() for ax in fig.axes if ax.get_title())
    assert titles == ["connmon/attention_entropy/all", "connmon/connection_spectral_radius/all (1 sample, step 25)"]
    assert {ax.get_ylabel() for ax in fig.axes if ax.get_title()} == {"attention_entropy", "connection_spectral_radius"}


def test_walk_heatmaps_use_a_power_scale_and_spectra_label_their_axes():
    fig = walks_figure({0: torch.eye(4), 1: torch.full((4, 4), 0.25)})
    image = fig.axes[0].get_images()[0]
    assert type(image.norm).__name__ == "PowerNorm" and image.norm.gamma == 0.3
    spectra = spectra_figure({0: torch.tensor([[0.5 + 0.1j, float("nan") + 0j]])})
    assert (spectra.axes[0].get_xlabel(), spectra.axes[0].get_ylabel()) == ("Re lambda", "Im lambda")


def test_the_spectra_legend_sits_beside_the_plane_and_the_figure_says_what_it_plots():
    spectra = spectra_figure({i: torch.randn(2, 8, dtype=torch.complex64) for i in range(6)}, "step 25")
    ax = spectra.axes[0]
    assert ax.get_legend() is None and len(spectra.legends) == 1  # a figure legend: never over the points
    labels = [text.get_text() for text in spectra.legends[0].get_texts()]
    assert labels[0] == "|lambda| = 1" and labels[1:] == [f"L{i:02d}" for i in range(6)]
    assert "every recorded sequence" in ax.get_title() and "mean" in ax.get_title()


def test_float_round_off_is_drawn_flat_not_as_spikes():
    fig = series_figure({"connmon/stochasticity_gap/all": ([0, 25, 50], [1.19e-7, 1.34e-7, 1.2e-7])})
    low, high = fig.axes[0].get_ylim()
    assert high - low >= 0.09  # round-off around 0 in a window of +-0.05, not autoscaled into a spike
    trend = series_figure({"connmon/attention_entropy/all": ([0, 25], [3.0, 2.5])})
    low, high = trend.axes[0].get_ylim()
    assert high - low < 1.0  # a real change keeps matplotlib's own scale


def test_walk_heatmaps_label_the_grid_once_and_spread_the_colour_bar_ticks():
    torch.manual_seed(0)
    fig = walks_figure({i: torch.softmax(torch.randn(12, 12) * 2, -1) for i in range(6)})  # two rows
    fig.canvas.draw()
    panels, bar = fig.axes[:6], fig.axes[-1]
    assert all(ax.get_xlabel() == "" and ax.get_ylabel() == "" for ax in panels)  # no label runs into a title
    assert fig.get_supxlabel() == "key" and fig.get_supylabel() == "query"
    ticks = sorted(
        bar.transAxes.inverted().transform(bar.transData.transform([(0, t) for t in bar.get_yticks()]))[:, 1]
    )
    assert len(ticks) >= 5 and min(b - a for a, b in itertools.pairwise(ticks)) > 0.05  # no crowding at the top


def test_the_reconstruction_error_is_drawn_on_a_log_axis_and_the_rest_on_a_linear_one():
    error, entropy = ([0, 100, 200], [1e-7, 2e-7, 1.5e-7]), ([0, 100], [3.1, 2.7])
    fig = series_figure({"connmon/reconstruction_error/all": error, "connmon/attention_entropy/all": entropy})
    scales = {ax.get_title(): ax.get_yscale() for ax in fig.axes}
    assert scales == {"connmon/attention_entropy/all": "linear", "connmon/reconstruction_error/all": "log"}


def test_token_axes_have_whole_number_ticks_and_a_round_off_series_keeps_its_points_in_view():
    walks = walks_figure({0: torch.softmax(torch.randn(37, 37), -1)})
    for axis in (walks.axes[0].xaxis, walks.axes[0].yaxis):
        ticks = [t for t in axis.get_majorticklocs() if 0 <= t <= 36]
        assert 2 <= len(ticks) <= 6 and all(float(t).is_integer() for t in ticks)
    values = [1.1e-7, 1.3e-7, 1.2e-7]  # reconstruction_error: round-off, on a log axis that shows it
    fig = series_figure({"connmon/reconstruction_error/all": ([0, 100, 200], values)})
    low, high = fig.axes[0].get_ylim()
    assert fig.axes[0].get_yscale() == "log" and low < min(values) and max(values) < high
