"""The optimizer's own state after a step, against its definition in float64."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from connmon.curvature.optimizer_state import optimizer_signals


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3), torch.nn.Linear(3, 3))


def train(net: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int, clear: bool = True) -> None:
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        x = torch.randn(8, 6, generator=gen) * (1 + 20 * (step == steps - 1))  # the last gradient jumps: stale v
        x = x.to(net[0].weight.dtype)
        net(x).square().mean().backward()
        net[3].weight.grad = None  # a parameter without a gradient since its first step keeps its state
        if step == 0:
            net[3].bias.grad = None  # one without state at all
        optimizer.step()
        if clear or step < steps - 1:
            optimizer.zero_grad()


def reference(optimizer: torch.optim.Optimizer) -> dict[str, float]:
    """The definitions on the optimizer's state, coordinate by coordinate, in float64 (Adam and SGD momentum)."""
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
        values["gradient_to_second_moment"] = decoupling(optimizer)
    return values


def decoupling(optimizer: torch.optim.Optimizer) -> float:
    """``sum g^2 / sum v_hat`` over every coordinate with state, in float64 (a missing gradient counts as zero)."""
    gradient, second = 0.0, 0.0
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            if "exp_avg_sq" not in state:
                continue
            gradient += float(p.grad.double().square().sum()) if p.grad is not None else 0.0
            second += float(state["exp_avg_sq"].double().sum()) / (1 - group["betas"][1] ** float(state["step"]))
    return gradient / second


class StepTaken:
    """The update the optimizer takes, from the parameters before and after each step (float64): the reference.

    ``u = (theta_before (1 - lr decay) - theta_after) / lr`` (the decoupled decay of AdamW left out; Adagrad's rate
    decayed by its step count), its RMS, the share where ``|u| > 1``, and ``||lr u|| / ||theta_after||``.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, normalized: bool, stale: bool) -> None:
        self.optimizer, self.normalized, self.stale = optimizer, normalized, stale
        self.before: dict[torch.Tensor, torch.Tensor] = {}
        self.values: dict[str, float] = {}
        optimizer.register_step_pre_hook(self._pre)
        optimizer.register_step_post_hook(self._post)

    def _pre(self, *_):
        self.before = {p: p.detach().clone() for g in self.optimizer.param_groups for p in g["params"]}

    def _post(self, *_):
        update, squares, count, stale, theta = 0.0, 0.0, 0, 0, 0.0
        decoupled = isinstance(self.optimizer, torch.optim.AdamW)
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                before = self.before[p]
                if torch.equal(before, p.detach()):
                    continue  # not stepped
                lr = group["lr"]
                if isinstance(self.optimizer, torch.optim.Adagrad):
                    t = float(self.optimizer.state[p]["step"])
                    lr = lr / (1 + (t - 1) * group["lr_decay"])
                shrink = 1 - lr * group["weight_decay"] if decoupled else 1.0
                u = (before * shrink - p.detach()) / lr
                update += float((lr * u).square().sum())
                squares += float(u.square().sum())
                count += u.numel()
                stale += int((u.abs() > 1).sum())
                theta += float(p.detach().square().sum())
        self.values = {"update_to_weight": math.sqrt(update / theta)}
        if self.normalized:
            self.values = {"update_rms": math.sqrt(squares / count), **self.values}
        if self.stale:
            self.values = {"update_rms": self.values["update_rms"], "stale_second_moment": stale / count,
                           "update_to_weight": self.values["update_to_weight"]}  # fmt: skip


KINDS = {  # every kind connmon reads: (its optimizer, whether update_rms and stale_second_moment apply)
    "adam": (lambda ps: torch.optim.Adam(ps, lr=1e-2), True, True),
    "adamw": (lambda ps: torch.optim.AdamW(ps, lr=3e-2, eps=1e-6, weight_decay=0.1), True, True),
    "adam amsgrad": (lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True, weight_decay=0.01), True, True),
    "adamw amsgrad": (lambda ps: torch.optim.AdamW(ps, lr=1e-2, amsgrad=True), True, True),
    "sgd momentum": (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), False, False),
    "sgd dampened": (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.5, weight_decay=0.01), False,
                     False),
    "sgd nesterov": (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.05), False,
                     False),
    "sgd nesterov maximize": (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.5, nesterov=True, maximize=True),
                              False, False),
    "rmsprop": (lambda ps: torch.optim.RMSprop(ps, lr=1e-2, weight_decay=0.05), True, False),
    "rmsprop centered": (lambda ps: torch.optim.RMSprop(ps, lr=1e-2, centered=True), True, False),
    "rmsprop momentum": (lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.9), False, False),
    "adagrad": (lambda ps: torch.optim.Adagrad(ps, lr=0.1, lr_decay=0.01, weight_decay=0.05), True, False),
}  # fmt: skip


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_signals_are_the_update_the_optimizer_takes_in_float64_over_groups_with_their_own_rates(kind):
    make, normalized, stale = KINDS[kind]
    net = model().double()
    groups = [{"params": net[0].parameters()}, {"params": [*net[2].parameters(), *net[3].parameters()], "lr": 5e-3}]
    optimizer = make(groups)
    taken = StepTaken(optimizer, normalized, stale)
    train(net, optimizer, steps=5, clear=False)  # the gradients stay, as in the optimizer's step post-hook
    found = optimizer_signals(optimizer)
    if stale:  # Adam's: the gradient against its second moment, from the state (the step taken does not show it)
        assert found.pop("gradient_to_second_moment") == pytest.approx(decoupling(optimizer), rel=1e-6)
    assert found.keys() == taken.values.keys()
    assert found == pytest.approx(taken.values, rel=1e-6)
    if "stale_second_moment" in found:
        assert 0 < found["stale_second_moment"] < 1  # the last gradient's jump outran beta2 = 0.999's average


@pytest.mark.parametrize("kind", ["adam", "adamw", "sgd momentum"])
def test_the_signals_are_their_float64_definitions_on_the_optimizers_state(kind):
    net = model()
    groups = [{"params": net[0].parameters()}, {"params": [*net[2].parameters(), *net[3].parameters()], "lr": 5e-3}]
    optimizer = KINDS[kind][0](groups)
    train(net, optimizer, steps=5, clear=False)
    assert optimizer_signals(optimizer) == pytest.approx(reference(optimizer), rel=1e-5)


def test_an_optimizer_it_cannot_read_and_one_before_its_first_step_give_nothing():
    net = model()
    assert optimizer_signals(torch.optim.Adagrad(net.parameters())) == {}
    assert optimizer_signals(torch.optim.Adam(net.parameters())) == {}
    assert optimizer_signals(torch.optim.SGD(net.parameters(), lr=0.1)) == {}  # no momentum: no buffer kept
    assert optimizer_signals(torch.optim.Adamax(net.parameters())) == {}


def test_a_kind_it_cannot_read_is_said_once_and_a_non_finite_update_is_kept_over_later_finite_ones():
    from connmon.curvature.optimizer_state import OptimizerSignalWindow

    net = model()
    window = OptimizerSignalWindow("test")
    optimizer = torch.optim.Adafactor(net.parameters())
    with pytest.warns(UserWarning, match="Adafactor is none of them") as said:
        train(net, optimizer, steps=1)
        window.read(optimizer)
        window.read(optimizer)
    assert len([w for w in said if "none of them" in str(w.message)]) == 1 and window.take() == {}

    optimizer = torch.optim.Adam(net.parameters(), lr=1e-2)
    train(net, optimizer, steps=2)
    window.read(optimizer, step=2)
    with torch.no_grad():
        optimizer.state[net[0].weight]["exp_avg"][0, 0] = math.nan  # a NaN in the update after step 3
    with pytest.warns(UserWarning, match="non-finite after step 3"):
        window.read(optimizer, step=3)
    with torch.no_grad():
        optimizer.state[net[0].weight]["exp_avg"][0, 0] = 0.0
    finite = window.read(optimizer, step=4)
    assert all(math.isfinite(v) for v in finite.values())
    logged = window.take()
    assert math.isnan(logged["connmon/update_rms"]) and math.isnan(logged["connmon/update_to_weight"])


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
                              optimizer_every_n_steps=1,
                              log=lambda values, step: logged.setdefault(step, values))  # fmt: skip
    plain_run(net, optimizer, monitor, steps=5)
    for name in ("update_rms", "stale_second_moment", "update_to_weight"):
        assert f"connmon/{name}" not in logged[0]  # no step taken before the first sample
        expected = max(values[name] for values in per_step[:3])  # steps 1..3 taken by the sample at step 3
        assert logged[3][f"connmon/{name}"] == pytest.approx(expected, rel=1e-5)
    median = statistics.median(values["gradient_to_second_moment"] for values in per_step[:3])  # within 50 steps
    assert logged[3]["connmon/gradient_to_second_moment"] == pytest.approx(median, rel=1e-5)
    pending = monitor.state_dict()["optimizer_state"]  # steps 4 and 5, not logged yet
    assert pending["connmon/update_rms"] == pytest.approx(max(v["update_rms"] for v in per_step[3:]), rel=1e-5)
    assert [step for step, _ in pending["recent"]] == [1, 2, 3, 4, 5]  # the steps taken of each reading
    fresh = connmon.Monitor(TinyGPT(), every_n_steps=3, diagnostics=("walk",))
    fresh.load_state_dict(monitor.state_dict())
    assert fresh.signals.optimizer_state.state_dict() == pending
    monitor.close()
    off = connmon.Monitor(TinyGPT(), every_n_steps=3, optimizer_every_n_steps=None)
    assert off.signals.optimizer_state is None and not off.signals._hooks
