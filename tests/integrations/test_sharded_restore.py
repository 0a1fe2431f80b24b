"""A restore point of a sharded run (FSDP2, FSDP2 + TP on gloo processes) holds the whole state: loaded into the same
sharding it resumes bitwise, and into an unsharded model it holds every parameter whole."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
import torch.distributed as dist

import connmon
from connmon.alerts import AlertRunner, RestorePoints, load_restore_point
from tests.capture.models import TinyGPT
from tests.gloo import free_port, leave, spawn
from tests.integrations.test_sharded_curvature import loss_fn

WORLD = {"fsdp2": 2, "2d": 4}


def build(layout: str, seed: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(seed)
    model = TinyGPT()
    mesh = None
    if layout == "2d":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        for block in model.blocks:
            parallelize_module(block.mlp, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        mesh = mesh["dp"]
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def whole(model) -> list[torch.Tensor]:
    return [p.full_tensor().detach().clone() if hasattr(p, "full_tensor") else p.detach().clone()
            for p in model.parameters()]  # fmt: skip


def run(model, optimizer, data, monitor=None) -> list[float]:
    losses = []
    for step, ids in enumerate(data):
        if monitor is not None:
            with monitor.step(step, batch=ids):
                loss = loss_fn(model, ids)
        else:
            loss = loss_fn(model, ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def worker(rank: int, port: int, out: str, layout: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD[layout])
    try:
        generator = torch.Generator().manual_seed(100 + rank // (2 if layout == "2d" else 1))
        data = [torch.randint(0, 50, (4, 10), generator=generator) for _ in range(6)]
        model = build(layout, seed=0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        points = RestorePoints(dirpath=os.path.join(out, "points"))
        monitor = connmon.Monitor(model, every_n_steps=2, diagnostics=("walk",), optimizer=optimizer,
                                  alerts=AlertRunner([], actions=("checkpoint",), restore_points=points))  # fmt: skip
        run(model, optimizer, data[:3], monitor)  # a sample at step 2
        points.due = 2  # what an alert at step 2 asks for
        with warnings.catch_warnings(record=True):
            path = monitor.save_restore_point(3)
        at_point = whole(model)
        ahead = run(model, optimizer, data[3:])
        at_end = whole(model)

        resumed = build(layout, seed=1)  # other weights, replaced by the restore point's
        resumed_optimizer = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
        again = connmon.Monitor(resumed, every_n_steps=2, diagnostics=("walk",), optimizer=resumed_optimizer)
        step = load_restore_point(path, resumed, resumed_optimizer, again)
        loaded = whole(resumed)
        resumed_ahead = run(resumed, resumed_optimizer, data[3:])
        unsharded = TinyGPT()
        load_restore_point(path, unsharded)  # every process, as torch.distributed.checkpoint reads
        result = {
            "path": path,
            "step": step,
            "samples": [monitor.samples, again.samples],
            "loaded": all(torch.equal(a, b) for a, b in zip(loaded, at_point, strict=True)),
            "unsharded": all(torch.equal(a, b) for a, b in zip(whole(unsharded), at_point, strict=True)),
            "ahead": ahead == resumed_ahead,
            "end": all(torch.equal(a, b) for a, b in zip(whole(resumed), at_end, strict=True)),
        }
        with open(os.path.join(out, f"{rank}.json"), "w") as file:
            json.dump(result, file)
    except BaseException:
        dist.destroy_process_group()
        raise
    leave()


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(WORLD))
def test_a_sharded_restore_point_holds_the_whole_state_and_resumes_bitwise(tmp_path, layout):
    spawn(worker, (free_port(), str(tmp_path), layout), nprocs=WORLD[layout], timeout=300)
    for rank in range(WORLD[layout]):
        result = json.loads((tmp_path / f"{rank}.json").read_text())
        assert result["path"].endswith("step=3.ckpt") and os.path.isdir(result["path"]), result
        assert result["step"] == 3 and result["samples"][0] == result["samples"][1] > 0, (
            result
        )  # the monitor's state came back too
        assert result["loaded"] and result["unsharded"], result  # every parameter whole, as at the point
        assert result["ahead"] and result["end"], result  # the resumed run goes on bitwise
