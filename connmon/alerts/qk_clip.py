"""QK-clip: after an optimizer step, scale down the query and key projections of each head whose logits ran away.

Kimi K2's QK-Clip (MuonClip): with ``S`` a head's largest attention logit over the step's whole batch (every
micro-batch, every data-parallel replica; :class:`connmon.capture.max_logit.HeadMaxLogits`) and ``tau`` the
threshold, a head with ``S > tau`` has its query rows and its key rows scaled by ``sqrt(tau / S)`` each, so its
largest logit on that batch becomes ``tau``; values, the output projection and every head under ``tau`` are
untouched. A key head that several query heads share (GQA) is scaled by ``sqrt(tau / S)`` with ``S`` the largest
over the query heads it serves, and each of those query heads by its own factor, so no logit of the group stays
above ``tau``. Biases of the clipped rows are scaled with them (a query or key is then scaled exactly). The
optimizer's state (Adam's moments) is left as it is, as in K2: the moments describe gradients, which the next steps
keep measuring.

Against the other implementations: torchtitan's and Megatron-LM's (``--qk-clip-threshold``) apply the same rule per
head after the optimizer step; torchtitan reads ``S`` from flex_attention's ``max_scores`` and Megatron-LM from
Transformer Engine's ``return_max_logit``, both MAX-reduced over data-parallel ranks, as here. K2 splits multi-head
latent attention's rotary part (shared key, scaled ``tau / S`` on the query side only): connmon finds the query and
key rows from the data, and a layer whose queries pass through a norm or a latent is not clipped (one warning).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor, nn

from connmon._options import check_number
from connmon.alerts._head_rows import HeadClipCount, scale_rows
from connmon.capture.max_logit import HeadLayout, Projection

__all__ = ["QKClip"]


@dataclass
class QKClip(HeadClipCount):
    """The ``"qk_clip"`` action: each head's query and key scaled by ``sqrt(tau / S)`` where its max logit ``S > tau``.

    Args:
        threshold: ``tau``, the largest logit a head may keep (K2: 100).

    Attributes:
        clipped: how many head clips so far (one per head and step).
        last: ``(layer, head, S)`` of the latest step's clips.

    Examples:
        >>> import torch
        >>> from connmon.alerts import QKClip
        >>> from connmon.capture.max_logit import HeadLayout, Projection
        >>> attention = torch.nn.Module()
        >>> attention.qkv = torch.nn.Linear(4, 12)  # [q, k, v], 2 heads of 2
        >>> rows = torch.arange(4).view(2, 2)
        >>> query, key = (Projection("qkv.weight", "qkv.bias", r) for r in (rows, rows + 4))
        >>> layout = HeadLayout(query, key)
        >>> before = attention.qkv.weight.detach().clone()
        >>> QKClip(threshold=100.0).apply([attention], torch.tensor([[400.0, 50.0]]), [layout])
        [(0, 0, 400.0)]
        >>> weight = attention.qkv.weight
        >>> torch.allclose(weight[:2], before[:2] / 2), torch.equal(weight[2:4], before[2:4])
        (True, True)
    """

    name: ClassVar[str] = "qk_clip"
    state_key: ClassVar[str] = "qk_clip"
    threshold: float = 100.0

    def __post_init__(self) -> None:
        check_number("threshold", self.threshold, low=0, low_open=True)

    @torch.no_grad()
    def apply(self, modules: Sequence[nn.Module], table: Tensor, layouts: Sequence[HeadLayout | None]) -> list[tuple]:
        """Scale the heads of ``modules`` whose max logit in ``table`` ``(layers, H)`` exceeds the threshold.

        A layer whose queries and keys were not found is left alone, and so is a head whose max logit is not finite
        (an overflowed fp16 query: ``sqrt(tau / inf)`` would zero it). Returns ``(layer, head, S)`` per clipped head.
        """
        clips = []
        for index, (module, layout) in enumerate(zip(modules, layouts, strict=True)):
            if layout is None or layout.query is None or layout.key is None:
                continue
            heads = layout.query.rows.shape[0]
            logits = table[index, :heads].double()
            over = torch.isfinite(logits) & (logits > self.threshold)  # a non-finite logit is no measure: never clipped
            if not bool(over.any()):
                continue
            factors = torch.where(over, self.threshold / logits, torch.ones_like(logits)).sqrt()
            _scale(module, layout.query, factors)
            key_rows, key_factors = _key_heads(layout.key.rows, factors)
            _scale(module, layout.key, key_factors, key_rows)
            clips += [(index, int(h), float(logits[h])) for h in torch.nonzero(over).flatten()]
        return self.counted(clips)


def _key_heads(rows: Tensor, factors: Tensor) -> tuple[Tensor, Tensor]:
    """Each distinct key head's rows and factor: the smallest of the query heads it serves.

    ``rows`` ``(H_kv, d_h)`` serve ``H / H_kv`` query heads each; a key repeated per query head (a model that calls the
    kernel after ``repeat_kv``) gives ``H`` rows with repeats, one key head under several of them.
    """
    served = rows.shape[0]
    per_query = rows.repeat_interleave(factors.numel() // served, dim=0) if served < factors.numel() else rows
    first = per_query[:, 0].tolist()
    distinct = sorted(set(first), key=first.index)
    picked = torch.stack([per_query[first.index(row)] for row in distinct])
    smallest = torch.stack([factors[[h for h, r in enumerate(first) if r == row]].min() for row in distinct])
    return picked, smallest


def _scale(module: nn.Module, side: Projection, factors: Tensor, rows: Tensor | None = None) -> None:
    """Multiply each head's rows of ``side``'s weight (and bias) by its factor, in place, on this process's part."""
    weight = module.get_parameter(side.weight)
    heads = side.rows if rows is None else rows
    per_row = factors.repeat_interleave(heads.shape[1])
    rows = heads.flatten()
    scale_rows(weight, rows, per_row, 1 if side.transposed else 0, local=side.local)
    if side.bias is not None:
        offset = 0 if side.bias_rows is None else int(side.bias_rows.flatten()[0] - side.rows.flatten()[0])
        scale_rows(module.get_parameter(side.bias), rows + offset, per_row, 0, local=side.local)
