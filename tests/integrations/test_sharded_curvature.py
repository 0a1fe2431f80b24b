"""The curvature of the global batch under data parallelism: DDP and FSDP2 (2 CPU processes, gloo) read what one
process reads on the whole batch, and training with the sampler is bitwise the same sharded run without it."""

from __future__ import annotations

import contextlib
import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import connmon
from connmon.integrations.sharpness import SharpnessSampler
from tests.capture.models import TinyGPT
from tests.gloo import free_port, leave

RATIO = "connmon/sharpness_ratio"
STEPS = 6


def loss_fn(model, ids):
    return torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())


def batches(rank: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + rank)
    return [torch.randint(0, 50, (4, 10), generator=generator) for _ in range(STEPS)]


def train(model, data: list[list[torch.Tensor]], watched: bool) -> tuple[list[float], dict[int, float]]:
    """AdamW on ``data[step]`` (the step's micro-batches, each loss its mean over them); the logged ratios."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    logged: dict[int, float] = {}
    monitor = None
    if watched:
        monitor = connmon.Monitor(
            model, every_n_steps=10**6, diagnostics=("walk",), optimizer=optimizer, loss_fn=loss_fn,
            sharpness=SharpnessSampler(every_n_steps=2, cadence="fixed"),
            log=lambda values, step: RATIO in values and logged.update({step: values[RATIO]}),
        )  # fmt: skip
    losses = []
    for step, micro_batches in enumerate(data):
        for ids in micro_batches:
            with monitor.step(step, batch=ids) if monitor is not None else contextlib.nullcontext():
                loss = loss_fn(model, ids) / len(micro_batches)
            loss.backward()
            losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    if monitor is not None:
        assert monitor.sharpness.off is None, monitor.sharpness.off
        monitor.close()
    return losses, logged


def worker(rank: int, port: int, out: str, layout: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        runs = {}
        for watched in (False, True):
            torch.manual_seed(0)
            model = TinyGPT().double()
            if layout == "fsdp2":
                from torch.distributed.fsdp import fully_shard

                for block in model.blocks:
                    fully_shard(block)
                fully_shard(model)
            else:
                model = torch.nn.parallel.DistributedDataParallel(model)
            runs[watched] = train(model, [[ids] for ids in batches(rank)], watched)
        with open(os.path.join(out, f"{layout}{rank}.json"), "w") as file:
            json.dump({"plain": runs[False][0], "watched": runs[True][0], "ratios": runs[True][1]}, file)
    except BaseException:
        dist.destroy_process_group()
        raise
    leave()


@pytest.mark.parametrize("layout", ["ddp", "fsdp2"])
def test_data_parallel_reads_the_global_batch_and_leaves_training_bitwise_unchanged(tmp_path, layout):
    mp.spawn(worker, args=(free_port(), str(tmp_path), layout), nprocs=2)
    ranks = [json.loads((tmp_path / f"{layout}{r}.json").read_text()) for r in range(2)]
    for rank in ranks:
        assert rank["watched"] == rank["plain"]  # bitwise, on every rank
    assert ranks[1]["ratios"] == {} and sorted(ranks[0]["ratios"]) == ["2", "4"]  # logged once, by rank zero
    torch.manual_seed(0)
    whole = [[a, b] for a, b in zip(batches(0), batches(1), strict=True)]  # one process, the global batch
    _, expected = train(TinyGPT().double(), whole, watched=True)
    for step, ratio in ranks[0]["ratios"].items():
        assert ratio == pytest.approx(expected[int(step)], rel=1e-4), step
