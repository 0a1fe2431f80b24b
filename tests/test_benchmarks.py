"""The benchmarks' own machinery: cuda_check.py (which gpu.sh runs on a lent GPU) passes on the CPU; bench_backoff's
run without the back-off is the run connmon did not touch."""

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


def test_bench_backoffs_run_without_the_back_off_is_the_plain_run_bitwise(monkeypatch):
    """Its 'diverges without' column comes from a continuation of the monitored run: the plain run, step for step."""
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    import bench_backoff
    from bench_instability import next_batch
    from bench_sharpness import build, train_step

    from connmon.alerts import edge_of_stability_rule

    rule = edge_of_stability_rule(bound=0.0, consecutive=1)
    monkeypatch.setattr(bench_backoff, "edge_of_stability_rule", lambda: rule)
    config = {"variant": "base", "arm": "ramp", "seed": 0}
    run = bench_backoff.backoff_run((config, 30))  # the first sample, at step 20, alerts and backs off
    assert run["alerts"] == [20] and run["backoffs"] == [(20, 0.5)] and run["without"]["from"] == 20
    config, data, model, optimizer, gen = build(config, 1e-3, 1e-1, 1500)
    losses = []
    for step in range(30):
        train_step(model, optimizer, next_batch(config, step, optimizer, data, gen)[:2], losses)
    assert run["loss"][:21] == losses[:21] and run["loss"][21] != losses[21]  # step 20's back-off shows at 21
    assert run["without"]["loss"] == losses[21:]
