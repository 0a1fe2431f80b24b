"""The attention walk: heads averaged into one random walk on tokens (docs/diagnostics.md, "Walk").

Shapes: ``attn`` is ``(*, H, n, n)`` (H heads, n query rows, n keys; each row sums to 1 over its allowed keys and
is 0 elsewhere); ``P`` is ``(*, n, n)``. Masks are boolean with True = allowed key, as in
``torch.nn.functional.scaled_dot_product_attention``, and broadcast to the tensor they mask.

A query row with no allowed key (for example a padding query under a causal mask) is all zeros. Such a row is not
a probability distribution, so the walk diagnostics leave it out, each as its docstring says.

Non-finite input gives NaN (or, for ``max_attention_logit``, the non-finite value) and never raises.
Only ``walk_spectral_gap`` synchronizes a GPU (an eigenvalue solver); the rest stay on the device.
"""

from __future__ import annotations

import torch
from torch import Tensor

from connmon._linalg import eigvals, frobenius, safe_divide
from connmon.functional._checks import as_float, check_attention, check_mask, check_square

__all__ = [
    "attention_entropy",
    "max_attention_logit",
    "reversibility_gap",
    "stationary_distribution",
    "stochasticity_gap",
    "walk_matrix",
    "walk_spectral_gap",
]

_P_LAYOUT = "(*, n, n)"


def walk_matrix(attn: Tensor) -> Tensor:
    """Normalized walk ``P = W / H``: the mean of the heads' attention maps.

    Args:
        attn: attention probabilities ``(*, H, n, n)``.

    Returns:
        ``(*, n, n)``; each row with an allowed key sums to 1.

    Raises:
        ValueError: if ``attn`` is not ``(*, H, n, n)``.

    Examples:
        >>> import torch
        >>> from connmon.functional import walk_matrix
        >>> _ = torch.manual_seed(0)
        >>> attn = torch.randn(2, 4, 5, 5).softmax(-1)  # (B, H, n, n)
        >>> P = walk_matrix(attn)
        >>> P.shape, bool(torch.allclose(P.sum(-1), torch.ones(2, 5)))
        (torch.Size([2, 5, 5]), True)
    """
    attn = as_float(attn, "attn")
    check_attention(attn)
    return attn.mean(dim=-3)


def _has_allowed_key(P: Tensor) -> Tensor:
    """Rows of ``P`` with at least one nonzero (or NaN) entry: ``(*, n)`` bool."""
    return (P != 0).any(dim=-1)


def stochasticity_gap(P: Tensor) -> Tensor:
    """Largest deviation of a row sum from 1, ``max_i |sum_j P_ij - 1|``, over rows with an allowed key.

    All-zero rows (queries with no allowed key) are left out; a walk with no such row has gap 0.

    Args:
        P: walk matrix ``(*, n, n)``.

    Returns:
        ``(*,)``.

    Raises:
        ValueError: if ``P`` is not square in its last two dims.

    Examples:
        >>> import torch
        >>> from connmon.functional import stochasticity_gap
        >>> P = torch.tensor([[0.5, 0.5], [0.0, 0.0]])  # second query has no allowed key
        >>> stochasticity_gap(P)
        tensor(0.)
        >>> stochasticity_gap(torch.tensor([[0.5, 0.4], [1.0, 0.0]]))
        tensor(0.1000)
    """
    P = as_float(P, "P")
    check_square(P, "P", _P_LAYOUT)
    deviation = (P.sum(dim=-1) - 1).abs()
    return torch.where(_has_allowed_key(P), deviation, torch.zeros_like(deviation)).amax(dim=-1)


def attention_entropy(attn: Tensor, normalized: bool = False, mask: Tensor | None = None) -> Tensor:
    """Mean Shannon entropy (nats) of the attention rows, ``-sum_j A_ij log A_ij``, over heads and rows.

    ``0 log 0 = 0``. Rows with no allowed key are left out of the mean. With ``normalized=True`` each row is
    divided by ``log(#allowed keys)`` (1 = uniform over the allowed keys) and rows with a single allowed key are
    left out too. The mean is NaN when no row qualifies (for example ``n = 1`` with ``normalized=True``).

    Allowed keys come from ``mask`` when given; otherwise they are the nonzero entries of ``attn``, which counts
    a key whose probability underflowed to exactly 0 as masked. Pass ``mask`` when that matters (near one-hot
    attention in float32).

    Args:
        attn: attention probabilities ``(*, H, n, n)``.
        normalized: divide each row's entropy by the log of its number of allowed keys.
        mask: optional bool tensor broadcastable to ``attn``, True where a key is allowed.

    Returns:
        ``(*,)``.

    Raises:
        ValueError: if ``attn`` is not ``(*, H, n, n)`` or ``mask`` does not broadcast to it.
        TypeError: if ``mask`` is not a bool tensor.

    Examples:
        >>> import torch
        >>> from connmon.functional import attention_entropy
        >>> uniform = torch.full((1, 4, 4), 0.25)  # one head, four tokens
        >>> attention_entropy(uniform), attention_entropy(uniform, normalized=True)
        (tensor(1.3863), tensor(1.))
    """
    attn = as_float(attn, "attn")
    check_attention(attn)
    allowed = check_mask(mask, attn)
    if allowed is None:
        allowed = attn != 0
    row_entropy = -torch.special.xlogy(attn, attn).sum(dim=-1)  # (*, H, n)
    num_keys = allowed.sum(dim=-1)  # (*, H, n)
    if normalized:
        counted = num_keys >= 2
        row_entropy = row_entropy / num_keys.clamp(min=2).to(attn.dtype).log()
    else:
        counted = num_keys >= 1
    total = torch.where(counted, row_entropy, torch.zeros_like(row_entropy)).flatten(-2).sum(dim=-1)
    return total / counted.flatten(-2).sum(dim=-1)


def stationary_distribution(P: Tensor, num_squarings: int = 40) -> Tensor:
    """Stationary distribution ``pi = lim_t u^T ((I + P) / 2)^t`` of the lazy walk from the uniform start ``u``.

    Computed by repeated squaring of the lazy chain (rows renormalized after each product), so it is defined
    for every stochastic ``P``, reducible ones included: for causal attention all mass flows to the first token.
    ``num_squarings`` squarings take ``2**num_squarings`` lazy steps; the default (about 1e12 steps) resolves
    every spectral gap that float32 can represent. Rows with no allowed key (all zero) are not states of the walk:
    ``u`` is uniform over the other tokens and such a token keeps whatever mass reaches it.

    Args:
        P: row-stochastic walk matrix ``(*, n, n)``.
        num_squarings: number of squarings of the lazy chain.

    Returns:
        ``(*, n)``, nonnegative, summing to 1.

    Raises:
        ValueError: if ``P`` is not square or ``num_squarings`` is negative.

    Examples:
        >>> import torch
        >>> from connmon.functional import stationary_distribution
        >>> P = torch.tensor([[0.9, 0.1], [0.2, 0.8]])
        >>> stationary_distribution(P)  # solves pi P = pi
        tensor([0.6667, 0.3333])
        >>> causal = torch.tensor([[1.0, 0.0], [0.5, 0.5]])
        >>> stationary_distribution(causal)
        tensor([1., 0.])
    """
    P = as_float(P, "P")
    n = check_square(P, "P", _P_LAYOUT)
    if num_squarings < 0:
        raise ValueError(f"num_squarings must be >= 0, got num_squarings={num_squarings}")
    valid = _has_allowed_key(P)  # (*, n)
    eye = torch.eye(n, dtype=P.dtype, device=P.device)
    # Tokens with no allowed key get a self-loop, which makes the chain stochastic without moving any mass.
    lazy = (eye + P + torch.diag_embed((~valid).to(P.dtype))) / 2
    for _ in range(num_squarings):
        lazy = lazy @ lazy
        lazy = lazy / lazy.sum(dim=-1, keepdim=True)
    start = torch.where(valid.any(dim=-1, keepdim=True), valid.to(P.dtype), torch.ones_like(valid, dtype=P.dtype))
    start = start / start.sum(dim=-1, keepdim=True)
    return (start.unsqueeze(-2) @ lazy).squeeze(-2)


def reversibility_gap(P: Tensor, pi: Tensor | None = None) -> Tensor:
    """Distance from detailed balance: ``||Pi P - P^T Pi||_F / (||Pi P||_F + ||P^T Pi||_F)``, ``Pi = diag(pi)``.

    In ``[0, 1]``; 0 exactly when the walk is reversible (``pi_i P_ij = pi_j P_ji``). A zero flow has gap 0.

    Args:
        P: walk matrix ``(*, n, n)``.
        pi: its stationary distribution ``(*, n)``; computed with :func:`stationary_distribution` when omitted.

    Returns:
        ``(*,)``.

    Raises:
        ValueError: if ``P`` is not square or ``pi`` does not match it.

    Examples:
        >>> import torch
        >>> from connmon.functional import reversibility_gap
        >>> symmetric = torch.tensor([[0.5, 0.5], [0.5, 0.5]])
        >>> reversibility_gap(symmetric)
        tensor(0.)
        >>> cycle = torch.tensor([[0.1, 0.9, 0.0], [0.0, 0.1, 0.9], [0.9, 0.0, 0.1]])
        >>> reversibility_gap(cycle)
        tensor(0.7028)
    """
    P = as_float(P, "P")
    n = check_square(P, "P", _P_LAYOUT)
    if pi is None:
        pi = stationary_distribution(P)
    elif pi.shape[-1:] != (n,):
        raise ValueError(f"pi must have shape (*, n) = (*, {n}) to match P{tuple(P.shape)}, got pi{tuple(pi.shape)}")
    flow = pi.to(P.dtype).unsqueeze(-1) * P  # (*, n, n): Pi P
    return safe_divide(frobenius(flow - flow.mT), 2 * frobenius(flow))


def walk_spectral_gap(P: Tensor) -> Tensor:
    """Spectral gap ``1 - |lambda_2(P)|``, eigenvalues ordered by descending modulus (``lambda_1 = 1``).

    A walk on one token (``n = 1``) has gap 1. Synchronizes the GPU (dense eigenvalue solver).

    Args:
        P: walk matrix ``(*, n, n)``.

    Returns:
        ``(*,)``.

    Raises:
        ValueError: if ``P`` is not square.

    Examples:
        >>> import torch
        >>> from connmon.functional import walk_spectral_gap
        >>> P = torch.tensor([[0.9, 0.1], [0.2, 0.8]])  # eigenvalues 1 and 0.7
        >>> walk_spectral_gap(P)
        tensor(0.3000)
    """
    P = as_float(P, "P")
    n = check_square(P, "P", _P_LAYOUT)
    if n == 1:
        return torch.ones_like(P[..., 0, 0])
    moduli = eigvals(P).abs()
    return 1 - moduli.topk(2, dim=-1).values[..., 1]


def max_attention_logit(logits: Tensor, mask: Tensor | None = None) -> Tensor:
    """Largest pre-softmax score over heads, rows and allowed keys.

    ``logits`` are the scores the softmax sees: scaled ``q . k`` plus any additive bias. Blocked keys may
    already be ``-inf`` in them, or be named by ``mask``. A slice with no allowed key gives ``-inf``.

    Args:
        logits: pre-softmax scores ``(*, H, n, n)``.
        mask: optional bool tensor broadcastable to ``logits``, True where a key is allowed.

    Returns:
        ``(*,)``.

    Raises:
        ValueError: if ``logits`` is not ``(*, H, n, n)`` or ``mask`` does not broadcast to it.
        TypeError: if ``mask`` is not a bool tensor.

    Examples:
        >>> import torch
        >>> from connmon.functional import max_attention_logit
        >>> logits = torch.tensor([[[1.0, 9.0], [2.0, 3.0]]])  # (H=1, n=2, n=2)
        >>> causal = torch.tensor([[True, False], [True, True]])
        >>> max_attention_logit(logits), max_attention_logit(logits, mask=causal)
        (tensor(9.), tensor(3.))
    """
    logits = as_float(logits, "logits")
    check_attention(logits, "logits")
    allowed = check_mask(mask, logits)
    if allowed is not None:
        logits = logits.masked_fill(~allowed, float("-inf"))
    return logits.flatten(-3).amax(dim=-1)
