import csv
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from connmon._cost import total_fraction
from connmon.callbacks import ConnectionMonitor
from tests.callbacks.lightning_models import LitGPT, loader
from tests.callbacks.wandb_run import finish_and_read, history, offline_logger


def trainer(tmp_path, monitor, max_steps=6, logger="csv", **kwargs):
    if logger == "csv":
        logger = CSVLogger(tmp_path, name="csv")
    elif logger is None:
        logger = False
    return L.Trainer(
        max_steps=max_steps, callbacks=[monitor], logger=logger, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, accelerator="cpu", devices=1, log_every_n_steps=1, **kwargs,
    )  # fmt: skip


def read_csv(tmp_path):
    path = next(Path(tmp_path).rglob("metrics.csv"))
    rows = list(csv.DictReader(path.open()))
    return [{k: v for k, v in row.items() if v != ""} for row in rows]


def sample_rows(tmp_path):
    """The rows of connmon's samples: the run's end logs one more, of what connmon cost (``connmon/overhead...``)."""
    return [row for row in read_csv(tmp_path) if any(k.startswith("connmon/") and "overhead" not in k for k in row)]


class HookSpy(L.Callback):
    """Counts forward hooks on the attention modules at the start of every batch (before the monitor arms)."""

    def __init__(self):
        self.counts = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.counts.append(sum(len(b.attn._forward_pre_hooks) for b in pl_module.model.blocks))


def test_logs_every_metric_per_layer_at_sampled_steps_and_arms_only_then(tmp_path):
    monitor = ConnectionMonitor(every_n_steps=2, figures_every_n_samples=None)
    spy = HookSpy()
    model = LitGPT()
    t = L.Trainer(
        max_steps=6, callbacks=[spy, monitor], logger=CSVLogger(tmp_path, name="csv"), enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, accelerator="cpu", devices=1,
    )  # fmt: skip
    t.fit(model, loader())
    rows = sample_rows(tmp_path)
    assert [int(row["step"]) for row in rows] == [0, 2, 4]
    keys = set().union(*rows)
    for metric in ("attention_entropy", "ov_isometry_gap", "connection_spectral_radius", "depth_drift"):
        assert {f"connmon/{metric}/L00", f"connmon/{metric}/all"} <= keys or metric == "depth_drift"
    assert "connmon/depth_drift/L01" in keys and "connmon/depth_drift/L00" not in keys
    assert "connmon/time_drift/L00" in rows[1] and "connmon/time_drift/L00" not in rows[0]
    assert all(float(rows[0][f"connmon/reconstruction_error/L0{i}"]) < 1e-5 for i in range(2))
    assert spy.counts == [0] * 6  # hooks never outlive a sampled step
    assert all(len(b.attn._forward_hooks) == 0 for b in model.model.blocks)
    assert monitor.samples == 3


def test_costly_diagnostics_run_on_every_full_sample_and_the_rest_on_every_sample(tmp_path):
    monitor = ConnectionMonitor(every_n_steps=1, full_every_n_samples=2, figures_every_n_samples=None)
    trainer(tmp_path, monitor, max_steps=5).fit(LitGPT(), loader())
    rows = {int(row["step"]): row for row in read_csv(tmp_path) if "connmon/attention_entropy/all" in row}
    assert sorted(rows) == [0, 1, 2, 3, 4]
    for step, row in rows.items():
        full = step % 2 == 0
        assert ("connmon/connection_spectral_radius/L01" in row) == full
        assert ("connmon/edge_isometry_gap/L01" in row) == full
        assert {"connmon/head_isometry_gap/L01", "connmon/depth_drift/L01", "connmon/walk_spectral_gap/L00"} <= set(row)
    with pytest.raises(ValueError, match="full_every_n_samples"):
        ConnectionMonitor(full_every_n_samples=0)


def test_gradient_accumulation_samples_once_per_optimizer_step(tmp_path):
    monitor = ConnectionMonitor(every_n_steps=1, diagnostics=("walk",), figures_every_n_samples=None)
    t = trainer(tmp_path, monitor, max_steps=3, accumulate_grad_batches=2)
    t.fit(LitGPT(), loader())
    rows = [row for row in read_csv(tmp_path) if "connmon/attention_entropy/all" in row]
    assert [int(row["step"]) for row in rows] == [0, 1, 2] and monitor.samples == 3


def test_probe_runs_in_eval_mode_and_restores_training(tmp_path):
    probe = next(iter(loader(seed=1)))[0]
    monitor = ConnectionMonitor(every_n_steps=2, probe=probe, diagnostics=("walk", "drift"), layers=[1])
    model = LitGPT()
    trainer(tmp_path, monitor).fit(model, loader())
    assert all(model.modes)  # every training step ran in train mode
    sampled = [row for row in read_csv(tmp_path) if "connmon/stochasticity_gap/L01" in row]
    assert [int(row["step"]) for row in sampled] == [2, 4, 6]  # the model after 2, 4, 6 optimizer steps
    rows = [row for row in read_csv(tmp_path) if "connmon/time_drift/L01" in row]
    assert [int(row["step"]) for row in rows] == [4, 6]  # time drift needs a previous sample
    keys = set().union(*read_csv(tmp_path))
    assert not any("/L00" in key for key in keys)  # layers=[1] only


class FrozenFirstBlock(LitGPT):
    """Keeps its first block in eval mode, as users freeze a pretrained part."""

    def on_train_start(self):
        self.model.blocks[0].eval()

    def training_step(self, batch, batch_idx):
        self.modes.append(self.model.blocks[0].training)
        return super().training_step(batch, batch_idx)


def test_probe_restores_the_mode_of_every_submodule(tmp_path):
    monitor = ConnectionMonitor(every_n_steps=2, probe=next(iter(loader(seed=1)))[0], diagnostics=("walk",))
    model = FrozenFirstBlock()
    trainer(tmp_path, monitor).fit(model, loader())
    assert monitor.samples == 3
    assert model.modes[0::2] == [False] * 6  # the frozen block stayed in eval mode after every probe
    assert all(model.modes[1::2])  # and the module itself in train mode


def test_layers_by_regex(tmp_path):
    monitor = ConnectionMonitor(every_n_steps=4, layers=r"blocks\.0\.", diagnostics=("transport",))
    trainer(tmp_path, monitor, max_steps=2).fit(LitGPT(), loader())
    keys = set().union(*read_csv(tmp_path))
    assert "connmon/ov_isometry_gap/L00" in keys and "connmon/ov_isometry_gap/L01" not in keys


def test_resume_continues_cadence_and_time_drift(tmp_path):
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
    monitor = ConnectionMonitor(every_n_steps=2, diagnostics=("drift",), probe=next(iter(loader(seed=2)))[0])
    t = L.Trainer(
        max_steps=3, callbacks=[monitor, checkpoint], logger=False, enable_progress_bar=False, accelerator="cpu",
        enable_model_summary=False,
    )  # fmt: skip
    t.fit(LitGPT(), loader())
    assert monitor.samples == 1  # probe mode: after optimizer step 2
    state = t.checkpoint_callback.best_model_path or str(next((tmp_path / "ckpt").glob("*.ckpt")))
    resumed = ConnectionMonitor(every_n_steps=2, diagnostics=("drift",), probe=monitor.options.probe)
    t2 = trainer(tmp_path / "resumed", resumed, max_steps=5)
    t2.fit(LitGPT(), loader(), ckpt_path=state)
    assert resumed.samples == 2  # 2 before the checkpoint (restored), 4 after
    rows = [row for row in read_csv(tmp_path / "resumed") if "connmon/time_drift/all" in row]
    assert [int(row["step"]) for row in rows] == [4]  # compared with the step-2 sample saved in the checkpoint


def test_configuration_errors_name_the_value():
    with pytest.raises(ValueError, match="every_n_steps must be an integer >= 1, got every_n_steps=0"):
        ConnectionMonitor(every_n_steps=0)
    with pytest.raises(ValueError, match=r"diagnostics must be a non-empty subset of .*got diagnostics=\('walks',\)"):
        ConnectionMonitor(diagnostics=("walks",))
    with pytest.raises(ValueError, match="not a valid regular expression"):
        ConnectionMonitor(layers="blocks[")
    with pytest.raises(ValueError, match="probe_fn needs a probe batch"):
        ConnectionMonitor(probe_fn=lambda m, p: None)


class NoAttention(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_model_without_attention_warns_and_trains(tmp_path):
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=2)
    t = trainer(tmp_path, ConnectionMonitor(every_n_steps=1), max_steps=2)
    with pytest.warns(UserWarning, match="ConnectionMonitor is off for this run: connmon found no self-attention"):
        t.fit(NoAttention(), data)
    assert t.global_step == 2


def test_no_logger_is_reported_once(tmp_path):
    with pytest.warns(UserWarning, match="no logger is attached"):
        trainer(tmp_path, ConnectionMonitor(every_n_steps=1), max_steps=1, logger=None).fit(LitGPT(), loader())


def test_wandb_offline_run_has_connmon_scalars_and_histograms(tmp_path, monkeypatch):
    logger = offline_logger(tmp_path, monkeypatch)
    monitor = ConnectionMonitor(every_n_steps=2, figures_every_n_samples=1)
    csv_logger = CSVLogger(tmp_path, name="csv")
    trainer(tmp_path, monitor, max_steps=4, logger=[logger, csv_logger]).fit(LitGPT(), loader())
    items = history(finish_and_read(logger))
    logged = {int(row["step"]): row for row in read_csv(tmp_path) if "connmon/attention_entropy/L00" in row}
    for item in items:  # the values W&B holds are the ones the CSV logger wrote in the same run
        if "connmon/attention_entropy/L00" in item:
            row = logged[int(item["trainer/global_step"])]
            for key in (
                "connmon/attention_entropy/L00",
                "connmon/head_isometry_gap/all",
                "connmon/stochasticity_gap/L01",
            ):
                assert item[key] == pytest.approx(float(row[key]), rel=1e-6), key
    keys = set().union(*items)
    assert "connmon/attention_entropy/L00" in keys and "connmon/connection_spectral_radius/all" in keys
    assert "connmon/head_isometry_gap_hist/L01._type" in keys
    assert "connmon/spectrum_modulus_hist/L00._type" in keys
    assert any(key.startswith("connmon/figures/spectra") for key in keys)
    steps = sorted({item["trainer/global_step"] for item in items if "connmon/attention_entropy/L00" in item})
    assert steps == [0, 2]


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("every_n_steps", "10", "every_n_steps must be an integer >= 1, got every_n_steps='10'"),
        ("every_n_steps", 2.5, "every_n_steps must be an integer >= 1, got every_n_steps=2.5"),
        ("every_n_steps", True, "every_n_steps must be an integer >= 1, got every_n_steps=True"),
        ("layers", 0, "layers must be None .*got layers=0"),
        ("edge_samples", 0, "edge_samples must be an integer >= 1 or None, got edge_samples=0"),
        ("max_tokens", 0, "max_tokens must be an integer >= 1 or None"),
        ("diagnostics", "walks", r"diagnostics must be a non-empty subset"),
        ("log_histograms", "yes", "log_histograms must be True or False"),
    ],
)
def test_every_option_is_checked_in_init(option, value, message):
    with pytest.raises(ValueError, match=message):
        ConnectionMonitor(**{option: value})


def test_a_single_diagnostic_group_may_be_named_as_a_string():
    assert ConnectionMonitor(diagnostics="walk").options.diagnostics == ("walk",)


class StepSpy(L.Callback):
    def __init__(self):
        self.steps = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.steps.append(trainer.global_step)


def test_samples_follow_lightnings_optimizer_steps_under_partial_accumulation(tmp_path):
    # 14 batches an epoch, accumulate 4: Lightning also steps on each epoch's last (partial) group
    data = loader(batch_size=4)
    data = torch.utils.data.DataLoader(torch.utils.data.Subset(data.dataset, range(56)), batch_size=4)
    monitor = ConnectionMonitor(every_n_steps=3, diagnostics=("walk",), probe=torch.randint(0, 50, (2, 12)))
    spy = StepSpy()
    t = trainer(tmp_path, monitor, max_steps=16, accumulate_grad_batches=4)
    t.callbacks.append(spy)
    t.fit(LitGPT(), data)
    rows = [row for row in read_csv(tmp_path) if "connmon/attention_entropy/all" in row]
    assert [int(row["step"]) for row in rows] == [3, 6, 9, 12, 15]
    training = ConnectionMonitor(every_n_steps=3, diagnostics=("walk",))  # training-forward mode: first micro-batch
    t2 = trainer(tmp_path / "train", training, max_steps=16, accumulate_grad_batches=4)
    t2.fit(LitGPT(), data)
    rows = [row for row in read_csv(tmp_path / "train") if "connmon/attention_entropy/all" in row]
    assert [int(row["step"]) for row in rows] == [0, 3, 6, 9, 12, 15]


def test_two_monitors_coexist_and_checkpoint_apart(tmp_path):
    walk = ConnectionMonitor(every_n_steps=2, diagnostics=("walk",))
    drift = ConnectionMonitor(every_n_steps=3, diagnostics=("drift",), layers=[1])
    assert walk.state_key != drift.state_key
    t = trainer(tmp_path, walk, max_steps=4)
    t.callbacks.append(drift)
    t.fit(LitGPT(), loader())
    assert (walk.samples, drift.samples) == (2, 2)
    rows = read_csv(tmp_path)
    assert any("connmon/attention_entropy/L00" in r for r in rows) and any("connmon/time_drift/L01" in r for r in rows)


def test_validate_keeps_training_state_and_a_reused_monitor_starts_afresh(tmp_path):
    probe = torch.randint(0, 50, (2, 12))
    monitor = ConnectionMonitor(every_n_steps=2, diagnostics=("drift",), probe=probe)
    model = LitGPT()
    model.validation_step = lambda batch, batch_idx: None
    t = trainer(tmp_path, monitor, max_steps=4)
    t.fit(model, loader())
    before = monitor.state_dict()
    t.validate(model, loader())
    after = monitor.state_dict()
    assert after["samples"] == before["samples"] == 2
    assert after["drift"] is not None and after["drift"].keys() == before["drift"].keys()
    t2 = trainer(tmp_path / "again", monitor, max_steps=2)
    t2.fit(LitGPT(), loader())
    rows = sample_rows(tmp_path / "again")
    assert [int(row["step"]) for row in rows] == [2]  # probe mode samples after step 2; step 0 is not skipped...
    assert monitor.samples == 1  # ...and the count restarted
    assert "connmon/time_drift/all" not in rows[0]  # no comparison with the previous run's sample


def test_a_non_finite_layer_is_logged_as_nan_and_poisons_the_mean(tmp_path):
    model = LitGPT()
    with torch.no_grad():
        model.model.blocks[1].attn.c_attn.weight.fill_(float("nan"))
    monitor = ConnectionMonitor(every_n_steps=1, diagnostics=("walk",))
    with pytest.warns(UserWarning, match=r"non-finite attention, input or output in model\.blocks\.1\.attn"):
        trainer(tmp_path, monitor, max_steps=1).fit(model, loader())
    (row,) = sample_rows(tmp_path)
    assert row["connmon/attention_entropy/L01"] == "nan" and row["connmon/attention_entropy/all"] == "nan"
    assert float(row["connmon/attention_entropy/L00"]) > 0


def test_bf16_mixed_precision_trains_as_without_the_monitor(tmp_path):
    runs = []
    for callbacks in ([], [ConnectionMonitor(every_n_steps=2, figures_every_n_samples=None)]):
        model = LitGPT()
        t = L.Trainer(
            max_steps=4, callbacks=callbacks, logger=CSVLogger(tmp_path / str(len(runs)), name="csv"),
            precision="bf16-mixed", enable_progress_bar=False, enable_model_summary=False,
            enable_checkpointing=False, accelerator="cpu", devices=1, log_every_n_steps=1,
        )  # fmt: skip
        t.fit(model, loader())
        runs.append(model)
    for a, b in zip(runs[0].parameters(), runs[1].parameters(), strict=True):
        assert torch.equal(a, b)
    rows = [row for row in read_csv(tmp_path / "1") if "connmon/reconstruction_error/all" in row]
    assert [int(row["step"]) for row in rows] == [0, 2]
    assert all(float(row["connmon/reconstruction_error/all"]) < 5e-2 for row in rows)  # bf16 module arithmetic


def test_each_sample_logs_the_monitor_cost_beside_the_sharpness_monitor_and_the_fit_says_it(tmp_path, caplog):
    from connmon.callbacks import SharpnessMonitor

    def loss_fn(module, batch):
        return torch.nn.functional.cross_entropy(module(batch[0]).flatten(0, 1), batch[1].flatten())

    monitor = ConnectionMonitor(every_n_steps=2, diagnostics=("walk",), figures_every_n_samples=None, budget=0.5)
    sharpness = SharpnessMonitor(loss_fn, every_n_steps=3, cadence="fixed", budget=None)
    t = L.Trainer(
        max_steps=7, callbacks=[monitor, sharpness], logger=CSVLogger(tmp_path, name="csv"), enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, accelerator="cpu", devices=1,
    )  # fmt: skip
    with caplog.at_level("INFO"):
        t.fit(LitGPT(), loader())
    rows = read_csv(tmp_path)
    attention = {
        int(r["step"]): float(r["connmon/overhead/attention"]) for r in rows if "connmon/overhead/attention" in r
    }
    curvature = {
        int(r["step"]): float(r["connmon/overhead/curvature"]) for r in rows if "connmon/overhead/curvature" in r
    }
    # step 0's sample has no training time to compare with yet: its cost is logged from step 2 on, and once more at
    # the fit's end (step 7)
    assert sorted(attention) == [2, 4, 6, 7] and sorted(curvature) == [3, 6, 7]
    assert "connmon/attention_entropy/L00" in next(r for r in rows if r["step"] == "0")
    total = {int(r["step"]): float(r["connmon/overhead"]) for r in rows if "connmon/overhead" in r}
    assert total[6] > 0 and sorted(total) == [2, 3, 4, 6, 7]
    assert total[7] == pytest.approx(attention[7] + curvature[7], rel=0.05)  # one base: the shares add up
    assert all(0 < value < 100 for value in (*attention.values(), *curvature.values()))
    (said,) = [r.getMessage() for r in caplog.records if "% of training time" in r.getMessage()]  # one line
    assert said.startswith("connmon: ConnectionMonitor cost ") and "attention " in said and "curvature " in said
    a, c = monitor.sampler.clock, sharpness.sampler.clock  # one base: each excludes both monitors' time
    apart = abs(a._started - c._started) + abs(a._stopped - c._stopped)  # the two clocks' hooks, microseconds apart
    assert abs(a.training - c.training) <= apart + 1e-9 and c.spent > 10 * apart
    assert (a.others, c.others) == (c.spent, a.spent)  # each clock's training time leaves out the other's time whole
    assert total_fraction(a) == pytest.approx((a.spent + c.spent) / a.training)  # connmon/overhead: both, one base


def test_state_saved_with_torch_save_round_trips_through_weights_only_load_into_a_fresh_callback(tmp_path):
    """The max logits not logged yet (the step being read, the window, the running maxima) survive a fresh callback."""
    monitor = ConnectionMonitor(every_n_steps=4, diagnostics=("walk",), logit_every_n_steps=1)
    trainer(tmp_path, monitor, max_steps=3, logger=None).fit(LitGPT(), loader())
    saved = monitor.state_dict()
    assert saved["logits"]["window"] is not None and saved["logits"]["step"] == 2
    torch.save(saved, tmp_path / "state.pt")
    fresh = ConnectionMonitor(every_n_steps=4, diagnostics=("walk",), logit_every_n_steps=1)
    fresh.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    assert fresh.state_dict() == saved


class AdamGPT(LitGPT):
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def test_the_optimizers_state_is_read_after_every_step_and_logged_at_each_sample(tmp_path):
    """Lightning steps the optimizer in a closure: the monitor's post-hook still reads its state after every step,
    and each sample logs the largest of each signal since the previous one."""
    from connmon.curvature.optimizer_state import optimizer_signals

    seen: list[dict[str, float]] = []

    class Recorder(L.Callback):
        def on_train_start(self, trainer, pl_module):
            optimizer = trainer.optimizers[0]
            optimizer.register_step_post_hook(lambda *_: seen.append(optimizer_signals(optimizer)))

    monitor = ConnectionMonitor(every_n_steps=3, diagnostics=("walk",), optimizer_every_n_steps=1)
    run = L.Trainer(
        max_steps=5, callbacks=[monitor, Recorder()], logger=CSVLogger(tmp_path, name="csv"), enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, accelerator="cpu", devices=1, log_every_n_steps=1,
    )  # fmt: skip
    run.fit(AdamGPT(), loader())
    rows = {int(row["step"]): row for row in read_csv(tmp_path) if row.get("connmon/update_rms")}
    # a sample ends before its batch's optimizer step, as in every entry point: step 0's has no step before it
    assert sorted(rows) == [3]
    for name in ("update_rms", "stale_second_moment", "update_to_weight"):
        assert float(rows[3][f"connmon/{name}"]) == pytest.approx(max(v[name] for v in seen[0:3]), rel=1e-5)


def test_two_monitors_compose_into_one_run_whose_rules_see_both(tmp_path):
    """No elected hub: the run's rules see the values of every ConnectionMonitor, each on its own cadence."""
    from connmon.alerts import Rule, Threshold
    from connmon.callbacks import DriftAlert

    seen = []
    walk = ConnectionMonitor(every_n_steps=2, diagnostics=("walk",))
    drift = ConnectionMonitor(every_n_steps=3, diagnostics=("drift",), layers=[1])
    rules = [Rule("entropy seen", "connmon/attention_entropy/all", Threshold(-1.0), cooldown=1),
             Rule("drift seen", "connmon/time_drift/L01", Threshold(-1.0), cooldown=1)]  # fmt: skip
    alert = DriftAlert(rules, actions=(), on_alert=lambda a: seen.append((a.rule, a.step)))
    t = trainer(tmp_path, walk, max_steps=7)
    t.callbacks += [drift, alert]
    t.fit(LitGPT(), loader())
    assert sorted(seen) == [("drift seen", 3), ("drift seen", 6), ("entropy seen", 0), ("entropy seen", 2),
                            ("entropy seen", 4), ("entropy seen", 6)]  # fmt: skip
    assert (walk.samples, drift.samples) == (4, 3)


def test_a_compiled_part_is_read_beside_its_graph_and_trains_bitwise_as_without_the_monitor(tmp_path):
    """A LightningModule holding ``torch.compile(model)``: no hook enters the graph (as in a plain loop)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: a compiled reduction may split differently from run to run with several
    try:
        runs = []
        for watched in (False, True):
            module = LitGPT()
            module.model = torch.compile(module.model, backend="aot_eager")
            monitor = ConnectionMonitor(every_n_steps=2, diagnostics=("walk",), figures_every_n_samples=None)
            t = trainer(tmp_path / str(watched), monitor, max_steps=4)
            if not watched:
                t.callbacks.remove(monitor)
            t.fit(module, loader())
            runs.append((module, monitor))
    finally:
        torch.set_num_threads(threads)
    (plain, _), (module, monitor) = runs
    for a, b in zip(plain.parameters(), module.parameters(), strict=True):
        assert torch.equal(a, b)
    assert monitor.samples == 2
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in module.modules())
    rows = [row for row in read_csv(tmp_path / "True") if "connmon/reconstruction_error/all" in row]
    assert [int(row["step"]) for row in rows] == [0, 2]
    assert all(float(row["connmon/reconstruction_error/all"]) < 1e-5 for row in rows)
