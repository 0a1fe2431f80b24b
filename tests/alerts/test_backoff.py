"""The learning-rate back-off: inside the optimizer's steps, never undone by a scheduler, quiet runs untouched."""

from __future__ import annotations

import pytest
import torch

from connmon.alerts import AlertRunner, LearningRateBackoff, Rule, Threshold

EDGE = "past the edge of stability"


def sgd_run(schedule, backoff=None, fire_at=None, steps=8):
    """A least-squares model trained by SGD under ``schedule``: its weights, and each step's group lr after it."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = schedule(optimizer)
    if backoff is not None:
        backoff.attach([optimizer])
    lrs = []
    for step in range(steps):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        scheduler.step()
        lrs.append(optimizer.param_groups[0]["lr"])
        if backoff is not None and step == fire_at:
            backoff.fire(step)
    return [p.detach().clone() for p in model.parameters()], lrs


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step()`")  # the reference steps by hand
@pytest.mark.parametrize("name", ["LambdaLR", "OneCycleLR"])
def test_a_back_off_survives_the_scheduler_and_trains_as_the_scaled_schedule(name):
    if name == "OneCycleLR":

        def make(opt):
            return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=9, cycle_momentum=False)
    else:

        def make(opt):
            return torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1 / (1 + t))

    plain, plain_lrs = sgd_run(make)
    backed, backed_lrs = sgd_run(make, LearningRateBackoff(factor=0.5), fire_at=2)
    assert backed_lrs == plain_lrs  # the scheduler's own values, untouched
    # the reference: the same schedule with the steps after step 2 at half the rate
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = make(optimizer)
    for step in range(8):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        rate = optimizer.param_groups[0]["lr"]
        with torch.no_grad():
            for p in model.parameters():
                p -= rate * (0.5 if step > 2 else 1.0) * p.grad
        scheduler.step()
    for a, b, c in zip(backed, model.parameters(), plain, strict=True):
        torch.testing.assert_close(a, b.detach(), rtol=1e-6, atol=1e-7)
        assert not torch.equal(a, c)


def test_a_run_on_which_no_back_off_fired_is_bitwise_unchanged():
    def make(opt):
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1 / (1 + t))

    plain, plain_lrs = sgd_run(make)
    watched, watched_lrs = sgd_run(make, LearningRateBackoff(), fire_at=None)
    assert watched_lrs == plain_lrs
    assert all(torch.equal(a, b) for a, b in zip(plain, watched, strict=True))


@pytest.mark.parametrize("optimizer_class", [torch.optim.SGD, torch.optim.AdamW])
def test_a_back_off_fired_inside_the_optimizers_closure_scales_that_step(optimizer_class):
    """Lightning runs the forward (where a sample's alert fires) in the closure, after the step's pre-hooks."""

    def run(fire_in_closure: bool):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        x, y = torch.randn(16, 4), torch.randn(16, 1)
        optimizer = optimizer_class(model.parameters(), lr=0.1)
        backoff = LearningRateBackoff(factor=0.5)
        backoff.attach([optimizer])

        def closure():
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            if fire_in_closure:
                backoff.fire(0)
            return loss

        if not fire_in_closure:
            backoff.fire(0)
        optimizer.step(closure)
        return [p.detach().clone() for p in model.parameters()], optimizer.param_groups[0]["lr"]

    (inside, lr_inside), (before, lr_before) = run(True), run(False)
    assert all(torch.equal(a, b) for a, b in zip(inside, before, strict=True)) and lr_inside == lr_before == 0.1


def test_cooldown_state_and_bad_options():
    backoff = LearningRateBackoff(factor=0.25, cooldown=50)
    assert [backoff.fire(s) for s in (10, 40, 60, 100, 110)] == [True, False, True, False, True]
    assert backoff.scale == 0.25**3 and backoff.last_step == 110
    resumed = LearningRateBackoff(factor=0.25, cooldown=50)
    resumed.load_state_dict(backoff.state_dict())
    assert (resumed.scale, resumed.last_step, resumed.fire(150)) == (backoff.scale, 110, False)
    for options, named in (({"factor": 1.0}, "factor"), ({"factor": 0}, "factor"), ({"cooldown": -1}, "cooldown"),
                           ({"rules": EDGE}, "rules")):  # fmt: skip
        with pytest.raises(ValueError, match=named):
            LearningRateBackoff(**options)


def test_the_runner_backs_off_on_the_edge_rule_only_and_logs_the_scale():
    rules = [Rule(EDGE, "ratio", Threshold(1.0), cooldown=0), Rule("other", "logit", Threshold(1.0), cooldown=0)]
    runner = AlertRunner(rules, actions=("backoff",), backoff=LearningRateBackoff(factor=0.5, cooldown=0))
    alerts, stop = runner.run({"ratio": 0.5, "logit": 2.0}, step=1)
    assert [a.rule for a in alerts] == ["other"] and runner.counts(alerts)["connmon/lr_scale"] == 1.0 and not stop
    with pytest.warns(UserWarning, match="learning rate is scaled by 0.5 from step 2 on"):
        alerts, _ = runner.run({"ratio": 1.5, "logit": 0.0}, step=2)
    assert runner.counts(alerts)["connmon/lr_scale"] == 0.5
    state = runner.state_dict()
    again = AlertRunner(rules, actions=("backoff",))
    again.load_state_dict(state)
    assert again.backoff.scale == 0.5
    assert AlertRunner(rules).backoff is None and "connmon/lr_scale" not in AlertRunner(rules).counts([])


def test_the_edge_ratio_reads_the_rate_the_backed_off_step_applies():
    """``lr * lambda / c`` with the applied rate: before, inside and after the step, and a detached back-off not."""
    from connmon.curvature import sharpness_ratio

    torch.manual_seed(0)
    a = torch.randn(6, 6, dtype=torch.float64)
    hessian = a @ a.T
    w = torch.nn.Parameter(torch.randn(6, dtype=torch.float64))
    optimizer = torch.optim.SGD([w], lr=0.1, momentum=0.9)
    loss_fn = lambda: 0.5 * w @ hessian @ w  # noqa: E731
    exact = 0.1 * torch.linalg.eigvalsh(hessian)[-1].item() / (2 * 1.9)

    def ratio() -> float:  # the rate is passed in, as the sampler does: the math reads no back-off itself
        scale = backoff.pending_scale(optimizer)
        return sharpness_ratio(loss_fn, optimizer, steps=6, products="double_backward", lr_scale=scale).ratio

    backoff = LearningRateBackoff(factor=0.5)
    backoff.attach([optimizer])
    assert ratio() == pytest.approx(exact, rel=1e-9)
    backoff.fire(step=0)
    assert ratio() == pytest.approx(0.5 * exact, rel=1e-9)  # the groups still say 0.1; the step applies 0.05
    inside = []
    optimizer.register_step_pre_hook(lambda *_: inside.append((optimizer.param_groups[0]["lr"], ratio())))
    w.grad = torch.zeros_like(w)
    optimizer.step()
    assert inside[0][0] == pytest.approx(0.05) and inside[0][1] == pytest.approx(0.5 * exact, rel=1e-9)
    assert optimizer.param_groups[0]["lr"] == 0.1 and ratio() == pytest.approx(0.5 * exact, rel=1e-9)
    backoff.detach()
    assert backoff.pending_scale(optimizer) == 1.0 and ratio() == pytest.approx(exact, rel=1e-9)


def test_every_entry_point_hands_its_back_off_to_the_curvature_sampler():
    """The rate a back-off applies is passed in: the sampler reads its pending scale, never a global registry."""
    import lightning as L

    import connmon
    from connmon.alerts import AlertRunner, edge_of_stability_rule
    from connmon.callbacks import DriftAlert, SharpnessMonitor
    from connmon.curvature.sampler import SharpnessSampler
    from tests.callbacks.ddp_run import next_token_loss
    from tests.callbacks.lightning_models import LitGPT, loader
    from tests.capture.models import TinyGPT

    model = TinyGPT()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    runner = AlertRunner([edge_of_stability_rule()], actions=("backoff",))
    monitor = connmon.Monitor(model, optimizer=optimizer, sharpness=SharpnessSampler(budget=None), alerts=runner,
                              loss_fn=lambda m, b: m(b).mean())  # fmt: skip
    assert monitor.sharpness.backoff is runner.backoff and monitor.sharpness._lr_scale() == 1.0
    runner.backoff.fire(step=0)
    assert monitor.sharpness._lr_scale() == 0.5  # the scale the next step applies
    monitor.close()

    drift = DriftAlert(actions=("backoff",))
    sharpness = SharpnessMonitor(next_token_loss, every_n_steps=2, budget=None)
    trainer = L.Trainer(
        max_steps=2, callbacks=[sharpness, drift], logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, accelerator="cpu",
    )  # fmt: skip
    trainer.fit(LitGPT(), loader())
    assert sharpness.sampler.backoff is drift.runner.backoff
