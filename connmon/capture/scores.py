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

    Args:
        query: ``(B, H, L, E)``.
        key: ``(B, H_kv, S, E)``, ``H_kv`` divides ``H``.
        mask: bool or additive float mask broadcastable to ``(B, H, L, S)``.
        scale: score scale; default ``1 / sqrt(E)``.
        is_causal: apply the lower-triangular mask.

    Returns:
        ``logits (B, H, L, S)`` with ``-inf`` where blocked, ``probs (B, H, L, S)`` with rows of no allowed key set
        to 0, ``allowed (B, H, L, S)`` bool.

    Example:
        >>> import torch
        >>> from connmon.capture.scores import attention_scores
        >>> q, k = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4)
        >>> logits, probs, allowed = attention_scores(q, k, is_causal=True)
        >>> probs[0, 0, 0].tolist(), bool(allowed[0, 0].tril().equal(allowed[0, 0]))
        ([1.0, 0.0, 0.0], True)
    """
    dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    q, k = query.to(dtype), key.to(dtype)
    if k.shape[-3] != q.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    logits = (q @ k.mT).mul_(scale)  # in place from here on: one map of logits, one of probabilities
    if mask is not None and mask.dtype != torch.bool:
        logits = logits.add_(mask.to(dtype)) if mask.shape == logits.shape else logits + mask.to(dtype)
    allowed = logits != float("-inf")
    if is_causal:
        allowed &= torch.ones(logits.shape[-2:], dtype=torch.bool, device=q.device).tril()
    if mask is not None and mask.dtype == torch.bool:
        allowed = allowed & mask
    logits.masked_fill_(~allowed, float("-inf"))
    probs = logits.softmax(dim=-1)
    probs.masked_fill_(~allowed.any(dim=-1, keepdim=True), 0.0)  # a row with no allowed key: 0, not NaN
    return logits, probs, allowed
