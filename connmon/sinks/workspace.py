"""A saved W&B workspace of connmon's panels, built with ``wandb-workspaces``.

Needs the ``workspace`` extra: ``pip install "torch-connmon[workspace]"``.

One section per diagnostic group, one line panel per diagnostic with every layer as a line (a regex over
``connmon/<metric>/(L<ll>|all)``, so the panel fits any depth) and the ``/all`` mean drawn thick; a section of
histogram panels (one per layer: W&B draws a histogram series as a heatmap over steps), a section of the figures
(media panels), one of the curvature (a SharpnessMonitor's ratio against the edge of stability) and of what every
monitor costs (``connmon/overhead``), and one of the alert counts. The keys are those the monitor logs, read from
the metric classes.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from connmon import keys
from connmon.metrics import DriftMetrics, SpectrumMetrics, TransportMetrics, WalkMetrics
from connmon.metrics.layerwise import LayerwiseMean

Trainer = Literal["lightning", "transformers", "plain"]
# where each entry point's keys live and which step they are drawn against
LAYOUTS: dict[str, tuple[str, str]] = {
    "lightning": ("", "trainer/global_step"),  # Lightning's WandbLogger
    "transformers": ("train/", "train/global_step"),  # the Trainer's W&B integration writes train/<key>
    "plain": ("", "Step"),  # connmon.Monitor logging with step=
}
GROUPS: dict[str, type[LayerwiseMean]] = {
    "walk": WalkMetrics, "transport": TransportMetrics, "spectrum": SpectrumMetrics, "drift": DriftMetrics
}  # fmt: skip
HISTOGRAMS = ("head_isometry_gap_hist", "spectrum_modulus_hist")
FIGURES = ("spectra", "gaps_by_depth")
ALERTS = (keys.ALERT_TOTAL, keys.ALERT_COUNT)
OVERHEAD = (keys.OVERHEAD, keys.overhead_key("attention"), keys.overhead_key("curvature"))  # every monitor's
CURVATURE_INTERVAL = keys.CURVATURE_INTERVAL  # the adaptive cadence's choice (connmon.curvature.sampler)
CURVATURE_GRADIENTS = keys.CURVATURE_GRADIENTS  # its cost in gradients of a step's batch per step


def metric_regex(metric: str, prefix: str = "") -> str:
    r"""The regex a panel uses for every layer of ``metric`` and its ``/all`` mean.

    Examples:
        >>> from connmon.sinks.workspace import metric_regex
        >>> metric_regex("attention_entropy")
        '^connmon/attention_entropy/(L\\d+|all)$'
    """
    return f"^{re.escape(prefix)}connmon/{metric}/(L\\d+|all)$"


def build_workspace(
    entity: str,
    project: str,
    num_layers: int,
    name: str = "connmon",
    trainer: Trainer = "lightning",
) -> Any:
    """The ``wandb_workspaces.workspaces.Workspace`` of connmon's panels (``.save()`` writes it to W&B).

    Args:
        entity: W&B entity (user or team).
        project: W&B project.
        num_layers: attention layers of the model (histogram panels are per layer).
        name: the workspace's name.
        trainer: whose keys: ``"lightning"`` (``ConnectionMonitor``), ``"transformers"`` (the Hugging Face
            callback, keys under ``train/``) or ``"plain"`` (``connmon.Monitor`` logging with ``step=``).

    Raises:
        ValueError: for an unknown trainer or ``num_layers < 1``.
        ImportError: without ``wandb-workspaces`` (the message says how to install it).

    Examples:
        >>> from connmon.sinks.workspace import build_workspace
        >>> workspace = build_workspace("my-team", "my-project", num_layers=4)
        >>> [section.name for section in workspace.sections][:2]
        ['connmon: walk', 'connmon: transport']
    """
    if trainer not in LAYOUTS:
        raise ValueError(f"trainer must be one of {tuple(LAYOUTS)}, got trainer={trainer!r}")
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"num_layers must be an integer >= 1, got num_layers={num_layers!r}")
    try:
        import wandb_workspaces.reports.v2 as wr
        import wandb_workspaces.workspaces as ws
    except ImportError as error:
        raise ImportError(
            f"connmon workspace needs wandb-workspaces: pip install 'torch-connmon[workspace]' ({error})"
        ) from None
    prefix, x = LAYOUTS[trainer]
    sections = []
    for group, metrics in GROUPS.items():
        panels: list[Any] = [  # wandb-workspaces' Section takes a list of its panel union
            wr.LinePlot(
                title=metric,
                x=x,
                metric_regex=metric_regex(metric, prefix),
                title_x="step",
                title_y=metric,
                line_widths={f"{prefix}connmon/{metric}/all": 4.0},
                line_titles={f"{prefix}connmon/{metric}/all": "mean over layers"},
            )
            for metric in metrics.metrics
        ]
        if group == "walk":  # per layer: the largest logit over the whole batch of the read steps, every step's
            # bound from the attention kernel's logsumexp (within log n above it), and what QK-clip did
            panels += [
                wr.LinePlot(
                    title=title,
                    x=x,
                    metric_regex=f"^{re.escape(prefix)}connmon/{key}/L\\d+$",
                    title_x="step",
                    title_y=axis,
                    line_widths={},
                )
                for key, title, axis in (
                    (keys.STEP_MAX_LOGIT, "step max logit (whole batch)", "max logit"),
                    (keys.MAX_LOGIT_BOUND, "max logit bound (every step, kernel logsumexp)", "logsumexp bound"),
                    (keys.QK_CLIPS, "QK-clip: head clips since the last sample", "head clips"),
                    (keys.QK_CLIP_SCALE, "QK-clip: smallest row scale sqrt(tau / S)", "scale"),
                    (keys.LOGIT_AFTER_QK_CLIP, "QK-clip: max logit once clipped", "max logit"),
                )
            ]
        sections.append(
            ws.Section(name=f"connmon: {group}", panels=panels, is_open=True, layout_settings=_grid(panels))
        )
    histograms: list[Any] = [
        wr.LinePlot(title=f"{hist} L{layer:02d}", x=x, y=[f"{prefix}connmon/{hist}/L{layer:02d}"])
        for hist in HISTOGRAMS
        for layer in range(num_layers)
    ]
    sections.append(ws.Section(name="connmon: histograms", panels=histograms, layout_settings=_grid(histograms)))
    figures: list[Any] = [wr.MediaBrowser(title=f, media_keys=[f"{prefix}connmon/figures/{f}"]) for f in FIGURES]
    sections.append(ws.Section(name="connmon: figures", panels=figures))
    curvature: list[Any] = [
        wr.LinePlot(
            title=title,
            x=x,
            metric_regex=f"^{re.escape(prefix)}connmon/(update_|critical_)?sharpness_{quantity}$",  # each estimator's
            line_widths={f"{prefix}connmon/sharpness_{quantity}": 4.0},
            line_titles={f"{prefix}connmon/sharpness_{quantity}": "top of the spectrum (the warning)"},
        )
        for quantity, title in (
            ("ratio", "sharpness ratio (1: the edge of stability)"),
            ("eigenvalue", "sharpness eigenvalue"),
        )
    ]
    curvature.append(
        wr.LinePlot(
            title="curvature: steps to the next sample, gradients per training step",
            x=x,
            y=[f"{prefix}{CURVATURE_INTERVAL}", f"{prefix}{CURVATURE_GRADIENTS}"],
        )
    )
    curvature += [
        wr.LinePlot(title=f"optimizer state: {title} (largest since the last sample)", x=x, y=[f"{prefix}{key}"])
        for key, title in (
            (keys.UPDATE_RMS, "RMS of Adam's normalized update"),
            (keys.STALE_SECOND_MOMENT, "share with |m_hat| > sqrt(v_hat)"),
            (keys.UPDATE_TO_WEIGHT, "update-to-weight ratio"),
        )
    ]
    curvature.append(
        wr.LinePlot(
            title="optimizer state: sum g^2 / sum v_hat, median over 50 steps (low: a stale second moment)",
            x=x,
            y=[f"{prefix}{keys.GRADIENT_TO_SECOND_MOMENT}"],
        )
    )
    curvature.append(
        wr.LinePlot(
            title="connmon overhead (fraction of training time)",
            x=x,
            y=[f"{prefix}{key}" for key in OVERHEAD],
            line_widths={f"{prefix}{OVERHEAD[0]}": 4.0},
        )
    )
    sections.append(
        ws.Section(name="connmon: curvature and cost", panels=curvature, is_open=True, layout_settings=_grid(curvature))
    )
    alerts: list[Any] = [wr.LinePlot(title="connmon alerts", x=x, y=[f"{prefix}{key}" for key in ALERTS])]
    sections.append(ws.Section(name="connmon: alerts", panels=alerts, is_open=True))
    return ws.Workspace(entity=entity, project=project, name=name, sections=sections)


def _grid(panels: list) -> Any:
    """Three panels a row, every panel of the section on its first page."""
    import wandb_workspaces.workspaces as ws

    return ws.SectionLayoutSettings(columns=3, rows=max(1, -(-len(panels) // 3)))


def workspace_spec(workspace: Any) -> dict[str, Any]:
    """The JSON spec W&B stores for ``workspace`` (what ``save()`` sends), computed offline.

    Examples:
        >>> from connmon.sinks.workspace import build_workspace, workspace_spec
        >>> spec = workspace_spec(build_workspace("my-team", "my-project", num_layers=2))
        >>> spec["project"], len(spec["spec"]["section"]["panelBankConfig"]["sections"])
        ('my-project', 8)
    """
    return workspace._to_model().model_dump(mode="json", by_alias=True, exclude_none=True)
