"""Finding a kernel call's value among the projections that ran: the layer's ``W_V`` rows and its input.

An attention module's value tensor is one projection's output, reshaped; which projection, and which of its output
columns go to which head (its own projection, fused ``[q, k, v]``, grouped or interleaved per head, or any other
layout) is read from the values themselves: candidate layouts are checked bitwise against the kernel's ``value``.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from connmon.capture.session import CaptureSession


def find_value(session: CaptureSession, calls: list, value: Tensor, heads: int) -> tuple[tuple, Tensor, Tensor] | None:
    """The projection ``(W, b)`` whose columns are ``value`` ``(B_s, H_v, m, d_h)``, its rows per head, its input."""
    batch, value_heads, m, d_h = value.shape
    for weight, bias, inp, out, _ in reversed(calls):  # the value projection usually runs last of q, k, v
        columns = session.window(out).detach()  # (B_s, m, F)
        if columns.shape[:2] != (batch, m):
            continue
        for rows in value_layouts(columns.shape[-1], heads, d_h, columns.device):
            kv = rows.shape[0]
            if value_heads % kv or heads % kv:
                continue
            read = columns[..., rows.flatten()].view(batch, m, kv, d_h).transpose(1, 2)  # (B_s, kv, m, d_h)
            read = read.repeat_interleave(value_heads // kv, dim=1)
            if same(read.to(value.dtype), value.detach()):
                return (weight, bias), rows.repeat_interleave(heads // kv, dim=0), inp
        matched = matching_columns(columns, value) if heads % value_heads == 0 else None
        if matched is not None:  # any other layout: each value feature is one output column (DeepSeek's kv_b_proj)
            return (weight, bias), matched.repeat_interleave(heads // value_heads, dim=0), inp
    return None


def matching_columns(columns: Tensor, value: Tensor) -> Tensor | None:
    """``(H_v, d_h)`` indices of the columns ``(B_s, m, F)`` equal to each value feature ``(B_s, H_v, m, d_h)``.

    Columns are matched by a random projection over the tokens, then checked bitwise; None if one feature has none.
    """
    batch, value_heads, m, d_h = value.shape
    if not columns.is_floating_point() or m * batch < 2:
        return None
    probe = torch.randn(batch * m, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    flat = columns.reshape(batch * m, -1).to(torch.float64)
    features = value.detach().permute(0, 2, 1, 3).reshape(batch * m, -1).to(torch.float64)
    keys, order = (probe.to(flat.device) @ flat).sort()
    wanted = probe.to(flat.device) @ features
    at = torch.searchsorted(keys, wanted).clamp(max=keys.numel() - 1)
    below = (at - 1).clamp(min=0)
    nearest = torch.where((keys[at] - wanted).abs() <= (keys[below] - wanted).abs(), at, below)
    rows = order[nearest]
    if not same(flat[:, rows], features):
        return None
    return rows.view(value_heads, d_h)


def same(a: Tensor, b: Tensor) -> bool:
    """Bitwise-equal values, NaN equal to NaN (a forward gone non-finite is still recorded, and flagged)."""
    return torch.equal(a, b) or torch.allclose(a, b, rtol=0.0, atol=0.0, equal_nan=True)


def value_layouts(features: int, heads: int, d_h: int, device: torch.device) -> Iterator[Tensor]:
    """Candidate ``(H_kv, d_h)`` value rows of a projection with ``features`` outputs, for ``heads`` query heads."""
    if features % d_h:
        return
    per = features // d_h  # head-sized blocks
    e = torch.arange(d_h, device=device)
    yield torch.arange(features, device=device).view(per, d_h)  # a value projection of its own
    if per > heads and (per - heads) % 2 == 0:  # [q (H), k (H_kv), v (H_kv)] contiguous (nanoGPT, Phi3, MQA)
        kv = (per - heads) // 2
        yield torch.arange(features - kv * d_h, features, device=device).view(kv, d_h)
        if heads % kv == 0:  # grouped per kv head [q (H / H_kv), k, v] (Falcon)
            group = heads // kv + 2
            yield (torch.arange(kv, device=device)[:, None] * group + group - 1) * d_h + e
    if per % 3 == 0:  # per head [q, k, v] interleaved (GPT-NeoX)
        yield (torch.arange(per // 3, device=device)[:, None] * 3 + 2) * d_h + e
