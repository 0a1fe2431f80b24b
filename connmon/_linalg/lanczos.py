"""Lanczos on many small symmetric operators at once, in lock-step: one batched matvec per step for all of them.

The edge isometry gap needs a spectral sum (``tr sqrt(X)``) of one ``d x d`` Gram map per edge. A decomposition of
each costs ``O(d^3)``; ``m`` Lanczos steps cost ``m`` matvecs per map, and all maps advance together, so a step is
one batched GEMM whatever their number. The ``m x m`` tridiagonal matrices then give Gauss quadrature rules
(Golub and Meurant): ``z^T f(X) z ~= ||z||^2 sum_j U_1j^2 f(theta_j)`` over the eigenpairs ``(theta_j, U_.j)``.

Plain three-term recurrence in float64 (no reorthogonalization): losing orthogonality duplicates converged Ritz
values but leaves the quadrature accurate, which is all it is used for. A map whose Krylov space is invariant
before ``m`` steps (its next vector vanishes) stops there: its later coefficients are 0, which decouples them from
the first node, so the rule stays exact.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from connmon._linalg import finite_or_zero

_BREAKDOWN = 1e-12  # a new vector this small relative to ||X q|| means the Krylov space is invariant


def lanczos(matvec: Callable[[Tensor], Tensor], start: Tensor, steps: int) -> Tensor:
    """The ``(N, m, m)`` Lanczos tridiagonal matrices of ``N`` symmetric operators from ``start (N, r)``.

    ``matvec`` maps ``(N, r)`` to ``(N, r)`` (row ``i`` through operator ``i``) and is called ``m = steps`` times.
    Computed in float64 on ``start``'s device.

    Examples:
        >>> import torch
        >>> from connmon._linalg.lanczos import gauss_quadrature, lanczos
        >>> gen = torch.Generator().manual_seed(0)
        >>> a = torch.randn(2, 6, 6, dtype=torch.float64, generator=gen)
        >>> x = a @ a.mT  # two 6 x 6 symmetric positive definite maps
        >>> z = torch.randn(2, 6, dtype=torch.float64, generator=gen)
        >>> rule = lanczos(lambda v: (x @ v.unsqueeze(-1)).squeeze(-1), z, steps=6)
        >>> estimate = gauss_quadrature(rule, z.norm(dim=-1) ** 2, torch.sqrt)
        >>> root = torch.stack([zi @ (v * w.sqrt()) @ v.mT @ zi for (w, v), zi in zip(map(torch.linalg.eigh, x), z)])
        >>> bool(torch.allclose(estimate, root))  # m = r steps: exact
        True
    """
    alpha, beta = _recurrence(matvec, start, steps)
    return _tridiagonal(alpha, beta[:, :-1])


def largest_eigenvalue(
    matvec: Callable[[Tensor], Tensor],
    start: Tensor,
    steps: int,
    tol: float,
    dtype: torch.dtype = torch.float64,
    inner: Callable[[Tensor, Tensor], Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """The largest eigenvalue of each of ``N`` symmetric operators after ``steps`` Lanczos steps; whether it converged.

    The top Ritz value of the tridiagonal matrix never exceeds the operator's largest eigenvalue (up to round-off) and
    its distance to an eigenvalue is at most the residual ``|beta_m u_m|`` of its Ritz vector (Parlett); converged
    means that residual is within ``tol`` times the value (the Krylov-Schur solver's test). One host
    synchronization is left to the caller (reading the flags). The vectors are kept in ``dtype`` (float32 for
    operators too large to hold several float64 copies of), the recurrence's coefficients in float64. ``inner(x, y)``,
    the ``(N,)`` float64 inner products of two ``(N, r)`` blocks of vectors, replaces the plain one where the vectors
    are parts of larger ones (sharded across processes: the parts' products added across them).

    Returns:
        ``(values (N,), converged (N,) bool)``, float64.

    Examples:
        >>> import torch
        >>> from connmon._linalg.lanczos import largest_eigenvalue
        >>> gen = torch.Generator().manual_seed(0)
        >>> a = torch.randn(3, 40, 40, dtype=torch.float64, generator=gen)
        >>> x = a @ a.mT
        >>> top, ok = largest_eigenvalue(lambda v: (x @ v.unsqueeze(-1)).squeeze(-1), torch.ones(3, 40), 30, 1e-10)
        >>> bool(ok.all()), bool(torch.allclose(top, torch.linalg.eigvalsh(x)[:, -1]))
        (True, True)
    """
    alpha, beta = _recurrence(matvec, start, steps, dtype, inner=inner)
    nodes, vectors = torch.linalg.eigh(finite_or_zero(_tridiagonal(alpha, beta[:, :-1]))[0])
    residual = (beta[:, -1] * vectors[:, -1, -1]).abs()
    finite = torch.isfinite(alpha).all(-1) & torch.isfinite(beta).all(-1)
    values = torch.where(finite, nodes[:, -1], float("nan"))
    return values, finite & (residual <= tol * values.abs())


def _recurrence(
    matvec: Callable[[Tensor], Tensor],
    start: Tensor,
    steps: int,
    dtype: torch.dtype = torch.float64,
    inner: Callable[[Tensor, Tensor], Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """The three-term recurrence: ``alpha (N, m)`` and ``beta (N, m)``, ``beta[:, -1]`` the next vector's norm."""

    def norm_of(x: Tensor) -> Tensor:
        return x.norm(dim=-1, dtype=torch.float64) if inner is None else inner(x, x).sqrt()

    start = start.to(dtype)
    count = start.shape[0]
    alpha = start.new_zeros(count, steps, dtype=torch.float64)
    beta = start.new_zeros(count, steps, dtype=torch.float64)
    norm = start.norm(dim=-1, keepdim=True) if inner is None else norm_of(start).to(dtype).unsqueeze(-1)
    q = torch.where(norm > 0, start / norm.clamp(min=torch.finfo(start.dtype).tiny), 0)
    previous = torch.zeros_like(q)
    for j in range(steps):
        w = matvec(q).to(dtype)  # updated in place below: three vectors held, not more (operators of a model's size)
        scale = norm_of(w)
        a = (w * q).sum(dim=-1, dtype=torch.float64) if inner is None else inner(w, q)
        w.addcmul_(a.to(dtype).unsqueeze(-1), q, value=-1)
        if j:
            w.addcmul_(beta[:, j - 1].to(dtype).unsqueeze(-1), previous, value=-1)
        b = norm_of(w)
        ended = b <= _BREAKDOWN * scale
        alpha[:, j] = a
        beta[:, j] = torch.where(ended, 0, b)
        norm = b.clamp(min=torch.finfo(dtype).tiny).to(dtype)
        previous, q = q, w.div_(norm.unsqueeze(-1)).masked_fill_(ended.unsqueeze(-1), 0)
    return alpha, beta


def _tridiagonal(alpha: Tensor, off: Tensor) -> Tensor:
    return torch.diag_embed(alpha) + torch.diag_embed(off, offset=1) + torch.diag_embed(off, offset=-1)


def gauss_quadrature(tridiagonal: Tensor, weight: Tensor, function: Callable[[Tensor], Tensor]) -> Tensor:
    """``weight * sum_j U_1j^2 f(theta_j)``: the Gauss rule for ``z^T f(X) z`` with ``weight = ||z||^2``: ``(N,)``.

    A non-finite tridiagonal matrix gives NaN (LAPACK is never called on it).
    """
    finite = torch.isfinite(tridiagonal).flatten(-2).all(-1)
    nodes, vectors = torch.linalg.eigh(torch.where(finite[:, None, None], tridiagonal, 0))
    rule = weight * (vectors[:, 0, :] ** 2 * function(nodes)).sum(dim=-1)
    return torch.where(finite, rule, float("nan"))
