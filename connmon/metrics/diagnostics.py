"""The diagnostic groups of docs/diagnostics.md as torchmetrics accumulators, updated from AttentionRecords.

Each group delegates to :mod:`connmon.functional`; values are per sequence (a transport diagnostic, which depends
on the weights only, counts once per sequence so that every group averages over the same sequences). In a padded
batch every diagnostic reads a sequence's valid tokens only (:func:`connmon.metrics.readings.valid_queries`).

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

from torch import Tensor

from connmon.capture import AttentionRecord
from connmon.capture.session import warn_once
from connmon.metrics.layerwise import LayerwiseMean
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

__all__ = ["DriftMetrics", "SpectrumMetrics", "TransportMetrics", "WalkMetrics"]


class WalkMetrics(LayerwiseMean):
    """Walk diagnostics per layer: stochasticity, entropy, reversibility, spectral gap, max logit, reconstruction.

    Args:
        num_layers: number of captured attention layers.
        **kwargs: passed to ``torchmetrics.Metric``.
    """

    metrics: ClassVar[tuple[str, ...]] = WALK

    def measure(self, record: AttentionRecord) -> Tensor:  # noqa: D102
        return read_walk(record)


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

    metrics: ClassVar[tuple[str, ...]] = TRANSPORT

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
        values, self.last_head_gaps[record.index] = read_transport(
            record,
            edges=self.measure_edges,
            edge_samples=self.edge_samples,
            edge_queries=self.edge_queries,
            edge_lanczos_steps=self.edge_lanczos_steps,
        )
        return values


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

    metrics: ClassVar[tuple[str, ...]] = SPECTRUM

    def __init__(self, num_layers: int, k: int = 8, max_restarts: int = 30, **kwargs: object) -> None:
        super().__init__(num_layers, **kwargs)
        if k < 1:
            raise ValueError(f"k must be >= 1, got k={k}")
        if max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got max_restarts={max_restarts}")
        self.k, self.max_restarts = k, max_restarts
        self.last_spectra: dict[int, Tensor] = {}

    def measure(self, record: AttentionRecord) -> Tensor:  # noqa: D102
        values, self.last_spectra[record.index] = read_spectrum(record, k=self.k, max_restarts=self.max_restarts)
        return values


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

    metrics: ClassVar[tuple[str, ...]] = DRIFT

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
        previous_layer = None
        if self._depth_walk is not None and self._depth_walk[0] == record.index - 1:
            previous_layer = self._depth_walk[1]
        old_transport = self.previous_transports.get(record.index)
        values, P, T = read_drift(record, previous_layer, self.previous_walks.get(record.index), old_transport)
        if old_transport is not None and old_transport.shape != T.shape:  # not compared: read_drift gave NaN
            warn_once(
                f"connmon: the transport_drift reference of layer {record.index} (from a checkpoint?) has shape "
                f"{tuple(old_transport.shape)}, not this layer's {tuple(T.shape)}: it is dropped, and the drift starts "
                "again from this sample",
                key=("transport reference", record.index, tuple(old_transport.shape)),
            )
        self._depth_walk = (record.index, P)
        self.previous_walks[record.index] = P
        self.previous_transports[record.index] = T
        return values
