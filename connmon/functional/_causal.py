"""The spectrum's causal path: every head causal, so ``M`` is block lower triangular and exact by its diagonal blocks.

The eigenvalues are the union over tokens of ``eig(D_i)``, ``D_i = sum_h A^h_ii T_h``; tokens go in the order of
bounds on their blocks' spectra, and the solve stops once no remaining block can beat the ``k``-th value found
(:func:`causal_first`). Also the ordering of eigenvalues every spectrum path shares (:func:`first_by`).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import numpy as np
import torch
from torch import Tensor

from connmon._linalg import eigvals, eigvalsh, spectral_norm
from connmon._linalg.heads import concat_heads
from connmon._linalg.krylov import Which
from connmon.functional.operator import each_layer
from connmon.functional.transport import transport_singular_values

CHUNK_ELEMENTS = 2**24  # bound on the causal path's block tensor (64 MiB in float32)
SQUARINGS = 5  # the causal path's power bound ||B^32||_F^(1/32) (see power_radius_bounds)
POWER_MARGIN = 1e-3  # relative slack on that bound for the round-off of its five GEMMs
SHIFTED_SQUARINGS = 7  # the rightmost request's bound rho(B + cI)^(1/128) - c (see real_part_bounds)


def complex_dtype(real: Tensor) -> torch.dtype:
    """The complex dtype of ``real``'s precision."""
    return torch.complex64 if real.dtype == torch.float32 else torch.complex128


def order_key(values: Tensor, which: Which) -> Tensor:
    """What ``which`` orders by: the modulus (``"LM"``) or the real part (``"LR"``)."""
    return values.abs() if which == "LM" else values.real


def first_by(values: Tensor, k: int, which: Which) -> Tensor:
    """The ``k`` first of ``values (*, N)`` by descending modulus or real part; ties by descending imaginary part."""
    values = values.gather(-1, values.imag.argsort(dim=-1, descending=True, stable=True))
    return values.gather(-1, order_key(values, which).argsort(dim=-1, descending=True, stable=True)[..., :k])


def causal_first(
    attn: Tensor, w_v: Tensor, w_o: Tensor, requests: dict[Which, int], deflate: bool = False
) -> dict[Which, Tensor]:
    """For each request ``{which: k}``, the first ``k`` of the union over tokens of ``eig(D_i)``: ``(*, k)``.

    With ``deflate`` the first valid token is left out: it attends only itself, its block is ``T_bar`` (the
    constant fields), and the union over the other tokens is the walk part.

    ``D_i = sum_h A^h_ii T_h = O diag(a_i) V``, whose nonzero eigenvalues are those of ``diag(a_i) P`` and
    ``P diag(a_i)``, ``P = V O``. Tokens go in descending order of a bound on their blocks' spectral radius, the
    smallest of ``sum_h A^h_ii ||T_h||_2`` and ``sqrt(sum_h (A^h_ii)^2 ||P_h||_2^2)`` for ``P_h`` the rows (then
    the columns) of head h in ``P`` (Cauchy-Schwarz over heads; in attention layers it halves the blocks left in),
    and stop once no remaining block can beat the k-th key found for any request: for modulus, the norm bound; for
    real part, the tighter numerical-abscissa bound ``Re lambda(D_i) <= sum_h A^h_ii omega(T_h)``,
    ``omega(T) = lambda_max((T + T^T)/2)`` (subadditive over nonnegative combinations). Blocks that cannot enter
    any answer are never decomposed, and one pass serves all requests. When ``H d_h < d`` each block is solved
    through its ``H d_h`` core ``diag(a_i) V O``, which has the nonzero eigenvalues of ``O diag(a_i) V``; the other
    ``d - H d_h`` are 0. Blocks the norm bounds leave in are bounded again, far more tightly, by
    :func:`power_radius_bounds` and :func:`real_part_bounds` before they are decomposed (see
    :func:`first_over_blocks`).
    """
    heads, d_h, d = w_v.shape[-3:]
    inner = heads * d_h
    batch = torch.broadcast_shapes(attn.shape[:-3], w_v.shape[:-3], w_o.shape[:-3])
    norms = block_norms(w_v, w_o).expand(*batch, 3, heads)  # weight-only: once, not per sequence
    size = min(inner, d)
    largest_chunk = max(1, CHUNK_ELEMENTS // (size * size))
    values = {which: attn.new_zeros(*batch, k, dtype=complex_dtype(attn)) for which, k in requests.items()}
    if "LR" in requests:  # numerical abscissa of each head map, omega(T) = lambda_max((T + T^T) / 2)
        abscissa = numerical_abscissa(w_v, w_o).expand(*batch, heads)  # (*, H)
    for index, a, v_cat, o_cat in each_layer(attn, w_v, w_o):
        self_weight = a.diagonal(dim1=-2, dim2=-1).mT  # (n, H): A^h_ii
        bound = block_radius_bounds(self_weight, norms[index])
        order = bound.argsort(descending=True)
        if deflate:  # the first valid token (the first column some query reads) holds T_bar
            first = (a != 0).any(dim=-2).any(dim=-2).int().argmax()
            order = order[order != first]
        # For each request, the largest key any block from position j of the order on can reach: |lambda| <= the
        # norm bound (sorted, so the next one); Re lambda <= omega(D_i) <= sum_h A^h_ii omega(T_h) (subadditive).
        reach = {"LM": bound[order]}
        if "LR" in requests:
            right = torch.minimum(self_weight @ abscissa[index], bound)[order]
            reach["LR"] = right.flip(0).cummax(0).values.flip(0)  # suffix maximum
        reach = {w: r.cpu() for w, r in reach.items()}  # one synchronization per layer
        gates = self_weight.repeat_interleave(d_h, dim=-1)  # (n, H*d_h)
        core = v_cat @ o_cat if inner < d else None  # (H*d_h, H*d_h)
        zeros = a.new_zeros(min(max(requests.values()), len(order) * (d - inner)) if inner < d else 0)
        best = {which: zeros.to(complex_dtype(attn)) for which in requests}

        keys = {"LM": bound[order].cpu()}  # each block's own bounds, by position in the order
        if "LR" in requests:
            keys["LR"] = right.cpu()

        blocks_at = partial(causal_blocks, gates[order], core, v_cat, o_cat)
        best = first_over_blocks(blocks_at, reach, keys, requests, best=best, largest_chunk=largest_chunk)
        for which in requests:
            values[which][index] = best[which]
    return values


def causal_blocks(gates: Tensor, core: Tensor | None, v_cat: Tensor, o_cat: Tensor, positions: Tensor) -> Tensor:
    """The causal blocks ``diag(g) V O`` (the core) or ``O diag(g) V`` at ``positions``: ``(c, m, m)``."""
    g = gates[positions]  # (c, H*d_h)
    return g.unsqueeze(-1) * core if core is not None else (o_cat * g.unsqueeze(-2)) @ v_cat


def first_over_blocks(
    blocks_at: Callable[[Tensor], Tensor],
    reach: dict[str, Tensor],
    keys: dict[str, Tensor],
    requests: dict[Which, int],
    best: dict[Which, Tensor],
    largest_chunk: int,
) -> dict[Which, Tensor]:
    """The first ``k`` eigenvalues of the union of the blocks, for each request, decomposing as few blocks as it can.

    Blocks are indexed by position in descending order of their norm bound; ``keys[w]`` holds each block's bound on
    its key for request ``w`` and ``reach[w]`` the largest such bound from a position on. Until every request has
    ``k`` values there is no bar to prune against, so the block that heads the order is decomposed. Then blocks are
    bounded more tightly by :func:`power_radius_bounds` (in doubling chunks, while some unbounded block's norm
    bound could beat the tight bounds in hand; squaring stops for a block once it is below every bar it could
    reach; a rightmost request's real-part bounds are tightened by :func:`real_part_bounds`), and decomposed one
    at a time in descending order of the tight bound, each raising the bar; a block is never decomposed once no
    request's k-th key is within its bound.
    """
    size = len(reach["LM"])
    pool = torch.zeros(0, dtype=torch.long)  # bounded, not yet decomposed positions
    tight = {w: torch.zeros(0) for w in {"LM", *requests}}  # their tight key bounds (and radius bounds)
    position, chunk = 0, 4
    while True:
        bars = {
            w: order_key(best[w][k - 1], w).item() if best[w].numel() >= k else -np.inf for w, k in requests.items()
        }
        could = torch.zeros(len(pool), dtype=torch.bool)
        for w in requests:
            could |= ~(tight[w] + POWER_MARGIN * tight[w].abs() < bars[w])  # NaN bounds are kept
        pool, tight = pool[could], {w: b[could] for w, b in tight.items()}
        ahead = position < size and any(not float(reach.get(w, reach["LM"])[position]) < bars[w] for w in requests)
        if not ahead and len(pool) == 0:
            return best
        top = int(tight["LM"].nan_to_num(np.inf).argmax()) if len(pool) else None
        if ahead and all(bar == -np.inf for bar in bars.values()):
            take = torch.tensor([position])  # nothing to prune against yet
            position += 1
        elif ahead and (top is None or float(reach["LM"][position]) > float(tight["LM"][top])):
            # bounds along the order are non-increasing, so the blocks still reaching are a run from ``position``
            reaching = max(int((~(reach.get(w, reach["LM"])[position:] < bars[w])).sum()) for w in requests)
            take = torch.arange(position, min(size, position + max(1, min(reaching, chunk, largest_chunk))))
            position, chunk = int(take[-1]) + 1, 2 * chunk
            # the radius each block must reach to matter: a request's bar, where its own key bound reaches that bar
            floor = torch.full((len(take),), np.inf)
            for w in requests:
                floor = torch.where(keys.get(w, keys["LM"])[take] < bars[w], floor, floor.clamp(max=bars[w]))
            blocks = blocks_at(take)
            radius = power_radius_bounds(blocks, floor=floor.to(blocks.device, blocks.dtype)).cpu()
            pool = torch.cat([pool, take])
            bounded = {w: torch.minimum(radius, keys.get(w, keys["LM"])[take]) for w in tight}
            if "LR" in requests and bars["LR"] > -np.inf:
                bounded["LR"] = real_part_bounds(blocks, radius, bounded["LR"], bars["LR"])
            tight = {w: torch.cat([b, bounded[w]]) for w, b in tight.items()}
            continue
        else:
            assert top is not None  # the pool is not empty here
            take = pool[top : top + 1]
            keep = torch.arange(len(pool)) != top
            pool, tight = pool[keep], {w: b[keep] for w, b in tight.items()}
        found = eigvals(blocks_at(take)).flatten()
        if not bool(found.isfinite().all()):  # a non-finite layer: NaN, not a search through every block
            return {w: found.new_full((k,), complex(float("nan"), float("nan"))) for w, k in requests.items()}
        best = {w: first_by(torch.cat([best[w], found]), k, w) for w, k in requests.items()}


def real_part_bounds(blocks: Tensor, radius: Tensor, bounds: Tensor, bar: float) -> Tensor:
    """Tighter upper bounds on ``max Re lambda`` of the blocks whose ``bounds`` ``(c,)`` still reach ``bar``.

    For every ``c > 0``, ``Re lambda <= |lambda + c| - c <= rho(B + c I) - c``: a disk centred at ``-c`` that
    holds the spectrum, tending to the half-plane as ``c`` grows. With ``c`` the block's radius bound and
    ``rho(I + B / c)`` bounded by :func:`power_radius_bounds` at ``m = 128``, it lies within about 10% of the
    rightmost real part on attention blocks, where the numerical-abscissa and radius bounds are 1.5-3x off; the
    rightmost request then decomposes about a third as many blocks. The round-off margin is applied before the
    shift is taken off. ``radius`` is ``(c,)`` on the host.
    """
    open_ = (bounds + POWER_MARGIN * bounds.abs() >= bar) & (radius > 0) & radius.isfinite()
    if not bool(open_.any()):
        return bounds
    shift = radius[open_].to(blocks.device, blocks.dtype)
    chosen = blocks[open_.to(blocks.device)] / shift[:, None, None]
    chosen.diagonal(dim1=-2, dim2=-1).add_(1)  # I + B / c
    rho = power_radius_bounds(chosen, SHIFTED_SQUARINGS, floor=1 + bar / shift)
    shifted = (shift * (rho * (1 + POWER_MARGIN) - 1)).cpu()
    return bounds.masked_scatter(open_, torch.minimum(bounds[open_], shifted))


def numerical_abscissa(w_v: Tensor, w_o: Tensor) -> Tensor:
    """``omega(T_h) = lambda_max((T_h + T_h^T) / 2)`` of each head map: ``(*, H)``.

    ``(T + T^T) / 2 = B J B^T`` with ``B = [O_h, V_h^T]`` (``d x 2 d_h``) and ``J = [[0, I], [I, 0]] / 2``; with
    ``B = Q R`` its nonzero eigenvalues are those of the ``2 d_h x 2 d_h`` symmetric ``R J R^T`` (and 0 when
    ``2 d_h < d``), so no ``d x d`` decomposition is needed.
    """
    d_h, d = w_v.shape[-2:]
    if 2 * d_h >= d:
        maps = w_o @ w_v
        return eigvalsh((maps + maps.mT) / 2)[..., -1]
    r = torch.linalg.qr(torch.cat([w_o, w_v.mT], dim=-1), mode="r").R  # (*, H, 2 d_h, 2 d_h)
    left, right = r[..., :d_h], r[..., d_h:]
    return eigvalsh((left @ right.mT + right @ left.mT) / 2)[..., -1].clamp(min=0)


def block_norms(w_v: Tensor, w_o: Tensor) -> Tensor:
    """The weight-only factors of :func:`block_radius_bounds`: ``(*, 3, H)``, computed once for every sequence.

    Rows: ``||T_h||_2``; ``||P_h||_2`` of head h's rows and of its columns in ``P = V O``. (``max_h A^h_ii ||O||_2
    ||V||_2`` is a valid bound too, but was almost never the smallest on trained or random layers and cost two
    ``d x d`` SVDs: at d = 768, more than the rest of the bounds together.)
    """
    heads = w_v.shape[-3]
    v_cat, o_cat = concat_heads(w_v, w_o)
    p = v_cat @ o_cat  # (*, H*d_h, H*d_h)
    rows = spectral_norm(p.unflatten(-2, (heads, -1)))  # (*, H)
    columns = spectral_norm(p.unflatten(-1, (heads, -1)).movedim(-2, -3))  # (*, H)
    return torch.stack([transport_singular_values(w_v, w_o)[..., 0], rows, columns], dim=-2)


def block_radius_bounds(self_weight: Tensor, norms: Tensor) -> Tensor:
    """Upper bounds on the spectral radius of each causal diagonal block ``D_i = O diag(a_i) V``: ``(n,)``.

    ``self_weight`` is ``(n, H)`` (``A^h_ii``), ``norms`` the ``(3, H)`` of :func:`block_norms`; see
    :func:`causal_first` for the three bounds.
    """
    squared = self_weight**2
    return torch.stack(
        [
            self_weight @ norms[0],
            (squared @ norms[1] ** 2).sqrt(),
            (squared @ norms[2] ** 2).sqrt(),
        ]
    ).amin(dim=0)


def power_radius_bounds(blocks: Tensor, squarings: int = SQUARINGS, floor: Tensor | None = None) -> Tensor:
    """Upper bounds ``||B^m||_F^(1/m)``, ``m = 2^squarings``, on the spectral radii of blocks ``(c, r, r) -> (c,)``.

    ``rho(B)^m = rho(B^m) <= ||B^m||_F``, and the bound tends to ``rho(B)`` as ``m`` grows (Gelfand): the factor by
    which it can exceed it is at most ``(sqrt(r) kappa)^(1/m)`` for ``r`` the size and ``kappa`` the eigenvector
    condition number, so 5 squarings leave about 1.1 where the norm bounds leave 2-4. Each squaring is normalized
    (no overflow or underflow); five GEMMs cost far less than the eigenvalue problem they spare. NaN for a
    non-finite block.

    With ``floor`` ``(c,)``, a block stops being squared once its bound (every ``||B^(2^j)||_F^(1/2^j)`` is one) lies
    below its floor by more than the round-off margin: the caller needs no tighter bound for it. Most blocks the
    norm bounds leave in drop after one or two squarings.
    """
    bounds = torch.linalg.matrix_norm(blocks)
    active = torch.arange(len(blocks), device=blocks.device)
    log_scale = blocks.new_zeros(blocks.shape[:-2])
    power = blocks
    for level in range(1, squarings + 1):
        if floor is not None:
            keep = ~(bounds[active] + POWER_MARGIN * bounds[active] < floor[active])  # NaN is kept
            if not bool(keep.all()):
                active, power, log_scale = active[keep], power[keep], log_scale[keep]
            if len(active) == 0:
                break
        norm = torch.linalg.matrix_norm(power)
        power = power / torch.where(norm > 0, norm, torch.ones_like(norm))[..., None, None]
        log_scale = 2 * (log_scale + norm.log())
        power = power @ power
        bounds[active] = torch.exp((log_scale + torch.linalg.matrix_norm(power).log()) / 2**level)
    return bounds
