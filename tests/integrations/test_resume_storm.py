"""A plain loop saved and rebuilt many times logs what the uninterrupted run logs, bitwise: the same samples, curvature
values, alerts, applied learning rates and final weights; its restore points hold ``keep`` across resumes; and every
piece of a monitor's state survives a round trip (a field added later and left out of a ``state_dict`` fails here)."""

from __future__ import annotations

import math
import os
import warnings

import pytest
import torch

import connmon
from connmon import keys
from connmon.alerts import AlertRunner, LearningRateBackoff, RestorePoints, Rule, Threshold, load_restore_point
from connmon.curvature.sampler import SharpnessSampler
from tests.capture.models import TinyGPT

STEPS = 40


def loss_fn(model, ids):
    return torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())


def data() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, 50, (4, 10), generator=generator) for _ in range(STEPS)]


def build(folder: str, keep: int = 3):
    """Model, AdamW, and a monitor whose curvature rule fires often: back-off and restore point on each alert."""
    torch.manual_seed(0)
    model = TinyGPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-2)
    rule = Rule("edge", keys.SHARPNESS_RATIO, Threshold(0.02), cooldown=4)
    backoff = LearningRateBackoff(factor=0.8, cooldown=4, rules=("edge",))
    points = RestorePoints(keep=keep, dirpath=folder)
    runner = AlertRunner([rule], actions=("backoff", "checkpoint"), backoff=backoff, restore_points=points)
    log: dict[int, dict[str, float]] = {}
    monitor = connmon.Monitor(
        model, every_n_steps=5, diagnostics=("walk",), optimizer=optimizer, loss_fn=loss_fn, alerts=runner,
        sharpness=SharpnessSampler(every_n_steps=2, lanczos_steps=4, budget=None),
        log=lambda values, step: log.setdefault(step, {}).update(
            {k: v for k, v in values.items() if not k.startswith("connmon/overhead")}),
    )  # fmt: skip
    return model, optimizer, monitor, log


def train(model, optimizer, monitor, batches, steps) -> list[float]:
    losses = []
    for step in steps:
        with monitor.step(step, batch=batches[step]):
            loss = loss_fn(model, batches[step])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        (math.isnan(a[k]) and math.isnan(b[k])) if isinstance(a[k], float) and math.isnan(a[k]) else a[k] == b[k]
        for k in a
    )


def test_a_plain_loop_resumed_ten_times_logs_and_trains_bitwise_as_the_uninterrupted_run(tmp_path):
    batches = data()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, optimizer, monitor, log = build(str(tmp_path / "whole"))
        train(model, optimizer, monitor, batches, range(STEPS))
        alerts, scale = monitor.alerts.total, monitor.alerts.backoff.scale
        monitor.close()

        stops = list(range(4, STEPS, 4))  # 9 saves and rebuilds: ten pieces
        resumed_log: dict[int, dict[str, float]] = {}
        state = None
        start = 0
        for stop in [*stops, STEPS]:
            again, again_optimizer, again_monitor, piece = build(str(tmp_path / "resumed"))
            if state is not None:
                again.load_state_dict(state["model"])
                again_optimizer.load_state_dict(state["optimizer"])
                again_monitor.load_state_dict(state["connmon"])
            train(again, again_optimizer, again_monitor, batches, range(start, stop))
            resumed_log.update(piece)
            state = {"model": again.state_dict(), "optimizer": again_optimizer.state_dict(),
                     "connmon": again_monitor.state_dict()}  # fmt: skip
            again_monitor.close()
            start = stop
    assert alerts >= 3 and any(values.get("connmon/lr_scale", 1) < 1 for values in log.values())  # it backed off
    assert sorted(log) == sorted(resumed_log)  # the same sampled steps
    assert any(keys.SHARPNESS_RATIO in values for values in log.values())
    for step in log:
        assert same(log[step], resumed_log[step]), step  # values, intervals, lr scale: bitwise
    assert again_monitor.alerts.total == alerts and again_monitor.alerts.backoff.scale == scale
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters(), strict=True))


def test_restore_points_hold_keep_across_resumes_from_one_of_them(tmp_path):
    batches = data()
    folder = str(tmp_path / "points")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, optimizer, monitor, _ = build(folder, keep=2)
        train(model, optimizer, monitor, batches, range(STEPS // 2))
        saved = list(monitor.alerts.restore_points.paths)
        monitor.close()
        assert len(saved) == 2 and len(os.listdir(folder)) == 2
        latest = saved[-1]
        again, again_optimizer, again_monitor, _ = build(folder, keep=2)
        step = load_restore_point(latest, again, again_optimizer, again_monitor)
        assert again_monitor.alerts.restore_points.paths == saved  # the point's own state lists it
        train(again, again_optimizer, again_monitor, batches, range(step, STEPS))
        assert again_monitor.alerts.total > monitor.alerts.total  # more alerts, more restore points
        kept = again_monitor.alerts.restore_points.paths
    assert len(kept) == 2 and sorted(os.listdir(folder)) == sorted(os.path.basename(p) for p in kept)


# What a round trip through state_dict need not carry: the run's wiring and what each run measures afresh.
NOT_STATE = {
    "SharpnessSampler": {
        "every_n_steps",
        "estimator",
        "lanczos_steps",
        "budget",
        "cadence",
        "storage",
        "owner",  # options
        "clock",
        "optimizer",
        "backoff",
        "_device",
        "_hook",  # the run's wiring and its time (measured per run)
        "off",  # re-decided by each run (attach checks the optimizer again)
        "last_values",
        "_probe",
        "_probe_step",
        "_stepped",
        "_losses",
        "_weights",
        "_loss_step",
        "_model",
        "_last_step",
        "_start_step",
        "_failure",  # within one step
        "_waited",  # the budget's wait is said once by each process that meets it
    },
}


def test_every_field_of_the_samplers_state_survives_a_round_trip():
    torch.manual_seed(0)
    model = TinyGPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-2)
    sampler = SharpnessSampler(every_n_steps=1, lanczos_steps=3, budget=0.5)
    monitor = connmon.Monitor(model, every_n_steps=10**6, diagnostics=("walk",), optimizer=optimizer, loss_fn=loss_fn,
                              sharpness=sampler)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train(model, optimizer, monitor, data(), range(16))  # the budget affords a first reading at step 12
    fresh = SharpnessSampler(every_n_steps=1, lanczos_steps=3, budget=0.5)
    fresh.load_state_dict(sampler.state_dict())
    carried = set(vars(sampler)) - NOT_STATE["SharpnessSampler"]
    assert carried, "nothing to compare"
    for name in carried:
        mine, theirs = getattr(sampler, name), getattr(fresh, name)
        assert mine == theirs or (mine != mine and theirs != theirs), name  # NaN == NaN here
    assert math.isfinite(sampler._difference_length) and sampler.samples > 0


@pytest.mark.parametrize("part", ["alerts", "sharpness"])
def test_a_monitors_state_dict_round_trips_to_an_equal_state_dict(tmp_path, part):
    batches = data()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, optimizer, monitor, _ = build(str(tmp_path))
        train(model, optimizer, monitor, batches, range(12))
        again = build(str(tmp_path / "again"))[2]
        again.load_state_dict(monitor.state_dict())
    assert repr(again.state_dict()[part]) == repr(monitor.state_dict()[part])
