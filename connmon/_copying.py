"""Copies of connmon's stateful objects that carry no tie to the original's run.

``strategy="ddp_spawn"`` pickles the Lightning callbacks into new processes, and Lightning and users deep-copy
callbacks. A hook handle copied along would remove the original's hook, and a weak cache or a Trainer does not
pickle at all: such attributes are left out of a copy and start fresh in it, as they do before ``attach``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class CopiesDetached:
    """Pickle and deepcopy without the attributes ``_not_copied`` names: each starts as its factory makes it.

    Examples:
        >>> import copy
        >>> from connmon._copying import CopiesDetached
        >>> class Watcher(CopiesDetached):
        ...     _not_copied = (("hook", lambda: None),)
        ...     def __init__(self):
        ...         self.hook, self.seen = object(), 3
        >>> twin = copy.deepcopy(Watcher())
        >>> twin.hook, twin.seen
        (None, 3)
    """

    _not_copied: tuple[tuple[str, Callable[[], Any]], ...] = ()  # (attribute, factory of its fresh value)

    def __getstate__(self) -> dict[str, Any]:
        """The instance's attributes, less those that tie it to the original's run."""
        left_out = {name for name, _ in self._not_copied}
        return {name: value for name, value in self.__dict__.items() if name not in left_out}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """The saved attributes, and a fresh value for each one left out."""
        self.__dict__.update(state)
        for name, fresh in self._not_copied:
            self.__dict__[name] = fresh()
