"""Pure tensor math of the connection walk (docs/diagnostics.md): no state, no hooks, no Lightning.

Every function runs on its inputs' device, is batched over leading dims, keeps float32/float64 inputs in their
dtype and upcasts float16/bfloat16 to float32. Non-finite input gives NaN results and never raises or hangs.

Examples:
    >>> import torch
    >>> import connmon.functional as F
    >>> _ = torch.manual_seed(0)
    >>> attn = torch.randn(4, 6, 6).softmax(-1)  # H=4 heads, n=6 tokens
    >>> w_v, w_o = torch.randn(4, 2, 8), torch.randn(4, 8, 2)  # d_h=2, d=8
    >>> P = F.walk_matrix(attn)
    >>> float(F.stochasticity_gap(P)) < 1e-6
    True
    >>> F.connection_spectrum(attn, w_v, w_o, k=3).shape
    torch.Size([3])
"""

from connmon.functional.drift import depth_drift, time_drift, transport_drift
from connmon.functional.laplacian import connection_laplacian_distance, edge_compatibility_gap
from connmon.functional.operator import connection_matvec, connection_operator, walk_basis
from connmon.functional.spectrum import (
    Spectra,
    SpectrumResult,
    connection_laplacian_gap,
    connection_operator_norm,
    connection_spectra,
    connection_spectral_radius,
    connection_spectrum,
    ov_spectral_radius,
)
from connmon.functional.transport import (
    edge_isometry_gap,
    head_isometry_gap,
    isometry_gap,
    ov_isometry_gap,
    ov_singular_values,
    ov_transport,
    transport_scale,
    transport_singular_values,
    transport_symmetry_gap,
)
from connmon.functional.walk import (
    attention_entropy,
    max_attention_logit,
    reversibility_gap,
    stationary_distribution,
    stochasticity_gap,
    walk_matrix,
    walk_spectral_gap,
)

__all__ = [
    "Spectra",
    "SpectrumResult",
    "attention_entropy",
    "connection_laplacian_distance",
    "connection_laplacian_gap",
    "connection_matvec",
    "connection_operator",
    "connection_operator_norm",
    "connection_spectra",
    "connection_spectral_radius",
    "connection_spectrum",
    "depth_drift",
    "edge_compatibility_gap",
    "edge_isometry_gap",
    "head_isometry_gap",
    "isometry_gap",
    "max_attention_logit",
    "ov_isometry_gap",
    "ov_singular_values",
    "ov_spectral_radius",
    "ov_transport",
    "reversibility_gap",
    "stationary_distribution",
    "stochasticity_gap",
    "time_drift",
    "transport_drift",
    "transport_scale",
    "transport_singular_values",
    "transport_symmetry_gap",
    "walk_basis",
    "walk_matrix",
    "walk_spectral_gap",
]
