"""ForwardWrapper: connmon's reading around a module's own ``forward``, where a hook would change what runs.

torch's ``nn.TransformerEncoderLayer`` refuses its fused path when any forward hook sits on it or inside it, and
PyTorch runs a forward hook's clean-up (``always_call``) only for an ``Exception``, never a ``KeyboardInterrupt``. A
wrapper is an attribute of the instance that ``nn.Module.__call__`` calls in place of the class's ``forward``: code
that checks for hooks sees none, and its clean-up runs however the forward ends.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from torch import nn

__all__ = ["ForwardWrapper"]


class ForwardWrapper:
    """Calls ``before(args, kwargs)`` and ``after(args, kwargs, output)`` around a module's own ``forward``.

    ``ended(completed)``, if given, runs after the forward however it ended (``completed`` False when it raised,
    any ``BaseException``). Removed like a hook handle; a wrapper that another one was stacked on after it turns into
    a plain call of the forward it wrapped, and is skipped when the later one is removed.

    Examples:
        >>> import torch
        >>> from connmon.capture.forward_wrapper import ForwardWrapper
        >>> layer, seen = torch.nn.Linear(2, 2), []
        >>> handle = ForwardWrapper(layer, None, lambda args, kwargs, out: seen.append(tuple(out.shape)))
        >>> _ = layer(torch.zeros(3, 2))
        >>> handle.remove()
        >>> _ = layer(torch.zeros(1, 2))
        >>> seen, "forward" in vars(layer), len(layer._forward_hooks)
        ([(3, 2)], False, 0)
    """

    def __init__(
        self,
        module: nn.Module,
        before: Callable | None,
        after: Callable | None,
        ended: Callable[[bool], None] | None = None,
    ) -> None:
        self.module, self.active = module, True
        self.own = vars(module).get("forward")  # an instance forward of the user's own (or a wrapper), kept as it is
        inner = module.forward

        @functools.wraps(inner)
        def forward(*args: object, **kwargs: object) -> object:
            if not self.active:
                return inner(*args, **kwargs)
            if before is not None:
                before(args, kwargs)
            completed = False
            try:
                output = inner(*args, **kwargs)
                completed = True
            finally:
                if ended is not None:
                    ended(completed)
            if after is not None:
                after(args, kwargs, output)
            return output

        forward._connmon_wrapper = self  # type: ignore[attr-defined]
        self.forward = forward
        module.forward = forward

    def remove(self) -> None:
        """Take the wrapper off (idempotent)."""
        self.active = False
        if vars(self.module).get("forward") is not self.forward:
            return  # a later wrapper sits on it: this one only passes calls through now
        restored = self.own
        below = getattr(restored, "_connmon_wrapper", None)
        while below is not None and not below.active:  # removed before the one above it: skipped now
            restored = below.own
            below = getattr(restored, "_connmon_wrapper", None)
        if restored is None:
            del self.module.forward
        else:
            self.module.forward = restored
