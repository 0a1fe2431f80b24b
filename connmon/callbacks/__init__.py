"""Lightning callbacks, inside the package so that installing connmon claims no global ``callbacks`` import name.

Examples:
    >>> from connmon.callbacks import ConnectionMonitor
    >>> ConnectionMonitor(every_n_steps=10).options.every_n_steps
    10
"""

from connmon.callbacks.connection_monitor import ConnectionMonitor
from connmon.callbacks.drift_alert import DriftAlert
from connmon.callbacks.sharpness_monitor import SharpnessMonitor

__all__ = ["ConnectionMonitor", "DriftAlert", "SharpnessMonitor"]
