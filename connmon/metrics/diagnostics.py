"""The diagnostic groups of docs/diagnostics.md as torchmetrics accumulators, updated from AttentionRecords.

Each group delegates to :mod:`connmon.functional`; values are per sequence (a transport diagnostic, which depends
on the weights only, counts once per sequence so that every group averages over the same sequences). In a padded
batch every diagnostic reads a sequence's valid tokens only (:func:`connmon.metrics.layerwise.valid_queries`).

Examples:
    >>> import torch
    >>> import connmon
    >>> from connmon.metrics import WalkMetrics
    >>> _ = torch.manual_seed(0)
    >>> layer = torch.nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)
    >>> model = torch.nn.TransformerEncoder(layer, 2)
    >>> walk = WalkMetrics(num_layers=2)
    >>> for step in range(3):  # a plain training loop would capture on its sampled steps
    ...     for record in connmon.capture(model, torch.randn(4, 8, 16)):
    ...         walk.update(record)
    >>> values = walk.compute()
    >>> tuple(values["attention_entropy"].shape), float(values["stochasticity_gap/all"]) < 1e-6
    ((2,), True)
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

import connmon.functional as F
from connmon.capture import AttentionRecord
from connmon.capture.session import warn_once
from connmon.metrics.layerwise import LayerwiseMean, per_sequence, valid_queries

__all__ = ["DriftMetrics", "SpectrumMetrics", "TransportMetrics", "WalkMetrics"]


class WalkMetrics(LayerwiseMean):
    """Walk diagnostics per layer: stochasticity, entropy, reversibility, spectral gap, max logit, reconstruction.

    Args:
        num_layers: number of captured attention layers.
        **kwargs: passed to ``torchmetrics.Metric``.
    """

    metrics: ClassVar[tuple[str, ...]] = (
        "stochasticity_gap",
        "attention_entropy",
        "attention_entropy_normalized",
        "reversibility_gap",
        "walk_spectral_gap",
        "max_attention_logit",
        "reconstruction_error",
    )

    def measure(self, record: AttentionRecord) -> Tensor:  # noqa: D102
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


class TransportMetrics(LayerwiseMean):
    """Transport diagnostics per layer: head, OV and edge isometry gaps, symmetry gap, transport scale.

    Per-head gaps of the latest record of each layer are kept in ``last_head_gaps`` for histograms. The edge gap
    is the costly column (SVDs per sampled edge); set ``measure_edges = False`` to leave it out of the updates
    that follow (it then counts nothing for them), as ConnectionMonitor does between its full samples.

    Args:
        num_layers: number of captured attention layers.
        edge_samples: keys drawn per query for ``edge_isometry_gap`` (None: every key).
        edge_queries: query rows drawn for it (None: every row); with both None and ``edge_lanczos_steps=None`` it
            is exact, ``O(n^2 d^3)``. The defaults (1 key for each of 16 queries) keep it affordable in training,
            with standard error at most 0.125.
        edge_lanczos_steps: Lanczos steps per edge for its ``sum s`` (None: one decomposition of ``d x d`` per
            edge); see :func:`connmon.functional.edge_isometry_gap`.
        **kwargs: passed to ``torchmetrics.Metric``.
    """

    metrics: ClassVar[tuple[str, ...]] = (
        "head_isometry_gap",
        "ov_isometry_gap",
        "edge_isometry_gap",
        "transport_symmetry_gap",
        "transport_scale",
    )

    def __init__(
        self,
        num_layers: int,
        edge_samples: int | None = 1,
        edge_queries: int | None = 16,
        edge_lanczos_steps: int | None = 32,
        **kwargs: object,
    ) -> None:
        super().__init__(num_layers, **kwargs)
        self.edge_samples, self.edge_queries = edge_samples, edge_queries
        self.edge_lanczos_steps = edge_lanczos_steps
        self.measure_edges = True
        self.last_head_gaps: dict[int, Tensor] = {}  # (H,) per layer, the latest record, for histograms

    def measure(self, record: AttentionRecord) -> Tensor:  # noqa: D102
        w_v, w_o = record.w_v, record.w_o
        batch = record.attn.shape[0]
        head_gaps = F.head_isometry_gap(w_v, w_o, reduction="none")
        self.last_head_gaps[record.index] = head_gaps
        if self.measure_edges:
            edges = F.edge_isometry_gap(
                valid_queries(record),
                w_v,
                w_o,
                num_samples=self.edge_samples,
                num_queries=self.edge_queries,
                lanczos_steps=self.edge_lanczos_steps,
            )
        else:
            edges = torch.full((batch,), float("nan"), dtype=head_gaps.dtype, device=head_gaps.device)
        ov = F.ov_singular_values(w_v, w_o)  # (d,): one SVD for ov_isometry_gap and transport_scale
        columns = [
            per_sequence(head_gaps.mean(), batch),
            per_sequence(F.isometry_gap(ov), batch),
            edges,
            per_sequence(F.transport_symmetry_gap(w_v, w_o), batch),
            per_sequence(ov.mean(dim=-1), batch),
        ]
        return torch.stack(columns, dim=-1)


class SpectrumMetrics(LayerwiseMean):
    """Connection-operator diagnostics per layer, of the walk part of ``M / s`` and of its constant-field part.

    Spectral radius, operator norm and Laplacian gap are the walk part's (the quotient by constant fields, see
    :func:`connmon.functional.connection_spectrum`); ``ov_spectral_radius`` is ``rho(T_bar) / s``, the weight-only
    part. The spectral radius comes from the ``k`` walk eigenvalues of largest modulus, which are kept per layer in
    ``last_spectra`` (``(B_s, k)`` complex, the latest record of each layer) for histograms and figures. A
    one-token sequence has no walk part (NaN, left out of the means). On bidirectional layers the spectrum comes
    from a restarted Krylov solver, run from two independent starts (three where two disagree); a value that has not
    met its tolerance after ``max_restarts`` restarts, or whose rank no two solves agree on, is left out too (the
    radius when the largest eigenvalue is not certified, the gap when the rightmost is not, each such entry of the
    spectrum), because a Ritz value can be far from any eigenvalue, and a converged one can have skipped another
    above it. That happens when the top eigenvalues are nearly tied, as in a randomly initialized layer whose
    attention is near uniform; trained layers converge in about 15 restarts.

    Args:
        num_layers: number of captured attention layers.
        k: eigenvalues kept per sequence.
        max_restarts: Krylov restarts per solve before its values count as unmeasured.
        **kwargs: passed to ``torchmetrics.Metric``.
    """

    metrics: ClassVar[tuple[str, ...]] = (
        "connection_spectral_radius",
        "connection_operator_norm",
        "connection_laplacian_gap",
        "ov_spectral_radius",
    )

    def __init__(self, num_layers: int, k: int = 8, max_restarts: int = 30, **kwargs: object) -> None:
        super().__init__(num_layers, **kwargs)
        if k < 1:
            raise ValueError(f"k must be >= 1, got k={k}")
        if max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got max_restarts={max_restarts}")
        self.k, self.max_restarts = k, max_restarts
        self.last_spectra: dict[int, Tensor] = {}

    def measure(self, record: AttentionRecord) -> Tensor:  # noqa: D102
        args = (record.attn, record.w_v, record.w_o)
        batch, n, d = record.attn.shape[0], record.attn.shape[-1], record.w_v.shape[-1]
        scale = F.transport_scale(record.w_v, record.w_o)  # weight-only: once for the three diagnostics
        ov = per_sequence(F.ov_spectral_radius(record.w_v, record.w_o, scale=scale), batch)
        if n < 2:
            nan = torch.full((batch,), float("nan"), dtype=record.attn.dtype, device=record.attn.device)
            self.last_spectra[record.index] = torch.full((batch, self.k), float("nan"), dtype=torch.complex64)
            return torch.stack([nan, nan, nan, ov.to(nan.dtype)], dim=-1)
        spectra = F.connection_spectra(*args, k=min(self.k, (n - 1) * d), max_restarts=self.max_restarts, scale=scale)
        # Ritz values of a Krylov solve out of restarts are not measurements: NaN, left out of the means
        largest = spectra.largest.masked_fill(~spectra.largest_converged, complex(float("nan"), float("nan")))
        self.last_spectra[record.index] = largest  # (B_s, k)
        columns = [
            largest.abs()[..., 0],
            F.connection_operator_norm(*args, scale=scale),
            (1 - spectra.rightmost.real).masked_fill(~spectra.rightmost_converged, float("nan")),
            ov,
        ]
        return torch.stack([c.to(record.attn.dtype) for c in columns], dim=-1)


class DriftMetrics(LayerwiseMean):
    """Drift per layer: depth drift (against the previous layer), time and transport drift (against the last sample).

    ``depth_drift`` compares a record with the previous layer's record of the same forward; ``time_drift`` and
    ``transport_drift`` compare it with this layer's previous sample (pass the same probe input every time). The
    previous walk and transport of each layer are kept between updates (not synced: each rank compares its own
    sequences, and the synced means then cover all of them) and travel in ``state_dict()`` as the module's extra
    state, so a resumed run continues its time drift. Nothing to compare against yet counts nothing.

    Args:
        num_layers: number of captured attention layers.
        **kwargs: passed to ``torchmetrics.Metric``.
    """

    metrics: ClassVar[tuple[str, ...]] = ("depth_drift", "time_drift", "transport_drift")

    def __init__(self, num_layers: int, **kwargs: object) -> None:
        super().__init__(num_layers, **kwargs)
        self.previous_walks: dict[int, Tensor] = {}
        self.previous_transports: dict[int, Tensor] = {}
        self._depth_walk: tuple[int, Tensor] | None = None

    def get_extra_state(self) -> dict:
        """The previous sample's walks and transports, per layer (saved with ``state_dict()``)."""
        return {"walks": dict(self.previous_walks), "transports": dict(self.previous_transports)}

    def set_extra_state(self, state: dict) -> None:
        """Restore what :meth:`get_extra_state` saved."""
        self.previous_walks = dict(state.get("walks", {}))
        self.previous_transports = dict(state.get("transports", {}))

    def measure(self, record: AttentionRecord) -> Tensor:  # noqa: D102
        P = F.walk_matrix(valid_queries(record))
        T = F.ov_transport(record.w_v, record.w_o)
        batch, nan = P.shape[0], torch.full((P.shape[0],), float("nan"), dtype=P.dtype, device=P.device)
        depth = nan
        if self._depth_walk is not None and self._depth_walk[0] == record.index - 1:
            if self._depth_walk[1].shape == P.shape:
                depth = F.depth_drift(P, self._depth_walk[1])
        old_walk = self.previous_walks.get(record.index)  # may come from a checkpoint saved on another device
        time = F.time_drift(P, old_walk.to(P.device)) if old_walk is not None and old_walk.shape == P.shape else nan
        old_transport = self.previous_transports.get(record.index)
        if old_transport is not None and old_transport.shape != T.shape:
            warn_once(
                f"connmon: the transport_drift reference of layer {record.index} (from a checkpoint?) has shape "
                f"{tuple(old_transport.shape)}, not this layer's {tuple(T.shape)}: it is dropped, and the drift starts "
                "again from this sample",
                key=("transport reference", record.index, tuple(old_transport.shape)),
            )
            old_transport = None
        transport = nan
        if old_transport is not None:
            transport = per_sequence(F.transport_drift(T, old_transport.to(T.device)), batch)
        self._depth_walk = (record.index, P)
        self.previous_walks[record.index] = P
        self.previous_transports[record.index] = T
        return torch.stack([depth, time, transport.to(P.dtype)], dim=-1)
