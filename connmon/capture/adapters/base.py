"""What an adapter does: find its attention modules, read their transport weights, feed a session from hooks."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from connmon.capture.session import CaptureSession


class Adapter:
    """Base class of capture adapters, one per model family.

    An adapter recognises its self-attention modules (:meth:`matches`), reads their per-head value and output maps
    (:meth:`weights`), and, while a capture is armed, hands the session each module's input, attention scores and
    output (:meth:`hooks`, plus :meth:`armed` for process-wide switches such as intercepting
    ``scaled_dot_product_attention``). Everything it registers is removed when the capture ends.
    """

    name = "adapter"

    def matches(self, module: nn.Module) -> bool:
        """Whether this adapter reads ``module``."""
        raise NotImplementedError

    def weights(self, module: nn.Module) -> tuple[Tensor, Tensor, Tensor]:
        """``w_v (H, d_h, d)``, ``w_o (H, d, d_h)`` and the bias constant ``c (d,)``."""
        raise NotImplementedError

    def hooks(self, model: nn.Module, name: str, module: nn.Module, session: CaptureSession) -> list[RemovableHandle]:
        """Register the hooks that feed ``session`` for one module; return their handles."""
        raise NotImplementedError

    @contextlib.contextmanager
    def armed(self, model: nn.Module, session: CaptureSession) -> Iterator[None]:
        """Process-wide switches needed while armed (none by default)."""
        yield
