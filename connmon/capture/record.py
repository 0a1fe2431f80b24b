"""AttentionRecord: one self-attention layer's forward pass, as the connection walk reads it (docs/architecture.md)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

from connmon.functional import connection_matvec, ov_singular_values

__all__ = ["AttentionRecord", "reconstruction_error"]


@dataclass
class AttentionRecord:
    """What one capture saw in one self-attention layer, for the first ``B_s`` sequences of the batch.

    Every tensor is detached, float32 (unless the capture asked for float64) and a copy: a record never keeps the
    model's activations alive.

    Attributes:
        name: module path in the model (``model.named_modules()``).
        index: layer index among the captured attention modules, in module order.
        attn: ``(B_s, H, n, n)`` pre-dropout attention probabilities; rows with no allowed key are 0.
        max_logit: ``(B_s,)`` largest pre-softmax score over heads, rows and allowed keys.
        w_v: ``(H, d_h, d)`` value-projection rows per query head (GQA expanded).
        w_o: ``(H, d, d_h)`` output-projection columns per head.
        bias: ``(d,)`` the constant ``c = sum_h O_h b_v + b_o`` added to every token.
        x: ``(B_s, n, d)`` the attention module's input (after any pre-norm).
        output: ``(B_s, n, d)`` the attention output (after the output projection, before residual dropout).
        key_mask: ``(B_s, n)`` bool, True for keys that some query may attend (False = padding), or None.
        reconstruction_error: ``||output - M(x) - c||_F / ||output||_F`` over the record; NaN when the window was
            truncated from a longer bidirectional sequence (see ``max_tokens`` in :func:`connmon.capture`).
    """

    name: str
    index: int
    attn: Tensor
    max_logit: Tensor
    w_v: Tensor
    w_o: Tensor
    bias: Tensor
    x: Tensor
    output: Tensor
    key_mask: Tensor | None
    reconstruction_error: Tensor

    @property
    def num_heads(self) -> int:
        """Number of query heads ``H``."""
        return self.attn.shape[-3]

    @cached_property
    def ov_singular_values(self) -> Tensor:
        """``(d,)`` singular values of ``T_bar = sum_h O_h V_h``, computed once per record.

        They are weight-only, so one SVD serves every diagnostic of the record (``transport_scale`` is their mean).
        """
        return ov_singular_values(self.w_v, self.w_o)


def reconstruction_error(attn: Tensor, w_v: Tensor, w_o: Tensor, bias: Tensor, x: Tensor, output: Tensor) -> Tensor:
    """``||output - M(x) - c||_F / ||output||_F``: how exactly the connection walk rebuilds a layer's output.

    Args:
        attn: ``(B, H, n, n)``.
        w_v: ``(H, d_h, d)``.
        w_o: ``(H, d, d_h)``.
        bias: ``(d,)``.
        x: ``(B, n, d)``.
        output: ``(B, n, d)``.

    Returns:
        A 0-dim tensor.

    Examples:
        >>> import torch
        >>> from connmon.capture import reconstruction_error
        >>> _ = torch.manual_seed(0)
        >>> mha = torch.nn.MultiheadAttention(8, 2, batch_first=True)
        >>> x = torch.randn(1, 5, 8)
        >>> with torch.no_grad():
        ...     out, attn = mha(x, x, x, average_attn_weights=False)
        >>> w_v = mha.in_proj_weight.detach()[16:].view(2, 4, 8)  # value rows per head
        >>> w_o = mha.out_proj.weight.detach().view(8, 2, 4).transpose(0, 1)  # output columns per head
        >>> float(reconstruction_error(attn, w_v, w_o, torch.zeros(8), x, out)) < 1e-6
        True
    """
    walk = connection_matvec(attn, w_v, w_o, x) + bias
    return torch.linalg.vector_norm(output - walk) / torch.linalg.vector_norm(output)
