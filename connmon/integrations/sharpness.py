"""Deprecated: the curvature sampler moved to :mod:`connmon.curvature.sampler`.

These names keep working until connmon 0.2.0, each with a ``DeprecationWarning`` that names its new place.
"""

from __future__ import annotations

from typing import Any

from connmon._moved import moved


def __getattr__(name: str) -> Any:
    import connmon.curvature.sampler

    if name.startswith("_") or not hasattr(connmon.curvature.sampler, name):
        raise AttributeError(f"module 'connmon.integrations.sharpness' has no attribute {name!r}")
    return moved("connmon.integrations.sharpness", name, "connmon.curvature.sampler", removed_in="0.2.0")
