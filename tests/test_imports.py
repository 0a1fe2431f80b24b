"""`import connmon` and `connmon --help` pay only for what they use: no torch, torchmetrics or Lightning up front."""

import importlib
import subprocess
import sys

import pytest


def loaded_after(code: str) -> set[str]:
    probe = f"{code}\nimport sys\nprint(' '.join(sorted(m.split('.')[0] for m in sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120)
    return set(out.stdout.split())


def test_import_connmon_loads_no_heavy_dependency():
    assert not loaded_after("import connmon") & {"torch", "torchmetrics", "lightning", "transformers", "wandb"}


def test_the_command_line_help_loads_no_torch():
    code = "from connmon.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass"
    assert "torch" not in loaded_after(code)


def test_attributes_still_resolve_on_first_use():
    code = "import connmon\nconnmon.functional.walk_matrix\nconnmon.capture.armed\nconnmon.analyze\nconnmon.curvature"
    loaded = loaded_after(code)
    assert "torch" in loaded and "lightning" not in loaded
    assert "torchmetrics" not in loaded  # connmon analyze reads records; it needs no accumulator (a second of import)
    loaded = loaded_after("import connmon.metrics\nconnmon.metrics.SpectrumMetrics")
    assert "torchmetrics" in loaded and "lightning" not in loaded


def test_no_private_name_is_imported_across_modules_of_the_package():
    """A module's ``_name`` is its own: what another module needs is public (in a private module if need be)."""
    import ast
    from pathlib import Path

    root = Path(__file__).parent.parent / "connmon"
    crossings = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("connmon"):
                private = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
                crossings += [f"{path.relative_to(root.parent)}: {node.module}.{name}" for name in private]
    assert crossings == []


def test_no_name_that_never_shipped_in_a_release_is_kept_alive_by_a_shim():
    """The old paths are gone (no release ever had them), and no module answers a missing attribute but the two
    packages that import their parts on first use (``connmon`` and ``connmon.metrics``)."""
    import ast
    from pathlib import Path

    for old in ("connmon.loggers", "connmon.integrations.monitor", "connmon.integrations.sharpness", "connmon._moved"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(old)
    import connmon.alerts
    import connmon.functional.spectrum
    import connmon.integrations

    for module, name in ((connmon.integrations, "Monitor"), (connmon.alerts, "ACTIONS"),
                         (connmon.functional.spectrum, "walk_basis")):  # fmt: skip
        assert not hasattr(module, name), (module.__name__, name)
    root = Path(__file__).parent.parent / "connmon"
    answering = sorted(
        str(path.relative_to(root.parent))
        for path in root.rglob("*.py")
        for node in ast.parse(path.read_text()).body
        if isinstance(node, ast.FunctionDef) and node.name == "__getattr__"
    )
    assert answering == ["connmon/__init__.py", "connmon/metrics/__init__.py"]
