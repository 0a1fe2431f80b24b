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

    Example:
        >>> import torch
        >>> from connmon.capture.adapters.base import head_maps
        >>> w_v, w_o, c = head_maps(torch.randn(4, 8), torch.randn(8, 8), heads=4, value_bias=None, output_bias=None)
        >>> tuple(w_v.shape), tuple(w_o.shape), bool(torch.equal(w_v[0], w_v[1]))  # 2 kv heads for 4 query heads
        ((4, 2, 8), (4, 8, 2), True)
    """
    d_out, inner = output.shape
    d_h = inner // heads
    kv_heads = value.shape[0] // d_h
    w_v = value.reshape(kv_heads, d_h, value.shape[1]).repeat_interleave(heads // kv_heads, dim=0)
    w_o = output.reshape(d_out, heads, d_h).transpose(0, 1)  # (H, d, d_h)
    bias = torch.zeros(d_out, dtype=w_o.dtype, device=w_o.device)
    if value_bias is not None:
        b_v = value_bias.reshape(kv_heads, d_h, 1).repeat_interleave(heads // kv_heads, dim=0)
        bias = bias + (w_o @ b_v).sum(dim=0).squeeze(-1)
    if output_bias is not None:
        bias = bias + output_bias
    return w_v, w_o, bias
