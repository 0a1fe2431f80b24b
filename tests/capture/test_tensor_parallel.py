"""Attention whose heads are split across processes by tensor parallelism (2 CPU processes, gloo): each process reads
its heads, the record assembles every head over the group, and it equals the unsharded model's; the model computes
exactly what it computes unarmed, and the monitor logs what it logs on the unsharded model, once."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import connmon
from tests.capture.models import SplitAttention
from tests.gloo import free_port, leave

pytestmark = pytest.mark.distributed


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(SplitAttention() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return x


FIELDS = ("attn", "max_logit", "w_v", "w_o", "bias", "x", "output")


def monitored(net: nn.Module, x: torch.Tensor) -> dict[str, float]:
    logged: dict[str, float] = {}
    monitor = connmon.Monitor(net, every_n_steps=1, log=lambda values, step: logged.update(values), edge_samples=None)
    with torch.no_grad(), monitor.step(0):
        net(x)
    monitor.close()
    return {k: v for k, v in logged.items() if "overhead" not in k and "edge_isometry" not in k}


def worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        torch.manual_seed(0)
        net = Net()
        x = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(1))
        whole = {record.name: record for record in connmon.capture(net, x)}  # the unsharded model
        whole_logged = monitored(net, x)
        plan = {"wq": ColwiseParallel(), "wk": ColwiseParallel(), "wv": ColwiseParallel(), "wo": RowwiseParallel()}
        mesh = init_device_mesh("cpu", (2,))
        for layer in net.layers:
            parallelize_module(layer, mesh, plan)
        with torch.no_grad():
            unarmed = net(x)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with connmon.capture.armed(net) as session:
                    armed = net(x)
                logged = monitored(net, x)
        differences = {
            f"{record.name}.{field}": float((getattr(record, field) - getattr(whole[record.name], field)).abs().max())
            for record in session.records
            for field in FIELDS
        }
        result = {
            "records": [record.name for record in session.records],
            "errors": [float(record.reconstruction_error) for record in session.records],
            "differences": differences,
            "said": [str(w.message) for w in caught],
            "equal": bool(torch.equal(armed, unarmed)),
            "logged": logged,
            "whole_logged": whole_logged,
        }
        with open(os.path.join(out, f"rank{rank}.json"), "w") as file:
            json.dump(result, file)
    except BaseException:
        dist.destroy_process_group()
        raise
    leave()


def test_tensor_parallel_attention_is_read_exactly_as_the_unsharded_model_and_computes_as_unarmed(tmp_path):
    mp.spawn(worker, args=(free_port(), str(tmp_path)), nprocs=2)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank in ranks:
        assert rank["records"] == ["layers.0", "layers.1"] and rank["said"] == [] and rank["equal"]
        assert all(error < 1e-5 for error in rank["errors"])
        assert all(difference < 1e-5 for difference in rank["differences"].values()), rank["differences"]
    zero = ranks[0]
    assert ranks[1]["logged"] == {} and zero["logged"].keys() == zero["whole_logged"].keys()  # once, by rank zero
    assert len(zero["logged"]) > 20
    for key, value in zero["whole_logged"].items():
        assert zero["logged"][key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
