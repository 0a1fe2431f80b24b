"""How the walk and the transport move across depth and across training time (docs/diagnostics.md, "Drift").

All three drifts are the relative Frobenius change ``||X - X_prev||_F / ||X||_F`` over the last two dims;
they differ in what is compared. A change between two zero matrices is 0; NaN propagates.
"""

from __future__ import annotations

from torch import Tensor

from connmon._linalg import frobenius, safe_divide
from connmon.functional._checks import as_float, promote, shape

__all__ = ["depth_drift", "time_drift", "transport_drift"]


def _relative_change(current: Tensor, previous: Tensor, name: str) -> Tensor:
    current, previous = promote(as_float(current, name), as_float(previous, f"{name}_previous"))
    if current.ndim < 2 or current.shape[-2:] != previous.shape[-2:]:
        raise ValueError(
            f"{name} and {name}_previous must be (*, m, m) matrices of one size, "
            f"got {name}{shape(current)} and {name}_previous{shape(previous)}"
        )
    return safe_divide(frobenius(current - previous), frobenius(current))


def depth_drift(walk: Tensor, walk_previous_layer: Tensor) -> Tensor:
    """``||P_l - P_{l-1}||_F / ||P_l||_F``: how much layer ``l``'s walk differs from layer ``l-1``'s on one input.

    Args:
        walk: ``P_l``, ``(*, n, n)``.
        walk_previous_layer: ``P_{l-1}`` on the same input, ``(*, n, n)``.

    Returns:
        ``(*,)``.

    Raises:
        ValueError: if the shapes differ in their last two dims.

    Examples:
        >>> import torch
        >>> from connmon.functional import depth_drift
        >>> P1, P2 = torch.eye(2), torch.full((2, 2), 0.5)
        >>> depth_drift(P2, P1)
        tensor(1.)
    """
    return _relative_change(walk, walk_previous_layer, "walk")


def time_drift(walk: Tensor, walk_previous_sample: Tensor) -> Tensor:
    """``||P_l(t) - P_l(t')||_F / ||P_l(t)||_F`` between consecutive samples on the same probe input.

    Args:
        walk: ``P_l(t)``, ``(*, n, n)``.
        walk_previous_sample: ``P_l(t')`` from the previous sample of the same layer and input, ``(*, n, n)``.

    Returns:
        ``(*,)``.

    Raises:
        ValueError: if the shapes differ in their last two dims.

    Examples:
        >>> import torch
        >>> from connmon.functional import time_drift
        >>> P = torch.full((3, 3), 1 / 3)
        >>> time_drift(P, P)
        tensor(0.)
    """
    return _relative_change(walk, walk_previous_sample, "walk")


def transport_drift(ov_transport: Tensor, ov_transport_previous_sample: Tensor) -> Tensor:
    """``||T_bar(t) - T_bar(t')||_F / ||T_bar(t)||_F``: the OV transport's change between consecutive samples.

    Args:
        ov_transport: ``T_bar(t)``, ``(*, d, d)`` (see :func:`connmon.functional.ov_transport`).
        ov_transport_previous_sample: ``T_bar(t')``, ``(*, d, d)``.

    Returns:
        ``(*,)``.

    Raises:
        ValueError: if the shapes differ in their last two dims.

    Examples:
        >>> import torch
        >>> from connmon.functional import transport_drift
        >>> transport_drift(2 * torch.eye(3), torch.eye(3))
        tensor(0.5000)
    """
    return _relative_change(ov_transport, ov_transport_previous_sample, "ov_transport")
