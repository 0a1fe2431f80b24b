"""The package's imports run one way: no module imports one that imports it back, and no layer imports one above it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import connmon

ROOT = Path(connmon.__file__).parent
# every module's floor, lowest first: a module imports only modules of lower floors and of its own group (a package
# or a module named here); two groups on one floor never import each other
FLOORS = [
    ("connmon.keys", "connmon._collectives", "connmon._copying", "connmon._optimizer",
     "connmon._options", "connmon._pause", "connmon.demo", "connmon.sample_text", "connmon.sinks.figures",
     "connmon.sinks.wandb"),
    ("connmon._ranks", "connmon._cost", "connmon._linalg"),
    ("connmon.step_options",),
    ("connmon._saved_state", "connmon._budget", "connmon.functional", "connmon.sampling", "connmon.sinks.panels"),
    ("connmon.capture",),
    ("connmon.metrics", "connmon.curvature", "connmon._probe"),
    ("connmon.alerts", "connmon.analysis", "connmon.attention_sampler", "connmon.sinks.workspace"),
    ("connmon.step_signals",),
    ("connmon.monitor",),
    ("connmon.callbacks", "connmon.integrations"),
    ("connmon", "connmon.sinks"),
    ("connmon.cli",),
]  # fmt: skip


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


def group_of(name: str) -> tuple[int, str] | None:
    """The floor and group of module ``name``: the longest group that is it or a package above it."""
    places = [(len(group), floor, group) for floor, groups in enumerate(FLOORS) for group in groups
              if name == group or name.startswith(group + ".")]  # fmt: skip
    return max(places)[1:] if places else None


def test_every_module_has_a_floor():
    missing = sorted(name for name in modules() if group_of(name) is None)
    assert not missing, f"give them a floor in FLOORS: {missing}"


def test_no_module_imports_one_above_it_or_beside_it():
    wrong = []
    for name, targets in graph().items():
        floor, group = group_of(name) or (0, name)
        for target in targets:
            there, other = group_of(target) or (0, target)
            if there > floor or (there == floor and other != group):
                wrong.append(f"{name} (floor {floor}) imports {target} (floor {there})")
    assert not wrong


def test_collectives_go_through_one_module():
    """Only ``connmon._collectives`` calls ``torch.distributed`` (its process-group and collective functions)."""
    calls = []
    for path in sorted(ROOT.rglob("*.py")):
        if path.name == "_collectives.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                owner = ast.unparse(node.func.value)
                if owner in ("dist", "torch.distributed"):
                    calls.append(f"{path.relative_to(ROOT.parent)}:{node.lineno} {ast.unparse(node.func)}")
    assert not calls, f"call them through connmon._collectives: {calls}"


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


def test_no_call_passes_more_than_four_positionals_to_connmons_own_functions():
    """Past four, a call names its arguments (a callee taking ``*args`` excepted; torch's and others' are theirs)."""
    defined: dict[str, bool] = {}  # a function's or class's name in connmon -> whether every one of them takes *args
    trees = {path: ast.parse(path.read_text()) for path in sorted(ROOT.rglob("*.py"))}
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                varargs = isinstance(node, ast.FunctionDef) and node.args.vararg is not None
                defined[node.name] = defined.get(node.name, True) and varargs
    calls = []
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or len(node.args) <= 4:
                continue
            name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
            if name in defined and not defined[name] and not any(isinstance(a, ast.Starred) for a in node.args):
                calls.append(f"{path.relative_to(ROOT.parent)}:{node.lineno} {ast.unparse(node.func)}")
    assert not calls, f"name the arguments past the fourth: {calls}"
