"""The heads of a layer stacked, so that one GEMM applies them all."""

from __future__ import annotations

from torch import Tensor


def concat_heads(w_v: Tensor, w_o: Tensor) -> tuple[Tensor, Tensor]:
    """Stack the heads: ``V = (*, H*d_h, d)`` and ``O = (*, d, H*d_h)``, so that ``O @ V = sum_h T_h``.

    Examples:
        >>> import torch
        >>> from connmon._linalg.heads import concat_heads
        >>> w_v, w_o = torch.randn(3, 2, 5), torch.randn(3, 5, 2)  # H=3, d_h=2, d=5
        >>> v_cat, o_cat = concat_heads(w_v, w_o)
        >>> v_cat.shape, bool(torch.allclose(o_cat @ v_cat, (w_o @ w_v).sum(0), atol=1e-5))
        (torch.Size([6, 5]), True)
    """
    heads, d_h, d = w_v.shape[-3:]
    v_cat = w_v.reshape(*w_v.shape[:-3], heads * d_h, d)
    o_cat = w_o.transpose(-3, -2).reshape(*w_o.shape[:-3], d, heads * d_h)  # (*, d, H, d_h) -> (*, d, H*d_h)
    return v_cat, o_cat
