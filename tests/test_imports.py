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


def test_the_engine_moved_to_connmon_monitor_and_its_old_paths_warn_with_the_new_one():
    import connmon
    import connmon.monitor

    assert connmon.Monitor is connmon.monitor.Monitor
    for old in ("connmon.integrations.monitor", "connmon.integrations"):
        module = importlib.import_module(old)
        for name in ("Monitor", "DIAGNOSTICS"):
            with pytest.warns(DeprecationWarning, match=rf"moved to connmon\.monitor\.{name}"):
                assert getattr(module, name) is getattr(connmon.monitor, name)


def test_the_curvature_is_one_package_and_the_samplers_old_paths_warn_with_the_new_one():
    import connmon.curvature.sampler

    for old in ("connmon.integrations.sharpness", "connmon.integrations"):
        module = importlib.import_module(old)
        with pytest.warns(DeprecationWarning, match=r"moved to connmon\.curvature\.sampler\.SharpnessSampler"):
            assert module.SharpnessSampler is connmon.curvature.sampler.SharpnessSampler
    from connmon.curvature import sharpness_ratio  # the public path of the public API, unchanged

    assert callable(sharpness_ratio)


def test_the_operator_moved_out_of_spectrum_and_its_old_paths_warn_with_the_new_one():
    import connmon.functional as F
    import connmon.functional.spectrum

    for name in ("connection_matvec", "walk_basis"):
        with pytest.warns(DeprecationWarning, match=rf"moved to connmon\.functional\.operator\.{name}"):
            assert getattr(connmon.functional.spectrum, name) is getattr(F, name)


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


def test_the_default_actions_are_named_as_such_and_the_old_name_warns():
    from connmon.alerts import DEFAULT_ACTIONS

    with pytest.warns(DeprecationWarning, match="DEFAULT_ACTIONS"):
        from connmon.alerts import ACTIONS
    assert ACTIONS == DEFAULT_ACTIONS == ("log", "wandb", "stop")


def test_finite_difference_lengths_are_not_called_steps_and_the_old_names_warn():
    import torch

    from connmon.curvature import Sharpness, sharpness_ratio

    reading = Sharpness(0.5, 1.0, 2.0, True, 9, difference_length=1e-4)
    with pytest.warns(DeprecationWarning, match="Sharpness.step is now Sharpness.difference_length"):
        assert reading.step == 1e-4
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = torch.randn(8, 3)
    loss = lambda: model(batch).pow(2).mean()  # noqa: E731
    with pytest.warns(DeprecationWarning, match=r"sharpness_ratio\(initial_step=...\) is now"):
        old = sharpness_ratio(loss, optimizer, model=model, steps=3, initial_step=1e-4)
    assert old == sharpness_ratio(loss, optimizer, model=model, steps=3, initial_length=1e-4)


def test_the_sinks_moved_out_of_loggers_and_their_old_paths_warn_with_the_new_one():
    import connmon.sinks.wandb

    for old, new, name in (("connmon.loggers.wandb", "connmon.sinks.wandb", "WandbSink"),
                           ("connmon.loggers.workspace", "connmon.sinks.workspace", "workspace_spec"),
                           ("connmon.loggers", "connmon.sinks", "depth_figure")):  # fmt: skip
        with pytest.warns(DeprecationWarning, match=rf"moved to {new}\.{name}"):
            assert getattr(importlib.import_module(old), name) is getattr(importlib.import_module(new), name)
    assert connmon.sinks.wandb.WandbSink.__module__ == "connmon.sinks.wandb"
