"""Suite-wide fixtures."""

from __future__ import annotations

import sys

import pytest


@pytest.fixture(autouse=True)
def _wandb_setup_ends_with_each_test():
    """W&B reads its settings (``WANDB_MODE`` among them) once per process, at the first ``wandb.init``: a test that
    inits a run must not leave that setup to the next, which may ask for another mode (offline without an API key).
    """
    yield
    wandb = sys.modules.get("wandb")
    if wandb is not None:
        wandb.teardown()
