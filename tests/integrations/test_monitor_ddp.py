"""connmon.Monitor in a plain DDP loop (2 CPU processes, gloo): the logged values equal one process over the
same sequences, and only rank zero logs."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import connmon
from connmon.metrics import DriftMetrics, TransportMetrics, WalkMetrics
from tests.capture.models import TinyGPT
from tests.gloo import free_port, leave

pytestmark = pytest.mark.distributed


def inputs(rank: int) -> torch.Tensor:
    return torch.randint(0, 50, (4, 10), generator=torch.Generator().manual_seed(100 + rank))


def worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(TinyGPT())
        logged = []
        monitor = connmon.Monitor(
            model, every_n_steps=1, diagnostics=("walk", "transport", "drift"), log=lambda v, step: logged.append(v)
        )
        with monitor.step(0):
            loss = model(inputs(rank)).pow(2).mean()
        loss.backward()
        with open(os.path.join(out, f"rank{rank}.json"), "w") as file:
            json.dump(logged, file)
    except BaseException:
        dist.destroy_process_group()
        raise
    leave()


def test_plain_ddp_loop_logs_synced_values_on_rank_zero_only(tmp_path):
    mp.spawn(worker, args=(free_port(), str(tmp_path)), nprocs=2)
    on_zero = json.loads((tmp_path / "rank0.json").read_text())
    assert json.loads((tmp_path / "rank1.json").read_text()) == []  # only rank zero logs
    (logged,) = on_zero
    torch.manual_seed(0)
    model = TinyGPT()
    groups = []
    for rank in range(2):
        metrics = [WalkMetrics(2), TransportMetrics(2, edge_samples=1, edge_queries=16), DriftMetrics(2)]
        for record in connmon.capture(model, inputs(rank)):
            for metric in metrics:
                metric.update(record)
        groups.append(metrics)
    checked = 0
    for mine, theirs in zip(*groups, strict=True):
        mine.merge_state(theirs)  # what the sum-reduction across ranks does
        for name, value in mine.compute().items():
            random_edges = name.startswith("edge_isometry_gap")  # samples edges and a probe at random
            if name.endswith("/all") and torch.isfinite(value) and not random_edges:
                assert logged[f"connmon/{name}"] == pytest.approx(value.item(), rel=1e-5, abs=1e-7), name
                checked += 1
    assert checked >= 10
    assert "connmon/edge_isometry_gap/all" in logged
