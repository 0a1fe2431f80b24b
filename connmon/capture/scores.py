"""Attention probabilities from the exact ``q``, ``k``, mask and score features an attention kernel receives.

Follows ``torch.nn.functional.scaled_dot_product_attention``'s semantics: a bool mask is True where a key may be
attended, a float mask is added to the scores, ``is_causal`` is the upper-left aligned lower triangle, and keys
with fewer heads than queries (GQA) are repeated ``H / H_kv`` times. The score features of Hugging Face's eager
attention functions are applied in their order: ``scale``, then soft-capping ``cap * tanh(s / cap)``, then an
additive position ``bias`` (T5's relative bias), then the mask; attention sinks (GPT-OSS) are one extra logit per
head that joins each row's softmax and is dropped afterwards, so those rows sum to less than 1.

An additive float mask blocks a key where its entry is at most :data:`BLOCKED_AT` (``-1e4``): ``-inf``, the dtype's
minimum that transformers' eager attention adds, the ``-10000`` and ``-1e9`` of older code all read as the same key
mask as the boolean one. Such an entry gives its key exactly zero probability in the kernel too (``exp(-1e4)`` is 0
in every float dtype), so the probabilities are unchanged; what the mask decides is which tokens are padding.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

BLOCKED_AT = -1e4
"""The additive mask value at or below which a key is blocked (see the module docstring)."""


def allowed_by(mask: Tensor) -> Tensor:
    """Where a bool (True: may attend) or additive float mask lets a query attend a key, as a bool tensor.

    Examples:
        >>> import torch
        >>> from connmon.capture.scores import allowed_by
        >>> finfo_min = torch.finfo(torch.float32).min
        >>> allowed_by(torch.tensor([0.0, -2.0, -10000.0, finfo_min, float("-inf")])).tolist()
        [True, True, False, False, False]
    """
    return mask if mask.dtype == torch.bool else mask > BLOCKED_AT


def attention_scores(
    query: Tensor,
    key: Tensor,
    mask: Tensor | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    softcap: float | None = None,
    bias: Tensor | None = None,
    sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Probabilities, the largest allowed logit per sequence and the allowed-key mask, in float32 (float64 stays).

    Memory: one ``(B, H, L, S)`` map (the logits become the probabilities in place) plus the mask's own shape; the
    allowed mask is built on the mask's shape (a float mask blocks where it is at most ``BLOCKED_AT``), so an
    unmasked or causal layer never materializes a full ``(B, H, L, S)`` bool tensor.

    Args:
        query: ``(B, H, L, E)``.
        key: ``(B, H_kv, S, E)``, ``H_kv`` divides ``H``.
        mask: bool or additive float mask broadcastable to ``(B, H, L, S)``.
        scale: score scale; default ``1 / sqrt(E)``.
        is_causal: apply the lower-triangular mask.
        softcap: soft-capping constant (Gemma 2): scores become ``softcap * tanh(scores / softcap)``.
        bias: additive float bias broadcastable to ``(B, H, L, S)``, added after soft-capping (T5's position bias).
        sinks: ``(H,)`` attention-sink logits (GPT-OSS): each joins its head's softmax as an extra key.

    Returns:
        ``probs (B, H, L, S)`` with rows whose every logit is ``-inf`` set to 0 (a row that a finite mask blocks
        entirely keeps the kernel's softmax, as transformers' eager padding queries do), ``max_logit (B,)`` the
        largest score the softmax sees over heads, allowed keys and the rows of tokens some query may attend (a
        padding query is left out), and ``allowed``, a 4-dim bool tensor broadcastable to ``(B, H, L, S)``.

    Examples:
        >>> import torch
        >>> from connmon.capture.scores import attention_scores
        >>> q, k = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4)
        >>> probs, max_logit, allowed = attention_scores(q, k, is_causal=True)
        >>> probs[0, 0, 0].tolist(), tuple(max_logit.shape), tuple(allowed.shape)
        ([1.0, 0.0, 0.0], (1,), (1, 1, 3, 3))
        >>> sunk, _, _ = attention_scores(q, k, sinks=torch.zeros(2))
        >>> bool((sunk.sum(-1) < 1).all())  # a sink takes part of every row's mass
        True
    """
    dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    q, k = query.to(dtype), key.to(dtype)
    if k.shape[-3] != q.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (q @ k.mT).mul_(scale)  # (B, H, L, S); in place from here on: one map in all
    if softcap is not None:
        scores.div_(softcap).tanh_().mul_(softcap)
    if bias is not None:
        scores.add_(bias.to(dtype))
    length, keys = scores.shape[-2:]
    allowed = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=q.device)
    if is_causal:
        allowed = allowed & torch.ones(length, keys, dtype=torch.bool, device=q.device).tril()
    finite = None  # where a float mask blocks with a finite value: the kernel's logit there is finite
    if mask is not None:
        mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
        if mask.dtype != torch.bool:
            scores.add_(mask.to(dtype))
            finite = ~allowed_by(mask) & (mask != float("-inf"))
        allowed = allowed & allowed_by(mask)
    blocked = not bool(allowed.all())
    if blocked:  # a row that a finite mask value blocks entirely keeps the kernel's softmax of its masked logits
        fill = ~allowed if finite is None else ~allowed & ~(finite & ~allowed.any(dim=-1, keepdim=True))
        scores.masked_fill_(fill, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True)  # (B, H, L, 1)
    empty = ~torch.isfinite(row_max)  # every logit -inf: the row is 0 (SDPA's math kernel would give NaN)
    seen = row_max
    if blocked and length == keys:  # a token no query may attend (padding) is left out as a query too
        attended = allowed.any(dim=-2, keepdim=True).any(dim=-3, keepdim=True)  # (B | 1, 1, 1, S)
        seen = row_max.masked_fill(~attended.transpose(-1, -2), float("-inf"))
    max_logit = seen.flatten(1).amax(dim=-1)
    if sinks is not None:
        sink = sinks.to(dtype).view(1, -1, 1, 1)
        row_max = torch.maximum(row_max, sink)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))  # a fully blocked row
    probs = scores.sub_(row_max).exp_()  # the logits become unnormalized probabilities in place
    total = probs.sum(dim=-1, keepdim=True)
    if sinks is not None:
        total = total + (sink - row_max).exp()
    probs.div_(total)
    if bool(empty.any()):
        probs.masked_fill_(empty, 0.0)
    return probs, max_logit, allowed
