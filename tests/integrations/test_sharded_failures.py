"""A curvature sample that fails on one process only, at any of its loss calls (before the model's forward, after it,
in the backward) or between its products: every process turns the curvature off together, none is left waiting in a
collective (the test times out otherwise), and training goes on bitwise as without connmon. FSDP2, tensor parallel
and FSDP2 + TP (2-D) on gloo processes, the plain loop's ``connmon.Monitor``."""

from __future__ import annotations

import contextlib
import json
import os
import warnings

import pytest
import torch
import torch.distributed as dist

import connmon
from connmon.curvature.sampler import SharpnessSampler
from tests.capture.models import TinyGPT
from tests.gloo import free_port, leave, spawn
from tests.integrations.test_sharded_curvature import FailingBackward, loss_fn

STEPS = 3  # the sample is at step 2
LANCZOS = 2
WORLD = {"fsdp2": 2, "tp": 2, "2d": 4}
WHERE = ("start", "forward", "backward")


def failing(call: int, where: str, failing_rank: int):
    """The monitor's loss: on ``failing_rank`` its ``call``-th call fails ``where``; and a counter of its calls."""
    calls = [0]

    def loss(model, ids):
        calls[0] += 1
        fails = dist.get_rank() == failing_rank and calls[0] == call
        if fails and where == "start":
            raise RuntimeError("injected failure before the forward")
        value = loss_fn(model, ids)
        if fails and where == "forward":
            raise RuntimeError("injected failure after the forward")
        return FailingBackward.apply(value) if fails and where == "backward" else value

    return loss, calls


def build(layout: str):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = TinyGPT().double()
    if layout == "fsdp2":
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        return model
    mesh = init_device_mesh("cpu", (WORLD[layout] // 2, 2), mesh_dim_names=("dp", "tp"))
    for block in model.blocks:
        parallelize_module(block.mlp, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    if layout == "2d":
        for block in model.blocks:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    return model


def train(layout: str, data: list[torch.Tensor], monitor_loss=None, between: int = 0) -> dict:
    """AdamW at a rate past the edge (the noise check's second solve runs); the losses, and the sampler's state."""
    model = build(layout)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.5)
    monitor = None
    if monitor_loss is not None:
        monitor = connmon.Monitor(
            model, every_n_steps=10**6, diagnostics=("walk",), optimizer=optimizer, loss_fn=monitor_loss,
            sharpness=SharpnessSampler(every_n_steps=2, cadence="fixed", lanczos_steps=LANCZOS, budget=None),
        )  # fmt: skip
    losses = []
    with warnings.catch_warnings(record=True) as seen, _failing_between(between):
        warnings.simplefilter("always")
        for step, ids in enumerate(data):
            with monitor.step(step, batch=ids) if monitor is not None else contextlib.nullcontext():
                loss = loss_fn(model, ids)
            loss.backward()
            losses.append(loss.item())
            optimizer.step()
            optimizer.zero_grad()
    result = {"losses": losses}
    if monitor is not None:
        result["off"] = monitor.sharpness.off
        result["samples"] = monitor.sharpness.samples
        result["warnings"] = [str(w.message) for w in seen if "off for the rest" in str(w.message)]
        monitor.close()
    return result


@contextlib.contextmanager
def _failing_between(call: int):
    """Rank 1's ``call``-th inner product of Lanczos vectors raises (a failure between products)."""
    if not call or dist.get_rank() != 1:
        yield
        return
    from connmon.curvature.shards import Shards

    original, calls = Shards.dots, [0]

    def dots(self, x, y):
        calls[0] += 1
        if calls[0] == call:
            raise RuntimeError("injected failure between products")
        return original(self, x, y)

    Shards.dots = dots
    try:
        yield
    finally:
        Shards.dots = original


def worker(rank: int, port: int, out: str, layout: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD[layout])
    try:
        generator = torch.Generator().manual_seed(100 + rank // 2 if layout != "fsdp2" else 100 + rank)
        data = [torch.randint(0, 50, (4, 10), generator=generator) for _ in range(STEPS)]
        plain = train(layout, data)
        counting, calls = failing(0, "start", failing_rank=1)
        healthy = train(layout, data, counting)
        assert healthy["off"] is None and healthy["samples"] == 1, healthy
        runs = []
        for call in range(1, calls[0] + 1):
            # FSDP2: each call fails at each place; TP and 2-D (slower on gloo): the first and last calls at each, the
            # others at one place in turn
            for where in WHERE if layout == "fsdp2" or call in (1, calls[0]) else WHERE[call % 3 : call % 3 + 1]:
                loss, _ = failing(call, where, failing_rank=1)
                runs.append({"call": call, "where": where, **train(layout, data, loss)})
        for between in (1, 5):
            runs.append({"call": 0, "where": f"inner product {between}", **train(layout, data, loss_fn, between)})
        with open(os.path.join(out, f"{layout}{rank}.json"), "w") as file:
            json.dump({"plain": plain["losses"], "calls": calls[0], "runs": runs}, file)
    except BaseException:
        dist.destroy_process_group()
        raise
    leave()


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(WORLD))
def test_a_failure_on_one_process_turns_the_curvature_off_everywhere_and_training_goes_on_bitwise(tmp_path, layout):
    spawn(worker, (free_port(), str(tmp_path), layout), nprocs=WORLD[layout], timeout=600)
    ranks = [json.loads((tmp_path / f"{layout}{r}.json").read_text()) for r in range(WORLD[layout])]
    assert ranks[0]["calls"] >= LANCZOS + 2  # the base gradient, the products, the noise check's second solve
    calls = ranks[0]["calls"]
    assert len(ranks[0]["runs"]) == (3 * calls if layout == "fsdp2" else calls + 4) + 2
    for rank, result in enumerate(ranks):
        for run in result["runs"]:
            assert run["losses"] == result["plain"], (rank, run["call"], run["where"])  # bitwise, on every rank
            assert run["off"] is not None and run["samples"] == 0, (rank, run)
            if rank == 0:  # one warning, on rank zero, naming the process that failed and why
                assert len(run["warnings"]) == 1, run
                assert "on process 1, RuntimeError: injected failure" in run["warnings"][0], run["warnings"]
            else:
                assert run["warnings"] == [], run
