"""Which process this is, for logging once under data parallelism (Lightning, Accelerate, torchrun alike)."""

from __future__ import annotations

import warnings

import torch.distributed as dist


def is_rank_zero() -> bool:
    """True unless ``torch.distributed`` is initialized and this process has a global rank other than 0.

    Examples:
        >>> from connmon._ranks import is_rank_zero
        >>> is_rank_zero()
        True
    """
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


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
        warnings.warn(message, UserWarning, stacklevel=3)
