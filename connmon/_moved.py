"""Names that moved: the old path keeps working for one release, with a ``DeprecationWarning`` naming the new one."""

from __future__ import annotations

import importlib
import warnings
from typing import Any


def moved(old: str, name: str, new: str) -> Any:
    """``new.name``, after a ``DeprecationWarning`` that ``old.name`` moved there (call from ``old``'s ``__getattr__``).

    Examples:
        >>> import warnings
        >>> from connmon._moved import moved
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     value = moved("connmon.integrations", "Monitor", "connmon.monitor")
        >>> value.__name__, str(caught[0].message).split(";")[0]
        ('Monitor', 'connmon.integrations.Monitor moved to connmon.monitor.Monitor')
    """
    warnings.warn(
        f"{old}.{name} moved to {new}.{name}; the old path goes in the next release", DeprecationWarning, stacklevel=3
    )
    return getattr(importlib.import_module(new), name)
