"""The Hugging Face Trainer callback: a tiny GPT-2 trained by transformers.Trainer on CPU."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from connmon.alerts import AlertRunner, Rule, Threshold  # noqa: E402
from connmon.integrations.transformers import STATE_FILE, ConnectionMonitorCallback  # noqa: E402
from tests.callbacks.wandb_run import history  # noqa: E402


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 64, length: int = 12, vocab: int = 64) -> None:
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, length), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def make_trainer(
    tmp_path, *, monitor: dict | None = None, report_to=(), attn_dropout: float = 0.0, **args
) -> transformers.Trainer:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=attn_dropout,
    )  # fmt: skip
    options = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        max_steps=6,
        logging_steps=2,
        learning_rate=1e-3,
        report_to=list(report_to),
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        data_seed=0,
    )
    options.update(args)
    trainer = transformers.Trainer(
        model=transformers.GPT2LMHeadModel(config),
        args=transformers.TrainingArguments(**options),
        train_dataset=Tokens(),
    )
    if monitor is not None:
        trainer.add_callback(ConnectionMonitorCallback(trainer, **monitor))
    return trainer


def rows(trainer, key: str = "connmon/attention_entropy/L00") -> dict[int, dict]:
    return {row["step"]: row for row in trainer.state.log_history if key in row}


def losses(trainer) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in trainer.state.log_history if "loss" in row}


def test_trainer_logs_every_layer_on_sampled_steps_and_trains_exactly_as_without_it(tmp_path):
    plain = make_trainer(tmp_path / "plain")
    plain.train()
    watched = make_trainer(tmp_path / "watched", monitor={"every_n_steps": 2, "full_every_n_samples": 1})
    watched.train()
    assert losses(watched) == losses(plain)  # same losses, and the loss rows at sampled steps were not swallowed
    assert set(losses(watched)) == {2, 4, 6}
    for a, b in zip(plain.model.parameters(), watched.model.parameters(), strict=True):
        assert torch.equal(a, b)
    sampled = rows(watched)
    # the forwards after 0, 2 and 4 steps, in the rows of the Trainer's steps 1, 3 and 5 (where it logs their losses)
    assert set(sampled) == {1, 3, 5}
    row = sampled[3]
    for name in ("attention_entropy", "head_isometry_gap", "connection_spectral_radius", "time_drift"):
        for layer in ("L00", "L01", "all"):
            assert math.isfinite(row[f"connmon/{name}/{layer}"]), (name, layer)
    assert "connmon/time_drift/L00" not in sampled[1]  # nothing to compare with on the first sample
    callback = next(cb for cb in watched.callback_handler.callbacks if isinstance(cb, ConnectionMonitorCallback))
    assert callback.monitor.samples == 3 and not callback.monitor.is_armed


def test_gradient_accumulation_samples_one_forward_per_optimizer_step(tmp_path):
    seen = []
    options = {"every_n_steps": 1, "diagnostics": ("walk",)}
    trainer = make_trainer(tmp_path, monitor=options, gradient_accumulation_steps=3)
    callback = next(cb for cb in trainer.callback_handler.callbacks if isinstance(cb, ConnectionMonitorCallback))
    sampler = callback.monitor.attention_sampler
    consume = sampler._consume
    sampler._consume = lambda record: (seen.append(record.name), consume(record))
    trainer.train()
    assert set(rows(trainer)) == set(range(1, 7))
    assert len(seen) == 6 * 2  # one forward (two layers) per optimizer step, not one per micro-batch


def test_an_error_alert_stops_training_through_control(tmp_path):
    rule = Rule("any entropy", "connmon/attention_entropy/L00", Threshold(-1.0), level="ERROR")
    trainer = make_trainer(tmp_path, monitor={"every_n_steps": 2, "alerts": AlertRunner([rule], actions=("stop",))})
    trainer.train()
    assert trainer.state.global_step == 1  # the first sample (of the first step's forward) stopped it
    assert rows(trainer)[1]["connmon/alerts/count"] == 1


def test_resume_from_a_checkpoint_restores_cadence_drift_and_alert_state(tmp_path):
    options = {"every_n_steps": 2, "diagnostics": ("walk", "drift"), "alerts": AlertRunner([])}
    first = make_trainer(tmp_path, monitor=options, save_strategy="steps", save_steps=4, max_steps=4)
    first.train()
    assert (tmp_path / "checkpoint-4" / STATE_FILE).is_file()
    resumed = make_trainer(tmp_path, monitor=options, save_strategy="no", max_steps=6)
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-4"))
    callback = next(cb for cb in resumed.callback_handler.callbacks if isinstance(cb, ConnectionMonitorCallback))
    assert callback.monitor.samples == 3  # 2 before the checkpoint, 1 after
    assert "connmon/time_drift/L00" in rows(resumed)[5]  # compared with the sample saved in the checkpoint


@pytest.mark.parametrize("restore_callbacks", [False, True])
def test_resume_from_a_checkpoint_outside_output_dir_reads_its_state(tmp_path, restore_callbacks):
    """The checkpoint's trainer_state.json names the run that saved it: its state is found from another output_dir."""
    options = {"every_n_steps": 2, "diagnostics": ("walk", "drift")}
    first = make_trainer(tmp_path / "first", monitor=options, save_strategy="steps", save_steps=4, max_steps=4)
    first.train()
    saved = json.loads((tmp_path / "first" / "checkpoint-4" / "trainer_state.json").read_text())
    assert saved["stateful_callbacks"]["connmon"] == {"output_dir": str((tmp_path / "first").resolve())}
    resumed = make_trainer(tmp_path / "second", monitor=options, save_strategy="no", max_steps=8,
                           restore_callback_states_from_checkpoint=restore_callbacks)  # fmt: skip
    resumed.train(resume_from_checkpoint=str(tmp_path / "first" / "checkpoint-4"))
    callback = next(cb for cb in resumed.callback_handler.callbacks if isinstance(cb, ConnectionMonitorCallback))
    assert callback.monitor.samples == 4  # 2 before the checkpoint, 2 after
    assert "connmon/time_drift/L00" in rows(resumed)[5]
    assert resumed.state.stateful_callbacks["connmon"] == {"output_dir": str((tmp_path / "second").resolve())}


def test_resuming_without_connmons_state_says_so(tmp_path):
    first = make_trainer(tmp_path / "first", save_strategy="steps", save_steps=4, max_steps=4)  # no monitor
    first.train()
    resumed = make_trainer(tmp_path / "second", monitor={"every_n_steps": 2, "diagnostics": ("walk",)}, max_steps=6)
    with pytest.warns(UserWarning, match="start afresh"):
        resumed.train(resume_from_checkpoint=str(tmp_path / "first" / "checkpoint-4"))


def test_a_probe_is_recorded_exactly_under_dropout_and_training_is_unchanged(tmp_path):
    """Parity with Lightning: GPT-2 with attention dropout, the probe records exactly, training is bitwise equal."""
    probe = {"input_ids": Tokens().ids[:2]}
    plain = make_trainer(tmp_path / "plain", attn_dropout=0.1)
    plain.train()
    watched = make_trainer(tmp_path / "watched", attn_dropout=0.1, monitor={"every_n_steps": 2, "probe": probe})
    watched.train()
    assert losses(watched) == losses(plain)
    for a, b in zip(plain.model.parameters(), watched.model.parameters(), strict=True):
        assert torch.equal(a, b)
    sampled = rows(watched, "connmon/reconstruction_error/all")
    assert set(sampled) == {1, 3, 5}  # the model after 0, 2 and 4 steps, in the rows of the forwards it runs
    assert all(row["connmon/reconstruction_error/all"] < 1e-5 for row in sampled.values())


def test_report_to_wandb_gets_the_keys_histograms_and_figures(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_PROJECT", "connmon-test")
    import wandb

    wandb.teardown()  # W&B reads the environment once per process: make it read WANDB_MODE=offline again
    options = {
        "every_n_steps": 2,
        "full_every_n_samples": 1,
        "figures_every_n_samples": 1,
        "optimizer_every_n_steps": 1,
    }
    trainer = make_trainer(tmp_path, monitor=options, report_to=["wandb"])
    trainer.train()
    run_dir = wandb.run.dir
    wandb.finish()
    from tests.integrations.wandb_read import read_run

    logged = history(read_run(run_dir))
    scalars = [row for row in logged if "train/connmon/attention_entropy/L01" in row]
    assert [row["train/global_step"] for row in scalars] == [1, 3, 5]  # the rows of the forwards read
    keys = set().union(*logged)
    assert "train/connmon/head_isometry_gap_hist/L00._type" in keys
    assert "train/connmon/spectrum_modulus_hist/L01._type" in keys
    assert "train/connmon/figures/spectra._type" in keys
    assert "train/loss" in keys
    # the optimizer's state, read after every step: each sample logs the steps before it (none before the first)
    states = [row["train/connmon/update_rms"] for row in scalars[1:]]
    assert "train/connmon/update_rms" not in scalars[0] and all(0 < value < 10 for value in states)
    assert all(0 <= row["train/connmon/stale_second_moment"] <= 1 for row in scalars[1:])
    from connmon.cli import main

    out = tmp_path / "report"  # connmon report reads the Trainer's train/connmon/... keys at train/global_step
    assert main(["report", str(Path(run_dir).parent), "--out", str(out)]) == 0
    summary = (out / "summary.md").read_text()
    assert "3 samples, steps 1..5" in summary and "latest figure the run itself logged" in summary


@pytest.mark.parametrize("every", [1, 2])
def test_a_forward_that_raises_on_a_sampled_step_leaves_no_hook_and_a_rerun_samples_whole(tmp_path, every):
    trainer = make_trainer(tmp_path, monitor={"every_n_steps": every, "diagnostics": ("walk",)})
    model = trainer.model
    original = model.lm_head.forward
    calls = []

    def broken(hidden):
        calls.append(1)
        if len(calls) == 1:  # the first step's forward, sampled
            raise RuntimeError("out of memory, say")
        return original(hidden)

    model.lm_head.forward = broken  # raises after the attention layers ran, inside the armed forward
    with pytest.raises(RuntimeError, match="out of memory"):
        trainer.train()
    model.lm_head.forward = original
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    trainer.train()  # the user caught it and trains again: the failed sample is gone, every sample is whole
    logged = [row for row in trainer.state.log_history if any(k.startswith("connmon/") and "overhead" not in k
                                                              for k in row)]  # fmt: skip  # not the end's cost row
    layered = rows(trainer)
    assert sorted(layered) == list(range(1, 7, every))
    assert all(row["step"] in layered for row in logged)  # no sample without its layers
    for row in layered.values():
        assert math.isfinite(row["connmon/attention_entropy/L01"]) and row["connmon/reconstruction_error/all"] < 1e-5


def test_rules_see_the_trainers_own_logged_loss(tmp_path):
    seen = []
    rule = Rule("loss seen", "loss", Threshold(-1.0), cooldown=1)
    options = {"every_n_steps": 2, "diagnostics": ("walk",), "alerts": AlertRunner([rule], on_alert=seen.append)}
    trainer = make_trainer(tmp_path, monitor=options, logging_steps=1)
    trainer.train()
    logged = losses(trainer)
    # the sample of the forward after s steps (the Trainer's step s + 1) runs before the Trainer logs that step's
    # loss: the rule sees the row before, step s's loss (none before the first sample)
    assert [(a.step, a.value) for a in seen] == [(s, pytest.approx(logged[s])) for s in (2, 4)]


def test_the_backoff_action_scales_the_trainers_rate_under_its_scheduler_and_logs_it(tmp_path):
    edge = Rule("past the edge of stability", "connmon/max_attention_logit/L*", Threshold(-1.0), cooldown=0)
    alerts = AlertRunner([edge], actions=("backoff",))
    plain = make_trainer(tmp_path / "plain", logging_steps=1)
    plain.train()
    backed = make_trainer(tmp_path / "backed", monitor={"every_n_steps": 2, "diagnostics": ("walk",), "alerts": alerts},
                          logging_steps=1)  # fmt: skip
    backed.train()
    scales = {row["step"]: row["connmon/lr_scale"] for row in backed.state.log_history if "connmon/lr_scale" in row}
    assert scales == {1: 0.5, 3: 0.5, 5: 0.5}  # each sample's alert, in the row of the forward it read
    assert backed.lr_scheduler.get_last_lr() == plain.lr_scheduler.get_last_lr()  # the linear schedule untouched
    # the first sample's alert comes before the first optimizer step, which it scales: the first loss alone is equal
    assert losses(backed)[1] == losses(plain)[1] and losses(backed)[2] != losses(plain)[2]
    assert not backed.optimizer.optimizer._optimizer_step_pre_hooks


def test_the_checkpoint_action_has_the_trainer_save_a_restore_point_that_resumes_bitwise(tmp_path):
    rule = Rule("any logit", "connmon/max_attention_logit/L*", Threshold(-1.0), cooldown=100, since=3)
    options = {"every_n_steps": 2, "diagnostics": ("walk",), "alerts": AlertRunner([rule], actions=("checkpoint",))}
    whole = make_trainer(tmp_path, monitor=options)  # save_strategy="no": only the restore point is saved
    with pytest.warns(UserWarning, match=r"saves a restore point after step 5 \(alert at step \d+\): .*checkpoint-5"):
        whole.train()
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-5"]
    assert (tmp_path / "checkpoint-5" / STATE_FILE).is_file()
    options["alerts"] = AlertRunner([rule], actions=("checkpoint",))
    resumed = make_trainer(tmp_path / "resumed", monitor=options)
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-5"))
    assert resumed.state.global_step == 6 and not (tmp_path / "resumed" / "checkpoint-6").exists()  # in cooldown
    for (name, value), again in zip(whole.model.state_dict().items(), resumed.model.state_dict().values(), strict=True):
        assert torch.equal(value, again), name


def test_a_second_run_in_the_same_output_dir_saves_no_restore_point_over_the_firsts(tmp_path):
    """The Trainer names its own folders: where ``checkpoint-<N>`` holds another run's, no restore point, said once."""
    rule = Rule("any logit", "connmon/max_attention_logit/L*", Threshold(-1.0), cooldown=100, since=3)
    for run in ("first", "second"):
        options = {"every_n_steps": 2, "diagnostics": ("walk",), "alerts": AlertRunner([rule], actions=("checkpoint",))}
        trainer = make_trainer(tmp_path, monitor=options, learning_rate=1e-3 if run == "first" else 3e-3)
        if run == "first":
            trainer.train()
            saved = {p.name: p.read_bytes() for p in (tmp_path / "checkpoint-5").iterdir() if p.is_file()}
            continue
        with pytest.warns(
            UserWarning, match=r"no restore point after step 5 .*checkpoint-5 holds a checkpoint this run"
        ):
            trainer.train()
    assert {p.name: p.read_bytes() for p in (tmp_path / "checkpoint-5").iterdir() if p.is_file()} == saved


def test_connmon_rows_reach_the_log_history_but_not_the_console(tmp_path, capsys):
    from typing import ClassVar

    from transformers import TrainerCallback
    from transformers.trainer_callback import PrinterCallback

    class Reporter(TrainerCallback):  # a reporter (W&B, TensorBoard) gets every row, the Trainer's handler as it was
        rows: ClassVar[list] = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            handler = trainer.callback_handler.callbacks
            self.rows.append((sorted(logs), any(isinstance(each, PrinterCallback) for each in handler)))

    trainer = make_trainer(tmp_path, logging_steps=1)  # disable_tqdm: the PrinterCallback prints every row it gets
    trainer.add_callback(ConnectionMonitorCallback(trainer, every_n_steps=2, diagnostics=("walk",)))
    trainer.add_callback(Reporter())
    trainer.train()
    printed = capsys.readouterr().out
    assert "'loss'" in printed and "connmon/" not in printed  # the Trainer's own rows still print
    assert any("connmon/attention_entropy/all" in row for row in trainer.state.log_history)
    connmon_rows = [row for row in trainer.state.log_history if "connmon/attention_entropy/all" in row]
    assert all(row["step"] in (1, 3, 5) and "epoch" in row for row in connmon_rows) and len(connmon_rows) == 3
    assert sum("connmon/attention_entropy/all" in keys for keys, _ in Reporter.rows) == 3
    assert all(printer_listed for _, printer_listed in Reporter.rows)  # the Trainer's handler is never edited


def test_qk_clip_runs_after_every_optimizer_step_the_last_too_and_a_resumed_run_clips_as_the_uninterrupted(tmp_path):
    from connmon.alerts import QKClip

    def clipping(folder, max_steps, **args):
        clip = QKClip(threshold=0.3)
        runner = AlertRunner([], actions=("qk_clip",), qk_clip=clip)
        monitor = {"every_n_steps": 100, "diagnostics": ("walk",), "alerts": runner}
        trainer = make_trainer(folder, monitor=monitor, max_steps=max_steps, learning_rate=3e-2,
                               lr_scheduler_type="constant", **args)  # fmt: skip
        applied = []
        apply = clip.apply
        clip.apply = lambda *a, **k: applied.append(trainer.state.global_step) or apply(*a, **k)
        return trainer, clip, applied

    whole, whole_clip, applied = clipping(tmp_path / "whole", 6)
    whole.train()
    assert applied == [0, 1, 2, 3, 4, 5]  # right after each optimizer step, before the Trainer counts it
    first, _, _ = clipping(tmp_path / "first", 3, save_strategy="steps", save_steps=3)
    first.train()
    resumed, resumed_clip, _ = clipping(tmp_path / "resumed", 6)
    resumed.train(resume_from_checkpoint=str(tmp_path / "first" / "checkpoint-3"))
    assert resumed_clip.clipped == whole_clip.clipped > 0
    for a, b in zip(whole.model.parameters(), resumed.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)  # HF's resume reloads the RNG and data order


def ddp_worker(rank: int, port: int, out: str) -> None:
    """The Trainer under DDP on 2 gloo processes (as torchrun starts it): each process's rows, alerts and weights."""
    import os

    from tests.gloo import leave

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2")  # fmt: skip
    seen = []
    rules = [Rule("loss seen", "loss", Threshold(-1.0), cooldown=1)]
    alerts = AlertRunner(rules, actions=(), on_alert=lambda alert: seen.append((alert.step, alert.value)))
    monitor = {"every_n_steps": 2, "diagnostics": ("walk", "transport"), "alerts": alerts, "optimizer_every_n_steps": 1}
    trainer = make_trainer(Path(out) / "run", monitor=monitor, logging_steps=1, ddp_backend="gloo", max_steps=5)
    trainer.train()
    weights = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
    with open(os.path.join(out, f"rank{rank}.json"), "w") as file:
        json.dump({"rows": rows(trainer), "losses": losses(trainer), "alerts": seen, "weights": weights.tolist()}, file)
    leave()


@pytest.mark.distributed
def test_under_ddp_every_process_samples_the_same_forwards_logs_the_same_rows_and_decides_alike(tmp_path):
    from tests.gloo import free_port, spawn

    spawn(ddp_worker, args=(free_port(), str(tmp_path)), nprocs=2, timeout=300)
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert ranks[0]["weights"] == ranks[1]["weights"] and ranks[0]["losses"] == ranks[1]["losses"]
    assert set(ranks[0]["rows"]) == {"1", "3", "5"}  # the forwards after 0, 2 and 4 steps, in their loss rows
    for step, row in ranks[0]["rows"].items():  # synced: every process logs the values of both processes' batches
        other = ranks[1]["rows"][step]
        assert {k: v for k, v in row.items() if "overhead" not in k} == {
            k: v for k, v in other.items() if "overhead" not in k
        }
        assert ("connmon/update_rms" in row) == (step != "1")  # the optimizer's state after every step before it
    # the rules of the samples after 2 and 4 steps see the Trainer's latest row, its mean loss over both processes
    assert ranks[0]["alerts"] == ranks[1]["alerts"] == [[step, ranks[0]["losses"][str(step)]] for step in (2, 4)]
