"""Deprecated: moved to :mod:`connmon.sinks.figures`; each name read here warns with its new place."""

from __future__ import annotations

from typing import Any

from connmon._moved import moved


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    return moved("connmon.loggers.figures", name, "connmon.sinks.figures", removed_in="0.2.0")
