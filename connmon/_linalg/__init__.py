"""Dense linear algebra that never crashes on non-finite input.

LAPACK's eigenvalue and SVD drivers raise (SVD) or even segfault (eigvals, in MKL's GEBAL) when a matrix holds
NaN or Inf. These wrappers solve a zeroed copy of each non-finite matrix and put NaN in its results, with
``torch.where`` instead of a host-side branch, so they add no GPU synchronization.
"""

from __future__ import annotations

import torch
from torch import Tensor


def finite_or_zero(matrix: Tensor) -> tuple[Tensor, Tensor]:
    finite = torch.isfinite(matrix).flatten(-2).all(-1)  # (*,)
    return torch.where(finite[..., None, None], matrix, torch.zeros_like(matrix)), finite


def eigvals(matrix: Tensor) -> Tensor:
    """``torch.linalg.eigvals`` of ``(*, m, m)``; NaN eigenvalues for a non-finite matrix."""
    clean, finite = finite_or_zero(matrix)
    values = torch.linalg.eigvals(clean)
    return torch.where(finite[..., None], values, torch.full_like(values, float("nan")))


def svdvals(matrix: Tensor) -> Tensor:
    """``torch.linalg.svdvals`` of ``(*, m, k)``; NaN singular values for a non-finite matrix."""
    clean, finite = finite_or_zero(matrix)
    values = torch.linalg.svdvals(clean)
    return torch.where(finite[..., None], values, torch.full_like(values, float("nan")))


def eigvalsh(matrix: Tensor) -> Tensor:
    """``torch.linalg.eigvalsh`` of symmetric ``(*, m, m)``, ascending; NaN eigenvalues for a non-finite matrix."""
    clean, finite = finite_or_zero(matrix)
    values = torch.linalg.eigvalsh(clean)
    return torch.where(finite[..., None], values, torch.full_like(values, float("nan")))


def gram_svdvals(matrix: Tensor) -> Tensor:
    """Singular values of ``(*, m, m)``, descending, from ``eigvalsh`` of the float64 Gram matrix ``X X^T``.

    About 1.5x faster than ``svdvals`` on CPU for batches of 128 x 128; float64 keeps the error of each value at
    about ``sqrt(eps_64) s_max = 1.5e-8 s_max``, below float32 resolution; float64 input, where that is not
    below resolution, goes to ``svdvals``. NaN for a non-finite matrix.
    """
    if matrix.dtype == torch.float64:
        return svdvals(matrix)
    wide = matrix.to(torch.float64)
    values = eigvalsh(wide @ wide.mT).clamp(min=0).sqrt().flip(-1)
    return values.to(matrix.dtype)


def spectral_norm(matrix: Tensor) -> Tensor:
    """Largest singular value of ``(*, m, k)``; NaN for a non-finite matrix."""
    return svdvals(matrix)[..., 0]


def safe_divide(numerator: Tensor, denominator: Tensor) -> Tensor:
    """``numerator / denominator`` with ``0 / 0 = 0`` (a zero quantity has zero relative size); NaN propagates."""
    zero = numerator == 0
    return torch.where(zero, torch.zeros_like(numerator), numerator / torch.where(zero, 1, denominator))


def frobenius(matrix: Tensor) -> Tensor:
    """Frobenius norm over the last two dims."""
    return torch.linalg.matrix_norm(matrix, ord="fro")
