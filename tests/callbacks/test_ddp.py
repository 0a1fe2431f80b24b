"""Two CPU processes under Lightning DDP or FSDP2 log the same values as one process over the same sequences."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DistributedSampler

import connmon
from connmon.metrics import DriftMetrics, SpectrumMetrics, TransportMetrics, WalkMetrics
from tests.callbacks.lightning_models import LitGPT, corpus

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).with_name("ddp_run.py")


CUDA_ONLY = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="Lightning's FSDPStrategy needs CUDA: benchmarks/gpu.sh runs this test"
)


@pytest.mark.parametrize("mode", ["ddp", "fsdp2", pytest.param("fsdp", marks=CUDA_ONLY)])
def test_synced_values_equal_single_process(tmp_path, mode):
    """DDP; FSDP2 (``ModelParallelStrategy``, ``fully_shard`` per Block, parameters sharded across the two CPU
    processes); FSDP1 (``FSDPStrategy``, CUDA only). The transports are read from the unsharded weights inside each
    Block's forward, so the values equal those of one process over the same sequences."""
    env = {**os.environ, "PYTHONPATH": str(SCRIPT.parents[2])}
    subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), mode], check=True, timeout=300, env=env)
    if mode == "fsdp2":
        assert [(tmp_path / f"sharded{r}.txt").read_text() for r in range(2)] == ["True", "True"]
    ranks = min(2, torch.cuda.device_count()) if mode == "fsdp" else 2
    tolerance = {"rel": 1e-3, "abs": 1e-5} if mode == "fsdp" else {"rel": 1e-5, "abs": 1e-7}  # CUDA kernels
    rows = list(csv.DictReader(next(tmp_path.rglob("metrics.csv")).open()))
    logged = {k: float(v) for row in rows if row["step"] == "0" for k, v in row.items() if v and k != "step"}

    # Step 0 runs the initial weights on each rank's first batch, drawn by the DistributedSampler Lightning puts
    # on a training loader under DDP (shuffled, seed 0, epoch 0); each rank records the first 2 sequences of it.
    model = LitGPT()
    dataset = corpus()
    inputs = dataset.tensors[0]
    shares = [
        list(DistributedSampler(dataset, num_replicas=ranks, rank=r, shuffle=True, seed=0))[:2] for r in range(ranks)
    ]

    def group():
        return [
            WalkMetrics(2),
            TransportMetrics(2, edge_samples=None, edge_queries=None),
            SpectrumMetrics(2),
            DriftMetrics(2),
        ]

    per_rank = []
    for share in shares:  # what each rank accumulates on its own
        metrics = group()
        for record in connmon.capture(model, inputs[share]):
            for metric in metrics:
                metric.update(record)
        per_rank.append(metrics)
    expected = {}
    for mine, *theirs in zip(*per_rank, strict=True):
        for other in theirs:
            mine.merge_state(other)  # what the sum-reduction across ranks does
        expected.update(mine.compute())
    assert not expected.pop("nonfinite_layers").any()
    checked = 0
    for name, value in expected.items():
        keys = {f"connmon/{name}": value} if name.endswith("/all") else {
            f"connmon/{name}/L{i:02d}": value[i] for i in range(2)
        }  # fmt: skip
        for key, want in keys.items():
            if torch.isfinite(want):
                assert logged[key] == pytest.approx(want.item(), **tolerance), key
                checked += 1
    assert checked >= 40


def test_ddp_drift_alert_stops_every_rank_together(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(SCRIPT.parents[2])}
    subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), "alert"], check=True, timeout=300, env=env)
    # rank 1 alone saw the alert at step 2; reduce_boolean_decision stops both after that step (no hang)
    assert [(tmp_path / f"rank{r}.txt").read_text() for r in range(2)] == ["3", "3"]


def test_ddp_sharpness_reads_the_global_batch_and_a_failure_on_one_rank_turns_both_off(tmp_path):
    """Each rank reads the Hessian of the step's whole batch (its gradients averaged as DDP's), not its own part."""
    env = {**os.environ, "PYTHONPATH": str(SCRIPT.parents[2])}
    subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), "sharpness"], check=True, timeout=300, env=env)
    ranks = [json.loads((tmp_path / f"sharpness{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["local"] == ranks[1]["local"]  # the global batch's reading, the same on both ranks
    assert [r["synced"] for r in ranks] == [{"2": pytest.approx(ranks[0]["local"], rel=1e-9)}] * 2  # 4 failed
    assert [r["step"] for r in ranks] == [6, 6]  # no hang, the run went on
    assert all("on process 1, RuntimeError: out of luck on rank 1" in rank["off"] for rank in ranks)  # who, and why


@pytest.mark.parametrize("estimator", ["secant", "finite_difference_lanczos"])
def test_the_reading_is_the_same_under_ddp_and_fsdp2_sharded_parameters(tmp_path, estimator):
    """The same data, the same global gradient: sharded parameters give the replicated run's ratios (the default
    gradient-difference Lanczos of the global batch, and the secant along the update)."""
    env = {**os.environ, "PYTHONPATH": str(SCRIPT.parents[2])}
    runs = {}
    for mode in ("ddp", "fsdp2"):
        command = [sys.executable, str(SCRIPT), str(tmp_path), "secant", mode, estimator]
        subprocess.run(command, check=True, timeout=300, env=env)
        runs[mode] = [json.loads((tmp_path / f"{estimator}-{mode}{r}.json").read_text()) for r in range(2)]
    for mode, ranks in runs.items():
        assert all(rank["off"] is None for rank in ranks), (mode, ranks)
        assert ranks[0]["synced"] == ranks[1]["synced"] and sorted(ranks[0]["synced"]) == ["2", "4", "6"]
    ddp, fsdp2 = runs["ddp"][0]["synced"], runs["fsdp2"][0]["synced"]
    assert fsdp2 == pytest.approx(ddp, rel=1e-3)


def test_ddp_ranks_back_off_and_save_restore_points_at_the_same_step_and_keep_equal_weights(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(SCRIPT.parents[2])}
    subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), "backoff"], check=True, timeout=300, env=env)
    ranks = [json.loads((tmp_path / f"backoff{r}.json").read_text()) for r in range(2)]
    assert ranks[0] == ranks[1]  # the same scale, from the same step, so DDP's replicas stay equal
    assert (ranks[0]["scale"], ranks[0]["last_step"]) == (0.5, 2)
    points = sorted(path.name for path in (tmp_path / "points").iterdir())  # alerts at 2 and 4, saved after 3 and 5
    assert points == ["step=5.ckpt"] and ranks[0]["restore_points"] == [str(tmp_path / "points" / "step=5.ckpt")]


def logged_by(tmp_path, run: str, mode: str) -> dict[tuple[str, str], float]:
    """Run ``ddp_run.py OUT run mode`` and read its CSV: ``(step, key) -> value``, the timed cost keys left out."""
    env = {**os.environ, "PYTHONPATH": str(SCRIPT.parents[2])}
    subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), run, mode], check=True, timeout=300, env=env)
    rows = list(csv.DictReader(next((tmp_path / mode).rglob("metrics.csv")).open()))
    return {
        (row["step"], key): float(value)
        for row in rows
        for key, value in row.items()
        if value and key != "step" and "overhead" not in key  # the cost is timed: it differs run to run
    }


def test_ddp_spawn_fits_with_every_callback_and_logs_what_ddp_logs(tmp_path):
    """``strategy="ddp_spawn"`` pickles the callbacks into its processes: the same fit logs the same values as ddp."""
    logged = {mode: logged_by(tmp_path, "spawn", mode) for mode in ("ddp", "ddp_spawn")}
    assert {key for _, key in logged["ddp"]} >= {"connmon/attention_entropy/L00", "connmon/sharpness_ratio"}
    assert logged["ddp_spawn"].keys() == logged["ddp"].keys()
    assert logged["ddp_spawn"] == pytest.approx(logged["ddp"], rel=1e-6)


def test_model_parallel_strategy_with_tensor_parallel_logs_what_one_device_logs(tmp_path):
    """ModelParallelStrategy(tensor_parallel_size=2): heads and MLPs sharded over 2 processes that read the same
    batches. Every attention diagnostic and the curvature equal the unsharded model's on one device."""
    logged = {mode: logged_by(tmp_path, "parallel", mode) for mode in ("single", "tp")}
    keys = {key for _, key in logged["single"]}
    assert {
        "connmon/reconstruction_error/L01",
        "connmon/connection_spectral_radius/L00",
        "connmon/sharpness_ratio",
    } <= keys
    assert logged["tp"].keys() == logged["single"].keys()
    for key, value in logged["single"].items():
        if "reconstruction_error" in key[1]:  # round-off either way
            assert logged["tp"][key] < 1e-5, key
        else:
            assert logged["tp"][key] == pytest.approx(value, rel=1e-3, abs=1e-5), key
