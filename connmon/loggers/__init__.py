"""Deprecated: moved to :mod:`connmon.sinks` (``connmon.loggers.wandb``, ``.figures``, ``.workspace`` likewise).

Every name read here warns with its new place, for one release.
"""

from __future__ import annotations

from typing import Any

from connmon._moved import moved


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    return moved("connmon.loggers", name, "connmon.sinks")
