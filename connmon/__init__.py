"""connmon: training-time monitoring of transformer attention read as a connection walk (arXiv 2607.10677).

Examples:
    >>> import connmon
    >>> import connmon.functional as F
    >>> connmon.__version__
    '0.1.0'
"""

import importlib
from typing import Any

__version__ = "0.1.0"

__all__ = [
    "AttentionRecord",
    "Monitor",
    "Report",
    "__version__",
    "analyze",
    "callbacks",
    "capture",
    "curvature",
    "functional",
]

# Imported on first use: torch, torchmetrics and Lightning take seconds to import, and `connmon --help` or a plain
# `import connmon` should not pay for the parts it does not touch.
_LAZY = {
    "callbacks": ("connmon.callbacks", None),
    "capture": ("connmon.capture", None),
    "curvature": ("connmon.curvature", None),
    "functional": ("connmon.functional", None),
    "analyze": ("connmon.analysis", "analyze"),
    "Monitor": ("connmon.monitor", "Monitor"),
    "Report": ("connmon.analysis", "Report"),
    "AttentionRecord": ("connmon.capture", "AttentionRecord"),
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'connmon' has no attribute {name!r}")
    module_name, attribute = _LAZY[name]
    module = importlib.import_module(module_name)
    value = module if attribute is None else getattr(module, attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
