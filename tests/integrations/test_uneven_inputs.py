"""Uneven inputs under DDP's ``join()`` (2 CPU processes, gloo): a process that runs out of data neither hangs nor
crashes the other, training is bitwise what it is without connmon, and what is logged is of the steps every process
took, equal to a run where both processes had the data for those steps."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
import torch.distributed as dist

import connmon
from connmon.alerts import AlertRunner, Rule, Threshold
from connmon.curvature.sampler import SharpnessSampler
from tests.capture.models import TinyGPT
from tests.gloo import free_port, leave, spawn

pytestmark = pytest.mark.distributed


def loss_fn(model, ids):
    return torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())


def batches(rank: int, count: int) -> list[torch.Tensor]:
    """``count`` batches; on rank 1 the fifth is of one sequence (a dataset's remainder)."""
    generator = torch.Generator().manual_seed(100 + rank)
    return [torch.randint(0, 50, (1 if rank == 1 and i == 4 else 4, 10), generator=generator) for i in range(count)]


def train(rank: int, counts: tuple[int, int], watched: bool) -> dict:
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(TinyGPT())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    logged: list = []
    seen: list = []  # the rules see each process's own loss as their mean over processes (a gather, every sample)
    rules = AlertRunner([Rule("loss seen", "loss", Threshold(-1.0))], actions=(), on_alert=lambda a: seen.append(a))
    monitor = None
    if watched:
        monitor = connmon.Monitor(
            model, every_n_steps=4, diagnostics=("walk", "transport"), optimizer=optimizer, loss_fn=loss_fn,
            sharpness=SharpnessSampler(every_n_steps=4, cadence="fixed", budget=None), logit_every_n_steps=2,
            optimizer_every_n_steps=1, log=lambda values, step: logged.append([step, values]), alerts=rules,
        )  # fmt: skip
    with warnings.catch_warnings(record=True) as said, model.join():
        warnings.simplefilter("always")
        for step, ids in enumerate(batches(rank, counts[rank])):
            if monitor is None:
                loss = loss_fn(model, ids)
            else:
                with monitor.step(step, batch=ids, rule_values={"loss": float(rank)}):
                    loss = loss_fn(model, ids)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    if monitor is not None:
        monitor.close()
    weights = [p.detach().tolist() for p in model.parameters()]
    said_join = [str(w.message) for w in said if "Join" in str(w.message)]
    return {"logged": logged, "weights": weights, "said": said_join, "alerts": [[a.step, a.value] for a in seen]}


def timeless(values: dict) -> dict:
    """The values without what the monitor's time costs (measured, so never the same twice)."""
    return {key: value for key, value in values.items() if "overhead" not in key}


def worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        runs = {
            "plain": train(rank, (7, 5), watched=False),
            "uneven": train(rank, (7, 5), watched=True),
            "even": train(rank, (7, 7), watched=True),
        }
        with open(os.path.join(out, f"rank{rank}.json"), "w") as file:
            json.dump(runs, file)
    except BaseException:
        dist.destroy_process_group()
        raise
    leave()


def test_ddp_join_with_uneven_inputs_trains_unchanged_and_logs_the_steps_every_process_took(tmp_path):
    spawn(worker, args=(free_port(), str(tmp_path)), nprocs=2, timeout=300)
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    for rank in ranks:
        assert rank["uneven"]["weights"] == rank["plain"]["weights"]  # bitwise: connmon changed nothing
        assert rank["even"]["said"] == []
    uneven, even = ranks[0]["uneven"]["logged"], ranks[0]["even"]["logged"]
    assert ranks[1]["uneven"]["logged"] == []  # only rank zero logs
    assert [step for step, _ in uneven] == [0, 4, 4]  # the attention samples and the curvature sample of step 4
    assert [[step, timeless(values)] for step, values in even if step <= 4] == [
        [step, timeless(values)] for step, values in uneven
    ]  # the same as where both processes had the data
    assert any(step == 4 and "connmon/sharpness_ratio" in values for step, values in uneven)
    (said,) = ranks[0]["uneven"]["said"]  # rank 0 took steps 5 and 6 alone
    assert "step 5 was taken by 1 of 2 processes" in said
    assert ranks[1]["uneven"]["said"] == []
    alerts = [rank[run]["alerts"] for rank in ranks for run in ("uneven", "even")]
    assert all(alerts_of == alerts[0] for alerts_of in alerts[::2])  # the uneven run's, alike on both processes
    assert alerts[0] and all(value == 0.5 for _, value in alerts[0])  # losses 0 and 1: their mean
    assert alerts[0] == [alert for alert in alerts[1] if alert[0] <= 4]  # as where both processes had the data
