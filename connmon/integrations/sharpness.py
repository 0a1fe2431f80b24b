"""Deprecated: the curvature sampler moved to :mod:`connmon.curvature.sampler`.

These names keep working for one release, each with a ``DeprecationWarning`` that names its new place.
"""

from __future__ import annotations

import warnings
from typing import Any


def __getattr__(name: str) -> Any:
    import connmon.curvature.sampler

    if name.startswith("_") or not hasattr(connmon.curvature.sampler, name):
        raise AttributeError(f"module 'connmon.integrations.sharpness' has no attribute {name!r}")
    warnings.warn(
        f"connmon.integrations.sharpness.{name} moved to connmon.curvature.sampler.{name}; the old path goes in the "
        "next release",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(connmon.curvature.sampler, name)
