"""What an adapter does: find its attention modules, read their transport weights, feed a session from hooks."""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from connmon.capture.session import CaptureSession


class Adapter(abc.ABC):
    """Base class of capture adapters, one per model family.

    An adapter recognises its self-attention modules (:meth:`matches`), reads their per-head value and output maps
    (:meth:`weights`), and, while a capture is armed, hands the session each module's input, attention scores and
    output (:meth:`hooks`, plus :meth:`armed` for process-wide switches such as intercepting
    ``scaled_dot_product_attention``). Everything it registers is removed when the capture ends.
    """

    name = "adapter"

    @abc.abstractmethod
    def matches(self, module: nn.Module) -> bool:
        """Whether this adapter reads ``module``."""

    @abc.abstractmethod
    def weights(self, module: nn.Module) -> tuple[Tensor, Tensor, Tensor]:
        """``w_v (H, d_h, d)``, ``w_o (H, d, d_h)`` and the bias constant ``c (d,)``."""

    @abc.abstractmethod
    def hooks(self, model: nn.Module, name: str, module: nn.Module, session: CaptureSession) -> list[RemovableHandle]:
        """Register the hooks that feed ``session`` for one module; return their handles (none: unsupported)."""

    @contextlib.contextmanager
    def armed(self, model: nn.Module, session: CaptureSession) -> Iterator[None]:
        """Process-wide switches needed while armed (none by default)."""
        yield


def head_maps(
    value: Tensor, output: Tensor, heads: int, value_bias: Tensor | None, output_bias: Tensor | None
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-head maps from a value projection ``(H_kv d_h, d)`` and an output projection ``(d, H d_h)`` (y = W x).

    Returns ``w_v (H, d_h, d)`` with query head ``h`` reading kv head ``h // (H / H_kv)``, ``w_o (H, d, d_h)``, and
    the bias constant ``c = sum_h O_h b_v^{g(h)} + b_o``.

    Examples:
        >>> import torch
        >>> from connmon.capture.adapters.base import head_maps
        >>> w_v, w_o, c = head_maps(torch.randn(4, 8), torch.randn(8, 8), heads=4, value_bias=None, output_bias=None)
        >>> tuple(w_v.shape), tuple(w_o.shape), bool(torch.equal(w_v[0], w_v[1]))  # 2 kv heads for 4 query heads
        ((4, 2, 8), (4, 8, 2), True)
    """
    d_h = output.shape[1] // heads
    kv_heads = value.shape[0] // d_h
    rows = torch.arange(kv_heads * d_h, device=value.device).view(kv_heads, d_h)
    return transport_maps(
        value, value_bias, rows.repeat_interleave(heads // kv_heads, dim=0), output, output_bias=output_bias
    )


def transport_maps(
    value: Tensor, value_bias: Tensor | None, rows: Tensor, output: Tensor, output_bias: Tensor | None
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-head maps from the rows of a value projection ``(F, d)`` that each query head reads, and ``(d, H d_h)``.

    Args:
        value: the weight (``y = W x``) of the Linear whose output holds the values, fused or not: ``(F, d)``.
        value_bias: its bias ``(F,)`` or None.
        rows: ``(H, d_h)`` long, the output features of ``value`` that query head ``h`` reads as its values.
        output: the output projection's weight ``(d, H d_h)``, input features head-major.
        output_bias: its bias ``(d,)`` or None.

    Returns:
        ``w_v (H, d_h, d)``, ``w_o (H, d, d_h)`` and the bias constant ``c = sum_h O_h b_v^h + b_o`` ``(d,)``.

    Examples:
        >>> import torch
        >>> from connmon.capture.adapters.base import transport_maps
        >>> qkv = torch.randn(12, 4)  # a fused [q; k; v] projection, 2 heads of width 2
        >>> rows = torch.arange(8, 12).view(2, 2)  # the value rows, head-major
        >>> w_v, w_o, c = transport_maps(qkv, None, rows, torch.randn(4, 4), None)
        >>> bool(torch.equal(w_v[1], qkv[10:12])), tuple(w_o.shape)
        (True, (2, 4, 2))
    """
    heads, d_h = rows.shape
    w_v = value[rows]  # (H, d_h, d)
    w_o = output.reshape(output.shape[0], heads, d_h).transpose(0, 1)  # (H, d, d_h)
    bias = torch.zeros(output.shape[0], dtype=w_o.dtype, device=w_o.device)
    if value_bias is not None:
        bias = bias + torch.einsum("hde,he->d", w_o, value_bias[rows])
    if output_bias is not None:
        bias = bias + output_bias
    return w_v, w_o, bias
