"""Checks on constructor options shared across the package (pure Python: no torch, so alerts stay light).

Examples:
    >>> from connmon._options import check_int
    >>> check_int("every_n_steps", 0)
    Traceback (most recent call last):
    ...
    ValueError: every_n_steps must be an integer >= 1, got every_n_steps=0
"""

from __future__ import annotations


def check_int(name: str, value: object, *, optional: bool = False) -> None:
    """An integer option >= 1 (or None where ``optional``); the error names the valid values and the one seen."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        valid = "an integer >= 1" + (" or None" if optional else "")
        raise ValueError(f"{name} must be {valid}, got {name}={value!r}")
