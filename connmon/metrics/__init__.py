"""torchmetrics accumulators of the connection-walk diagnostics, per layer, synced under DDP.

What each group reads from one record is :mod:`connmon.metrics.readings`, which needs torch only; the accumulators
(and torchmetrics, whose import takes a second) are imported on first use.

Examples:
    >>> from connmon.metrics import SpectrumMetrics
    >>> SpectrumMetrics(num_layers=12).metrics
    ('connection_spectral_radius', 'connection_operator_norm', 'connection_laplacian_gap', 'ov_spectral_radius')
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from connmon.metrics.diagnostics import DriftMetrics, SpectrumMetrics, TransportMetrics, WalkMetrics
    from connmon.metrics.layerwise import LayerwiseMean

__all__ = ["DriftMetrics", "LayerwiseMean", "SpectrumMetrics", "TransportMetrics", "WalkMetrics"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'connmon.metrics' has no attribute {name!r}")
    module = importlib.import_module(
        "connmon.metrics.layerwise" if name == "LayerwiseMean" else "connmon.metrics.diagnostics"
    )
    value = getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
