"""Head transports ``T_h = O_h V_h`` and how far they are from scaled isometries (docs/diagnostics.md, "Transport").

Shapes: ``w_v`` is ``(*, H, d_h, d)`` (the value-projection rows of each query head's kv head, GQA expanded) and
``w_o`` is ``(*, H, d, d_h)`` (the output-projection columns of each head), so ``T_h = w_o[h] @ w_v[h]`` is
``d x d`` with rank at most ``d_h``. ``attn`` is ``(*, H, n, n)``. Leading dims broadcast.

Singular values never form a ``d x d`` head map: with thin QR factorizations ``V_h^T = Q_v R_v`` and
``O_h = Q_o R_o``, ``T_h = Q_o (R_o R_v^T) Q_v^T`` has the singular values of the ``d_h x d_h`` core
``R_o R_v^T``. The same trick on the concatenated heads gives the OV and edge transports' singular values.

A zero map counts as a (zero-scale) isometry: its gaps are 0. Non-finite weights give NaN.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from connmon._linalg import frobenius, gram_svdvals, safe_divide, svdvals
from connmon._linalg.heads import concat_heads
from connmon._linalg.lanczos import gauss_quadrature, lanczos
from connmon.functional._checks import as_float, check_layer, check_transport, promote

__all__ = [
    "edge_isometry_gap",
    "head_isometry_gap",
    "isometry_gap",
    "ov_isometry_gap",
    "ov_singular_values",
    "ov_transport",
    "transport_scale",
    "transport_singular_values",
    "transport_symmetry_gap",
]


def _weights(w_v: Tensor, w_o: Tensor) -> tuple[Tensor, Tensor]:
    w_v, w_o = promote(as_float(w_v, "w_v"), as_float(w_o, "w_o"))
    check_transport(w_v, w_o)
    return w_v, w_o


def _qr_cores(v: Tensor, o: Tensor) -> tuple[Tensor, Tensor]:
    """Triangular factors with ``o @ v = Q_o (R_o R_v^T) Q_v^T``: ``R_o, R_v`` are ``(*, min(d, k), k)``."""
    r_v = torch.linalg.qr(v.mT, mode="r").R  # v^T = Q_v R_v
    r_o = torch.linalg.qr(o, mode="r").R  # o = Q_o R_o
    return r_v, r_o


def _gap(singular_values: Tensor, rank: int) -> Tensor:
    """``||s - mean(s)|| / ||s||`` over ``rank`` values, the missing ones being zeros; 0 for the zero map."""
    mean = singular_values.sum(dim=-1, keepdim=True) / rank
    spread = ((singular_values - mean) ** 2).sum(dim=-1) + (rank - singular_values.shape[-1]) * mean.squeeze(-1) ** 2
    return safe_divide(spread, (singular_values**2).sum(dim=-1)).sqrt()


def isometry_gap(singular_values: Tensor, rank: int | None = None) -> Tensor:
    """Distance of a map from the nearest scaled isometry, from its singular values.

    ``gap = sqrt(max(0, 1 - (sum s)^2 / (r sum s^2))) = ||T - s* Q||_F / ||T||_F`` with ``s* = mean(s)``. It is
    computed in the cancellation-free form ``||s - mean(s)|| / ||s||``, so equal singular values give exactly 0.
    In ``[0, sqrt(1 - 1/r)]``; invariant to scaling the map. The zero map has gap 0.

    Args:
        singular_values: ``(*, m)`` nonnegative singular values.
        rank: ``r``, the dimension of the map's domain; defaults to ``m``. Values beyond ``m`` count as zeros.

    Returns:
        ``(*,)``.

    Raises:
        ValueError: if ``rank`` is smaller than ``m``.

    Examples:
        >>> import torch
        >>> from connmon.functional import isometry_gap
        >>> isometry_gap(torch.tensor([2.0, 2.0, 2.0]))  # 2 x an isometry
        tensor(0.)
        >>> isometry_gap(torch.tensor([1.0, 0.0]))  # a rank-one projection in 2-d
        tensor(0.7071)
    """
    singular_values = as_float(singular_values, "singular_values")
    size = singular_values.shape[-1] if singular_values.ndim else 0
    rank = size if rank is None else rank
    if size == 0 or rank < size:
        raise ValueError(
            f"isometry_gap needs (*, m) singular values with m >= 1 and rank >= m, "
            f"got shape {tuple(singular_values.shape)} and rank={rank}"
        )
    return _gap(singular_values, rank)


def transport_singular_values(w_v: Tensor, w_o: Tensor) -> Tensor:
    """Singular values of each head transport ``T_h = O_h V_h``, descending.

    Thin QR of ``V_h^T`` and ``O_h``, then the SVD of a ``d_h x d_h`` matrix: ``O(H d d_h^2)`` instead of
    ``O(H d^3)`` for an SVD of each ``d x d`` map.

    Args:
        w_v: ``(*, H, d_h, d)``.
        w_o: ``(*, H, d, d_h)``.

    Returns:
        ``(*, H, d_h)``.

    Raises:
        ValueError: if the shapes do not match or ``d_h > d``.

    Examples:
        >>> import torch
        >>> from connmon.functional import transport_singular_values
        >>> _ = torch.manual_seed(0)
        >>> w_v, w_o = torch.randn(4, 8, 32), torch.randn(4, 32, 8)  # H=4, d_h=8, d=32
        >>> fast = transport_singular_values(w_v, w_o)
        >>> naive = torch.linalg.svdvals(w_o @ w_v)[..., :8]
        >>> fast.shape, bool(torch.allclose(fast, naive, rtol=1e-4))
        (torch.Size([4, 8]), True)
    """
    w_v, w_o = _weights(w_v, w_o)
    r_v, r_o = _qr_cores(w_v, w_o)
    return svdvals(r_o @ r_v.mT)


def head_isometry_gap(w_v: Tensor, w_o: Tensor, reduction: Literal["mean", "none"] = "mean") -> Tensor:
    """Isometry gap of each head transport on its own ``d_h``-dim domain (``r = d_h``).

    Args:
        w_v: ``(*, H, d_h, d)``.
        w_o: ``(*, H, d, d_h)``.
        reduction: ``"mean"`` over heads (the logged ``head_isometry_gap``) or ``"none"`` for ``(*, H)``.

    Returns:
        ``(*,)`` or ``(*, H)``.

    Raises:
        ValueError: if the shapes do not match or ``reduction`` is unknown.

    Examples:
        >>> import torch
        >>> from connmon.functional import head_isometry_gap
        >>> q = torch.linalg.qr(torch.randn(16, 16, generator=torch.Generator().manual_seed(0))).Q
        >>> w_v = q[:8].reshape(2, 4, 16)  # two heads, orthonormal rows
        >>> w_o = 3 * w_v.mT  # scaled isometries: T_h = 3 Q_h Q_h^T on each head's subspace
        >>> head_isometry_gap(w_v, w_o, reduction="none")
        tensor([0., 0.])
    """
    if reduction not in ("mean", "none"):
        raise ValueError(f"reduction must be 'mean' or 'none', got reduction={reduction!r}")
    gaps = _gap(transport_singular_values(w_v, w_o), w_v.shape[-2])
    return gaps.mean(dim=-1) if reduction == "mean" else gaps


def ov_transport(w_v: Tensor, w_o: Tensor) -> Tensor:
    """OV transport ``T_bar = sum_h T_h = W_O W_V``.

    Args:
        w_v: ``(*, H, d_h, d)``.
        w_o: ``(*, H, d, d_h)``.

    Returns:
        ``(*, d, d)``.

    Raises:
        ValueError: if the shapes do not match.

    Examples:
        >>> import torch
        >>> from connmon.functional import ov_transport
        >>> _ = torch.manual_seed(0)
        >>> w_v, w_o = torch.randn(2, 3, 6), torch.randn(2, 6, 3)
        >>> bool(torch.allclose(ov_transport(w_v, w_o), w_o[0] @ w_v[0] + w_o[1] @ w_v[1], atol=1e-5))
        True
    """
    v_cat, o_cat = concat_heads(*_weights(w_v, w_o))
    return o_cat @ v_cat


def ov_singular_values(w_v: Tensor, w_o: Tensor) -> Tensor:
    """All ``d`` singular values of the OV transport ``T_bar``, descending (zeros beyond its rank ``H d_h``).

    Args:
        w_v: ``(*, H, d_h, d)``.
        w_o: ``(*, H, d, d_h)``.

    Returns:
        ``(*, d)``.

    Raises:
        ValueError: if the shapes do not match.

    Examples:
        >>> import torch
        >>> from connmon.functional import ov_singular_values, ov_transport
        >>> _ = torch.manual_seed(0)
        >>> w_v, w_o = torch.randn(2, 3, 8), torch.randn(2, 8, 3)  # rank 6 in d = 8
        >>> s = ov_singular_values(w_v, w_o)
        >>> bool(torch.allclose(s, torch.linalg.svdvals(ov_transport(w_v, w_o)), atol=1e-4)), s[-2:]
        (True, tensor([0., 0.]))
    """
    v_cat, o_cat = concat_heads(*_weights(w_v, w_o))
    d, inner = o_cat.shape[-2:]
    if inner >= d:
        return svdvals(o_cat @ v_cat)
    r_v, r_o = _qr_cores(v_cat, o_cat)
    core = svdvals(r_o @ r_v.mT)  # (*, H*d_h)
    return torch.cat([core, core.new_zeros(*core.shape[:-1], d - inner)], dim=-1)


def ov_isometry_gap(w_v: Tensor, w_o: Tensor) -> Tensor:
    """Isometry gap of the OV transport ``T_bar`` on the full model width (``r = d``).

    Args:
        w_v: ``(*, H, d_h, d)``.
        w_o: ``(*, H, d, d_h)``.

    Returns:
        ``(*,)``.

    Raises:
        ValueError: if the shapes do not match.

    Examples:
        >>> import torch
        >>> from connmon.functional import ov_isometry_gap
        >>> eye = torch.eye(4)
        >>> w_v, w_o = eye.reshape(2, 2, 4), 5 * eye.reshape(4, 2, 2).transpose(0, 1)  # T_bar = 5 I
        >>> ov_isometry_gap(w_v, w_o)
        tensor(0.)
    """
    return _gap(ov_singular_values(w_v, w_o), w_v.shape[-1])


def transport_scale(w_v: Tensor, w_o: Tensor) -> Tensor:
    """Transport scale ``s``: the mean of the ``d`` singular values of ``T_bar`` (the normalizer of ``M``).

    Args:
        w_v: ``(*, H, d_h, d)``.
        w_o: ``(*, H, d, d_h)``.

    Returns:
        ``(*,)``.

    Raises:
        ValueError: if the shapes do not match.

    Examples:
        >>> import torch
        >>> from connmon.functional import transport_scale
        >>> eye = torch.eye(4)
        >>> transport_scale(eye.reshape(2, 2, 4), 5 * eye.reshape(4, 2, 2).transpose(0, 1))
        tensor(5.)
    """
    return ov_singular_values(w_v, w_o).mean(dim=-1)


def transport_symmetry_gap(w_v: Tensor, w_o: Tensor) -> Tensor:
    """Asymmetry of the OV transport, ``||T_bar - T_bar^T||_F / (2 ||T_bar||_F)``, in ``[0, 1]``.

    Metric compatibility of a connection asks ``T_ji = T_ij^T``; with the edge-independent part ``T_bar`` that
    is symmetry. 0 for a symmetric map (the zero map included), 1 for an antisymmetric one.

    Args:
        w_v: ``(*, H, d_h, d)``.
        w_o: ``(*, H, d, d_h)``.

    Returns:
        ``(*,)``.

    Raises:
        ValueError: if the shapes do not match.

    Examples:
        >>> import torch
        >>> from connmon.functional import transport_symmetry_gap
        >>> rotation = torch.tensor([[0.0, -1.0], [1.0, 0.0]])  # antisymmetric
        >>> transport_symmetry_gap(torch.eye(2)[None], rotation[None])
        tensor(1.)
    """
    t_bar = ov_transport(w_v, w_o)
    return safe_divide(frobenius(t_bar - t_bar.mT), 2 * frobenius(t_bar))


def edge_isometry_gap(
    attn: Tensor,
    w_v: Tensor,
    w_o: Tensor,
    num_samples: int | None = None,
    seed: int = 0,
    num_queries: int | None = None,
    lanczos_steps: int | None = None,
) -> Tensor:
    """Expected isometry gap (``r = d``) of the edge transport ``T_ij = sum_h a^h_ij T_h`` over the walk's edges.

    Edges are weighted by ``P_ij / n``: a uniform query ``i`` and a key ``j`` drawn from the walk. A query row with
    no allowed key (a padding query, see :func:`connmon.metrics.readings.valid_queries`) is not a query of the walk:
    ``n`` counts the rows with a key, ``num_queries`` are drawn among them, and a layer with none has gap 0. The
    gates are ``a^h_ij = A^h_ij / W_ij`` with ``W = sum_h A^h``. Each edge needs the SVD of an ``r x r`` core,
    ``r = min(d, H d_h)``.

    * ``num_samples=None``: exact, over all ``n^2`` edges: ``O(n^2 r^3)`` time and ``O(n^2 r^2)`` memory, for small
      layers.
    * ``num_samples=k``: unbiased stratified estimate. For every query ``i`` it draws ``k`` keys from row ``i`` of
      ``P`` by inverse-CDF sampling at the stratified points ``(m + U_m) / k``, ``m = 0..k-1``, and averages:
      ``(1/n) sum_i P_i. 1 * mean_m gap(T_{i j_m})``. ``O(n k r^3)``. Its standard error is at most
      ``0.5 / sqrt(n k)`` (gaps lie in ``[0, 1)``; stratification only lowers it). Deterministic for a ``seed``.
    * ``num_queries=q``: average over ``q`` query rows drawn uniformly without replacement (seeded, per sequence)
      instead of all ``n``: unbiased, ``O(q k r^3)``, standard error at most ``0.5 / sqrt(q k)`` (exact keys when
      ``num_samples=None``: ``O(q n r^3)``). This is what makes the diagnostic affordable inside a training run.
    * ``lanczos_steps=m``: no decomposition per edge. ``sum s^2 = ||T_ij||_F^2 = a^T G a`` is exact from the heads'
      Gram matrix ``G_hh' = <T_h, T_h'>_F``; ``sum s = tr sqrt(X)``, ``X = T_ij^T T_ij``, is
      ``sqrt(r sum s^2) - tr R`` with ``R = (sqrt(X) - c)^2 / (2c)``, ``c^2`` the mean eigenvalue of ``X`` (the
      tangent of ``sqrt`` at ``c^2`` is exact in trace), and ``tr R`` is estimated by ``m`` Lanczos steps on ``X``
      from one Rademacher vector (Gauss quadrature, Hutchinson's estimator). The control variate leaves noise only
      in ``R``, which is second order in the spread of the singular values, so near-isometric edges (small gaps)
      are estimated best. ``O(m r H d_h)`` per edge. The estimate of ``tr R`` is unbiased up to the quadrature
      error; through the square root of the gap it keeps a bias, measured below 0.01 on random and attention-shaped
      layers (``tests/functional/test_transport.py``), and the standard-error bound above still holds.

    Args:
        attn: attention probabilities ``(*, H, n, n)``.
        w_v: ``(*, H, d_h, d)``.
        w_o: ``(*, H, d, d_h)``.
        num_samples: keys drawn per query, or None for the exact expectation.
        seed: seed of the sampler (a generator on ``attn``'s device).
        num_queries: query rows to average over (uniform, without replacement), or None for all ``n``.
        lanczos_steps: estimate each edge's ``sum s`` with this many Lanczos steps instead of decomposing it (None:
            exact per edge).

    Returns:
        ``(*,)``.

    Raises:
        ValueError: if the shapes do not match, ``num_samples < 1`` or ``num_queries < 1``.

    Examples:
        >>> import torch
        >>> from connmon.functional import edge_isometry_gap
        >>> _ = torch.manual_seed(0)
        >>> attn = torch.randn(4, 6, 6).softmax(-1)
        >>> w_v, w_o = torch.randn(4, 2, 8), torch.randn(4, 8, 2)
        >>> exact = edge_isometry_gap(attn, w_v, w_o)
        >>> estimate = edge_isometry_gap(attn, w_v, w_o, num_samples=64)
        >>> bool((exact - estimate).abs() < 4 * 0.5 / (6 * 64) ** 0.5)
        True
    """
    attn, w_v, w_o = promote(as_float(attn, "attn"), as_float(w_v, "w_v"), as_float(w_o, "w_o"))
    heads, n, d_h, d = check_layer(attn, w_v, w_o)
    if num_samples is not None and num_samples < 1:
        raise ValueError(f"num_samples must be a positive int or None, got num_samples={num_samples}")
    if num_queries is not None and num_queries < 1:
        raise ValueError(f"num_queries must be a positive int or None, got num_queries={num_queries}")
    if lanczos_steps is not None and lanczos_steps < 1:
        raise ValueError(f"lanczos_steps must be a positive int or None, got lanczos_steps={lanczos_steps}")
    generator = torch.Generator(device=attn.device).manual_seed(seed)
    if num_queries is not None and num_queries < n:  # a uniform subset of the query rows that have a key
        live = (attn != 0).any(dim=-1).any(dim=-2)  # (*, n)
        draw = torch.rand(live.shape, generator=generator, device=attn.device, dtype=torch.float64)
        chosen = draw.masked_fill(~live, -1.0).topk(num_queries, dim=-1).indices  # (*, q): live rows first
        index = chosen.unsqueeze(-2).unsqueeze(-1).expand(*chosen.shape[:-1], heads, num_queries, n)
        attn = attn.gather(-2, index)
    r_v, r_o = _qr_cores(*concat_heads(w_v, w_o))  # (*, r, H*d_h) each
    weight = attn.sum(dim=-3)  # W: (*, n, n)
    gates = safe_divide(attn, weight.unsqueeze(-3)).movedim(-3, -1)  # (*, n, n, H)
    walk = weight / heads  # P
    rows = (walk != 0).any(dim=-1).sum(dim=-1, keepdim=True).unsqueeze(-1).clamp(min=1).to(walk.dtype)
    if num_samples is None:
        edge_weight = walk / rows  # (*, rows, n)
    else:
        row_mass = walk.sum(dim=-1)  # (*, rows)
        offsets = torch.rand((*walk.shape[:-1], num_samples), generator=generator, device=attn.device, dtype=walk.dtype)
        strata = torch.arange(num_samples, device=attn.device, dtype=walk.dtype)
        targets = (strata + offsets) / num_samples * row_mass.unsqueeze(-1)  # (*, n, k)
        keys = torch.searchsorted(walk.cumsum(dim=-1).contiguous(), targets.contiguous(), right=True)
        gates = torch.take_along_dim(gates, keys.clamp(max=n - 1).unsqueeze(-1), dim=-2)  # (*, n, k, H)
        edge_weight = (row_mass / (rows.squeeze(-1) * num_samples)).unsqueeze(-1).expand(keys.shape)  # (*, rows, k)
    if lanczos_steps is not None:
        gaps = _edge_gaps_by_lanczos(gates, r_v, r_o, d_h, d=d, steps=lanczos_steps, generator=generator)
        return (edge_weight * gaps).flatten(-2).sum(dim=-1)
    scaled = r_o[..., None, None, :, :] * gates.repeat_interleave(d_h, dim=-1).unsqueeze(-2)  # (*, n, n|k, r, H*d_h)
    cores = scaled @ r_v.mT[..., None, None, :, :]  # (*, n, n|k, r, r)
    gaps = _gap(gram_svdvals(cores), d)
    return (edge_weight * gaps).flatten(-2).sum(dim=-1)


def _edge_gaps_by_lanczos(
    gates: Tensor, r_v: Tensor, r_o: Tensor, d_h: int, d: int, steps: int, generator: torch.Generator
) -> Tensor:
    """Isometry gap (``r = d``) of each edge core ``C = R_o diag(g) R_v^T`` from ``gates (*, q, k, H)``: ``(*, q, k)``.

    See :func:`edge_isometry_gap` (``lanczos_steps``). Computed in float64.
    """
    wide, dtype = torch.float64, gates.dtype
    lead = torch.broadcast_shapes(gates.shape[:-3], r_v.shape[:-2])
    gates = gates.expand(*lead, *gates.shape[-3:]).to(wide)
    r_v, r_o = r_v.expand(*lead, *r_v.shape[-2:]).to(wide), r_o.expand(*lead, *r_o.shape[-2:]).to(wide)
    size = r_v.shape[-2]
    g = gates.repeat_interleave(d_h, dim=-1).flatten(-3, -2)  # (*, E, H*d_h)
    gram_o = r_o.mT @ r_o  # (*, H*d_h, H*d_h): <columns> of O
    gram = gram_o * (r_v.mT @ r_v)  # times <rows> of V
    squares = ((g @ gram) * g).sum(dim=-1).clamp(min=0)  # (*, E): sum s^2 = ||C||_F^2
    edges = g.shape[-2]

    def matvec(x: Tensor) -> Tensor:  # X = C^T C = R_v diag(g) R_o^T R_o diag(g) R_v^T on each edge, x (N, r)
        xs = x.view(*lead, edges, size)
        return ((((xs @ r_v) * g) @ gram_o * g) @ r_v.mT).reshape(-1, size)  # three GEMMs through R_o^T R_o

    probe = torch.randint(0, 2, (*lead, edges, size), generator=generator, device=g.device).to(wide) * 2 - 1
    c = (squares / size).sqrt().reshape(-1)  # sqrt of the mean eigenvalue of X
    half_c = (2 * c).clamp(min=torch.finfo(wide).tiny).unsqueeze(-1)
    rule = lanczos(matvec, probe.reshape(-1, size), min(steps, size))
    residual = gauss_quadrature(
        rule, torch.full_like(c, size), lambda x: (x.clamp(min=0).sqrt() - c[:, None]) ** 2 / half_c
    )
    correction = residual.view(squares.shape)
    sums = ((size * squares).sqrt() - correction).clamp(min=0)
    ratio = safe_divide(sums**2, d * squares)
    return (1 - ratio).clamp(min=0).sqrt().to(dtype).view(*lead, *gates.shape[-3:-1])
