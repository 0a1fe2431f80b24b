"""Lightning callbacks (the design card's ``callbacks`` part, inside the package so no global name is claimed).

Examples:
    >>> from connmon.callbacks import ConnectionMonitor
    >>> ConnectionMonitor(every_n_steps=10).every_n_steps
    10
"""

from connmon.callbacks.connection_monitor import ConnectionMonitor
from connmon.callbacks.drift_alert import DriftAlert
from connmon.callbacks.sharpness_monitor import SharpnessMonitor

__all__ = ["ConnectionMonitor", "DriftAlert", "SharpnessMonitor"]
