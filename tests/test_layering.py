"""The package's imports run one way: no module imports one that imports it back, and no layer imports one above it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import connmon

ROOT = Path(connmon.__file__).parent
# a module in one of these packages never imports one in the others listed after it (lower layers first)
LAYERS = [
    ("connmon._linalg", "connmon.functional"),
    ("connmon.functional", "connmon.capture", "connmon.curvature", "connmon.metrics"),
    ("connmon.capture", "connmon.curvature", "connmon.alerts", "connmon.monitor", "connmon.callbacks"),
    ("connmon.curvature", "connmon.capture", "connmon.metrics", "connmon.monitor", "connmon.callbacks"),
    ("connmon.metrics", "connmon.alerts", "connmon.monitor", "connmon.callbacks"),
    ("connmon.alerts", "connmon.monitor", "connmon.callbacks", "connmon.integrations"),
]


def modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def imported(path: Path, known: dict[str, Path]) -> set[str]:
    """The connmon modules ``path`` imports, at any depth of its code, except under ``if TYPE_CHECKING:``."""
    out = set()
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            node.body = []  # annotations only: not an import at run time
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("connmon"):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                out.add(full if full in known else node.module)
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names if alias.name.startswith("connmon"))
    return {name for name in out if name in known}


def graph() -> dict[str, set[str]]:
    known = modules()
    edges = {name: imported(path, known) - {name} for name, path in known.items()}
    # a package's face importing its own modules is how it re-exports them, not a dependency of theirs
    return {name: {other for other in targets if not other.startswith(name + ".")} for name, targets in edges.items()}


def test_no_import_cycle():
    edges = graph()
    cycles = []

    def walk(node: str, path: list[str]) -> None:
        for target in sorted(edges[node]):
            if target in path:
                cycles.append(" -> ".join([*path[path.index(target) :], target]))
            elif target not in done:
                done.add(target)
                walk(target, [*path, target])

    done: set[str] = set()
    for start in sorted(edges):
        if start not in done:
            done.add(start)
            walk(start, [start])
    assert not cycles


def test_no_layer_imports_one_above_it():
    edges = graph()
    wrong = [
        (name, target)
        for lower, *above in LAYERS
        for name, targets in edges.items()
        if name == lower or name.startswith(lower + ".")
        for target in targets
        if any(target == up or target.startswith(up + ".") for up in above)
    ]
    assert not wrong


def test_the_type_checker_exemptions_only_shrink():
    """pyproject has no mypy exemption: the whole package is type-checked (issue 48 took the last five away)."""
    text = (ROOT.parent / "pyproject.toml").read_text()  # read as text: tomllib is 3.11+, the package supports 3.10
    overrides = re.findall(r"\[\[tool\.mypy\.overrides\]\]\s*module = \[(.*?)\]", text, flags=re.S)
    exempt = {name for block in overrides for name in re.findall(r'"(connmon[\w.]*)"', block)}
    assert exempt or "tool.mypy.overrides" not in text  # the pattern still reads the file's layout
    assert not exempt, f"new exemptions: {sorted(exempt)}: type the module instead"


def test_the_architecture_page_names_every_module():
    page = (ROOT.parent / "docs" / "architecture.md").read_text()
    missing = [str(path.relative_to(ROOT.parent)) for path in sorted(ROOT.rglob("*.py"))
               if f"`{path.relative_to(ROOT.parent)}`" not in page]  # fmt: skip
    assert not missing, f"add them to docs/architecture.md's 'Every module': {missing}"
