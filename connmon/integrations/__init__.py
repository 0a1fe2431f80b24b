"""Entry points for trainers other than Lightning, adapters over the engine :class:`connmon.Monitor`.

* :class:`connmon.integrations.transformers.ConnectionMonitorCallback`: the Hugging Face ``Trainer``.
* :class:`connmon.integrations.sharpness.SharpnessSampler`: the curvature against the edge of stability, which
  Lightning's ``SharpnessMonitor``, the Trainer callback and ``connmon.Monitor`` (``sharpness=``) all drive.

``connmon.integrations.Monitor`` is deprecated (``connmon.Monitor``, :mod:`connmon.monitor`).

Examples:
    >>> from connmon.integrations import SharpnessSampler
    >>> SharpnessSampler(every_n_steps=10).every_n_steps
    10
"""

from typing import Any

from connmon.integrations.sharpness import ESTIMATORS, Estimator, SharpnessSampler

__all__ = ["ESTIMATORS", "Estimator", "SharpnessSampler"]


def __getattr__(name: str) -> Any:
    if name in ("DIAGNOSTICS", "Diagnostic", "Monitor"):
        import warnings

        import connmon.monitor

        warnings.warn(
            f"connmon.integrations.{name} moved to connmon.monitor.{name}; the old path goes in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(connmon.monitor, name)
    raise AttributeError(f"module 'connmon.integrations' has no attribute {name!r}")
