"""How close one layer is to a random-walk connection Laplacian (docs/diagnostics.md).

The paper's second claim: under stochasticity, reversibility and metric-compatible transports, the generator
``L = I - M / s`` is a random-walk connection Laplacian, ``M / s = P ⊗ R`` blockwise with ``R_ij`` orthogonal and
``R_ji = R_ij^T``. Stochasticity and reversibility are walk diagnostics (:mod:`connmon.functional.walk`); this
module measures the other two, on the edges the attention uses:

* :func:`edge_compatibility_gap`: how far the edge transports are from ``T_ji = T_ij^T`` on the edges used in both
  directions;
* :func:`connection_laplacian_distance`: the relative Frobenius distance of ``M / s`` from the nearest operator of
  that form with the layer's own walk ``P``.

Shapes as in :mod:`connmon.functional.transport`: ``attn (*, H, n, n)``, ``w_v (*, H, d_h, d)``,
``w_o (*, H, d, d_h)``; leading dims broadcast. Non-finite input gives NaN.
"""

from __future__ import annotations

import torch
from torch import Tensor

from connmon._linalg import gram_svdvals, safe_divide
from connmon._linalg.heads import concat_heads
from connmon.functional._checks import as_float, check_layer, promote
from connmon.functional.transport import transport_scale

__all__ = ["connection_laplacian_distance", "edge_compatibility_gap"]


def _head_products(w_v: Tensor, w_o: Tensor) -> tuple[Tensor, Tensor]:
    """``<T_h, T_g>_F`` and ``tr(T_h T_g)`` over head pairs: two ``(*, H, H)`` matrices."""
    maps = w_o @ w_v  # (*, H, d, d)
    return torch.einsum("...hab,...gab->...hg", maps, maps), torch.einsum("...hab,...gba->...hg", maps, maps)


def _quadratic(left: Tensor, matrix: Tensor, right: Tensor) -> Tensor:
    """``left_ij^T matrix right_ij`` for ``left, right (*, n, n, H)`` and ``matrix (*, H, H)``: ``(*, n, n)``."""
    return ((left @ matrix.unsqueeze(-3)) * right).sum(dim=-1)


def edge_compatibility_gap(attn: Tensor, w_v: Tensor, w_o: Tensor) -> Tensor:
    """Metric compatibility of the edge transports on the edges the walk uses in both directions, in ``[0, 1]``.

    With the edge transports ``T_ij = sum_h a^h_ij T_h`` (gates ``a^h_ij = A^h_ij / W_ij``) and edge weights
    ``w_ij = P_ij P_ji`` for ``i != j``,
    ``gap^2 = sum w_ij ||T_ij - T_ji^T||_F^2 / (2 sum w_ij (||T_ij||_F^2 + ||T_ji||_F^2))``.
    0 iff ``T_ji = T_ij^T`` on every edge used both ways; 1 iff ``T_ji = -T_ij^T`` there. With constant gates
    (one head) it is :func:`~connmon.functional.transport_symmetry_gap`. Exact, from the heads' products
    ``<T_h, T_g>_F`` and ``tr(T_h T_g)``: ``O(n^2 H^2 + H^2 d^2)``, no decomposition.

    A causal layer has no edge used both ways: the condition is then vacuous and the gap is NaN (not 0, which
    would read as "compatible").

    Args:
        attn: attention probabilities ``(*, H, n, n)``.
        w_v: ``(*, H, d_h, d)``.
        w_o: ``(*, H, d, d_h)``.

    Returns:
        ``(*,)``.

    Raises:
        ValueError: if the shapes do not match.

    Examples:
        >>> import torch
        >>> from connmon.functional import edge_compatibility_gap
        >>> attn = torch.full((1, 3, 3), 1 / 3)  # one head, uniform: every edge used both ways
        >>> symmetric, rotation = torch.eye(2), torch.tensor([[0.0, -1.0], [1.0, 0.0]])
        >>> edge_compatibility_gap(attn, symmetric[None], torch.eye(2)[None])
        tensor(0.)
        >>> edge_compatibility_gap(attn, rotation[None], torch.eye(2)[None])  # T^T = -T
        tensor(1.)
        >>> edge_compatibility_gap(torch.ones(1, 2, 2).tril() / torch.tensor([[1.0], [2.0]]), rotation[None],
        ...                        torch.eye(2)[None])  # causal: no edge both ways
        tensor(nan)
    """
    attn, w_v, w_o = promote(as_float(attn, "attn"), as_float(w_v, "w_v"), as_float(w_o, "w_o"))
    heads, n, _, _ = check_layer(attn, w_v, w_o)
    gram, trace = _head_products(w_v, w_o)
    weight = attn.sum(dim=-3)  # W (*, n, n)
    gates = safe_divide(attn, weight.unsqueeze(-3)).movedim(-3, -1)  # (*, n, n, H), a^h_ij
    back = gates.transpose(-3, -2)  # a^h_ji at [i, j]
    squares = _quadratic(gates, gram, gates)  # ||T_ij||^2
    apart = (squares + squares.mT - 2 * _quadratic(gates, trace, back)).clamp(min=0)  # ||T_ij - T_ji^T||^2
    walk = weight / heads
    off_diagonal = ~torch.eye(n, dtype=torch.bool, device=attn.device)
    both = walk * walk.mT * off_diagonal
    gap = safe_divide((both * apart).sum(dim=(-2, -1)), 2 * (both * (squares + squares.mT)).sum(dim=(-2, -1))).sqrt()
    return torch.where(both.sum(dim=(-2, -1)) > 0, gap, torch.full_like(gap, float("nan")))


def connection_laplacian_distance(
    attn: Tensor, w_v: Tensor, w_o: Tensor, fit_scale: bool = False, chunk: int = 128
) -> Tensor:
    """Relative distance of ``M / s`` from the nearest random-walk connection Laplacian form, in ``[0, ...)``.

    The form (with the layer's own walk ``P``) is ``N_ij = P_ij R_ij``: ``R_ij`` a ``d x d`` orthogonal map with
    ``R_ji = R_ij^T`` (``R_ii`` symmetric). With ``B_ij`` the ``d x d`` blocks of ``M / s``
    (``B_ij = sum_h A^h_ij T_h / s``), the nearest such ``N`` in Frobenius norm takes, for each pair of directions
    of an edge, ``R_ij = polar(C_ij)`` with ``C_ij = P_ij B_ij + P_ji B_ji^T`` (weighted orthogonal Procrustes), so

    ``distance^2 = ||M/s - N||_F^2 / ||M/s||_F^2
    = (sum_ij ||B_ij||_F^2 + d sum_ij P_ij^2 - sum_ij ||C_ij||_*) / sum_ij ||B_ij||_F^2``

    (``||.||_*`` the nuclear norm). 0 iff ``M / s`` has the form; a layer whose transports are orthogonal and
    compatible but scaled by ``c`` has distance ``|1 - 1/c|``. Reversibility of ``P`` is not imposed (it is
    :func:`~connmon.functional.reversibility_gap`). ``fit_scale=True`` fits the form's overall scale too:
    ``min_c ||M/s - c N||_F / ||M/s||_F = sqrt(1 - (sum_ij ||C_ij||_*)^2 / (4 d sum_ij P_ij^2 sum_ij ||B_ij||_F^2))``,
    the sine of the angle between ``M / s`` and the nearest form, which separates the shape of the transports from
    the normalization by ``s``. On a causal layer only ``P_ij`` or ``P_ji`` is nonzero, so it
    measures how far each used edge's transport is from an orthogonal map (and each ``B_ii`` from a symmetric one).

    Cost: one ``r x r`` singular value decomposition per used pair ``i <= j``, ``r = min(d, 2 H d_h)``:
    ``O(n^2 r^3 / 2)``, done ``chunk`` pairs at a time. For studies and post-hoc analysis, not for every training
    step.

    Args:
        attn: attention probabilities ``(*, H, n, n)``.
        w_v: ``(*, H, d_h, d)``.
        w_o: ``(*, H, d, d_h)``.
        fit_scale: also fit the form's overall scale (see above).
        chunk: pairs decomposed per batch (memory ``chunk r^2``).

    Returns:
        ``(*,)``; NaN where the transport is zero (no scale ``s``) or the input is not finite.

    Raises:
        ValueError: if the shapes do not match or ``chunk < 1``.

    Examples:
        >>> import torch
        >>> from connmon.functional import connection_laplacian_distance
        >>> _ = torch.manual_seed(0)
        >>> attn = torch.randn(1, 5, 5).exp()
        >>> attn = attn + attn.mT  # a symmetric kernel: a reversible walk
        >>> attn = attn / attn.sum(-1, keepdim=True)
        >>> u = torch.nn.functional.normalize(torch.randn(4, 1), dim=0)
        >>> reflection = torch.eye(4) - 2 * u @ u.T  # orthogonal and symmetric: one head, R_ji = R_ij^T
        >>> float(connection_laplacian_distance(attn, reflection[None], torch.eye(4)[None])) < 1e-6
        True
        >>> float(connection_laplacian_distance(attn, torch.randn(1, 4, 4), torch.eye(4)[None])) > 0.1
        True
    """
    if chunk < 1:
        raise ValueError(f"chunk must be a positive int, got chunk={chunk}")
    attn, w_v, w_o = promote(as_float(attn, "attn"), as_float(w_v, "w_v"), as_float(w_o, "w_o"))
    heads, n, d_h, d = check_layer(attn, w_v, w_o)
    wide = torch.float64
    scale = transport_scale(w_v, w_o).to(wide)  # s, (*w)
    gram, _ = _head_products(w_v.to(wide), w_o.to(wide))
    probabilities = attn.to(wide).movedim(-3, -1)  # (*, n, n, H): A^h_ij
    blocks = _quadratic(probabilities, gram, probabilities).sum(dim=(-2, -1))  # s^2 sum ||B_ij||^2
    walk = attn.to(wide).sum(dim=-3) / heads
    squares = (walk**2).sum(dim=(-2, -1))

    v_cat, o_cat = concat_heads(w_v, w_o)  # s C_ij = left diag(P_ij A_ij, P_ji A_ji) right^T
    r_left = torch.linalg.qr(torch.cat([o_cat, v_cat.mT], dim=-1), mode="r").R  # (*w, r, 2Hd_h)
    r_right = torch.linalg.qr(torch.cat([v_cat.mT, o_cat], dim=-1), mode="r").R
    lead = torch.broadcast_shapes(attn.shape[:-3], w_v.shape[:-3], w_o.shape[:-3])
    walks = walk.expand(*lead, n, n).reshape(-1, n, n)
    probabilities = probabilities.expand(*lead, n, n, heads).reshape(-1, n, n, heads)
    r_left = r_left.expand(*lead, *r_left.shape[-2:]).reshape(-1, *r_left.shape[-2:])
    r_right = r_right.expand(*lead, *r_right.shape[-2:]).reshape(-1, *r_right.shape[-2:])
    rows, cols = torch.triu_indices(n, n, device=attn.device)
    totals = []
    for item in range(walks.shape[0]):
        forward, backward = walks[item, rows, cols], walks[item, cols, rows]
        used = (forward != 0) | (backward != 0) | ~torch.isfinite(forward + backward)
        i, j = rows[used], cols[used]
        pair = torch.where(i == j, 1.0, 2.0).to(wide)  # C_ji = C_ij^T: the same nuclear norm
        total = torch.zeros((), dtype=wide, device=attn.device)
        for start in range(0, i.numel(), chunk):
            a, b = i[start : start + chunk], j[start : start + chunk]
            diagonal = torch.cat(
                [
                    walks[item, a, b, None] * probabilities[item, a, b],
                    walks[item, b, a, None] * probabilities[item, b, a],
                ],
                dim=-1,
            ).repeat_interleave(d_h, dim=-1)  # (E, 2 H d_h)
            cores = (r_left[item] * diagonal.unsqueeze(-2).to(r_left.dtype)) @ r_right[item].mT
            total = total + (pair[start : start + chunk] * gram_svdvals(cores).to(wide).sum(dim=-1)).sum()
        totals.append(total)
    nuclear = torch.stack(totals).view(lead) if totals else walk.new_zeros(lead)
    if fit_scale:
        distance = (1 - safe_divide(nuclear**2, 4 * d * squares * blocks)).clamp(min=0).sqrt()
    else:
        numerator = blocks / scale**2 + d * squares - nuclear / scale
        distance = safe_divide(numerator.clamp(min=0), blocks / scale**2).sqrt()
    return torch.where(scale > 0, distance, torch.full_like(distance, float("nan"))).to(attn.dtype)
