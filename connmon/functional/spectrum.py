"""The connection walk operator ``M = sum_h kron(A^h, T_h)`` and its spectrum (docs/diagnostics.md).

``M`` acts on token-major vector fields ``X`` (``n x d``, flat index ``i * d + a``) as
``M(X) = sum_h A^h X T_h^T``. Spectral quantities are of ``M / s``, ``s`` the transport scale
(:func:`connmon.functional.transport_scale`); a zero transport (``s = 0``) has the zero normalized operator.

Constant fields are invariant: rows of ``A^h`` sum to 1, so ``M(1 v^T) = 1 (T_bar v)^T`` and ``eig(T_bar / s)`` is
always part of ``eig(M / s)``, a weight-only part (:func:`ov_spectral_radius`). By default (``deflate=True``) the
spectral functions report the *walk part*: the operator on the quotient by constant fields, ``Q M Q`` on the range
of ``Q = (I - 1 1^T / m) ⊗ I_d`` over the ``m`` valid tokens (keys some query attends; a padding key nobody reads
has a zero column). In an orthonormal basis ``U (n, n - 1)`` of the mean-zero fields on the valid tokens (Helmert
vectors, zero columns for padding) it is ``sum_h kron(U^T A^h U, T_h)``, so every path below runs on
``U^T A^h U`` unchanged, except the causal one, which drops the first valid token's block (``D = T_bar``). The full
spectrum is the union of the walk part and ``eig(T_bar / s)``, with multiplicity.

The spectrum solver picks the cheapest exact path that the layer allows (``method="auto"``):

* ``"kron"``: one head, ``M = kron(A, T)``: the eigenvalues are the products ``lambda_i(A) mu_a(T)``.
* ``"dense"``: ``n d <= 512``: ``torch.linalg.eigvals`` of the dense operator.
* ``"causal"``: every head causal (``A^h`` lower triangular), so ``M`` is block lower triangular and its
  eigenvalues are the union over tokens of ``eig(sum_h A^h_ii T_h)``. Krylov methods stall on such non-normal
  operators; this path is exact. Detecting it costs one GPU synchronization.
* ``"krylov"``: otherwise, a restarted Krylov-Schur method that only applies the operator and never forms ``M``.
  ``M = F G`` factors through the heads' values (``G(X) = [A^h X V_h^T]_h``, ``F(Z) = Z O^T``); where they span
  ``d`` (``H d_h = d``, most models) it solves on ``G F`` instead, which has the same characteristic polynomial and
  costs one GEMM per product where ``M`` costs two. The operator norm uses the same solver on ``M^T M``
  (thick-restart Lanczos).

Shapes: ``attn (*, H, n, n)``, ``w_v (*, H, d_h, d)``, ``w_o (*, H, d, d_h)``, leading dims broadcast. All paths
except the matvec synchronize the GPU (eigenvalue solvers). Non-finite input gives NaN and never hangs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Any, Literal, NamedTuple, get_args, overload

import numpy as np
import torch
from torch import Tensor

from connmon._linalg import eigvals, spectral_norm
from connmon._linalg.heads import concat_heads
from connmon._linalg.krylov import Which, certified, default_tol, krylov_schur
from connmon._linalg.lanczos import largest_eigenvalue
from connmon.functional._causal import causal_first, complex_dtype, first_by
from connmon.functional._checks import as_float, promote, shape
from connmon.functional.operator import (
    checked_layer,
    connection_operator,
    each_layer,
    head_space_matvec,
    matvec,
    rmatvec,
    walk_part,
)
from connmon.functional.transport import transport_scale

__all__ = [
    "Spectra",
    "SpectrumResult",
    "connection_laplacian_gap",
    "connection_operator_norm",
    "connection_spectra",
    "connection_spectral_radius",
    "connection_spectrum",
    "ov_spectral_radius",
]

Method = Literal["auto", "dense", "kron", "causal", "krylov"]
DENSE_MAX_DIM = 512  # n * d up to which "auto" takes the dense eigensolver
_SECOND_SEED = 7919  # the second Krylov start of a certified spectrum
_HEAD_SPACE = True  # Krylov solves on G F where H d_h = d (benchmarks/bench_certified.py compares it with M)
_GUARD = 4  # values solved for beyond the k wanted, so that one near the k-th is not skipped by both solves
_NORM_LANCZOS_STEPS = 24  # batched Lanczos steps for the operator norm before the restarted solver


class SpectrumResult(NamedTuple):
    """Eigenvalues of ``M / s`` with the evidence of how they were found.

    Attributes:
        eigenvalues: ``(*, k)`` complex, in the wanted order.
        residuals: ``(*, k)`` ``||(M/s) x - theta x||`` of the unit Ritz vectors (Krylov path); 0 on the direct
            paths, whose accuracy is LAPACK's.
        converged: ``(*, k)`` bool, residual within tolerance.
        num_matvecs: ``(*,)`` matvecs used (0 on the direct paths).
        method: the path taken.
    """

    eigenvalues: Tensor
    residuals: Tensor
    converged: Tensor
    num_matvecs: Tensor
    method: str


def _padded(attn: Tensor) -> Tensor | None:
    """The valid tokens ``(*, n)`` when some sequence has a key nobody reads (padding), else None (one host sync)."""
    valid = (attn != 0).any(dim=-2).any(dim=-2)
    return None if bool(valid.all()) else valid


def _each_sequence(
    solve: Callable[..., Tensor], attn: Tensor, w_v: Tensor, w_o: Tensor, valid: Tensor, scale: Tensor | None
) -> Tensor:
    """``solve(attn, w_v, w_o, m, scale=s)`` on each layer of the batch restricted to its ``m`` valid tokens, stacked.

    The walk part's ``Q`` runs over the valid tokens of a padded sequence, whose count differs between sequences.
    ``scale`` (``transport_scale``, computed here when None) is weight-only: one per layer, not one per sequence.
    """
    heads, n = attn.shape[-3], attn.shape[-1]
    batch = torch.broadcast_shapes(attn.shape[:-3], w_v.shape[:-3], w_o.shape[:-3])
    scale = torch.as_tensor(transport_scale(w_v, w_o) if scale is None else scale).expand(batch)
    attn, valid = attn.expand(*batch, heads, n, n), valid.expand(*batch, n)
    w_v, w_o = w_v.expand(*batch, *w_v.shape[-3:]), w_o.expand(*batch, *w_o.shape[-3:])
    found = []
    for index in np.ndindex(*batch):
        keep = valid[index].nonzero().squeeze(-1)
        found.append(solve(attn[index][:, keep][:, :, keep], w_v[index], w_o[index], len(keep), scale=scale[index]))
    return torch.stack(found).reshape(tuple(batch) + tuple(found[0].shape))


def _nan_padded(values: Tensor, k: int) -> Tensor:
    """``values (..., j)`` followed by NaN up to ``k`` entries (a short sequence has fewer eigenvalues)."""
    missing = values.new_full((*values.shape[:-1], k - values.shape[-1]), float("nan"))
    return torch.cat([values, missing], dim=-1)


def _inverse_scale(w_v: Tensor, w_o: Tensor, scale: Tensor | None = None) -> Tensor:
    scale = transport_scale(w_v, w_o) if scale is None else scale
    return torch.where(scale == 0, torch.zeros_like(scale), 1 / scale)


def _kron_eigenvalues(attn: Tensor, w_v: Tensor, w_o: Tensor) -> Tensor:
    lam = eigvals(attn[..., 0, :, :])  # (*, n)
    mu = eigvals(w_o[..., 0, :, :] @ w_v[..., 0, :, :])  # (*, d)
    return (lam.unsqueeze(-1) * mu.unsqueeze(-2)).flatten(-2)


def _direct_first(
    chosen: Method, attn: Tensor, w_v: Tensor, w_o: Tensor, requests: dict[Which, int], deflate: bool = False
) -> dict[Which, Tensor]:
    """The exact paths (kron, dense, causal): one decomposition serves every request ``{which: k}``.

    ``attn`` is already the walk part's (``U^T A U``) on the kron and dense paths; the causal path takes the original
    attention and ``deflate``.
    """
    if chosen == "causal":
        return causal_first(attn, w_v, w_o, requests, deflate=deflate)
    if chosen == "kron":
        everything = _kron_eigenvalues(attn, w_v, w_o)
    else:
        n, d = attn.shape[-1], w_v.shape[-1]
        everything = eigvals(connection_operator(attn, w_v, w_o, max_dim=n * d))
    return {which: first_by(everything, k, which) for which, k in requests.items()}


def _is_causal(attn: Tensor) -> bool:
    return not bool(torch.triu(attn, diagonal=1).any())  # one GPU synchronization


def _choose(method: Method, attn: Tensor, n: int, d: int) -> Method:
    if method != "auto":
        return method
    if attn.shape[-3] == 1:
        return "kron"
    if n * d <= DENSE_MAX_DIM:
        return "dense"
    return "causal" if _is_causal(attn) else "krylov"


def _krylov_per_layer(
    attn: Tensor,
    w_v: Tensor,
    w_o: Tensor,
    k: int,
    which: Which,
    normal_equations: bool,
    **options: Any,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Run the Krylov solver on each layer of the broadcast batch; return eigenvalues, residuals, flags, matvecs."""
    n, d = attn.shape[-1], w_v.shape[-1]
    batch = torch.broadcast_shapes(attn.shape[:-3], w_v.shape[:-3], w_o.shape[:-3])
    values = torch.zeros(*batch, k, dtype=torch.complex128)
    residuals = torch.zeros(*batch, k, dtype=torch.float64)
    converged = torch.zeros(*batch, k, dtype=torch.bool)
    matvecs = torch.zeros(batch, dtype=torch.long)
    # values beyond the k-th guard its order; a second start with twice the basis certifies it, a third with three
    # times the basis where the two disagree (see connmon._linalg.krylov.certified)
    seed, ncv = options.pop("seed", 0), options.get("ncv")
    wanted = k if normal_equations else max(k, min(k + _GUARD, (ncv or n * d) - 2, n * d - 2))
    basis = ncv or max(2 * wanted + 1, 30)
    wider, widest = ({**options, "ncv": min(n * d, times * basis)} for times in (2, 3))
    tol = options.get("tol") or default_tol(attn.dtype)
    # where the heads' values span d, the eigenvalues are solved for on G F instead of M = F G: half the flops
    head_space = _HEAD_SPACE and not normal_equations and attn.shape[-3] * w_v.shape[-2] == d
    for index, a, v, o in each_layer(attn, w_v, w_o):
        mix = v @ o if head_space else None

        def operator(x: Tensor, a: Tensor = a, v: Tensor = v, o: Tensor = o, mix: Tensor | None = mix) -> Tensor:
            if mix is not None:
                return head_space_matvec(a, mix, x.view(n, d)).flatten()
            y = matvec(a, v, o, x.view(n, d))
            return (rmatvec(a, v, o, y) if normal_equations else y).flatten()

        solve = partial(krylov_schur, operator, n * d, wanted, which=which, dtype=attn.dtype, device=attn.device)
        found = solve(seed=seed, **options)
        if not normal_equations:
            solves = [found, solve(seed=seed + _SECOND_SEED, **wider)]
            found = certified(solves, k, which, tol)
            # they disagree while one found its top k: a third start arbitrates (where neither found them, on layers
            # of nearly tied values, a third would run out of restarts too); with the second's basis it agreed with
            # the second on lists that both had skipped a value in (benchmarks/bench_certified.py), with three times
            # the first's it did not
            if not found.converged.all() and any(each.converged[:k].all() for each in solves):
                solves.append(solve(seed=seed + 2 * _SECOND_SEED, **widest))
                found = certified(solves, k, which, tol)
        values[index] = torch.from_numpy(found.eigenvalues)
        residuals[index] = torch.from_numpy(found.residuals)
        converged[index] = torch.from_numpy(found.converged)
        matvecs[index] = found.num_matvecs
    return values.to(attn.device), residuals.to(attn.device), converged.to(attn.device), matvecs.to(attn.device)


@overload
def connection_spectrum(
    attn: Tensor,
    w_v: Tensor,
    w_o: Tensor,
    k: int = 8,
    which: Which = "LM",
    *,
    deflate: bool = True,
    method: Method = "auto",
    tol: float | None = None,
    ncv: int | None = None,
    max_restarts: int = 100,
    seed: int = 0,
    return_info: Literal[False] = False,
    scale: Tensor | None = None,
) -> Tensor: ...


@overload
def connection_spectrum(
    attn: Tensor,
    w_v: Tensor,
    w_o: Tensor,
    k: int = 8,
    which: Which = "LM",
    *,
    deflate: bool = True,
    method: Method = "auto",
    tol: float | None = None,
    ncv: int | None = None,
    max_restarts: int = 100,
    seed: int = 0,
    return_info: Literal[True],
    scale: Tensor | None = None,
) -> SpectrumResult: ...


def connection_spectrum(
    attn: Tensor,
    w_v: Tensor,
    w_o: Tensor,
    k: int = 8,
    which: Which = "LM",
    *,
    deflate: bool = True,
    method: Method = "auto",
    tol: float | None = None,
    ncv: int | None = None,
    max_restarts: int = 100,
    seed: int = 0,
    return_info: bool = False,
    scale: Tensor | None = None,
) -> Tensor | SpectrumResult:
    """The ``k`` eigenvalues of the walk part of ``M / s`` of largest modulus (``"LM"``) or real part (``"LR"``).

    The walk part is ``Q M Q / s`` on the quotient by constant fields (see the module docstring): it excludes
    ``eig(T_bar / s)``, which every layer has whatever its attention. ``deflate=False`` gives the eigenvalues of
    ``M / s`` itself. Eigenvalues come in descending order of the chosen key; a complex-conjugate pair is ordered
    with the positive imaginary part first. See the module docstring for the solver paths.

    Args:
        attn: ``(*, H, n, n)``.
        w_v: ``(*, H, d_h, d)``.
        w_o: ``(*, H, d, d_h)``.
        k: number of eigenvalues; at most ``(n - 1) d`` for the walk part, ``n d`` for ``M``.
        which: ``"LM"`` or ``"LR"``.
        deflate: the walk part (default) or, with False, the whole operator ``M / s``.
        method: ``"auto"``, ``"dense"``, ``"kron"`` (needs ``H = 1``), ``"causal"`` (needs causal attention; not
            checked) or ``"krylov"``.
        tol: Krylov relative residual tolerance; default 1e-5 in float32, 1e-10 in float64.
        ncv: Krylov basis size; default ``max(2k + 1, 30)``.
        max_restarts: bound on Krylov restarts.
        seed: seed of the Krylov start vector (results are deterministic for a seed).
        return_info: return a :class:`SpectrumResult` with residuals instead of the eigenvalues alone.
        scale: ``transport_scale(w_v, w_o)`` ``(*,)`` when the caller has it already (it is weight-only: one per
            layer serves every diagnostic of that layer); computed when None.

    Returns:
        ``(*, k)`` complex eigenvalues, or a :class:`SpectrumResult`.

    Raises:
        ValueError: if the shapes do not match, ``k`` is out of range, or ``which``/``method`` are unknown.

    Examples:
        >>> import torch
        >>> from connmon.functional import connection_operator, connection_spectrum, transport_scale
        >>> _ = torch.manual_seed(0)
        >>> attn = (3 * torch.randn(4, 32, 32)).softmax(-1)  # H=4, n=32
        >>> w_v, w_o = torch.randn(4, 8, 32) / 6, torch.randn(4, 32, 8) / 6  # d_h=8, d=32: n*d = 1024
        >>> found = connection_spectrum(attn, w_v, w_o, k=4, deflate=False, return_info=True)
        >>> found.method, bool(found.converged.all())
        ('krylov', True)
        >>> dense = torch.linalg.eigvals(connection_operator(attn, w_v, w_o).double()) / transport_scale(w_v, w_o)
        >>> top = dense[dense.abs().argsort(descending=True)][:4]
        >>> bool(torch.allclose(found.eigenvalues.abs().double(), top.abs(), rtol=1e-4))
        True
        >>> walk = connection_spectrum(attn, w_v, w_o, k=4)  # the walk part: below the constant-field part here
        >>> bool(walk.abs()[0] <= found.eigenvalues.abs()[0])
        True
    """
    attn, w_v, w_o, (heads, n, _, d) = checked_layer(attn, w_v, w_o)
    if which not in ("LM", "LR"):
        raise ValueError(f"which must be 'LM' (largest modulus) or 'LR' (largest real part), got which={which!r}")
    if method not in get_args(Method):
        raise ValueError(f"method must be one of {', '.join(map(repr, get_args(Method)))}, got method={method!r}")
    size = (n - 1) * d if deflate else n * d
    if not 1 <= k <= size:
        part = "(n-1)*d" if deflate else "n*d"
        raise ValueError(f"k must satisfy 1 <= k <= {part} = {size}, got k={k}")
    valid = _padded(attn) if deflate else None
    if valid is not None:  # Q runs over each sequence's valid tokens
        options: dict[str, Any] = dict(
            which=which, method=method, tol=tol, ncv=ncv, max_restarts=max_restarts, seed=seed
        )
        methods = set()

        def solve(a: Tensor, v: Tensor, o: Tensor, m: int, scale: Tensor) -> Tensor:
            if (m - 1) * d < 1:
                return a.new_full((k, 3), float("nan"), dtype=complex_dtype(a))
            found = connection_spectrum(a, v, o, k=min(k, (m - 1) * d), return_info=True, scale=scale, **options)
            methods.add(found.method)
            columns = torch.stack([found.eigenvalues, found.residuals.to(found.eigenvalues.dtype),
                                   found.converged.to(found.eigenvalues.dtype)], dim=-1)  # fmt: skip
            return _nan_padded(columns.mT, k).mT  # (k, 3)

        found = _each_sequence(solve, attn, w_v, w_o, valid=valid, scale=scale)  # (*, k, 3)
        if not return_info:
            return found[..., 0]
        residuals, converged = found[..., 1].real, found[..., 2].real == 1
        matvecs = torch.zeros(found.shape[:-2], dtype=torch.long, device=attn.device)
        return SpectrumResult(found[..., 0], residuals, converged, matvecs, method="/".join(sorted(methods)) or "none")
    chosen = _choose(method, attn, n, d)
    if deflate and chosen != "causal":
        attn, n = walk_part(attn), n - 1
    if chosen == "kron" and heads != 1:
        raise ValueError(f"method='kron' needs a single head, got attn{shape(attn)} with H={heads}")
    if chosen == "krylov" and k + 2 > n * d:
        raise ValueError(f"method='krylov' needs k + 2 <= {n * d} (the operator's size), got k={k}; use 'dense'")
    inverse_scale = _inverse_scale(w_v, w_o, scale).unsqueeze(-1)
    batch = torch.broadcast_shapes(attn.shape[:-3], w_v.shape[:-3], w_o.shape[:-3])
    matvecs = torch.zeros(batch, dtype=torch.long, device=attn.device)
    if chosen == "krylov":
        values, residuals, converged, matvecs = _krylov_per_layer(
            attn,
            w_v,
            w_o,
            k,
            which=which,
            normal_equations=False,
            tol=tol,
            ncv=ncv,
            max_restarts=max_restarts,
            seed=seed,
        )
        values = values.to(complex_dtype(attn))
        residuals = residuals.to(attn.dtype) * inverse_scale
        values = values * inverse_scale
    else:
        values = (
            _direct_first(chosen, attn, w_v, w_o, requests={which: k}, deflate=deflate)[which] * inverse_scale
        ).expand(*batch, k)
        residuals = torch.zeros(*batch, k, dtype=attn.dtype, device=attn.device)
        converged = values.isfinite()
    if not return_info:
        return values
    return SpectrumResult(values, residuals, converged, matvecs, method=chosen)


class Spectra(NamedTuple):
    """The two ends of the spectrum (of the walk part, by default) of ``M / s`` that the diagnostics read.

    Attributes:
        largest: ``(*, k)`` the ``k`` eigenvalues of largest modulus, descending.
        rightmost: ``(*,)`` the eigenvalue of largest real part.
        largest_converged: ``(*, k)`` bool, per eigenvalue: it met the Krylov tolerance (always True on the exact
            paths). A Krylov solve that runs out of restarts returns Ritz values, which can be far from any
            eigenvalue; the metrics leave unconverged values out rather than log them as measured.
        rightmost_converged: ``(*,)`` bool, the same for ``rightmost``. On a layer whose largest eigenvalue did
            not converge the rightmost solve is not attempted (NaN, False).
    """

    largest: Tensor
    rightmost: Tensor
    largest_converged: Tensor
    rightmost_converged: Tensor


def connection_spectra(
    attn: Tensor, w_v: Tensor, w_o: Tensor, k: int = 8, *, deflate: bool = True, **solver: Any
) -> Spectra:
    """The ``k`` eigenvalues of largest modulus and the rightmost one, of the walk part, from one decomposition.

    Equal to ``connection_spectrum(..., k, "LM")`` and ``connection_spectrum(..., 1, "LR")[..., 0]``, but the exact
    paths (one head, dense, causal) decompose once for both, and the Krylov path solves for the rightmost only on the
    layers whose certified largest values do not settle it: every other eigenvalue ``mu`` has ``Re mu <= |mu| <=
    |lambda_m|``, the smallest certified modulus, so a certified value whose real part reaches it is the rightmost
    (trained layers, whose largest walk-part eigenvalue is real and positive, mostly are settled). This is what the
    spectral radius and the connection Laplacian gap need together.

    Args:
        attn: ``(*, H, n, n)``.
        w_v: ``(*, H, d_h, d)``.
        w_o: ``(*, H, d, d_h)``.
        k: eigenvalues of largest modulus.
        deflate: the walk part (default) or, with False, the whole operator ``M / s``.
        **solver: keyword options of :func:`connection_spectrum` (method, tol, ncv, max_restarts, seed, scale).

    Returns:
        A :class:`Spectra`.

    Raises:
        ValueError: as :func:`connection_spectrum`.

    Examples:
        >>> import torch
        >>> from connmon.functional import connection_spectra, connection_spectrum
        >>> _ = torch.manual_seed(0)
        >>> attn = (3 * torch.randn(2, 6, 6)).softmax(-1)
        >>> w_v, w_o = torch.randn(2, 2, 4), torch.randn(2, 4, 2)
        >>> both = connection_spectra(attn, w_v, w_o, k=3)
        >>> bool(torch.equal(both.largest, connection_spectrum(attn, w_v, w_o, k=3)))
        True
        >>> bool(torch.equal(both.rightmost, connection_spectrum(attn, w_v, w_o, k=1, which="LR")[..., 0]))
        True
    """
    attn, w_v, w_o, (_, n, _, d) = checked_layer(attn, w_v, w_o)
    method = solver.get("method", "auto")
    size = (n - 1) * d if deflate else n * d
    valid = _padded(attn) if deflate else None
    direct = method in ("auto", "dense", "kron", "causal") and 1 <= k <= size and valid is None
    chosen = _choose(method, attn, n, d) if direct else None
    if chosen in (None, "krylov"):  # the Krylov solves (or the checks and padding of connection_spectrum)
        options: dict[str, Any] = dict(solver, deflate=deflate, return_info=True)
        if chosen == "krylov":
            options["method"] = "krylov"
        largest = connection_spectrum(attn, w_v, w_o, k=k, which="LM", **options)
        rightmost, known = _rightmost_among(largest)
        # no LR solve where the radius did not converge: values tied that closely would exhaust its restarts too
        radius = largest.converged[..., 0]
        rightmost = rightmost.masked_fill(~radius, complex(float("nan"), float("nan")))
        unsettled = radius & ~known
        if bool(unsettled.any()):  # one LR solve, on the layers whose largest values do not settle it
            batch = rightmost.shape
            need = unsettled.flatten().nonzero().squeeze(-1)

            def pick(tensor: Tensor, dims: int) -> Tensor:
                tail = tensor.shape[tensor.dim() - dims :]
                return tensor.expand(tuple(batch) + tuple(tail)).reshape(-1, *tail)[need]

            if options.get("scale") is not None:
                options["scale"] = pick(torch.as_tensor(options["scale"]), 0)
            right = connection_spectrum(pick(attn, 3), pick(w_v, 3), pick(w_o, 3), k=1, which="LR", **options)
            rightmost, known = rightmost.flatten().clone(), known.flatten().clone()
            rightmost[need], known[need] = right.eigenvalues[..., 0], right.converged[..., 0]
            rightmost, known = rightmost.reshape(batch), known.reshape(batch)
        return Spectra(largest.eigenvalues, rightmost, largest.converged, known)
    if chosen == "kron" and attn.shape[-3] != 1:
        raise ValueError(f"method='kron' needs a single head, got attn{shape(attn)} with H={attn.shape[-3]}")
    batch = torch.broadcast_shapes(attn.shape[:-3], w_v.shape[:-3], w_o.shape[:-3])
    part = walk_part(attn) if deflate and chosen != "causal" else attn
    found = _direct_first(chosen, part, w_v, w_o, requests={"LM": k, "LR": 1}, deflate=deflate)
    inverse_scale = _inverse_scale(w_v, w_o, solver.get("scale"))
    largest = (found["LM"] * inverse_scale.unsqueeze(-1)).expand(*batch, k)
    rightmost = (found["LR"][..., 0] * inverse_scale).expand(batch)
    return Spectra(largest, rightmost, largest.isfinite(), rightmost.isfinite())


def _rightmost_among(largest: SpectrumResult) -> tuple[Tensor, Tensor]:
    """The rightmost eigenvalue where the certified largest ones settle it: ``(values (*,), settled (*,) bool)``.

    Every eigenvalue outside a certified prefix ``lambda_1..lambda_m`` of the largest moduli has ``Re mu <= |mu| <=
    |lambda_m|``; so when the largest ``Re lambda_j`` reaches ``|lambda_m|`` (each side moved by ten times its
    residual, the bound :func:`connmon._linalg.krylov.certified` matches values by), ``lambda_j`` is the rightmost.
    """
    values, margin = largest.eigenvalues, 10 * largest.residuals.to(largest.eigenvalues.real.dtype)
    prefix = largest.converged.int().cumprod(dim=-1).bool()
    last = (prefix.sum(dim=-1, keepdim=True) - 1).clamp(min=0)
    bound = (values.abs() + margin).gather(-1, last).squeeze(-1)
    real = torch.where(prefix, values.real, torch.full_like(margin, -float("inf")))
    best = real.argmax(dim=-1, keepdim=True)  # the first of a conjugate pair: positive imaginary part
    settled = prefix[..., 0] & ((real - margin).gather(-1, best).squeeze(-1) >= bound)
    return values.gather(-1, best).squeeze(-1), settled


def _no_walk_part(attn: Tensor, solver: dict) -> bool:
    """One token and the walk part asked for: nothing but constant fields, so no value (NaN)."""
    return solver.get("deflate", True) and attn.shape[-1] < 2


def _nan_batch(attn: Tensor, w_v: Tensor, w_o: Tensor) -> Tensor:
    batch = torch.broadcast_shapes(attn.shape[:-3], w_v.shape[:-3], w_o.shape[:-3])
    return torch.full(batch, float("nan"), dtype=as_float(attn, "attn").dtype, device=attn.device)


def connection_spectral_radius(attn: Tensor, w_v: Tensor, w_o: Tensor, **solver: Any) -> Tensor:
    """Spectral radius ``|lambda_1|`` of the walk part of ``M / s`` (``deflate=False``: of ``M / s``).

    Args:
        attn: ``(*, H, n, n)``.
        w_v: ``(*, H, d_h, d)``.
        w_o: ``(*, H, d, d_h)``.
        **solver: keyword options of :func:`connection_spectrum` (deflate, method, tol, ncv, max_restarts, seed).

    Returns:
        ``(*,)``.

    Raises:
        ValueError: as :func:`connection_spectrum`.

    Examples:
        >>> import torch
        >>> from connmon.functional import connection_spectral_radius
        >>> attn = torch.tensor([[[0.5, 0.5, 0.0], [0.0, 0.5, 0.5], [0.5, 0.0, 0.5]]])  # a lazy cycle on 3 tokens
        >>> w = torch.eye(2)[None]  # T = I, s = 1: eigenvalues 1 (constant fields) and (1 + exp(+-2 pi i / 3)) / 2
        >>> connection_spectral_radius(attn, w, w, deflate=False), connection_spectral_radius(attn, w, w)
        (tensor(1.0000), tensor(0.5000))
    """
    if _no_walk_part(attn, solver):
        return _nan_batch(attn, w_v, w_o)
    return connection_spectrum(attn, w_v, w_o, k=1, which="LM", **solver)[..., 0].abs()


def connection_laplacian_gap(attn: Tensor, w_v: Tensor, w_o: Tensor, **solver: Any) -> Tensor:
    """Bottom of the connection Laplacian's spectrum away from constant fields: ``1 - max Re lambda`` of the walk part.

    ``L = I - M / s``. As ``walk_spectral_gap`` drops the trivial eigenvalue 1, this drops the constant fields (whose
    eigenvalues are ``T_bar``'s, ``deflate=False`` keeps them). 0 when some mean-zero vector field is transported
    consistently (``M X = s X``); larger when none is.

    Args:
        attn: ``(*, H, n, n)``.
        w_v: ``(*, H, d_h, d)``.
        w_o: ``(*, H, d, d_h)``.
        **solver: keyword options of :func:`connection_spectrum` (deflate, ...).

    Returns:
        ``(*,)``.

    Raises:
        ValueError: as :func:`connection_spectrum`.

    Examples:
        >>> import torch
        >>> from connmon.functional import connection_laplacian_gap
        >>> attn = torch.eye(3)[None]  # every token attends itself: each one's field stays put
        >>> rotation = torch.tensor([[0.0, -1.0], [1.0, 0.0]])[None]  # eigenvalues +-i: no consistent field
        >>> connection_laplacian_gap(attn, torch.eye(2)[None], torch.eye(2)[None]), connection_laplacian_gap(
        ...     attn, torch.eye(2)[None], rotation)
        (tensor(0.), tensor(1.))
    """
    if _no_walk_part(attn, solver):
        return _nan_batch(attn, w_v, w_o)
    return 1 - connection_spectrum(attn, w_v, w_o, k=1, which="LR", **solver)[..., 0].real


def connection_operator_norm(
    attn: Tensor,
    w_v: Tensor,
    w_o: Tensor,
    *,
    deflate: bool = True,
    method: Literal["auto", "dense", "kron", "krylov"] = "auto",
    tol: float | None = None,
    ncv: int = 12,
    max_restarts: int = 100,
    seed: int = 0,
    scale: Tensor | None = None,
) -> Tensor:
    """Operator 2-norm of the walk part ``||Q M Q / s||_2`` (``deflate=False``: ``||M / s||_2``).

    The full operator's norm is at least ``||T_bar||_2 / s`` (constant fields) whatever the attention; the walk
    part's is not.

    One head: ``||A||_2 ||T||_2 / s``; ``n d <= 512``: dense; otherwise Krylov-Schur (thick-restart Lanczos) on
    ``M^T M`` through the matvec and its adjoint ``M^T(Y) = sum_h (A^h)^T Y T_h``.

    Args:
        attn: ``(*, H, n, n)``.
        w_v: ``(*, H, d_h, d)``.
        w_o: ``(*, H, d, d_h)``.
        deflate: the walk part (default) or, with False, the whole operator.
        method: ``"auto"``, ``"dense"``, ``"kron"`` or ``"krylov"``.
        tol: Krylov relative residual tolerance.
        ncv: Lanczos basis size; the largest eigenvalue of the symmetric ``M^T M`` converges in about 20 steps on
            attention layers, and convergence is checked once per basis, so a small basis stops sooner (12: 21
            matvecs where 30 took 30).
        max_restarts: bound on Krylov restarts.
        seed: seed of the Krylov start vector.
        scale: ``transport_scale(w_v, w_o)`` ``(*,)`` when the caller has it already (it is weight-only: one per
            layer serves every diagnostic of that layer); computed when None.

    Returns:
        ``(*,)``.

    Raises:
        ValueError: if the shapes do not match or ``method`` is unknown.

    Examples:
        >>> import torch
        >>> from connmon.functional import connection_operator, connection_operator_norm, transport_scale
        >>> _ = torch.manual_seed(0)
        >>> attn = torch.randn(2, 5, 5).softmax(-1)
        >>> w_v, w_o = torch.randn(2, 3, 6), torch.randn(2, 6, 3)
        >>> dense = torch.linalg.matrix_norm(connection_operator(attn, w_v, w_o), ord=2) / transport_scale(w_v, w_o)
        >>> found = connection_operator_norm(attn, w_v, w_o, deflate=False, method="krylov")
        >>> bool(torch.allclose(found, dense, rtol=1e-4))
        True
    """
    attn, w_v, w_o, (heads, n, _, d) = checked_layer(attn, w_v, w_o)
    if method not in ("auto", "dense", "kron", "krylov"):
        raise ValueError(f"method must be one of 'auto', 'dense', 'kron', 'krylov', got method={method!r}")
    if deflate:
        valid = _padded(attn)
        if valid is not None:  # Q runs over each sequence's valid tokens
            options: dict[str, Any] = dict(method=method, tol=tol, ncv=ncv, max_restarts=max_restarts, seed=seed)

            def solve(a: Tensor, v: Tensor, o: Tensor, m: int, scale: Tensor) -> Tensor:
                if m < 2:
                    return a.new_tensor(float("nan"))
                return connection_operator_norm(a, v, o, scale=scale, **options)

            return _each_sequence(solve, attn, w_v, w_o, valid=valid, scale=scale)
        if n < 2:  # one token: no field but the constant ones
            return _nan_batch(attn, w_v, w_o)
        attn, n = walk_part(attn), n - 1
    if method == "auto":
        method = "kron" if heads == 1 else "dense" if n * d <= DENSE_MAX_DIM else "krylov"
    if method == "kron" and heads != 1:
        raise ValueError(f"method='kron' needs a single head, got attn{shape(attn)} with H={heads}")
    if method == "kron":
        norm = spectral_norm(attn[..., 0, :, :]) * spectral_norm(w_o[..., 0, :, :] @ w_v[..., 0, :, :])
    elif method == "dense" or n * d < 3:
        norm = spectral_norm(connection_operator(attn, w_v, w_o, max_dim=n * d))
    else:
        norm = _normal_equations_norm(
            attn, w_v, w_o, tol=tol, ncv=min(ncv, n * d), max_restarts=max_restarts, seed=seed
        )
        norm = norm.clamp(min=0).sqrt().to(attn.dtype)
    return norm * _inverse_scale(w_v, w_o, scale)


def _normal_equations_norm(
    attn: Tensor, w_v: Tensor, w_o: Tensor, tol: float | None, ncv: int, max_restarts: int, seed: int
) -> Tensor:
    """``lambda_max(M^T M)`` of every layer of the batch: ``(*,)`` float64.

    First ``_NORM_LANCZOS_STEPS`` Lanczos steps on all layers at once (one batched matvec per step, no host round
    trip); the layers whose top Ritz value has not converged then go to the restarted Krylov-Schur solver, alone.
    """
    n, d = attn.shape[-1], w_v.shape[-1]
    batch = torch.broadcast_shapes(attn.shape[:-3], w_v.shape[:-3], w_o.shape[:-3])
    v_cat, o_cat = concat_heads(w_v, w_o)
    tol = default_tol(attn.dtype) if tol is None else tol

    def normal(x: Tensor) -> Tensor:  # (N, n d) float64 -> (N, n d): M^T M of each layer
        y = matvec(attn, v_cat, o_cat, x.to(attn.dtype).view(*batch, n, d))
        return rmatvec(attn, v_cat, o_cat, y).reshape(x.shape)

    generator = torch.Generator(device=attn.device).manual_seed(seed)
    start = torch.randn(math.prod(batch), n * d, generator=generator, device=attn.device, dtype=attn.dtype)
    values, converged = largest_eigenvalue(normal, start, min(_NORM_LANCZOS_STEPS, n * d), tol)
    values = values.view(batch)
    if not bool(converged.all()):  # one synchronization
        for index in np.ndindex(*batch):
            if not converged.view(batch)[index]:
                a = attn.expand(*batch, *attn.shape[-3:])[index]
                v = w_v.expand(*batch, *w_v.shape[-3:])[index]
                o = w_o.expand(*batch, *w_o.shape[-3:])[index]
                options: dict[str, Any] = dict(tol=tol, ncv=ncv, max_restarts=max_restarts, seed=seed)
                values[index] = _krylov_per_layer(a, v, o, 1, which="LM", normal_equations=True, **options)[0][
                    ..., 0
                ].real
    return values


def ov_spectral_radius(w_v: Tensor, w_o: Tensor, *, scale: Tensor | None = None) -> Tensor:
    """``rho(T_bar) / s``: the constant-field part of the connection spectrum, weight-only and cheap.

    ``eig(T_bar / s)`` is part of ``eig(M / s)`` for every attention (constant fields are invariant), so this is what
    the full operator's spectral radius can never fall below. Computed on the ``H d_h``-dimensional core
    ``V O`` when it is smaller than ``d`` (same nonzero eigenvalues as ``T_bar = O V``). Synchronizes the GPU
    (eigenvalue solver).

    Args:
        w_v: ``(*, H, d_h, d)``.
        w_o: ``(*, H, d, d_h)``.
        scale: ``transport_scale(w_v, w_o)`` ``(*,)`` when the caller has it already (it is weight-only: one per
            layer serves every diagnostic of that layer); computed when None.

    Returns:
        ``(*,)``.

    Examples:
        >>> import torch
        >>> from connmon.functional import connection_spectrum, ov_spectral_radius
        >>> _ = torch.manual_seed(0)
        >>> attn = (2 * torch.randn(2, 5, 5)).softmax(-1)
        >>> w_v, w_o = torch.randn(2, 3, 4), torch.randn(2, 4, 3)
        >>> full = connection_spectrum(attn, w_v, w_o, k=20, deflate=False)  # all n*d = 20 eigenvalues
        >>> walk = connection_spectrum(attn, w_v, w_o, k=16)  # the (n - 1) d of the walk part
        >>> bool(torch.isclose(full.abs()[0], torch.maximum(walk.abs()[0], ov_spectral_radius(w_v, w_o))))
        True
    """
    w_v, w_o = promote(as_float(w_v, "w_v"), as_float(w_o, "w_o"))
    v_cat, o_cat = concat_heads(w_v, w_o)
    core = v_cat @ o_cat if v_cat.shape[-2] < v_cat.shape[-1] else o_cat @ v_cat
    return eigvals(core).abs().amax(dim=-1) * _inverse_scale(w_v, w_o, scale)
