"""Every deprecation shim names the release that removes it, and this test fails once the package reaches it."""

from __future__ import annotations

import ast
import warnings
from pathlib import Path

import pytest
from packaging.version import Version

import connmon
from connmon._moved import moved, renamed, renamed_keywords, renamed_name

ROOT = Path(connmon.__file__).parent
SHIMS = {"renamed_name", "moved", "renamed", "renamed_keywords"}


def shim_calls() -> list[tuple[str, int, str | None]]:
    """Every call of a shim function in the package: (file, line, the literal ``removed_in`` or None)."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        if path.name == "_moved.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
            if name not in SHIMS:
                continue
            given = [k.value for k in node.keywords if k.arg == "removed_in"]
            if name == "renamed_keywords" and node.args:
                given.append(node.args[0])
            version = given[0].value if given and isinstance(given[0], ast.Constant) else None
            found.append((str(path.relative_to(ROOT.parent)), node.lineno, version))
    return found


def test_every_shim_names_a_release_still_ahead():
    calls = shim_calls()
    assert len({file for file, _, _ in calls}) >= 12  # the scan still finds the shims (13 files at 0.1.0)
    unnamed = [f"{file}:{line}" for file, line, version in calls if version is None]
    assert not unnamed, f"a shim without a literal removed_in=: {unnamed}"
    due = [f"{file}:{line} ({version})" for file, line, version in calls
           if Version(connmon.__version__) >= Version(str(version))]  # fmt: skip
    assert not due, f"connmon {connmon.__version__} is the release that removes these shims: {due}"


def test_a_shim_without_a_release_is_refused():
    with pytest.raises(TypeError, match="removed_in"):
        renamed_name("a", "b")  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="removed_in"):
        moved("connmon.loggers", "depth_figure", "connmon.sinks")  # type: ignore[call-arg]


@pytest.mark.parametrize(
    "call",
    [
        lambda: renamed_name("old", "new", removed_in="9.0"),
        lambda: moved("connmon.loggers", "depth_figure", "connmon.sinks", removed_in="9.0"),
        lambda: renamed("estimator", "lanczos", "exact_lanczos", removed_in="9.0"),
        lambda: renamed_keywords("9.0", old="new")(lambda *, new=None: new)(old=1),
    ],
)
def test_each_warning_says_its_release(call):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    assert [str(w.message).endswith("goes in connmon 9.0") for w in caught] == [True]
    assert caught[0].category is DeprecationWarning
