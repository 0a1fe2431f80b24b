"""What each diagnostic group reads from one AttentionRecord: ``(B_s, M)`` values, one row per sequence.

The accumulators of :mod:`connmon.metrics.diagnostics` average these over sampled sequences in training;
:func:`connmon.analyze` reports them for one forward. This module needs torch only (not torchmetrics, whose import
takes a second), so ``connmon analyze`` does not pay for the accumulators it does not use.

Examples:
    >>> import torch
    >>> import connmon
    >>> from connmon.metrics.readings import WALK, read_walk
    >>> layer = torch.nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)
    >>> (record,) = connmon.capture(torch.nn.TransformerEncoder(layer, 1), torch.randn(2, 8, 16))
    >>> values = read_walk(record)
    >>> tuple(values.shape) == (2, len(WALK)), float(values[:, WALK.index("stochasticity_gap")].max()) < 1e-6
    (True, True)
"""

from __future__ import annotations

import torch
from torch import Tensor

import connmon.functional as F
from connmon.capture import AttentionRecord

__all__ = [
    "DRIFT",
    "SPECTRUM",
    "TRANSPORT",
    "WALK",
    "per_sequence",
    "read_drift",
    "read_spectrum",
    "read_transport",
    "read_walk",
    "valid_queries",
]

WALK = (
    "stochasticity_gap",
    "attention_entropy",
    "attention_entropy_normalized",
    "reversibility_gap",
    "walk_spectral_gap",
    "max_attention_logit",
    "reconstruction_error",
)
TRANSPORT = (
    "head_isometry_gap",
    "ov_isometry_gap",
    "edge_isometry_gap",
    "transport_symmetry_gap",
    "transport_scale",
)
SPECTRUM = (
    "connection_spectral_radius",
    "connection_operator_norm",
    "connection_laplacian_gap",
    "ov_spectral_radius",
)
DRIFT = ("depth_drift", "time_drift", "transport_drift")


def per_sequence(value: Tensor, batch: int) -> Tensor:
    """A per-layer value (0-dim) or a per-sequence one (``(B_s,)``) as ``(B_s,)``."""
    return value.reshape(-1).expand(batch) if value.numel() == 1 else value


def valid_queries(record: AttentionRecord) -> Tensor:
    """``record.attn`` with the rows of padding tokens (keys no query may attend) set to 0.

    Every walk diagnostic leaves rows without an allowed key out, so the walk and transport metrics read the valid
    tokens only, as if the sequence had been recorded alone (the spectrum is unchanged by such rows already).

    Examples:
        >>> import torch
        >>> from connmon.capture import AttentionRecord
        >>> from connmon.metrics.readings import valid_queries
        >>> attn = torch.full((1, 1, 3, 3), 1 / 2).tril()  # token 2 is padding: no query attends it
        >>> attn[..., 0, 0] = 1
        >>> record = AttentionRecord("l", 0, attn, torch.zeros(1), torch.zeros(1, 1, 2), torch.zeros(1, 2, 1),
        ...     torch.zeros(2), torch.zeros(1, 3, 2), torch.zeros(1, 3, 2), torch.tensor([[True, True, False]]),
        ...     torch.tensor(0.0))
        >>> valid_queries(record)[0, 0].tolist()
        [[1.0, 0.0, 0.0], [0.5, 0.5, 0.0], [0.0, 0.0, 0.0]]
    """
    if record.key_mask is None:
        return record.attn
    return record.attn * record.key_mask[:, None, :, None].to(record.attn.dtype)


def read_walk(record: AttentionRecord) -> Tensor:
    """The :data:`WALK` columns: stochasticity, entropy, reversibility, spectral gap, max logit, reconstruction."""
    attn = valid_queries(record)  # padding queries are not part of the walk
    P = F.walk_matrix(attn)
    batch = P.shape[0]
    causal = (P.triu(1) == 0).all(dim=-1).all(dim=-1)  # the walk ends on the first token: 0 by the mask alone
    reversibility = F.reversibility_gap(P).masked_fill(causal, float("nan"))  # left out, never logged as 0
    columns = [
        F.stochasticity_gap(P),
        F.attention_entropy(attn),
        F.attention_entropy(attn, normalized=True),
        reversibility,
        F.walk_spectral_gap(P),
        record.max_logit,
        per_sequence(record.reconstruction_error, batch),
    ]
    return torch.stack([c.to(P.dtype) for c in columns], dim=-1)


def read_transport(
    record: AttentionRecord,
    *,
    edges: bool = True,
    edge_samples: int | None = 1,
    edge_queries: int | None = 16,
    edge_lanczos_steps: int | None = 32,
) -> tuple[Tensor, Tensor]:
    """The :data:`TRANSPORT` columns, and the per-head isometry gaps ``(H,)``.

    ``edges=False`` leaves the costly edge gap out (NaN); the edge options are those of
    :func:`connmon.functional.edge_isometry_gap` (``num_samples``, ``num_queries``, ``lanczos_steps``).
    """
    w_v, w_o = record.w_v, record.w_o
    batch = record.attn.shape[0]
    head_gaps = F.head_isometry_gap(w_v, w_o, reduction="none")
    if edges:
        edge_gaps = F.edge_isometry_gap(
            valid_queries(record),
            w_v,
            w_o,
            num_samples=edge_samples,
            num_queries=edge_queries,
            lanczos_steps=edge_lanczos_steps,
        )
    else:
        edge_gaps = torch.full((batch,), float("nan"), dtype=head_gaps.dtype, device=head_gaps.device)
    ov = record.ov_singular_values  # (d,): one SVD per record, for these and the spectrum's scale
    columns = [
        per_sequence(head_gaps.mean(), batch),
        per_sequence(F.isometry_gap(ov), batch),
        edge_gaps,
        per_sequence(F.transport_symmetry_gap(w_v, w_o), batch),
        per_sequence(ov.mean(dim=-1), batch),
    ]
    return torch.stack(columns, dim=-1), head_gaps


def read_spectrum(record: AttentionRecord, *, k: int = 8, max_restarts: int = 30) -> tuple[Tensor, Tensor]:
    """The :data:`SPECTRUM` columns, and the ``k`` largest walk-part eigenvalues ``(B_s, k)`` (NaN where uncertified).

    A value the Krylov solver did not certify within ``max_restarts`` restarts is NaN, left out of the means:
    Ritz values out of restarts are not measurements (see :class:`connmon.metrics.SpectrumMetrics`).
    """
    args = (record.attn, record.w_v, record.w_o)
    batch, n, d = record.attn.shape[0], record.attn.shape[-1], record.w_v.shape[-1]
    scale = record.ov_singular_values.mean(dim=-1)  # transport_scale, the record's one SVD
    ov = per_sequence(F.ov_spectral_radius(record.w_v, record.w_o, scale=scale), batch)
    if n < 2:
        nan = torch.full((batch,), float("nan"), dtype=record.attn.dtype, device=record.attn.device)
        largest = torch.full((batch, k), float("nan"), dtype=torch.complex64)
        return torch.stack([nan, nan, nan, ov.to(nan.dtype)], dim=-1), largest
    spectra = F.connection_spectra(*args, k=min(k, (n - 1) * d), max_restarts=max_restarts, scale=scale)
    largest = spectra.largest.masked_fill(~spectra.largest_converged, complex(float("nan"), float("nan")))
    columns = [
        largest.abs()[..., 0],
        F.connection_operator_norm(*args, scale=scale),
        (1 - spectra.rightmost.real).masked_fill(~spectra.rightmost_converged, float("nan")),
        ov,
    ]
    return torch.stack([c.to(record.attn.dtype) for c in columns], dim=-1), largest


def read_drift(
    record: AttentionRecord,
    previous_layer: Tensor | None = None,
    previous_walk: Tensor | None = None,
    previous_transport: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """The :data:`DRIFT` columns, and this record's walk ``P`` and transport ``T_bar`` (the next references).

    ``previous_layer`` is the walk of the layer before in the same forward, ``previous_walk`` and
    ``previous_transport`` this layer's at the previous sample; a missing reference, or one of another shape, gives
    NaN.
    """
    P = F.walk_matrix(valid_queries(record))
    T = F.ov_transport(record.w_v, record.w_o)
    batch, nan = P.shape[0], torch.full((P.shape[0],), float("nan"), dtype=P.dtype, device=P.device)
    depth = F.depth_drift(P, previous_layer) if previous_layer is not None and previous_layer.shape == P.shape else nan
    time = transport = nan
    if previous_walk is not None and previous_walk.shape == P.shape:  # may come from a checkpoint on another device
        time = F.time_drift(P, previous_walk.to(P.device))
    if previous_transport is not None and previous_transport.shape == T.shape:
        transport = per_sequence(F.transport_drift(T, previous_transport.to(T.device)), batch)
    return torch.stack([depth, time, transport.to(P.dtype)], dim=-1), P, T
