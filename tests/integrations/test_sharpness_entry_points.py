"""One curvature definition in every entry point: Lightning, connmon.Monitor in a plain loop, the HF Trainer."""

from __future__ import annotations

import itertools
import math

import lightning as L
import pytest
import torch

import connmon
from connmon.alerts import AlertRunner, edge_of_stability_rule
from connmon.callbacks import SharpnessMonitor
from connmon.curvature.sampler import SharpnessSampler, first_reading_price, keys_of
from tests.callbacks.lightning_models import LitGPT, loader

RATIO = "connmon/sharpness_ratio"
UPDATE = "connmon/update_sharpness_ratio"
CRITICAL = "connmon/critical_sharpness_ratio"
GRADIENTS = "connmon/overhead/curvature_gradients"


def lightning_ratios(estimator: str, max_steps: int = 7) -> dict[int, float]:
    series = {}
    monitor = SharpnessMonitor(
        lambda m, b: next_token_loss(m.model, b), every_n_steps=2, estimator=estimator, cadence="fixed", budget=None
    )
    monitor.add_listener(lambda trainer, step, values: series.update({step: values[keys_of(estimator)[0]]}))
    trainer = L.Trainer(
        max_steps=max_steps, callbacks=[monitor], logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, accelerator="cpu",
    )  # fmt: skip
    trainer.fit(LitGPT(), loader())
    return series


def next_token_loss(model, batch):
    idx, target = batch
    return torch.nn.functional.cross_entropy(model(idx).flatten(0, 1), target.flatten())


def plain_loop(monitor_options: dict, max_steps: int = 7, looks: bool = False) -> tuple[dict, torch.nn.Module]:
    """LitGPT's model, data and SGD in a plain loop, with connmon.Monitor's sharpness.

    The ratio logged at each step, or with ``looks`` the two looks' ratios (``{key: ratio}``) at each step.
    """
    module = LitGPT()
    model = module.model
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    logged = {}

    def log(values, step):
        if looks:
            read = {key: values[key] for key in (RATIO, CRITICAL, GRADIENTS) if key in values}
            logged.setdefault(step, {}).update(read)
            return
        for key in (RATIO, UPDATE):
            if key in values:
                logged[step] = values[key]

    monitor = connmon.Monitor(
        model, every_n_steps=1000, diagnostics=("walk",), optimizer=optimizer, log=log, **monitor_options
    )
    batches = itertools.cycle(loader())  # epochs, as Lightning's loop runs them
    for step in range(max_steps):
        batch = next(batches)
        with monitor.step(step, batch=batch):
            loss = next_token_loss(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    monitor.close()
    return logged, model


@pytest.mark.parametrize("estimator", ["finite_difference_lanczos", "exact_lanczos", "secant", "difference"])
def test_a_plain_loop_logs_what_lightning_logs(estimator):
    sampler = SharpnessSampler(every_n_steps=2, estimator=estimator, cadence="fixed", budget=None)
    loop, _ = plain_loop({"sharpness": sampler, "loss_fn": next_token_loss})
    assert sorted(loop) == [2, 4, 6]
    assert loop == pytest.approx(lightning_ratios(estimator), rel=1e-9)


def test_the_default_budget_holds_lightning_and_a_plain_loop_to_the_same_readings_from_the_first():
    """Every reading waits until the passes spent plus its price fit the budget: the same steps in both entry points."""
    options = {"every_n_steps": 1, "cadence": "fixed", "lanczos_steps": 2, "budget": 0.25}
    loop, _ = plain_loop({"sharpness": SharpnessSampler(**options), "loss_fn": next_token_loss}, 70, looks=True)
    series: dict[int, float] = {}
    monitor = SharpnessMonitor(lambda m, b: next_token_loss(m.model, b), **options)
    monitor.add_listener(lambda trainer, step, values: series.update({step: values[RATIO]}))
    trainer = L.Trainer(max_steps=70, callbacks=[monitor], logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, accelerator="cpu")  # fmt: skip
    trainer.fit(LitGPT(), loader())
    loop = {step: values for step, values in loop.items() if RATIO in values}
    assert {step: values[RATIO] for step, values in loop.items()} == pytest.approx(series, rel=1e-9)
    assert len(series) >= 3
    spent = {step: values[GRADIENTS] * step for step, values in loop.items()}  # passes so far, as logged
    price, before = first_reading_price("finite_difference_lanczos", 2), 0.0  # replayed from the passes logged
    for step, total in sorted(spent.items()):
        assert before + price <= 0.25 * step + 1e-9 < before + price + 0.25  # the first step the budget affords
        price, before = max(price if before else 0.0, total - before), total
    assert before <= 0.25 * 70


def test_the_hugging_face_trainer_holds_the_readings_to_the_budget_from_the_first(tmp_path):
    pytest.importorskip("transformers")
    from connmon.integrations.transformers import ConnectionMonitorCallback
    from tests.integrations.test_transformers import make_trainer

    trainer = make_trainer(tmp_path, max_steps=45, logging_steps=1000)
    sharpness = SharpnessSampler(every_n_steps=1, cadence="fixed", lanczos_steps=2, budget=0.25)
    trainer.add_callback(ConnectionMonitorCallback(trainer, every_n_steps=1000, diagnostics=("walk",),
                                                   sharpness=sharpness))  # fmt: skip
    trainer.train()
    # the Trainer logs the reading of the forward after s steps in its row s + 1
    spent = {row["step"] - 1: row[GRADIENTS] * (row["step"] - 1) for row in trainer.state.log_history
             if GRADIENTS in row}  # fmt: skip
    assert min(spent) == 20 and len(spent) >= 2  # priced at 5 passes before the first, at 25%
    price, before = first_reading_price("finite_difference_lanczos", 2), 0.0
    for step, total in sorted(spent.items()):
        assert before + price <= 0.25 * step + 1e-9 < before + price + 0.25
        price, before = max(price if before else 0.0, total - before), total


def test_two_looks_log_the_same_in_lightning_and_a_plain_loop():
    options = {
        "every_n_steps": 4,
        "cadence": "fixed",
        "first_look_every_n_steps": 2,
        "first_look_trigger": 0.0,
        "budget": None,
    }
    loop, _ = plain_loop({"sharpness": SharpnessSampler(**options), "loss_fn": next_token_loss}, 9, looks=True)
    loop = {step: {k: v for k, v in values.items() if k != GRADIENTS} for step, values in loop.items() if values}
    series: dict[int, dict[str, float]] = {}
    monitor = SharpnessMonitor(lambda m, b: next_token_loss(m.model, b), **options)
    monitor.add_listener(lambda trainer, step, values: series.setdefault(step, {}).update(values))
    trainer = L.Trainer(max_steps=9, callbacks=[monitor], logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, accelerator="cpu")  # fmt: skip
    trainer.fit(LitGPT(), loader())
    assert sorted(s for s, v in loop.items() if RATIO in v) == [3, 7] and sorted(loop) == [2, 3, 4, 6, 7, 8]
    assert sorted(series) == sorted(loop)
    for step, values in loop.items():
        assert {k: series[step][k] for k in values} == pytest.approx(values, rel=1e-9)


def test_the_plain_loop_trains_bitwise_the_same_and_leaves_no_hook():
    _, plain = plain_loop({})
    sampler = SharpnessSampler(every_n_steps=1, estimator="secant", cadence="fixed", budget=None)
    _, monitored = plain_loop({"sharpness": sampler})
    assert all(
        torch.equal(a, b) for a, b in zip(plain.state_dict().values(), monitored.state_dict().values(), strict=True)
    )
    assert sampler.samples == 6 and sampler.optimizer._optimizer_step_post_hooks == {}


def test_the_plain_loop_alert_rules_see_the_ratio():
    seen = []
    runner = AlertRunner([edge_of_stability_rule(since=0, consecutive=1, bound=0.0)], actions=(), on_alert=seen.append)
    plain_loop(
        {"sharpness": SharpnessSampler(every_n_steps=2, budget=None), "alerts": runner, "loss_fn": next_token_loss}
    )
    assert [(a.key, a.step) for a in seen] == [(RATIO, 2)]  # the cooldown keeps it to one


def test_plain_loop_options_are_checked():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="sharpness needs the optimizer it watches"):
        connmon.Monitor(sharpness=SharpnessSampler(estimator="secant", budget=None))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="estimator='difference' reads a loss: pass loss_fn"):
        connmon.Monitor(optimizer=optimizer, sharpness=SharpnessSampler(estimator="difference", budget=None))
    with pytest.raises(ValueError, match=r"sharpness must be a connmon\.curvature\.sampler\.SharpnessSampler"):
        connmon.Monitor(optimizer=optimizer, sharpness="secant")


def test_the_hugging_face_trainer_logs_the_secant_of_its_own_gradients(tmp_path):
    """AdamW under a linear LR schedule, clipped every step: ratio = u.(g_s - g_{s-1}) / (u.(u / U)) / 3.8."""
    transformers = pytest.importorskip("transformers")
    from connmon.integrations.transformers import ConnectionMonitorCallback
    from tests.integrations.test_transformers import make_trainer

    trainer = make_trainer(tmp_path, max_grad_norm=0.05)  # the reading sees the clipped gradients the step uses
    seen = {}

    class Recorder(transformers.TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):  # after clipping, before the step
            optimizer = trainer.optimizer.optimizer
            params = [p for group in optimizer.param_groups for p in group["params"]]
            v_hat = [
                optimizer.state[p]["exp_avg_sq"] / (1 - 0.999 ** optimizer.state[p]["step"].item())
                if p in optimizer.state else torch.zeros_like(p)
                for p in params
            ]  # fmt: skip
            seen[state.global_step] = {
                "theta": torch.cat([p.detach().reshape(-1).double() for p in params]),
                "grad": torch.cat([p.grad.reshape(-1).double() for p in params]),
                "root": torch.cat([v.reshape(-1).double().sqrt() + 1e-8 for v in v_hat]),  # after step global_step
                "lr": optimizer.param_groups[0]["lr"],  # the next step's
            }

    sharpness = SharpnessSampler(every_n_steps=2, estimator="secant", cadence="fixed", budget=None)
    callback = ConnectionMonitorCallback(trainer, every_n_steps=1000, sharpness=sharpness)
    trainer.add_callback(callback)
    trainer.add_callback(Recorder())
    trainer.train()
    logged = {row["step"] - 1: row for row in trainer.state.log_history if UPDATE in row}  # the Trainer's row: s + 1
    assert sorted(logged) == [2, 4]  # step 6 is the last: no step follows it
    for s, row in logged.items():
        u = seen[s]["theta"] - seen[s - 1]["theta"]
        step_size = seen[s - 1]["lr"] * (1 - 0.9) / seen[s]["root"]
        expected = (u @ (seen[s]["grad"] - seen[s - 1]["grad"])) / (u @ (u / step_size)) / 3.8
        assert row[UPDATE] == pytest.approx(expected.item(), rel=1e-4)
        assert 0 < row["connmon/overhead/curvature"] < 1
    optimizer = trainer.optimizer.optimizer
    assert callback.sharpness.optimizer is optimizer and not optimizer._optimizer_step_post_hooks  # removed


@pytest.mark.parametrize(
    ("estimator", "accumulation"),
    [("finite_difference_lanczos", 1), ("finite_difference_lanczos", 2), ("exact_lanczos", 2), ("difference", 1)],
)
def test_the_hugging_face_trainer_reads_a_loss_on_the_sampled_step_batches(tmp_path, estimator, accumulation):
    """The estimators that read a loss take the Trainer's inputs from the model's forwards, before they run.

    The Lanczos ones read every micro-batch of the sampled step after its backward, before ``optimizer.step()``.
    """
    transformers = pytest.importorskip("transformers")
    from connmon.curvature import sharpness_ratio
    from connmon.integrations.transformers import ConnectionMonitorCallback
    from tests.integrations.test_transformers import make_trainer

    trainer = make_trainer(tmp_path, max_steps=5, gradient_accumulation_steps=accumulation)
    direct, inputs_of_step = {}, []
    products = "double_backward" if estimator == "exact_lanczos" else "gradient_difference"

    class Direct(transformers.TrainerCallback):  # the same micro-batches, seed and state, taken the same way
        def on_step_begin(self, args, state, control, model=None, **kwargs):
            if state.global_step == 2:

                def hook(module, hook_args, inputs):
                    if len(inputs_of_step) < accumulation:  # the step's own forwards, not the readings' after them
                        inputs_of_step.append((module, dict(inputs)))

                self.handle = model.register_forward_pre_hook(hook, with_kwargs=True, prepend=True)

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            if state.global_step == 2:
                self.handle.remove()
                losses = [lambda m=m, i=i: m(**i).loss for m, i in inputs_of_step]
                assert all("num_items_in_batch" in i for _, i in inputs_of_step)  # each loss is of the whole step's
                direct[2] = sharpness_ratio(losses, trainer.optimizer.optimizer, steps=8, model=inputs_of_step[0][0],
                                            seed=2, products=products,
                                            weights=[1.0] * len(losses))  # fmt: skip

    sharpness = SharpnessSampler(every_n_steps=2, estimator=estimator, cadence="fixed", budget=None)
    callback = ConnectionMonitorCallback(trainer, every_n_steps=2, diagnostics=("walk",), sharpness=sharpness)
    trainer.add_callback(callback)
    trainer.add_callback(Direct())
    trainer.train()
    key = keys_of(estimator)[0]
    logged = {row["step"] - 1: row[key] for row in trainer.state.log_history if key in row}  # the Trainer's row: s + 1
    assert sorted(logged) == [2, 4] and all(math.isfinite(v) for v in logged.values())
    if estimator != "difference":
        assert len(inputs_of_step) == accumulation
        assert logged[2] == pytest.approx(direct[2].ratio, rel=1e-6)
    attention = [row for row in trainer.state.log_history if "connmon/attention_entropy/L00" in row]
    # the capture recorded the training forwards (after 0, 2, 4 steps), not the readings
    assert [row["step"] - 1 for row in attention] == [0, 2, 4]


@pytest.mark.parametrize("estimator", ["finite_difference_lanczos", "exact_lanczos"])
def test_the_hugging_face_trainer_reads_the_steps_loss_whatever_its_accumulation(tmp_path, estimator):
    """8 x 1, 4 x 2 and 2 x 4 sequences per optimizer step read one curvature, and its ratio above 1 alerts in each.

    transformers passes ``num_items_in_batch`` (the tokens of the whole step) into the forward, so every
    micro-batch's loss is already normalised over the step and the Trainer sums them: a mean of them read ``1 / k``.
    """
    pytest.importorskip("transformers")
    from connmon.integrations.transformers import ConnectionMonitorCallback
    from tests.integrations.test_transformers import make_trainer

    readings, alerted = {}, {}
    for micro_batch, accumulation in ((8, 1), (4, 2), (2, 4)):
        trainer = make_trainer(
            tmp_path / str(accumulation), max_steps=5, per_device_train_batch_size=micro_batch,
            gradient_accumulation_steps=accumulation, learning_rate=0.05, lr_scheduler_type="constant",
        )  # fmt: skip
        # step 2 is Adam's second step (its preconditioner from two gradients reads 29): the rule tests from step 3
        alerts = AlertRunner([edge_of_stability_rule(consecutive=1, since=3)], actions=("log",))
        sharpness = SharpnessSampler(every_n_steps=2, estimator=estimator, cadence="fixed", budget=None)
        callback = ConnectionMonitorCallback(
            trainer, every_n_steps=1000, diagnostics=("walk",), sharpness=sharpness, alerts=alerts
        )
        trainer.add_callback(callback)
        with pytest.warns(UserWarning, match="past the edge of stability"):
            trainer.train()
        readings[accumulation] = {row["step"] - 1: row[RATIO] for row in trainer.state.log_history if RATIO in row}
        alerted[accumulation] = alerts.total
    assert sorted(readings[1]) == [2, 4]
    for accumulation in (2, 4):
        for step in (2, 4):
            assert readings[accumulation][step] == pytest.approx(readings[1][step], rel=1e-2), (accumulation, step)
    assert readings[4][4] > 1 and all(alerted.values())  # past the edge at step 4, said by the rule in each run


def test_a_plain_loop_reads_the_steps_loss_whatever_its_normaliser():
    """Two micro-batches read what their whole batch reads: each a mean divided by 2, or each normalised by the step.

    The second loop normalises each micro-batch's summed loss by the whole step's token count and sums the two (as
    Hugging Face's ``num_items_in_batch`` does); ``loss_weight=1.0`` says so, and a mean of them would read half.
    """

    def summed_loss(model, batch, count):
        idx, target = batch
        return torch.nn.functional.cross_entropy(model(idx).flatten(0, 1), target.flatten(), reduction="sum") / count

    readings, tokens = {}, {}
    for layout in ("whole", "mean", "normalised"):
        module = LitGPT()
        model = module.model
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
        logged = {}
        loss_fn = next_token_loss if layout != "normalised" else lambda m, b: summed_loss(m, b, tokens["step"])
        monitor = connmon.Monitor(
            model, every_n_steps=1000, diagnostics=("walk",), optimizer=optimizer, loss_fn=loss_fn,
            sharpness=SharpnessSampler(every_n_steps=1, cadence="fixed", budget=None),
            log=lambda values, step, logged=logged: RATIO in values and logged.update({step: values[RATIO]}),
        )  # fmt: skip
        batches = iter(loader(batch_size=8))
        for step in range(2):
            idx, target = next(batches)
            if layout == "whole":
                with monitor.step(step, batch=(idx, target)):
                    next_token_loss(model, (idx, target)).backward()
            else:
                count = tokens["step"] = target.numel()
                for part in zip(idx.chunk(2), target.chunk(2), strict=True):
                    if layout == "mean":
                        with monitor.step(step, batch=part):
                            (next_token_loss(model, part) / 2).backward()
                    else:
                        with monitor.step(step, batch=part, loss_weight=1.0):
                            summed_loss(model, part, count).backward()
            optimizer.step()
            optimizer.zero_grad()
        monitor.close()
        readings[layout] = logged[1]
    assert readings["mean"] == pytest.approx(readings["whole"], rel=1e-3)
    assert readings["normalised"] == pytest.approx(readings["whole"], rel=1e-3)


def test_past_the_edge_the_sampler_waits_for_the_rules_cooldown_in_every_entry_point():
    """Once the edge rule fired, no curvature sample comes before the rule can fire again (its cooldown, less the
    samples it needs in a row): 2, 4 (alert), 12, 14 (alert), 22, ... instead of every 2 steps."""
    expected = [2, 4, 12, 14, 22]

    def rule():
        return edge_of_stability_rule(bound=1e-9, consecutive=2, cooldown=10, since=0)

    sampler = SharpnessSampler(every_n_steps=2, cadence="fixed", budget=None)
    logged, _ = plain_loop(
        {"sharpness": sampler, "loss_fn": next_token_loss, "alerts": AlertRunner([rule()], actions=("log",))},
        max_steps=23,
    )
    assert sorted(logged) == expected
    assert sampler.state_dict()["held_until"] == 22  # saved: a resumed run keeps waiting

    from connmon.callbacks import DriftAlert

    seen = {}
    monitor = SharpnessMonitor(lambda m, b: next_token_loss(m.model, b), every_n_steps=2, cadence="fixed", budget=None)
    monitor.add_listener(lambda trainer, step, values: seen.update({step: values[RATIO]}))
    trainer = L.Trainer(
        max_steps=23, callbacks=[monitor, DriftAlert(rules=[rule()], actions=("log",))], logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, accelerator="cpu",
    )  # fmt: skip
    with pytest.warns(UserWarning, match="past the edge of stability"):
        trainer.fit(LitGPT(), loader())
    assert sorted(seen) == expected
