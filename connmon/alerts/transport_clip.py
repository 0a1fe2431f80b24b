"""Transport clip (an experiment): keep each head's transport ``T_h = O_h V_h`` near a scaled isometry.

The paper's third future-work item asks for transports designed to hold isometry properties for stability. This
action reads, after an optimizer step, each head's ``d_h`` singular values ``s`` of ``T_h`` (the values the
``head_isometry_gap`` diagnostic measures) and, where one lies outside ``[mean(s) / factor, factor * mean(s)]``, clamps
them into ``[m / factor, factor * m]`` with the singular vectors kept, ``T_h' = U clamp(S) W^T``, where ``m`` is the
mean of the clamped values themselves (the clipped head is inside its own band; ``m`` is found by bisection). Only
the head's output-projection columns ``O_h`` change (``O_h' = (I + U diag(s' / s - 1) U^T) O_h``, so ``O_h' V_h =
T_h'``): they belong to one query head, where a value head is shared by several under GQA. The value projection, the
queries and keys, the biases and every head already inside the band are untouched (bitwise), and so is the
optimizer's state, as with QK-clip. A singular value below ``1e-6 mean(s)`` is a null direction: it is not raised and
not counted in the mean.

It is labelled an experiment: what it did on the mechanisms benchmark is in docs/monitoring.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor, nn

from connmon._options import check_number
from connmon.alerts._head_rows import HeadClipCount, read_rows, write_rows
from connmon.capture.max_logit import HeadLayout
from connmon.functional.transport import transport_singular_values

__all__ = ["TransportClip", "isometry_clip"]

NULL = 1e-6  # a singular value below this fraction of the mean is a null direction: not raised


def isometry_clip(w_v: Tensor, w_o: Tensor, factor: float) -> tuple[Tensor, Tensor]:
    """Output columns that put each head's transport's singular values within ``factor`` of their mean (see above).

    Args:
        w_v: ``(H, d_h, d)`` value rows per query head.
        w_o: ``(H, d, d_h)`` output columns per head.
        factor: the band ``[mean / factor, factor * mean]``, ``factor >= 1``.

    Returns:
        ``(w_o', changed)``: ``w_o'`` with ``w_o'[h] @ w_v[h]`` the clamped transport (``w_o[h]`` itself where
        ``changed[h]`` is False: already inside the band, or not finite).

    Examples:
        >>> import torch
        >>> from connmon.alerts.transport_clip import isometry_clip
        >>> q = torch.linalg.qr(torch.randn(8, 4, dtype=torch.float64)).Q  # 4 orthonormal columns
        >>> w_v, w_o = q.mT.repeat(2, 1, 1), q.repeat(2, 1, 1)  # 2 heads, each T_h an isometry
        >>> w_o[0, :, 0] *= 10  # head 0: singular values 10, 1, 1, 1
        >>> clipped, changed = isometry_clip(w_v, w_o, factor=2.0)  # 10 -> 3: twice the new mean, 1.5
        >>> changed.tolist(), torch.linalg.svdvals(clipped @ w_v)[:, :4].round(decimals=4).tolist()
        ([True, False], [[3.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    """
    finite = torch.isfinite(w_v).flatten(1).all(1) & torch.isfinite(w_o).flatten(1).all(1)
    w_v, w_o_finite = (torch.where(finite[:, None, None], w, torch.zeros_like(w)) for w in (w_v, w_o))
    _, r_v = torch.linalg.qr(w_v.mT)  # V_h = R_v^T Q_v^T, so T_h = (O_h R_v^T) Q_v^T: the same U and s
    u, s, _ = torch.linalg.svd(w_o_finite @ r_v.mT, full_matrices=False)
    target = _clamped(s, factor)
    changed = finite & (target != s).any(-1)
    gain = torch.where(target != s, target / s.clamp_min(torch.finfo(s.dtype).tiny) - 1, torch.zeros_like(s))
    clipped = w_o_finite + u @ (gain[..., None] * (u.mT @ w_o_finite))
    return torch.where(changed[:, None, None], clipped, w_o), changed


def _clamped(s: Tensor, factor: float, iterations: int = 40) -> Tensor:
    """``s`` ``(..., r)`` clamped to ``[m / factor, factor m]`` with ``m`` the mean of the clamped values themselves.

    Null values (below ``NULL`` times the mean) stay as they are and out of the mean. ``m`` is found by bisection (in
    log scale, ``iterations`` halvings) on ``mean(clamp(s, m / factor, factor m)) - m``, positive below ``min(s) /
    factor`` and negative above ``factor max(s)``; a head already inside its band keeps ``s`` exactly.
    """
    keep = s > NULL * s.mean(-1, keepdim=True)
    count = keep.sum(-1, keepdim=True).clamp_min(1)
    mean = (s * keep).sum(-1, keepdim=True) / count
    inside = (((s <= factor * mean) & (s >= mean / factor)) | ~keep).all(-1, keepdim=True)
    if bool(inside.all()):
        return s
    low = torch.where(keep, s, torch.full_like(s, float("inf"))).amin(-1, keepdim=True) / factor
    high = (s * keep).amax(-1, keepdim=True) * factor
    for _ in range(iterations):
        middle = (low * high).sqrt()
        above = (torch.clamp(s, middle / factor, middle * factor) * keep).sum(-1, keepdim=True) / count > middle
        low, high = torch.where(above, middle, low), torch.where(above, high, middle)
    centre = (low * high).sqrt()
    target = torch.where(keep, torch.clamp(s, centre / factor, centre * factor), s)
    return torch.where(inside, s, target)


@dataclass
class TransportClip(HeadClipCount):
    """The ``"transport_clip"`` action (an experiment): each head's transport held within ``factor`` of an isometry.

    Args:
        factor: the band: singular values of ``O_h V_h`` within ``[mean / factor, factor * mean]`` (``> 1``).
        every_n_steps: check every this many optimizer steps.

    Attributes:
        clipped: how many head clips so far.
        last: ``(layer, head, largest / mean, smallest / mean)`` of the latest check's clips (before the clip).

    Examples:
        >>> import torch
        >>> from connmon.alerts import TransportClip
        >>> from connmon.capture.max_logit import HeadLayout, Projection
        >>> attention = torch.nn.Module()
        >>> attention.qkv, attention.out = torch.nn.Linear(4, 12), torch.nn.Linear(4, 4)  # 2 heads of 2
        >>> rows = torch.arange(4).view(2, 2)
        >>> query, key, value = (Projection("qkv.weight", "qkv.bias", r) for r in (rows, rows + 4, rows + 8))
        >>> output = Projection("out.weight", None, rows, transposed=True)  # a Linear's input columns
        >>> with torch.no_grad():  # values x itself, output the identity: each head's transport an isometry
        ...     attention.qkv.weight[8:] = torch.eye(4)
        ...     _ = attention.out.weight.copy_(torch.eye(4))
        ...     attention.out.weight[:, 0] *= 50  # head 0's first direction 50x
        >>> clips = TransportClip(factor=2.0).apply([attention], [HeadLayout(query, key, value, output)])
        >>> [(layer, head) for layer, head, _, _ in clips]
        [(0, 0)]
    """

    name: ClassVar[str] = "transport_clip"
    state_key: ClassVar[str] = "transport_clip"
    factor: float = 2.0
    every_n_steps: int = 1

    def __post_init__(self) -> None:
        check_number("factor", self.factor, low=1, low_open=True)
        check_number("every_n_steps", self.every_n_steps, low=1, integer=True)

    @torch.no_grad()
    def apply(self, modules: Sequence[nn.Module], layouts: Sequence[HeadLayout | None]) -> list[tuple]:
        """Clip the heads of ``modules`` outside the band; layers without a value or output layout are left alone.

        Under FSDP2 each process gathers a layer's value and output weights whole (every process calls it at the same
        steps) and writes its own shard; under tensor parallelism each process clips its own heads.
        """
        clips = []
        for index, (module, layout) in enumerate(zip(modules, layouts, strict=True)):
            if layout is None or layout.value is None or layout.output is None:
                continue
            w_v, w_o = _read(module, layout)
            clipped, changed = isometry_clip(w_v.double(), w_o.double(), self.factor)
            if not bool(changed.any()):
                continue
            s = transport_singular_values(w_v[changed].double(), w_o[changed].double())  # before the clip
            mean = s.mean(-1)
            heads = torch.nonzero(changed).flatten().tolist()
            high, low = (s.max(-1).values / mean).tolist(), (s.min(-1).values / mean).tolist()
            clips += [(index, h, hi, lo) for h, hi, lo in zip(heads, high, low, strict=True)]
            output = layout.output
            dim = 1 if output.transposed else 0
            columns = clipped[changed].mT.reshape(-1, clipped.shape[1])  # (changed heads * d_h, d)
            write_rows(module.get_parameter(output.weight), output.rows[changed].flatten(),
                       columns.mT if dim else columns, dim, local=output.local)  # fmt: skip
        return self.counted(clips)


def _read(module: nn.Module, layout: HeadLayout) -> tuple[Tensor, Tensor]:
    """``w_v (H, d_h, d)`` per query head and ``w_o (H, d, d_h)`` of ``module``, as its parameters hold them now."""
    value, output = layout.value, layout.output
    assert value is not None and output is not None
    heads, d_h = output.rows.shape
    rows = value.rows
    if rows.shape[0] < heads:  # a value head serves several query heads (GQA)
        rows = rows.repeat_interleave(heads // rows.shape[0], dim=0)
    sides = []
    for side, side_rows in ((value, rows), (output, output.rows)):
        dim = 1 if side.transposed else 0
        block = read_rows(module.get_parameter(side.weight), side_rows.flatten(), dim, side.local)
        sides.append(block.movedim(dim, 0).reshape(heads, d_h, -1))  # (H, d_h, d): V_h, and O_h^T
    return sides[0], sides[1].mT
