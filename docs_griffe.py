"""A Griffe extension for the API reference: the docstrings' Sphinx roles become mkdocstrings cross-references.

``:func:`connmon.capture``` links to that object's page, ``:class:`~connmon.alerts.Rule``` shows ``Rule`` linked;
a role on anything outside connmon (``:class:`torch.nn.Module```) or on a name without its package shows as code.
"""

from __future__ import annotations

import re

import griffe

_ROLE = re.compile(r":(?:func|class|meth|attr|data|mod|obj|exc):`(~?)([\w.]+)`")


class SphinxRoles(griffe.Extension):
    """Rewrite ``:role:`target``` in every docstring the reference renders."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: object) -> None:  # noqa: D102
        if obj.docstring is not None:
            obj.docstring.value = _ROLE.sub(_reference, obj.docstring.value)


def _reference(match: re.Match) -> str:
    short, target = match.groups()
    shown = target.rsplit(".", 1)[-1] if short else target
    if target.startswith("connmon."):  # optional: a private helper's name stays code, not a broken link
        return f'<autoref identifier="{target}" optional><code>{shown}</code></autoref>'
    return f"`{shown}`"
