"""Which process this is, for logging once under data parallelism (Lightning, Accelerate, torchrun alike)."""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from types import FrameType

from connmon._collectives import process_rank

_FRAMEWORKS = ("torch", "lightning", "pytorch_lightning", "lightning_fabric", "transformers", "accelerate")
_HERE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def is_rank_zero() -> bool:
    """True unless ``torch.distributed`` is initialized and this process has a global rank other than 0.

    Examples:
        >>> from connmon._ranks import is_rank_zero
        >>> is_rank_zero()
        True
    """
    return process_rank() == 0


def warn_rank_zero(message: str) -> None:
    """``warnings.warn(message)`` on the rank-zero process only.

    Examples:
        >>> import warnings
        >>> from connmon._ranks import warn_rank_zero
        >>> with warnings.catch_warnings(record=True) as seen:
        ...     warnings.simplefilter("always")
        ...     warn_rank_zero("hello")
        >>> str(seen[0].message)
        'hello'
    """
    if is_rank_zero():
        warnings.warn(message, UserWarning, stacklevel=user_stacklevel())


def user_stacklevel() -> int:
    """The ``stacklevel`` that attributes a warning to the user's own line, outside connmon and the trainers.

    For the function that calls :func:`warnings.warn`: the first frame above it that is not connmon's, torch's,
    Lightning's, transformers', Accelerate's or :mod:`contextlib`'s is the user's (``with monitor.step(...)``,
    ``trainer.fit(...)``).

    Examples:
        >>> import warnings
        >>> from connmon._ranks import user_stacklevel
        >>> with warnings.catch_warnings(record=True) as seen:
        ...     warnings.simplefilter("always")
        ...     warnings.warn("here", stacklevel=user_stacklevel())
        >>> seen[0].filename.endswith("_ranks.py")
        False
    """
    internal = [_HERE, contextlib.__file__]
    for name in _FRAMEWORKS:
        path = getattr(sys.modules.get(name), "__file__", None)
        if path is not None:
            internal.append(os.path.dirname(os.path.abspath(path)) + os.sep)
    prefixes = tuple(internal)
    frame: FrameType | None = sys._getframe(1)  # the caller of warnings.warn: stacklevel 1
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(prefixes):
        frame = frame.f_back
        level += 1
    return level if frame is not None else 1
