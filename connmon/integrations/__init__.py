"""Entry points for trainers other than Lightning, adapters over the engine :class:`connmon.Monitor`.

* :class:`connmon.integrations.transformers.ConnectionMonitorCallback`: the Hugging Face ``Trainer`` (the
  ``transformers`` extra).

``connmon.integrations.Monitor`` and ``connmon.integrations.SharpnessSampler`` are deprecated: the engine is
:mod:`connmon.monitor` (``connmon.Monitor``), the curvature sampler :mod:`connmon.curvature.sampler`.
"""

from typing import Any

from connmon._moved import moved

_MOVED = {
    "DIAGNOSTICS": "connmon.monitor",
    "Diagnostic": "connmon.monitor",
    "Monitor": "connmon.monitor",
    "ESTIMATORS": "connmon.curvature.sampler",
    "Estimator": "connmon.curvature.sampler",
    "SharpnessSampler": "connmon.curvature.sampler",
}


def __getattr__(name: str) -> Any:
    if name not in _MOVED:
        raise AttributeError(f"module 'connmon.integrations' has no attribute {name!r}")
    return moved("connmon.integrations", name, _MOVED[name], removed_in="0.2.0")
