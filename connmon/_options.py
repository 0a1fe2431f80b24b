"""Checks on constructor options shared across the package (pure Python: no torch, so alerts stay light).

Every check raises a ValueError that names the option, says what it expects and echoes the value seen.

Examples:
    >>> from connmon._options import check_int, check_number
    >>> check_int("every_n_steps", 0)
    Traceback (most recent call last):
    ...
    ValueError: every_n_steps must be an integer >= 1, got every_n_steps=0
    >>> check_number("history", 2.5, low=0, integer=True)
    Traceback (most recent call last):
    ...
    ValueError: history must be an integer >= 0, got history=2.5
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence


def check_int(name: str, value: object, *, optional: bool = False) -> None:
    """An integer option >= 1 (or None where ``optional``); the error names the valid values and the one seen."""
    check_number(name, value, low=1, integer=True, optional=optional)


def check_number(
    name: str,
    value: object,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
    integer: bool = False,
    optional: bool = False,
) -> None:
    """A real number (an integer where ``integer``) within ``[low, high]`` (open ends where said); None if ``optional``.

    Examples:
        >>> from connmon._options import check_number
        >>> check_number("alpha", 1.5, low=0, high=1, low_open=True)
        Traceback (most recent call last):
        ...
        ValueError: alpha must be a number in (0, 1], got alpha=1.5
    """
    if value is None and optional:
        return
    kind = (int,) if integer else (int, float)
    if not isinstance(value, bool) and isinstance(value, kind) and math.isfinite(value):
        above = low is None or (value > low if low_open else value >= low)
        below = high is None or (value < high if high_open else value <= high)
        if above and below:
            return
    what = "an integer" if integer else "a number"
    if low is not None and high is not None:
        what += f" in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    elif low is not None:
        what += f" {'>' if low_open else '>='} {low:g}"
    elif high is not None:
        what += f" {'<' if high_open else '<='} {high:g}"
    raise ValueError(f"{name} must be {what}{' or None' if optional else ''}, got {name}={value!r}")


def check_choice(name: str, value: object, choices: Iterable[object]) -> None:
    """One of ``choices``.

    Examples:
        >>> from connmon._options import check_choice
        >>> check_choice("level", "LOUD", ("INFO", "WARN", "ERROR"))
        Traceback (most recent call last):
        ...
        ValueError: level must be one of ('INFO', 'WARN', 'ERROR'), got level='LOUD'
    """
    choices = tuple(choices)
    if not isinstance(value, (str, int, float, bool, type(None))) or value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {name}={value!r}")


def check_callable(name: str, value: object, *, optional: bool = False, signature: str = "") -> None:
    """A callable (or None where ``optional``); ``signature`` says how it is called, for the message."""
    if (value is None and optional) or callable(value):
        return
    how = f" as {signature}" if signature else ""
    raise ValueError(f"{name} must be callable{how}{' or None' if optional else ''}, got {name}={value!r}")


def check_items(name: str, value: object, types: tuple[type, ...], what: str, *, hint: Callable[[object], str]) -> None:
    """A sequence (list, tuple) whose items are all instances of ``types``; ``hint(item)`` advises on a wrong one."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ValueError(f"{name} must be a list of {what}, got {name}={value!r}")
    for i, item in enumerate(value):
        if not isinstance(item, types):
            raise ValueError(f"{name}[{i}] must be {what}, got {item!r}{hint(item)}")
