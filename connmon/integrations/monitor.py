"""Deprecated: the engine moved to :mod:`connmon.monitor` (``connmon.Monitor``).

These names keep working for one release, each with a ``DeprecationWarning`` that names its new place.
"""

from __future__ import annotations

import warnings
from typing import Any

_MOVED = ("DIAGNOSTICS", "SAMPLING_OPTIONS", "Diagnostic", "LogFn", "Monitor")


def __getattr__(name: str) -> Any:
    if name not in _MOVED:
        raise AttributeError(f"module 'connmon.integrations.monitor' has no attribute {name!r}")
    warnings.warn(
        f"connmon.integrations.monitor.{name} moved to connmon.monitor.{name}; the old path goes in the next release",
        DeprecationWarning,
        stacklevel=2,
    )
    import connmon.monitor

    return getattr(connmon.monitor, name)
