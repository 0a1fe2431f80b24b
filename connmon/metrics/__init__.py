"""torchmetrics accumulators of the connection-walk diagnostics, per layer, synced under DDP.

Examples:
    >>> from connmon.metrics import SpectrumMetrics
    >>> SpectrumMetrics(num_layers=12).metrics
    ('connection_spectral_radius', 'connection_operator_norm', 'connection_laplacian_gap', 'ov_spectral_radius')
"""

from connmon.metrics.diagnostics import DriftMetrics, SpectrumMetrics, TransportMetrics, WalkMetrics
from connmon.metrics.layerwise import LayerwiseMean

__all__ = ["DriftMetrics", "LayerwiseMean", "SpectrumMetrics", "TransportMetrics", "WalkMetrics"]
