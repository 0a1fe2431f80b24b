"""Forwards that are not the training's: connmon's own model runs, which no reader records.

The curvature's Hessian products run the model between a capture's arming and the forward it records, and between
a step's max-logit reader's hooks; inside :func:`paused` they see nothing. Low in the package: the capture reads it,
and the curvature sets it, without importing each other.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

__all__ = ["is_paused", "paused"]

_PAUSED = threading.local()  # .depth > 0 inside paused() in this thread: armed sessions record nothing


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Forwards run inside the block are not recorded by any armed capture (nested blocks allowed).

    For work that runs the model between a capture's arming and the forward it is meant to record, such as
    :class:`connmon.callbacks.SharpnessMonitor`'s Hessian-vector products.

    Examples:
        >>> import torch
        >>> import connmon.capture as cc
        >>> layer = torch.nn.TransformerEncoderLayer(8, 2, dropout=0.0, batch_first=True)
        >>> model = torch.nn.TransformerEncoder(layer, 1)
        >>> with cc.armed(model) as session:
        ...     with cc.paused():
        ...         _ = model(torch.randn(1, 4, 8))  # not recorded
        ...     _ = model(torch.randn(1, 4, 8))  # recorded
        >>> len(session.records)
        1
    """
    _PAUSED.depth = is_paused() + 1
    try:
        yield
    finally:
        _PAUSED.depth -= 1


def is_paused() -> int:
    """Above 0 inside :func:`paused` in this thread (forwards run there are not the training's)."""
    return getattr(_PAUSED, "depth", 0)
