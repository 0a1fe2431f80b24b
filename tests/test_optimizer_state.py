"""The optimizer's own state after a step, against its definition in float64."""

from __future__ import annotations

import math

import pytest
import torch

from connmon.curvature.optimizer_state import optimizer_signals


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3), torch.nn.Linear(3, 3))


def train(net: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        x = torch.randn(8, 6, generator=gen) * (1 + 20 * (step == steps - 1))  # the last gradient jumps: stale v
        net(x).square().mean().backward()
        net[3].weight.grad = None  # a parameter without a gradient since its first step keeps its state
        if step == 0:
            net[3].bias.grad = None  # one without state at all
        optimizer.step()
        optimizer.zero_grad()


def reference(optimizer: torch.optim.Optimizer) -> dict[str, float]:
    """The definitions, coordinate by coordinate, in float64."""
    update, squares, count, stale, theta = 0.0, 0.0, 0, 0, 0.0
    adam = isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW))
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            if adam and "exp_avg" in state:
                beta1, beta2 = group["betas"]
                t = float(state["step"])
                m = state["exp_avg"].double() / (1 - beta1**t)
                root = (state["exp_avg_sq"].double() / (1 - beta2**t)).sqrt()
                u = m / (root + group["eps"])
                stale += int((m.abs() > root + group["eps"]).sum())
            elif not adam and state.get("momentum_buffer") is not None:
                u = state["momentum_buffer"].double()
            else:
                continue
            update += group["lr"] ** 2 * float(u.square().sum())
            squares += float(u.square().sum())
            count += u.numel()
            theta += float(p.detach().double().square().sum())
    values = {"update_to_weight": math.sqrt(update / theta)}
    if adam:
        values = {"update_rms": math.sqrt(squares / count), "stale_second_moment": stale / count, **values}
    return values


@pytest.mark.parametrize(
    "make",
    [
        lambda params: torch.optim.Adam(params, lr=1e-2),
        lambda params: torch.optim.AdamW(params, lr=3e-2, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.1),
        lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    ],
)
def test_the_signals_are_their_float64_definitions_over_groups_with_their_own_rates(make):
    net = model()
    groups = [{"params": net[0].parameters()}, {"params": [*net[2].parameters(), *net[3].parameters()], "lr": 5e-3}]
    optimizer = make(groups)
    train(net, optimizer, steps=5)
    found, expected = optimizer_signals(optimizer), reference(optimizer)
    assert found.keys() == expected.keys()
    assert found == pytest.approx(expected, rel=1e-5)
    if "stale_second_moment" in found:
        assert 0 < found["stale_second_moment"] < 1  # the last gradient's jump outran beta2 = 0.999's average


def test_an_optimizer_it_cannot_read_and_one_before_its_first_step_give_nothing():
    net = model()
    assert optimizer_signals(torch.optim.Adagrad(net.parameters())) == {}
    assert optimizer_signals(torch.optim.Adam(net.parameters())) == {}
    assert optimizer_signals(torch.optim.SGD(net.parameters(), lr=0.1)) == {}  # no momentum: no buffer kept


def test_a_monitor_reads_the_optimizer_after_every_step_and_logs_the_largest_since_the_last_sample():
    """The window logged at a sample is the largest of each signal over the steps since the previous one, each step's
    value the definition's after that step; a checkpoint carries the window; None turns the reading off."""
    import connmon
    from tests.alerts.test_clip_timing import plain_run
    from tests.capture.models import TinyGPT

    torch.manual_seed(0)
    net = TinyGPT()
    optimizer = torch.optim.AdamW(net.parameters(), lr=3e-2)
    per_step: list[dict[str, float]] = []
    optimizer.register_step_post_hook(lambda *_: per_step.append(reference(optimizer)))
    logged: dict[int, dict[str, float]] = {}
    monitor = connmon.Monitor(net, every_n_steps=3, diagnostics=("walk",), optimizer=optimizer,
                              log=lambda values, step: logged.setdefault(step, values))  # fmt: skip
    plain_run(net, optimizer, monitor, steps=5)
    for name in ("update_rms", "stale_second_moment", "update_to_weight"):
        assert f"connmon/{name}" not in logged[0]  # no step taken before the first sample
        expected = max(values[name] for values in per_step[:3])  # steps 1..3 taken by the sample at step 3
        assert logged[3][f"connmon/{name}"] == pytest.approx(expected, rel=1e-5)
    pending = monitor.state_dict()["optimizer_state"]  # steps 4 and 5, not logged yet
    assert pending["connmon/update_rms"] == pytest.approx(max(v["update_rms"] for v in per_step[3:]), rel=1e-5)
    fresh = connmon.Monitor(TinyGPT(), every_n_steps=3, diagnostics=("walk",))
    fresh.load_state_dict(monitor.state_dict())
    assert fresh.optimizer_state.largest == pending
    monitor.close()
    off = connmon.Monitor(TinyGPT(), every_n_steps=3, optimizer_every_n_steps=None)
    assert off.optimizer_state is None and not off._post_hooks
