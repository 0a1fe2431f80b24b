"""Suite-wide fixtures."""

from __future__ import annotations

import sys

import pytest

LONG = ("slow", "distributed")  # the suite-scale runs and the multi-process ones: CI runs them, and `pytest --all`


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--all", action="store_true", help="also run the tests marked slow or distributed (what CI runs)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Leave the long tests out of the default run, unless ``--all`` or ``-m`` asks for them."""
    if config.getoption("--all") or config.option.markexpr not in ("", "not timm and not olmo_core"):
        return
    kept, left = [], []
    for item in items:
        (left if any(item.get_closest_marker(name) for name in LONG) else kept).append(item)
    if left:
        config.hook.pytest_deselected(items=left)
        items[:] = kept


@pytest.fixture(autouse=True)
def _wandb_setup_ends_with_each_test():
    """W&B reads its settings (``WANDB_MODE`` among them) once per process, at the first ``wandb.init``: a test that
    inits a run must not leave that setup to the next, which may ask for another mode (offline without an API key).
    """
    yield
    wandb = sys.modules.get("wandb")
    if wandb is not None:
        wandb.teardown()
