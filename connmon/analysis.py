"""Every per-layer diagnostic of DESIGN section 1 for one forward pass: ``connmon.analyze`` and its Report."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn

import connmon.functional as F
from connmon.capture import AttentionRecord, capture

__all__ = ["LAYER_METRICS", "Report", "analyze", "diagnose_record"]

LAYER_METRICS = (
    "reconstruction_error",
    "stochasticity_gap",
    "attention_entropy",
    "attention_entropy_normalized",
    "reversibility_gap",
    "walk_spectral_gap",
    "max_attention_logit",
    "head_isometry_gap",
    "ov_isometry_gap",
    "edge_isometry_gap",
    "transport_symmetry_gap",
    "transport_scale",
    "connection_spectral_radius",
    "connection_operator_norm",
    "connection_laplacian_gap",
    "depth_drift",
)


@dataclass
class Report:
    """Per-layer diagnostics of one forward pass, and their model-level means.

    ``layers[i]`` holds ``name``, ``index``, every metric of :data:`LAYER_METRICS` (the mean over the sampled
    sequences; ``depth_drift`` is absent on the first layer) and ``connection_spectrum`` (per sequence, the k
    eigenvalues of ``M / s`` as ``[real, imag]`` pairs). ``model`` holds the mean of each metric over layers.
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


def _mean(values: Tensor) -> float:
    return values.float().mean().item()


def diagnose_record(
    record: AttentionRecord, previous_walk: Tensor | None = None, *, spectrum_k: int = 8, edge_samples: int | None = 4
) -> dict[str, Any]:
    """Every diagnostic of one record, averaged over its sequences.

    Args:
        record: an :class:`~connmon.capture.AttentionRecord`.
        previous_walk: the previous layer's walk on the same input, ``(B_s, n, n)``, for ``depth_drift``.
        spectrum_k: eigenvalues of ``M / s`` to keep.
        edge_samples: keys drawn per query for ``edge_isometry_gap`` (None: exact, ``O(n^2 d^3)``).

    Returns:
        A dict of metric name to value (floats; the spectrum as ``[[real, imag], ...]`` per sequence).

    Example:
        >>> import torch
        >>> import connmon
        >>> from connmon.analysis import diagnose_record
        >>> mha = torch.nn.MultiheadAttention(8, 2, batch_first=True)
        >>> x = torch.randn(1, 6, 8)
        >>> (record,) = connmon.capture(mha, x, x, x)
        >>> values = diagnose_record(record, spectrum_k=3)
        >>> values["stochasticity_gap"] < 1e-6, len(values["connection_spectrum"][0])
        (True, 3)
    """
    attn, w_v, w_o = record.attn, record.w_v, record.w_o
    n, d = attn.shape[-1], w_v.shape[-1]
    walk = F.walk_matrix(attn)
    k = min(spectrum_k, n * d)
    spectrum = F.connection_spectrum(attn, w_v, w_o, k=k)
    values = {
        "reconstruction_error": record.reconstruction_error.item(),
        "stochasticity_gap": _mean(F.stochasticity_gap(walk)),
        "attention_entropy": _mean(F.attention_entropy(attn)),
        "attention_entropy_normalized": _mean(F.attention_entropy(attn, normalized=True)),
        "reversibility_gap": _mean(F.reversibility_gap(walk)),
        "walk_spectral_gap": _mean(F.walk_spectral_gap(walk)),
        "max_attention_logit": _mean(record.max_logit),
        "head_isometry_gap": F.head_isometry_gap(w_v, w_o).item(),
        "ov_isometry_gap": F.ov_isometry_gap(w_v, w_o).item(),
        "edge_isometry_gap": _mean(F.edge_isometry_gap(attn, w_v, w_o, num_samples=edge_samples)),
        "transport_symmetry_gap": F.transport_symmetry_gap(w_v, w_o).item(),
        "transport_scale": F.transport_scale(w_v, w_o).item(),
        "connection_spectral_radius": _mean(spectrum.abs()[..., 0]),
        "connection_operator_norm": _mean(F.connection_operator_norm(attn, w_v, w_o)),
        "connection_laplacian_gap": _mean(F.connection_laplacian_gap(attn, w_v, w_o)),
    }
    if previous_walk is not None and previous_walk.shape == walk.shape:
        values["depth_drift"] = _mean(F.depth_drift(walk, previous_walk))
    values["connection_spectrum"] = [[[v.real, v.imag] for v in row.tolist()] for row in spectrum.reshape(-1, k)]
    return values


def analyze(
    model: nn.Module,
    *args: object,
    num_sequences: int = 2,
    max_tokens: int | None = 256,
    spectrum_k: int = 8,
    edge_samples: int | None = 4,
    **kwargs: object,
) -> Report:
    """Capture one forward pass of ``model(*args, **kwargs)`` and compute every per-layer diagnostic.

    Records are analysed as they stream out of the forward, so memory holds one layer's maps at a time.

    Args:
        model: the model.
        *args: positional inputs of the forward.
        num_sequences: analyse the first this many sequences.
        max_tokens: at most this many leading tokens (see :func:`connmon.capture`).
        spectrum_k: eigenvalues of ``M / s`` kept per layer.
        edge_samples: keys drawn per query for ``edge_isometry_gap`` (None: exact).
        **kwargs: keyword inputs of the forward.

    Returns:
        A :class:`Report`.

    Raises:
        ValueError: as :func:`connmon.capture`.

    Example:
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
    report, previous = Report(), []

    def consume(record: AttentionRecord) -> None:
        values = diagnose_record(
            record, previous[-1] if previous else None, spectrum_k=spectrum_k, edge_samples=edge_samples
        )
        report.layers.append({"name": record.name, "index": record.index, **values})
        previous[:] = [F.walk_matrix(record.attn)]  # keep one layer's walk for the depth drift

    capture(model, *args, num_sequences=num_sequences, max_tokens=max_tokens, on_record=consume, **kwargs)
    return report
