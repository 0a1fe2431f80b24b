"""The connection walk operator ``M = sum_h kron(A^h, T_h)``: its action on a field, its dense form, its walk part.

``M`` acts on token-major vector fields ``X`` (``n x d``, flat index ``i * d + a``) as ``M(X) = sum_h A^h X T_h^T``.
The walk part is ``M`` on the quotient by constant fields: in the orthonormal basis :func:`walk_basis` of the
mean-zero fields it is ``sum_h kron(U^T A^h U, T_h)`` (:mod:`connmon.functional.spectrum` reads its eigenvalues).

Shapes: ``attn (*, H, n, n)``, ``w_v (*, H, d_h, d)``, ``w_o (*, H, d, d_h)``, leading dims broadcast.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from torch import Tensor

from connmon._linalg.heads import concat_heads
from connmon.functional._checks import as_float, check_layer, promote, shape

__all__ = ["connection_matvec", "connection_operator", "walk_basis"]


def checked_layer(attn: Tensor, w_v: Tensor, w_o: Tensor) -> tuple[Tensor, Tensor, Tensor, tuple[int, int, int, int]]:
    attn, w_v, w_o = promote(as_float(attn, "attn"), as_float(w_v, "w_v"), as_float(w_o, "w_o"))
    return attn, w_v, w_o, check_layer(attn, w_v, w_o)


def walk_basis(attn: Tensor) -> Tensor:
    """An orthonormal basis ``U (*, n, n - 1)`` of the mean-zero fields on the valid tokens (Helmert vectors).

    A token is valid when some query of some head attends it (a nonzero column); with ``m`` valid tokens the first
    ``m - 1`` columns span ``{x : x_j = 0 off the valid tokens, sum_j x_j = 0}`` and the rest are 0. ``U^T A U`` is
    the walk on the quotient by constant fields. No host synchronization.

    Args:
        attn: ``(*, H, n, n)``.

    Returns:
        ``(*, n, n - 1)`` in ``attn``'s dtype.

    Examples:
        >>> import torch
        >>> from connmon.functional import walk_basis
        >>> U = walk_basis(torch.full((1, 4, 4), 0.25))
        >>> orthonormal = torch.allclose(U.mT @ U, torch.eye(3), atol=1e-6)  # float32 round-off off the diagonal
        >>> orthonormal, bool(torch.allclose(U.sum(0), torch.zeros(3), atol=1e-6))
        (True, True)
    """
    n = attn.shape[-1]
    valid = (attn != 0).any(dim=-2).any(dim=-2)  # (*, n): a column some query of some head reads
    rank = valid.cumsum(dim=-1) - 1  # position of each valid token among the valid ones
    count = valid.sum(dim=-1, keepdim=True)  # (*, 1)
    c = torch.arange(1, n, device=attn.device)  # column c - 1 averages the first c valid tokens against the next
    norm = 1 / torch.sqrt((c * (c + 1)).to(attn.dtype))
    used = valid.unsqueeze(-1) & (c < count).unsqueeze(-2)  # (*, n, n - 1)
    r, c = rank.unsqueeze(-1), c.to(rank.dtype)
    basis = torch.where(r < c, norm, torch.where(r == c, -c.to(attn.dtype) * norm, torch.zeros_like(norm)))
    return torch.where(used, basis, torch.zeros_like(basis))


def walk_part(attn: Tensor) -> Tensor:
    """``U^T A^h U``: ``(*, H, n - 1, n - 1)``, the attention of the walk on the quotient by constant fields."""
    basis = walk_basis(attn).unsqueeze(-3)  # (*, 1, n, n - 1)
    return basis.mT @ attn @ basis


def matvec(attn: Tensor, v_cat: Tensor, o_cat: Tensor, x: Tensor) -> Tensor:
    """``M(X) = sum_h A^h X V_h^T O_h^T`` with the heads stacked: ``x (*, n, d) -> (*, n, d)``."""
    heads = attn.shape[-3]
    y = (x @ v_cat.mT).unflatten(-1, (heads, -1)).transpose(-3, -2)  # (*, H, n, d_h)
    z = (attn @ y).transpose(-3, -2).flatten(-2)  # (*, n, H*d_h)
    return z @ o_cat.mT


def head_space_matvec(attn: Tensor, mix: Tensor, z: Tensor) -> Tensor:
    """``G F`` of ``M = F G``, ``F(Z) = Z O^T``, ``G(X) = [A^h X V_h^T]_h``: ``z (*, n, H*d_h) -> (*, n, H*d_h)``.

    ``mix = V O`` ``(H*d_h, H*d_h)``. ``F G`` and ``G F`` have the same nonzero eigenvalues, and the same
    characteristic polynomial when ``H d_h = d``; a product costs one GEMM of ``n (H d_h)^2`` where :func:`matvec`
    costs two of ``n d H d_h``.

    Examples:
        >>> import torch
        >>> from connmon._linalg.heads import concat_heads
        >>> from connmon.functional.operator import head_space_matvec, matvec
        >>> _ = torch.manual_seed(0)
        >>> attn = torch.randn(2, 3, 3, dtype=torch.float64).softmax(-1)  # H=2, n=3
        >>> w_v, w_o = torch.randn(2, 2, 4, dtype=torch.float64), torch.randn(2, 4, 2, dtype=torch.float64)  # H d_h = d
        >>> v_cat, o_cat = concat_heads(w_v, w_o)
        >>> fields = torch.eye(12, dtype=torch.float64).view(12, 3, 4)  # every basis field, as (n, d)
        >>> m = matvec(attn, v_cat, o_cat, fields).flatten(-2).T  # M, column by column
        >>> g_f = head_space_matvec(attn, v_cat @ o_cat, fields).flatten(-2).T
        >>> torch.allclose(torch.linalg.det(m - 0.3 * torch.eye(12)), torch.linalg.det(g_f - 0.3 * torch.eye(12)))
        True
    """
    heads = attn.shape[-3]
    y = (z @ mix.mT).unflatten(-1, (heads, -1)).transpose(-3, -2)  # (*, H, n, d_h)
    return (attn @ y).transpose(-3, -2).flatten(-2)


def rmatvec(attn: Tensor, v_cat: Tensor, o_cat: Tensor, y: Tensor) -> Tensor:
    """``M^T(Y) = sum_h (A^h)^T Y O_h V_h``: ``y (*, n, d) -> (*, n, d)``."""
    heads = attn.shape[-3]
    u = (y @ o_cat).unflatten(-1, (heads, -1)).transpose(-3, -2)  # (*, H, n, d_h)
    z = (attn.mT @ u).transpose(-3, -2).flatten(-2)  # (*, n, H*d_h)
    return z @ v_cat


def connection_matvec(attn: Tensor, w_v: Tensor, w_o: Tensor, x: Tensor) -> Tensor:
    """Apply the connection walk to a vector field: ``M(X)_i = sum_h sum_j A^h_ij T_h x_j``.

    Two GEMMs of the stacked heads and one batched attention GEMM, ``O(n d H d_h + H n^2 d_h)``: the cost of an
    attention forward. ``module_output = M(X) + c`` for the layer's input ``X`` (docs/diagnostics.md: reconstruction).

    Args:
        attn: ``(*, H, n, n)``.
        w_v: ``(*, H, d_h, d)``.
        w_o: ``(*, H, d, d_h)``.
        x: ``(*, n, d)``.

    Returns:
        ``(*, n, d)``.

    Raises:
        ValueError: if the shapes do not match.

    Examples:
        >>> import torch
        >>> from connmon.functional import connection_matvec, connection_operator
        >>> _ = torch.manual_seed(0)
        >>> attn = torch.randn(2, 3, 3).softmax(-1)  # H=2, n=3
        >>> w_v, w_o, x = torch.randn(2, 2, 4), torch.randn(2, 4, 2), torch.randn(3, 4)  # d_h=2, d=4
        >>> dense = (connection_operator(attn, w_v, w_o) @ x.flatten()).view(3, 4)
        >>> bool(torch.allclose(connection_matvec(attn, w_v, w_o, x), dense, atol=1e-5))
        True
    """
    attn, w_v, w_o, (_, n, _, d) = checked_layer(attn, w_v, w_o)
    x = as_float(x, "x").to(attn.dtype)
    if x.ndim < 2 or tuple(x.shape[-2:]) != (n, d):
        raise ValueError(f"x must have shape (*, n, d) = (*, {n}, {d}) to match attn and w_v, got x{shape(x)}")
    return matvec(attn, *concat_heads(w_v, w_o), x)


def connection_operator(attn: Tensor, w_v: Tensor, w_o: Tensor, max_dim: int = 4096) -> Tensor:
    """Dense connection operator ``M = sum_h kron(A^h, T_h)``, token-major; for small layers and tests.

    Args:
        attn: ``(*, H, n, n)``.
        w_v: ``(*, H, d_h, d)``.
        w_o: ``(*, H, d, d_h)``.
        max_dim: refuse ``n * d`` above this (memory grows as ``(n d)^2``).

    Returns:
        ``(*, n*d, n*d)``.

    Raises:
        ValueError: if the shapes do not match or ``n * d > max_dim``.

    Examples:
        >>> import torch
        >>> from connmon.functional import connection_operator
        >>> attn, t = torch.tensor([[[0.5, 0.5], [0.0, 1.0]]]), torch.tensor([[2.0]])  # H=1, n=2, d=1
        >>> connection_operator(attn, t[None], torch.ones(1, 1, 1))
        tensor([[1., 1.],
                [0., 2.]])
    """
    attn, w_v, w_o, (_, n, _, d) = checked_layer(attn, w_v, w_o)
    if n * d > max_dim:
        raise ValueError(
            f"the dense operator has n*d = {n}*{d} = {n * d} rows, above max_dim={max_dim}; "
            "use connection_matvec, or raise max_dim if (n*d)^2 numbers fit in memory"
        )
    t = w_o @ w_v  # (*, H, d, d)
    blocks = torch.einsum("...hij,...hab->...iajb", attn, t)  # (*, n, d, n, d)
    return blocks.reshape(*blocks.shape[:-4], n * d, n * d)


def each_layer(attn: Tensor, w_v: Tensor, w_o: Tensor) -> Iterator[tuple[tuple[int, ...], Tensor, Tensor, Tensor]]:
    """Yield ``(index, attn, V, O)`` for each layer of the broadcast batch, as views (shared weights are not copied).

    ``V (H*d_h, d)`` and ``O (d, H*d_h)`` are the stacked heads (``O @ V = T_bar``).
    """
    batch = torch.broadcast_shapes(attn.shape[:-3], w_v.shape[:-3], w_o.shape[:-3])
    v_cat, o_cat = concat_heads(w_v, w_o)
    attn = attn.expand(*batch, *attn.shape[-3:])
    v_cat = v_cat.expand(*batch, *v_cat.shape[-2:])
    o_cat = o_cat.expand(*batch, *o_cat.shape[-2:])
    for index in np.ndindex(*batch):
        yield index, attn[index], v_cat[index], o_cat[index]
