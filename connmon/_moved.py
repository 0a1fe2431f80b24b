"""Names that moved: the old path keeps working until the version each shim names, with a ``DeprecationWarning``.

Every shim passes ``removed_in``, the release that takes it out; ``tests/test_moved.py`` fails once the package's
version reaches it, so a shim cannot outlive its promise.
"""

from __future__ import annotations

import functools
import importlib
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def renamed_name(old: str, new: str, *, removed_in: str, stacklevel: int = 3) -> None:
    """Say, as a ``DeprecationWarning``, that ``old`` is now ``new`` and the old name goes in ``removed_in``.

    Every deprecation of connmon says it here (a path, a keyword, a value, an attribute), in one form.

    Examples:
        >>> import warnings
        >>> from connmon._moved import renamed_name
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     renamed_name("Sharpness.step", "Sharpness.difference_length", removed_in="0.2.0")
        >>> str(caught[0].message)
        'Sharpness.step is now Sharpness.difference_length; the old name goes in connmon 0.2.0'
    """
    warnings.warn(f"{old} is now {new}; the old name goes in connmon {removed_in}", DeprecationWarning, stacklevel)


def moved(old: str, name: str, new: str, *, removed_in: str) -> Any:
    """``new.name``, after a ``DeprecationWarning`` that ``old.name`` moved there (call from ``old``'s ``__getattr__``).

    Examples:
        >>> import warnings
        >>> from connmon._moved import moved
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     value = moved("connmon.integrations", "Monitor", "connmon.monitor", removed_in="0.2.0")
        >>> value.__name__, str(caught[0].message).split(";")[0]
        ('Monitor', 'connmon.integrations.Monitor moved to connmon.monitor.Monitor')
    """
    warnings.warn(
        f"{old}.{name} moved to {new}.{name}; the old path goes in connmon {removed_in}",
        DeprecationWarning,
        stacklevel=3,
    )  # "moved to": tests and users match the path's own wording
    return getattr(importlib.import_module(new), name)


def renamed(option: str, old: str, new: str, *, removed_in: str) -> str:
    """``new``, after a ``DeprecationWarning`` that the value ``old`` of ``option`` is now called ``new``.

    Examples:
        >>> import warnings
        >>> from connmon._moved import renamed
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     value = renamed("estimator", "lanczos", "exact_lanczos", removed_in="0.2.0")
        >>> value, str(caught[0].message).split(";")[0]
        ('exact_lanczos', "estimator='lanczos' is now estimator='exact_lanczos'")
    """
    renamed_name(f"{option}={old!r}", f"{option}={new!r}", removed_in=removed_in, stacklevel=4)
    return new


def renamed_keywords(removed_in: str, **names: str) -> Callable[[F], F]:
    """Let a function take its keywords' old names ``old=new`` until ``removed_in``, each with a ``DeprecationWarning``.

    Examples:
        >>> import warnings
        >>> from connmon._moved import renamed_keywords
        >>> @renamed_keywords("0.2.0", initial_step="initial_length")
        ... def solve(*, initial_length=None):
        ...     return initial_length
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     value = solve(initial_step=1e-4)
        >>> value, str(caught[0].message).split(";")[0]
        (0.0001, 'solve(initial_step=...) is now solve(initial_length=...)')
    """

    def decorate(function: F) -> F:
        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            for old, new in names.items():
                if old in kwargs:
                    renamed_name(
                        f"{function.__name__}({old}=...)", f"{function.__name__}({new}=...)", removed_in=removed_in
                    )
                    kwargs[new] = kwargs.pop(old)
            return function(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate
