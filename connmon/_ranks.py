"""Which process this is, for logging once under data parallelism (Lightning, Accelerate, torchrun alike)."""

from __future__ import annotations

import warnings
from typing import TypeVar

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


T = TypeVar("T")


def rank_zeros(value: T) -> T:
    """Rank zero's ``value`` on every process (``value`` itself without ``torch.distributed``): one decision for all.

    Every process must call it at the same point (a broadcast).

    Examples:
        >>> from connmon._ranks import rank_zeros
        >>> rank_zeros("connmon_restore_points/step=8.ckpt")
        'connmon_restore_points/step=8.ckpt'
    """
    if not (dist.is_available() and dist.is_initialized()):
        return value
    shared = [value]
    dist.broadcast_object_list(shared, src=0)
    return shared[0]
