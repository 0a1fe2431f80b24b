"""Offline W&B runs for callback tests, read back with the real client (``wandb leet inspect --json``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from lightning.pytorch.loggers import WandbLogger


def offline_logger(tmp_path: Path, monkeypatch) -> WandbLogger:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    return WandbLogger(project="connmon-test", save_dir=str(tmp_path), offline=True)


def finish_and_read(logger: WandbLogger) -> list[dict]:
    """Finish the logger's run and return every record ``wandb leet inspect --json`` prints for it."""
    run_dir = Path(logger.experiment.dir).parent
    logger.experiment.finish()
    out = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_dir)],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def history(records: list[dict]) -> list[dict]:
    return [record["history"]["item"] for record in records if record.get("type") == "history"]
