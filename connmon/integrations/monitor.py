"""Deprecated: the engine moved to :mod:`connmon.monitor` (``connmon.Monitor``).

These names keep working until connmon 0.2.0, each with a ``DeprecationWarning`` that names its new place.
"""

from __future__ import annotations

from typing import Any

from connmon._moved import moved


def __getattr__(name: str) -> Any:
    if name not in ("DIAGNOSTICS", "SAMPLING_OPTIONS", "Diagnostic", "LogFn", "Monitor"):
        raise AttributeError(f"module 'connmon.integrations.monitor' has no attribute {name!r}")
    return moved("connmon.integrations.monitor", name, "connmon.monitor", removed_in="0.2.0")
