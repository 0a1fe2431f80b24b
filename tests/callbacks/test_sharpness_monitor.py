import contextlib
import itertools
import math
import warnings

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from connmon.alerts import RuleSet, default_rules, edge_of_stability_rule
from connmon.callbacks import ConnectionMonitor, DriftAlert, SharpnessMonitor
from connmon.curvature import sharpness_ratio
from connmon.curvature.sampler import adaptive_interval
from tests.callbacks.lightning_models import VOCAB, LitGPT, loader
from tests.callbacks.test_connection_monitor import read_csv

RATIO = "connmon/sharpness_ratio"
UPDATE = "connmon/update_sharpness_ratio"  # what the update estimators log, which no default rule watches


LANCZOS = ("finite_difference_lanczos", "exact_lanczos")  # the top of the spectrum, what the edge rule watches
PRODUCTS = {"finite_difference_lanczos": "gradient_difference", "exact_lanczos": "double_backward"}


def key_of(estimator):
    return RATIO if estimator in LANCZOS else UPDATE


def gpt_loss(module, batch):
    idx, target = batch
    return nn.functional.cross_entropy(module(idx).flatten(0, 1), target.flatten())


class Direct(L.Callback):
    """After the monitor, connmon.curvature's ratio on the same micro-batches, seed and state, before the step."""

    def __init__(self, every_n_steps: int, loss_fn=gpt_loss, products="gradient_difference", precision=True) -> None:
        self.every_n_steps, self.loss_fn, self.products, self.precision = every_n_steps, loss_fn, products, precision
        self.ratios, self.batches, self.initial = {}, {}, None  # the step carried from sample to sample, as the sampler

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        step = trainer.global_step  # the batches the next optimizer step trains on
        if step and step % self.every_n_steps == 0:
            self.batches.setdefault(step, []).append(batch)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        step = trainer.global_step
        if step not in self.batches:
            return
        losses = [lambda b=b: self.loss_fn(pl_module, b) for b in self.batches.pop(step)]
        context = trainer.precision_plugin.train_step_context() if self.precision else contextlib.nullcontext()
        with context:
            result = sharpness_ratio(losses, trainer.optimizers[0], steps=8, model=pl_module, seed=step,
                                     products=self.products, initial_length=self.initial)  # fmt: skip
        self.ratios[step] = result.ratio
        self.initial = result.difference_length if 0 < result.difference_length < 0.1 else None


def fit(tmp_path, callbacks, module=None, max_steps=6, data=None, **trainer_kwargs):
    trainer = L.Trainer(
        max_steps=max_steps, callbacks=callbacks, logger=CSVLogger(tmp_path, name="csv"), enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, accelerator="cpu", devices=1, log_every_n_steps=1,
        **trainer_kwargs,
    )  # fmt: skip
    trainer.fit(module or LitGPT(), data or loader())
    return trainer


def logged(tmp_path, key=RATIO):
    if not any(tmp_path.rglob("metrics.csv")):  # nothing was logged at all
        return {}
    return {int(row["step"]): float(row[key]) for row in read_csv(tmp_path) if row.get(key)}


@pytest.mark.parametrize("estimator", LANCZOS)
def test_the_ratio_is_connmon_curvature_of_the_sampled_step_before_its_optimizer_step(tmp_path, estimator):
    monitor = SharpnessMonitor(gpt_loss, every_n_steps=2, estimator=estimator, cadence="fixed", budget=None)
    direct = Direct(2, products=PRODUCTS[estimator])
    fit(tmp_path, [monitor, direct], max_steps=7)
    values = logged(tmp_path)
    assert sorted(values) == [2, 4, 6] and monitor.samples == 3
    assert values == pytest.approx(direct.ratios, rel=1e-6)  # the CSV holds float32-rounded text
    assert all(0 < v < 1 for v in values.values())  # SGD at lr 1e-2: far inside the edge
    eigenvalues = logged(tmp_path, "connmon/sharpness_eigenvalue")
    assert eigenvalues == pytest.approx({s: 2 * v for s, v in values.items()}, rel=1e-6)  # plain SGD: c = 2


def test_gradient_differences_read_what_exact_lanczos_reads_through_the_fused_attention_kernel(tmp_path):
    """The default estimator on SDPA's fused CPU kernel against double backward on its math kernel, same run."""
    monitor = SharpnessMonitor(gpt_loss, every_n_steps=2, cadence="fixed", budget=None)
    exact = Direct(2, products="double_backward")
    fit(tmp_path, [monitor, exact], module=AdamGPT(), max_steps=9)
    values = logged(tmp_path)
    assert sorted(values) == [2, 4, 6, 8]
    assert values == pytest.approx(exact.ratios, rel=0.02)


def test_the_whole_accumulated_batch_reads_what_one_batch_of_its_size_reads_and_raises_no_alert(tmp_path):
    """4 micro-batches of 4 against one batch of 16, the same sequences: the same Hessian, so the same ratio."""
    runs = {}
    for name, batch_size, accumulate in (("one batch", 16, 1), ("four micro-batches", 4, 4)):
        series = {}
        monitor = SharpnessMonitor(gpt_loss, every_n_steps=2, cadence="fixed", budget=None)
        monitor.add_listener(lambda trainer, step, values, series=series: series.update({step: values[RATIO]}))
        alert = DriftAlert(actions=("log",))
        fit(tmp_path / name, [monitor, alert], module=AdamGPT(), max_steps=7, data=loader(batch_size),
            accumulate_grad_batches=accumulate)  # fmt: skip
        runs[name] = series
        assert alert.total == 0
    assert sorted(runs["one batch"]) == [2, 4, 6]
    assert runs["four micro-batches"] == pytest.approx(runs["one batch"], rel=1e-3)


def test_the_adaptive_cadence_samples_sparsely_far_from_the_edge_and_logs_its_interval_and_gradients(tmp_path):
    monitor = SharpnessMonitor(gpt_loss, every_n_steps=2, lanczos_steps=4, budget=None)
    fit(tmp_path, [monitor], max_steps=40)
    rows = {int(r["step"]): r for r in read_csv(tmp_path) if r.get(RATIO)}
    steps = sorted(rows)
    assert steps[0] == 2
    for before, after in itertools.pairwise(steps):  # each interval is the rule's for the ratio before it
        assert after - before == adaptive_interval(float(rows[before][RATIO]), 2)
        assert float(rows[before]["connmon/curvature_interval"]) == after - before
    assert len(steps) < 19  # SGD at lr 1e-2 is far inside the edge: fewer samples than every 2 steps
    spent = [float(rows[step]["connmon/overhead/curvature_gradients"]) * step for step in steps]  # gradients so far
    assert all(abs(total - round(total)) < 1e-3 for total in spent)
    assert all(later - earlier >= 5 for earlier, later in itertools.pairwise([0, *spent]))  # 4 products + g(theta)
    assert round(spent[-1]) == monitor.sampler.gradients
    fresh = SharpnessMonitor(gpt_loss, every_n_steps=2, lanczos_steps=4, budget=None)
    fresh.load_state_dict(monitor.state_dict())
    assert fresh.sampler.next_step == monitor.sampler.next_step > steps[-1]


class Noisy(L.LightningModule):
    """Dropout, batch norm and AdamW: what the estimate must leave as it was (random stream, buffers, state)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.Dropout(0.3), nn.GELU(), nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        return noisy_loss(self, batch)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def noisy_loss(module, batch):
    x, y = batch
    return nn.functional.mse_loss(module.net(x), y)


def noisy_data():
    gen = torch.Generator().manual_seed(1)
    return DataLoader(TensorDataset(torch.randn(64, 8, generator=gen), torch.randn(64, 1, generator=gen)), batch_size=8)


@pytest.mark.parametrize("estimator", ["finite_difference_lanczos", "secant", "difference", "exact_lanczos"])
def test_training_is_bitwise_the_same_with_the_monitor(tmp_path, estimator):
    runs = {}
    monitor = SharpnessMonitor(noisy_loss, every_n_steps=2, estimator=estimator, cadence="fixed", budget=None)
    for name, callbacks in (("plain", []), ("monitored", [monitor])):
        torch.manual_seed(5)
        module = Noisy()
        trainer = fit(tmp_path / name, callbacks, module=module, max_steps=8, data=noisy_data())
        runs[name] = {**module.state_dict(), **_optimizer_tensors(trainer), "rng": torch.get_rng_state()}
    assert runs["plain"].keys() == runs["monitored"].keys()
    assert all(torch.equal(runs["plain"][k], runs["monitored"][k]) for k in runs["plain"])
    assert len(logged(tmp_path / "monitored", key_of(estimator))) == 3  # steps 2, 4, 6: none after the last step


def _optimizer_tensors(trainer):
    state = trainer.optimizers[0].state_dict()["state"]
    return {f"optimizer/{i}/{k}": v for i, s in state.items() for k, v in s.items() if isinstance(v, torch.Tensor)}


def test_the_connection_monitor_reads_the_same_with_it_listed_before_after_or_absent(tmp_path):
    def read(name, sharpness_first):
        monitor = ConnectionMonitor(every_n_steps=2, diagnostics=("walk",), figures_every_n_samples=None)
        sharpness = SharpnessMonitor(gpt_loss, every_n_steps=2, cadence="fixed", budget=None)
        callbacks = {None: [monitor], True: [sharpness, monitor], False: [monitor, sharpness]}[sharpness_first]
        fit(tmp_path / name, callbacks)
        return {(int(r["step"]), k): v for r in read_csv(tmp_path / name) for k, v in r.items()
                if v and k.startswith("connmon/attention_entropy")}  # fmt: skip

    alone = read("alone", None)
    assert alone and read("before", True) == alone and read("after", False) == alone


@pytest.mark.parametrize("estimator", LANCZOS)
def test_sampled_once_per_optimizer_step_on_every_micro_batch_under_gradient_accumulation(tmp_path, estimator):
    monitor = SharpnessMonitor(gpt_loss, every_n_steps=1, estimator=estimator, cadence="fixed", budget=None)
    direct = Direct(1, products=PRODUCTS[estimator])
    trainer = fit(tmp_path, [monitor, direct], max_steps=4, accumulate_grad_batches=2)
    assert trainer.global_step == 4 and sorted(logged(tmp_path)) == [1, 2, 3]  # none after the last step
    assert logged(tmp_path) == pytest.approx(direct.ratios, rel=1e-6)  # the mean loss of each step's two batches


def test_the_curvature_rule_warns_past_the_edge_of_stability_on_two_samples_in_a_row(tmp_path):
    series = {}
    sharpness = SharpnessMonitor(gpt_loss, every_n_steps=1, budget=None)
    sharpness.add_listener(lambda trainer, step, values: series.update({step: values[RATIO]}))
    alert = DriftAlert(rules=[edge_of_stability_rule()], actions=("log",))  # the curvature alone (opt-in)
    with pytest.warns(
        UserWarning,
        match=r"connmon: past the edge of stability \[WARN\]: curvature along the step [\d.]+x the optimizer's edge",
    ):
        fit(tmp_path, [sharpness, alert], module=LitGPT(lr=2.0), max_steps=26)
    defaults = RuleSet(default_rules())  # crossing the edge needs growing logits too: the curvature alone is quiet
    assert not any(defaults.update({RATIO: ratio}, step) for step, ratio in sorted(series.items()))
    steps = [s for s in sorted(series) if s >= 20]  # the rule starts at step 20
    expected = next(s for prev, s in itertools.pairwise(steps) if series[prev] > 1 and series[s] > 1)
    assert [a.step for a in alert.alerts] == [expected]  # the cooldown (100 steps) keeps it to one
    assert [a.rule for a in alert.alerts] == ["past the edge of stability"]


class AdamGPT(LitGPT):
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


@pytest.mark.parametrize("estimator", ["finite_difference_lanczos", "secant"])
def test_no_default_alert_in_the_first_steps_of_a_healthy_adam_run_sampled_every_step(tmp_path, estimator):
    series = {}
    sharpness = SharpnessMonitor(gpt_loss, every_n_steps=1, estimator=estimator, cadence="fixed", budget=None)
    sharpness.add_listener(lambda trainer, step, values: series.update({step: values[key_of(estimator)]}))
    alert = DriftAlert(actions=("log",))
    fit(tmp_path, [sharpness, alert], module=AdamGPT(), max_steps=30)
    if estimator in LANCZOS:  # the young second moment: coordinates no gradient has reached yet are left out
        assert all(math.isfinite(series[s]) for s in range(1, 4))
    assert alert.total == 0 and len(series) == 29


class Recorder(L.Callback):
    """Parameters and gradients before every optimizer step (after its backward), and each step's first batch."""

    def __init__(self) -> None:
        self.params, self.grads, self.batches = {}, {}, {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches.setdefault(trainer.global_step, batch)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.params[trainer.global_step] = [p.detach().clone() for p in pl_module.parameters()]
        self.grads[trainer.global_step] = [p.grad.detach().clone() for p in pl_module.parameters()]


def flat(tensors):
    return torch.cat([t.reshape(-1).double() for t in tensors])


def test_secant_is_the_update_times_the_gradient_change_against_the_sgd_edge(tmp_path):
    """Plain SGD, lr 1e-2: ratio = u.(g_s - g_{s-1}) / (u.u / lr) / 2 with u = theta_s - theta_{s-1}."""
    series, recorder = {}, Recorder()
    monitor = SharpnessMonitor(every_n_steps=2, estimator="secant", cadence="fixed", budget=None)
    monitor.add_listener(lambda trainer, step, values: series.update({step: values[UPDATE]}))
    fit(tmp_path, [monitor, recorder], max_steps=7, accumulate_grad_batches=2)
    assert sorted(series) == [2, 4, 6] and sorted(logged(tmp_path, UPDATE)) == [2, 4, 6]
    assert not logged(tmp_path)  # nothing for the edge rule: the update's curvature is a lower bound
    for s, ratio in series.items():
        u = flat(recorder.params[s]) - flat(recorder.params[s - 1])
        expected = (u @ (flat(recorder.grads[s]) - flat(recorder.grads[s - 1]))) / (u @ u / 1e-2) / 2
        assert ratio == pytest.approx(expected.item(), rel=1e-4)


def test_difference_is_three_losses_along_the_update_on_the_step_batch(tmp_path):
    series, recorder = {}, Recorder()
    monitor = SharpnessMonitor(gpt_loss, every_n_steps=2, estimator="difference", cadence="fixed", budget=None)
    monitor.add_listener(lambda trainer, step, values: series.update({step: values[UPDATE]}))
    module = LitGPT()
    fit(tmp_path, [monitor, recorder], module=module, max_steps=7)
    names = [name for name, _ in module.named_parameters()]
    for s, ratio in series.items():
        now, before = recorder.params[s], recorder.params[s - 1]
        points = {
            "now": now,
            "before": before,
            "ahead": [(-b).add(n, alpha=2) for n, b in zip(now, before, strict=True)],
        }
        loss = {}
        for key, values in points.items():
            with torch.no_grad():
                logits = torch.func.functional_call(
                    module, dict(zip(names, values, strict=True)), (recorder.batches[s][0],)
                )
            loss[key] = nn.functional.cross_entropy(logits.flatten(0, 1), recorder.batches[s][1].flatten()).item()
        u = flat(now) - flat(before)
        expected = (loss["ahead"] + loss["before"] - 2 * loss["now"]) / (u @ u / 1e-2).item() / 2
        assert ratio == pytest.approx(expected, rel=1e-6)  # u in float32 there, float64 here


@pytest.mark.parametrize("estimator", ["finite_difference_lanczos", "secant", "difference"])
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_first_order_estimators_run_on_a_compiled_model_with_fused_attention_and_leave_training_unchanged(
    tmp_path, estimator, backend
):
    if backend == "inductor" and estimator != "finite_difference_lanczos":
        pytest.skip("the update estimators are covered on aot_eager; inductor is the default estimator's case")
    states, exact = {}, Direct(2, products="double_backward")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # with more, a busy machine splits compiled reductions differently from run to run
    try:
        for name in ("plain", "monitored"):
            module = LitGPT()
            if name == "monitored":
                uncompiled = module.model  # the same parameters: exact Lanczos reads them through the eager model
                exact.loss_fn = lambda m, b, model=uncompiled: next_token(model, b)
            module.model = torch.compile(module.model, backend=backend)
            callbacks = [SharpnessMonitor(gpt_loss, every_n_steps=2, estimator=estimator, cadence="fixed", budget=None)]
            if estimator == "finite_difference_lanczos":
                callbacks.append(exact)
            fit(tmp_path / name, callbacks if name == "monitored" else [], module=module, max_steps=5)
            states[name] = module.state_dict()
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(states["plain"][k], states["monitored"][k]) for k in states["plain"])
    values = logged(tmp_path / "monitored", key_of(estimator))
    assert sorted(values) == [2, 4] and all(math.isfinite(v) for v in values.values())
    if estimator == "finite_difference_lanczos":
        assert values == pytest.approx(exact.ratios, rel=0.02)


def next_token(model, batch):
    idx, target = batch
    return nn.functional.cross_entropy(model(idx).flatten(0, 1), target.flatten())


def test_it_logs_what_it_costs_and_says_it_at_the_end(tmp_path, caplog):
    monitor = SharpnessMonitor(gpt_loss, every_n_steps=2, estimator="exact_lanczos", cadence="fixed", budget=None)
    with caplog.at_level("INFO"):
        fit(tmp_path, [monitor], max_steps=7)
    rows = [r for r in read_csv(tmp_path) if r.get("connmon/overhead/curvature")]
    assert [int(r["step"]) for r in rows] == [2, 4, 6, 7]  # every sample, and the fit's end
    fractions = [float(r["connmon/overhead/curvature"]) for r in rows]
    assert all(f > 0.1 for f in fractions)  # Lanczos costs many steps of this tiny model
    assert [float(r["connmon/overhead"]) for r in rows] == pytest.approx(fractions, rel=0.05)  # the only monitor
    assert monitor.sampler.clock.fraction == pytest.approx(fractions[-1])  # the end's row: the stopped clock's
    assert any("SharpnessMonitor cost" in r.getMessage() and "% of training time" in r.getMessage()
               for r in caplog.records)  # fmt: skip


def test_the_budget_is_the_default_and_a_resumed_run_keeps_its_account(tmp_path):
    """5% of the training's passes by default; a resumed monitor affords the steps the uninterrupted one does."""
    assert SharpnessMonitor(gpt_loss).sampler.budget == 0.05
    monitor = SharpnessMonitor(gpt_loss, every_n_steps=1, lanczos_steps=2, budget=0.25, cadence="fixed")
    with pytest.warns(UserWarning, match=r"budget 25%: a curvature reading \(finite_difference_lanczos\) is priced "
                      r"at 5 passes .* the next at step 20 \(budget=None: no limit\)"):  # fmt: skip
        fit(tmp_path, [monitor], max_steps=45)
    steps = sorted(logged(tmp_path))
    assert steps[0] == 20  # 2 products + g(theta) + 2 retakes priced before the first reading, at 25%
    assert monitor.sampler.gradients <= 0.25 * 45 + 1e-9
    fresh = SharpnessMonitor(gpt_loss, every_n_steps=1, lanczos_steps=2, budget=0.25, cadence="fixed")
    fresh.load_state_dict(monitor.state_dict())
    kind = "finite_difference_lanczos"
    assert [fresh.sampler.affords(s, kind) for s in range(45, 120)] == [
        monitor.sampler.affords(s, kind) for s in range(45, 120)
    ]


class Adagrad(LitGPT):
    def configure_optimizers(self):
        return torch.optim.Adagrad(self.parameters(), lr=1e-2)


def failing_loss(module, batch):
    raise KeyError("input_ids")


@pytest.mark.parametrize(
    ("module", "loss_fn", "why"),
    [
        (Adagrad, gpt_loss, "Adagrad is not supported"),
        (LitGPT, failing_loss, "KeyError: 'input_ids'"),
        (LitGPT, lambda module, batch: gpt_loss(module, batch).detach(), "does not require grad"),
    ],
)
def test_what_it_cannot_measure_turns_it_off_with_one_warning_and_the_run_goes_on(tmp_path, module, loss_fn, why):
    monitor = SharpnessMonitor(loss_fn, every_n_steps=1, budget=None)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer = fit(tmp_path, [monitor], module=module(), max_steps=4)
    mine = [str(w.message) for w in seen if "SharpnessMonitor" in str(w.message)]
    assert len(mine) == 1 and "off for the rest of this run" in mine[0] and why in mine[0], mine
    assert trainer.global_step == 4 and monitor.samples == 0 and not logged(tmp_path)


def test_lanczos_on_a_compiled_model_has_no_double_backward_so_it_is_turned_off_and_trains_on(tmp_path):
    module = LitGPT()
    module.model = torch.compile(module.model, backend="aot_eager")
    monitor = SharpnessMonitor(gpt_loss, every_n_steps=1, estimator="exact_lanczos", cadence="fixed", budget=None)
    with pytest.warns(UserWarning, match="SharpnessMonitor is off for the rest of this run: RuntimeError"):
        trainer = fit(tmp_path, [monitor], module=module, max_steps=3)
    assert trainer.global_step == 3 and monitor.off is not None


@pytest.mark.parametrize("estimator", ["finite_difference_lanczos", "secant", "difference", "exact_lanczos"])
def test_bf16_mixed_precision_measures_a_finite_ratio_in_the_training_autocast(tmp_path, estimator):
    monitor = SharpnessMonitor(gpt_loss, every_n_steps=2, estimator=estimator, cadence="fixed", budget=None)
    fit(tmp_path, [monitor], max_steps=5, precision="bf16-mixed")
    values = logged(tmp_path, key_of(estimator))
    assert sorted(values) == [2, 4] and all(math.isfinite(v) for v in values.values())


def test_a_hugging_face_model_held_by_a_lightning_module(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=50, n_positions=16, n_embd=32, n_layer=2, n_head=4)

    class LitHF(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = transformers.GPT2LMHeadModel(config)  # SDPA attention, dropout 0.1

        def training_step(self, batch, batch_idx):
            return hf_loss(self, batch)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def hf_loss(module, batch):
        return module.model(input_ids=batch[0], labels=batch[0]).loss

    monitor, direct = SharpnessMonitor(hf_loss, every_n_steps=2, cadence="fixed", budget=None), Direct(2, hf_loss)
    exact = Direct(2, hf_loss, products="double_backward")
    fit(tmp_path, [monitor, direct, exact], module=LitHF(), max_steps=5)
    values = logged(tmp_path)
    assert sorted(values) == [2, 4] and values == pytest.approx(direct.ratios, rel=1e-6)
    assert values == pytest.approx(exact.ratios, rel=0.05)  # dropout 0.1: one mask for every product


def test_bad_options_are_refused_with_the_value():
    with pytest.raises(ValueError, match="loss_fn must be callable"):
        SharpnessMonitor("loss")
    with pytest.raises(ValueError, match="every_n_steps must be an integer >= 1, got every_n_steps=0"):
        SharpnessMonitor(gpt_loss, every_n_steps=0)
    with pytest.raises(ValueError, match="lanczos_steps"):
        SharpnessMonitor(gpt_loss, lanczos_steps=True)
    with pytest.raises(
        ValueError, match=r"estimator must be one of \('finite_difference_lanczos', 'exact_lanczos', .*got"
    ):
        SharpnessMonitor(gpt_loss, estimator="hutchinson")
    with pytest.raises(ValueError, match=r"cadence must be one of \('adaptive', 'fixed'\), got cadence='dense'"):
        SharpnessMonitor(gpt_loss, cadence="dense")
    with pytest.raises(ValueError, match=r"storage must be one of \('device', 'cpu'\), got storage='gpu'"):
        SharpnessMonitor(gpt_loss, storage="gpu")
    with pytest.raises(ValueError, match="estimator='difference' reads a loss: pass loss_fn"):
        SharpnessMonitor(estimator="difference")
    with pytest.raises(ValueError, match="budget must be None or a fraction of training time in \\(0, 1\\)"):
        SharpnessMonitor(budget=5)


class HandWrittenAttention(nn.Module):
    """Causal attention by hand (its own softmax), the nanoGPT layout."""

    def __init__(self, width: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.c_attn, self.c_proj, self.heads = nn.Linear(width, 3 * width), nn.Linear(width, width), heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2) for t in self.c_attn(x).split(width, 2))
        scores = q @ k.mT / math.sqrt(width // self.heads)
        future = torch.ones(length, length, dtype=torch.bool, device=x.device).triu(1)
        attention = scores.masked_fill(future, float("-inf")).softmax(-1)
        return self.c_proj((attention @ v).transpose(1, 2).reshape(batch, length, width))


class TiedGPT(LitGPT):
    """Hand-written attention and the input embedding tied to the output head, AdamW 1e-2."""

    def __init__(self) -> None:
        super().__init__()
        for block in self.model.blocks:
            block.attn = HandWrittenAttention()
        self.model.head = nn.Linear(32, VOCAB, bias=False)
        self.model.head.weight = self.model.wte.weight

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def test_gradient_differences_read_what_exact_lanczos_reads_with_tied_embeddings(tmp_path):
    """One tensor in two places of the graph: its curvature is read once, as exact Lanczos reads it."""
    monitor = SharpnessMonitor(gpt_loss, every_n_steps=2, cadence="fixed", budget=None)
    exact = Direct(2, products="double_backward")
    fit(tmp_path, [monitor, exact], module=TiedGPT(), max_steps=6)
    values = logged(tmp_path)
    assert sorted(values) == [2, 4] and values == pytest.approx(exact.ratios, rel=0.02)


def test_a_run_with_only_the_sharpness_monitor_sets_how_often_the_optimizer_is_read(tmp_path):
    """The step options are the run's: SharpnessMonitor takes them, and its curvature samples log what they read."""
    options = dict(every_n_steps=2, cadence="fixed", budget=None, estimator="secant")
    fit(tmp_path / "default", [SharpnessMonitor(**options)], AdamGPT())  # the default reads after every 10th step
    fit(tmp_path / "every", [SharpnessMonitor(**options, optimizer_every_n_steps=1)], AdamGPT())
    assert logged(tmp_path / "default", "connmon/update_rms") == {}
    every = logged(tmp_path / "every", "connmon/update_rms")
    assert sorted(every) == sorted(logged(tmp_path / "every", UPDATE)) and len(every) >= 2
    assert all(math.isfinite(value) and value > 0 for value in every.values())


def test_callbacks_that_set_one_step_option_differently_are_told_and_the_first_is_read(tmp_path):
    callbacks = [
        ConnectionMonitor(every_n_steps=2, diagnostics=("walk",), optimizer_every_n_steps=3),
        SharpnessMonitor(every_n_steps=2, estimator="secant", budget=None, optimizer_every_n_steps=1),
    ]
    with pytest.warns(UserWarning, match="optimizer_every_n_steps is set to 3 by ConnectionMonitor and to 1 by Sharp"):
        trainer = fit(tmp_path, callbacks, AdamGPT())
    assert trainer.global_step == 6
    assert set(logged(tmp_path, "connmon/update_rms")) == {4}  # read after step 3, logged at the sample after step 4


@pytest.mark.parametrize("part", ["SharpnessMonitor", "ConnectionMonitor"])
def test_a_checkpoint_saved_after_the_fit_resumes_the_optimizers_state_as_the_uninterrupted_run(tmp_path, part):
    """The optimizer's state read since the last sample rides in the checkpoint, saved during the fit or after it:
    the SharpnessMonitor's in a run without a ConnectionMonitor, else the first ConnectionMonitor's."""
    steps = dict(every_n_steps=4, optimizer_every_n_steps=1)

    def run(folder, max_steps, ckpt_path=None):
        if part == "SharpnessMonitor":
            callback = SharpnessMonitor(**steps, cadence="fixed", budget=None, estimator="secant")
        else:
            callback = ConnectionMonitor(**steps, diagnostics=("walk",))
        trainer = L.Trainer(
            max_steps=max_steps, callbacks=[callback], logger=CSVLogger(folder, name="csv"),
            enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, accelerator="cpu",
            devices=1, log_every_n_steps=1,
        )  # fmt: skip
        trainer.fit(AdamGPT(), loader(), ckpt_path=ckpt_path)
        return trainer

    run(tmp_path / "whole", 10)
    run(tmp_path / "first", 6).save_checkpoint(tmp_path / "at6.ckpt")
    run(tmp_path / "resumed", 10, ckpt_path=str(tmp_path / "at6.ckpt"))
    whole = logged(tmp_path / "whole", "connmon/update_rms")
    assert sorted(whole) == [4, 8] and logged(tmp_path / "resumed", "connmon/update_rms") == {8: whole[8]}
