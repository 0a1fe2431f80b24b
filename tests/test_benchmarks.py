"""benchmarks/cuda_check.py, which benchmarks/gpu.sh runs on a lent GPU, works: its checks pass on the CPU."""

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "cuda_check.py"


def test_cuda_check_passes_on_the_cpu():
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--families", "GPT-2", "GPT-OSS"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith("| ") and "| ok |" in line]
    assert len(rows) == 3 + 4 + 1 + 3  # functional cases, two families x two precisions, the monitor, curvature
    assert result.stdout.rstrip().endswith("0 failed")
