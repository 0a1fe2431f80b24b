"""Every per-layer diagnostic of docs/diagnostics.md for one forward pass: ``connmon.analyze`` and its Report."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from connmon.capture import AttentionRecord, attention_layers, capture
from connmon.metrics.readings import (
    DRIFT,
    SPECTRUM,
    TRANSPORT,
    WALK,
    read_drift,
    read_spectrum,
    read_transport,
    read_walk,
)

__all__ = ["LAYER_METRICS", "Report", "analyze"]

LAYER_METRICS = tuple(
    name
    for group in (WALK, TRANSPORT, SPECTRUM, DRIFT)
    for name in group
    if name not in ("time_drift", "transport_drift")  # they compare two samples; a Report has one
)


@dataclass
class Report:
    """Per-layer diagnostics of one forward pass, and their model-level means.

    ``layers[i]`` holds ``name``, ``index``, every metric of :data:`LAYER_METRICS` (the mean over the sampled
    sequences of the values ``connmon.metrics`` computes in training; a metric with no finite value, such as
    ``depth_drift`` on the first layer, is absent) and ``connection_spectrum`` (per sequence, the k
    eigenvalues of the walk part of ``M / s`` as ``[real, imag]`` pairs; NaN where a sequence has fewer).
    ``model`` holds the mean of each metric over layers.
    """

    layers: list[dict[str, Any]] = field(default_factory=list)

    @property
    def model(self) -> dict[str, float]:
        """Mean of each scalar metric over the layers that have it."""
        means = {}
        for metric in LAYER_METRICS:
            values = [layer[metric] for layer in self.layers if metric in layer]
            if values:
                means[metric] = sum(values) / len(values)
        return means

    def to_dict(self) -> dict[str, Any]:
        """``{"layers": [{"name": ..., "index": ..., <metric>: value}], "model": {<metric>: mean}}``."""
        return {"layers": self.layers, "model": self.model}

    def to_json(self, **kwargs: Any) -> str:
        """The :meth:`to_dict` form as JSON (NaN written as ``NaN``, as Python's json module does)."""
        return json.dumps(self.to_dict(), **kwargs)


def analyze(
    model: nn.Module,
    *args: object,
    num_sequences: int = 2,
    max_tokens: int | None = 256,
    spectrum_k: int = 8,
    edge_samples: int | None = 4,
    edge_queries: int | None = 32,
    edge_lanczos_steps: int | None = 32,
    on_record: Callable[[AttentionRecord], object] | None = None,
    **kwargs: Any,
) -> Report:
    """Capture one forward pass of ``model(*args, **kwargs)`` and compute every per-layer diagnostic.

    Records are analysed as they stream out of the forward, so memory holds one layer's maps at a time. The values
    are :mod:`connmon.metrics.readings`' (one definition for training and post-hoc), with the edge isometry gap over
    more edges than in training (``edge_queries`` queries, ``edge_samples`` keys each: standard error at most 0.045
    per sequence at the defaults).

    Args:
        model: the model.
        *args: positional inputs of the forward.
        num_sequences: analyse the first this many sequences.
        max_tokens: at most this many leading tokens (see :func:`connmon.capture`).
        spectrum_k: eigenvalues of ``M / s`` kept per layer.
        edge_samples: keys drawn per query for ``edge_isometry_gap`` (None: every key).
        edge_queries: query rows drawn for it (None: every row; with ``edge_samples=None`` and
            ``edge_lanczos_steps=None``: exact, ``O(n^2 d^3)``).
        edge_lanczos_steps: Lanczos steps per edge (None: one decomposition per edge); see
            :func:`connmon.functional.edge_isometry_gap`.
        on_record: also called with each record once it is analysed (to keep a walk for a figure, or count
            progress).
        **kwargs: keyword inputs of the forward.

    Returns:
        A :class:`Report`.

    Raises:
        ValueError: as :func:`connmon.capture`.

    Examples:
        >>> import torch
        >>> import connmon
        >>> _ = torch.manual_seed(0)
        >>> layer = torch.nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, dropout=0.0, batch_first=True)
        >>> report = connmon.analyze(torch.nn.TransformerEncoder(layer, 2), torch.randn(2, 8, 16))
        >>> [layer["name"] for layer in report.to_dict()["layers"]]
        ['layers.0.self_attn', 'layers.1.self_attn']
        >>> report.model["reconstruction_error"] < 1e-5
        True
    """
    attention_layers(getattr(model, "_orig_mod", model))  # no readable attention: its clear error, before a forward
    report = Report()
    before: tuple[int, torch.Tensor] | None = None  # the previous record's index and walk, for depth_drift

    def consume(record: AttentionRecord) -> None:
        nonlocal before
        layer: dict[str, Any] = {"name": record.name, "index": record.index}
        walk = read_walk(record)
        transport, _ = read_transport(
            record, edge_samples=edge_samples, edge_queries=edge_queries, edge_lanczos_steps=edge_lanczos_steps
        )
        spectrum, largest = read_spectrum(record, k=spectrum_k)
        drift, walk_matrix, _ = read_drift(record, before[1] if before and before[0] == record.index - 1 else None)
        before = (record.index, walk_matrix)
        for names, values in ((WALK, walk), (TRANSPORT, transport), (SPECTRUM, spectrum), (DRIFT, drift)):
            for name, column in zip(names, values.unbind(-1), strict=True):  # what the training-time metrics average
                finite = column[torch.isfinite(column)]
                if name in LAYER_METRICS and finite.numel():
                    layer[name] = finite.double().mean().item()
        layer["connection_spectrum"] = [[[v.real, v.imag] for v in row.tolist()] for row in largest]
        report.layers.append(layer)
        if on_record is not None:
            on_record(record)

    capture(model, *args, num_sequences=num_sequences, max_tokens=max_tokens, on_record=consume, **kwargs)
    return report
