"""Read an offline W&B run back with the real client (``wandb leet inspect --json``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def read_run(files_dir: str | Path) -> list[dict]:
    """Every record of the run whose ``run.dir`` (its ``files`` folder) is ``files_dir``."""
    out = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(Path(files_dir).parent)],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
