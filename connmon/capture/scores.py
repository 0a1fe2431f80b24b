"""Attention logits and probabilities from the exact ``q``, ``k``, mask and scale an attention kernel receives.

Follows ``torch.nn.functional.scaled_dot_product_attention``'s semantics: a bool mask is True where a key may be
attended, a float mask is added to the scores, ``is_causal`` is the upper-left aligned lower triangle, and keys
with fewer heads than queries (GQA) are repeated ``H / H_kv`` times.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def attention_scores(
    query: Tensor, key: Tensor, mask: Tensor | None = None, *, scale: float | None = None, is_causal: bool = False
) -> tuple[Tensor, Tensor, Tensor]:
    """Logits, probabilities and the allowed-key mask, in float32 (float64 stays float64).

    The allowed mask is built on the mask's own shape (a float mask blocks exactly where it is ``-inf``, since
    ``q . k`` is finite), so an unmasked or causal layer never materializes a full ``(B, H, L, S)`` bool tensor.

    Args:
        query: ``(B, H, L, E)``.
        key: ``(B, H_kv, S, E)``, ``H_kv`` divides ``H``.
        mask: bool or additive float mask broadcastable to ``(B, H, L, S)``.
        scale: score scale; default ``1 / sqrt(E)``.
        is_causal: apply the lower-triangular mask.

    Returns:
        ``logits (B, H, L, S)`` with ``-inf`` where blocked, ``probs (B, H, L, S)`` with rows of no allowed key set
        to 0, and ``allowed``, a 4-dim bool tensor broadcastable to ``(B, H, L, S)``.

    Example:
        >>> import torch
        >>> from connmon.capture.scores import attention_scores
        >>> q, k = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4)
        >>> logits, probs, allowed = attention_scores(q, k, is_causal=True)
        >>> probs[0, 0, 0].tolist(), tuple(allowed.shape)
        ([1.0, 0.0, 0.0], (1, 1, 3, 3))
    """
    dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    q, k = query.to(dtype), key.to(dtype)
    if k.shape[-3] != q.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    logits = (q @ k.mT).mul_(scale)  # in place from here on: one map of logits, one of probabilities
    length, keys = logits.shape[-2:]
    allowed = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=q.device)
    if is_causal:
        allowed = allowed & torch.ones(length, keys, dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
        if mask.dtype == torch.bool:
            allowed = allowed & mask
        else:
            logits.add_(mask.to(dtype))
            allowed = allowed & (mask != float("-inf"))
    blocked = not bool(allowed.all())
    if blocked:
        logits.masked_fill_(~allowed, float("-inf"))
    probs = logits.softmax(dim=-1)
    if blocked:
        probs.masked_fill_(~allowed.any(dim=-1, keepdim=True), 0.0)  # a row with no allowed key: 0, not NaN
    return logits, probs, allowed
