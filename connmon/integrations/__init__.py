"""Entry points for trainers other than Lightning, on the same capture, metrics and alerts.

* :class:`connmon.integrations.monitor.Monitor` (also ``connmon.Monitor``): plain PyTorch and Accelerate loops, and
  the sampler every other entry point drives.
* :class:`connmon.integrations.transformers.ConnectionMonitorCallback`: the Hugging Face ``Trainer``.
* :class:`connmon.integrations.sharpness.SharpnessSampler`: the curvature against the edge of stability, which
  Lightning's ``SharpnessMonitor``, the Trainer callback and ``connmon.Monitor`` (``sharpness=``) all drive.

Examples:
    >>> from connmon.integrations import Monitor
    >>> Monitor(every_n_steps=10).every_n_steps
    10
"""

from connmon.integrations.monitor import DIAGNOSTICS, Diagnostic, Monitor
from connmon.integrations.sharpness import ESTIMATORS, Estimator, SharpnessSampler

__all__ = ["DIAGNOSTICS", "ESTIMATORS", "Diagnostic", "Estimator", "Monitor", "SharpnessSampler"]
