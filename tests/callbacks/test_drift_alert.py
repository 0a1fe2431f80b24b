import json
import os
import re
import warnings

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from connmon.alerts import AllOf, NonFinite, Rule, Threshold, default_rules
from connmon.callbacks import ConnectionMonitor, DriftAlert
from tests.callbacks.lightning_models import LitGPT, loader
from tests.callbacks.test_connection_monitor import read_csv
from tests.callbacks.wandb_run import finish_and_read, history, offline_logger

LOGIT = "connmon/max_attention_logit/L*"


def fit(tmp_path, callbacks, max_steps=6, logger="csv", ckpt_path=None, extra=(), module=None, data=None):
    logger = CSVLogger(tmp_path, name="csv") if logger == "csv" else logger
    trainer = L.Trainer(
        max_steps=max_steps, callbacks=[*callbacks, *extra], logger=logger, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=bool(extra), accelerator="cpu", devices=1, log_every_n_steps=1,
    )  # fmt: skip
    trainer.fit(module or LitGPT(), data or loader(), ckpt_path=ckpt_path)
    return trainer


def monitor(**kwargs):
    return ConnectionMonitor(every_n_steps=1, diagnostics=("walk",), figures_every_n_samples=None, **kwargs)


def test_an_error_level_alert_warns_with_its_evidence_counts_and_stops_the_run(tmp_path):
    seen = []
    rule = Rule("logit above -1", LOGIT, Threshold(-1.0), level="ERROR")
    alert = DriftAlert(rules=[rule], on_alert=seen.append)
    evidence = r"connmon: logit above -1 \[ERROR\]: connmon/max_attention_logit/L00 = .* at step 0"
    with pytest.warns(UserWarning, match=evidence):
        trainer = fit(tmp_path, [monitor(), alert])
    assert trainer.global_step == 1  # stopped after the first sampled step, not at max_steps=6
    assert [(a.rule, a.key, a.step) for a in seen] == [("logit above -1", "connmon/max_attention_logit/L00", 0)]
    assert seen[0].value > -1.0 and alert.total == 1
    rows = [row for row in read_csv(tmp_path) if "connmon/alerts/count" in row]
    assert [(int(r["step"]), float(r["connmon/alerts/count"]), float(r["connmon/alerts/total"])) for r in rows] == [
        (0, 1.0, 1.0)
    ]


def test_warn_level_alerts_respect_the_cooldown_across_layers_and_do_not_stop(tmp_path):
    alert = DriftAlert(rules=[Rule("any logit", LOGIT, Threshold(-1.0), cooldown=2)], actions=("stop",))
    trainer = fit(tmp_path, [alert, monitor()])  # listed before the monitor: it listens, order does not matter
    assert trainer.global_step == 6
    assert [(a.step, a.key) for a in alert.alerts] == [(s, "connmon/max_attention_logit/L00") for s in (0, 2, 4)]
    rows = {int(r["step"]): float(r["connmon/alerts/count"]) for r in read_csv(tmp_path) if "connmon/alerts/count" in r}
    assert rows == {0: 1, 1: 0, 2: 1, 3: 0, 4: 1, 5: 0}


def test_a_resumed_run_keeps_the_cooldown_and_the_count(tmp_path):
    rule = Rule("any logit", LOGIT, Threshold(-1.0), cooldown=100)
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
    first = DriftAlert(rules=[rule], actions=())
    fit(tmp_path / "a", [monitor(), first], max_steps=3, extra=[checkpoint])
    assert first.total == 1
    path = str(next((tmp_path / "ckpt").glob("*.ckpt")))
    resumed = DriftAlert(rules=[rule], actions=())
    fit(tmp_path / "b", [monitor(), resumed], max_steps=6, ckpt_path=path)
    assert resumed.total == 1 and list(resumed.alerts) == []  # no new alert: still in the cooldown from step 0
    forgetful = DriftAlert(rules=[rule], actions=())
    forgetful.load_state_dict = lambda state: None  # the control: the same resume without the saved state
    fit(tmp_path / "c", [monitor(), forgetful], max_steps=6, ckpt_path=path)
    assert [a.step for a in forgetful.alerts] == [3]  # it alerts again at once


def test_wandb_offline_run_records_the_alert(tmp_path, monkeypatch):
    logger = offline_logger(tmp_path, monkeypatch)
    alert = DriftAlert(rules=[Rule("any logit", LOGIT, Threshold(-1.0), cooldown=100)], actions=("wandb",))
    fit(tmp_path, [monitor(), alert], max_steps=2, logger=logger)
    records = finish_and_read(logger)
    alerts = [r for r in records if r.get("type") == "alert" or "alert" in r]
    assert alerts, sorted({r.get("type") for r in records})
    text = json.dumps(alerts)
    assert "connmon: any logit" in text and "connmon/max_attention_logit/L00" in text
    assert any(item.get("connmon/alerts/total") == 1 for item in history(records))


def test_without_a_monitor_it_warns_and_the_run_goes_on(tmp_path):
    with pytest.warns(UserWarning, match="has none: add one"):
        trainer = fit(tmp_path, [DriftAlert()], max_steps=2)
    assert trainer.global_step == 2


def test_a_non_finite_forward_raises_the_default_critical_alert(tmp_path):
    class NaNGPT(LitGPT):
        def on_train_batch_start(self, batch, batch_idx):
            if batch_idx == 2:  # the weights blow up before step 2's forward
                self.model.blocks[0].attn.c_attn.weight.data.fill_(float("nan"))

    alert = DriftAlert(actions=("stop",))
    trainer = L.Trainer(
        max_steps=6, callbacks=[monitor(), alert], logger=False, enable_progress_bar=False, accelerator="cpu",
        enable_model_summary=False, enable_checkpointing=False,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the NaN loss makes Lightning and the capture warn too
        trainer.fit(NaNGPT(), loader())
    assert [(a.rule, a.step, a.level) for a in alert.alerts][:1] == [("non-finite attention", 2, "ERROR")]
    assert trainer.global_step == 3  # stopped at the sampled step that saw it


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"actions": ("email",)}, "actions"),
        ({"stop_level": "FATAL"}, "stop_level"),
        ({"rules": [Rule("a", "*", NonFinite()), Rule("a", "*", NonFinite())]}, "unique"),
        ({"rules": [default_rules]}, r"rules\[0\] must be .* \(the function default_rules itself: call it"),
        ({"rules": [default_rules()]}, r"rules\[0\] must be .* \(a list inside the list: unpack it"),
        ({"rules": "edge"}, r"rules must be a list of connmon.alerts.Rule or AllOf objects, got rules='edge'"),
        ({"history": 2.5}, r"history must be an integer >= 0, got history=2.5"),
        ({"history": -1}, r"history must be an integer >= 0, got history=-1"),
        ({"wait_duration": "5m"}, r"wait_duration must be a number >= 0, got wait_duration='5m'"),
        ({"on_alert": "print"}, r"on_alert must be callable as on_alert\(alert\) or None, got on_alert='print'"),
        ({"actions": "log"}, r"actions must be a list or tuple of"),
    ],
)
def test_bad_configuration_raises_in_init(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DriftAlert(**kwargs)


def test_an_on_alert_handler_that_raises_does_not_end_the_run(tmp_path):
    def handler(alert):
        raise RuntimeError("pager down")

    alert = DriftAlert(rules=[Rule("any logit", LOGIT, Threshold(-1.0))], actions=(), on_alert=handler)
    with pytest.warns(UserWarning, match="on_alert raised RuntimeError: pager down"):
        trainer = fit(tmp_path, [monitor(), alert], max_steps=2)
    assert trainer.global_step == 2 and alert.total == 1


class LoggingGPT(LitGPT):
    """Logs its loss with self.log, as users do."""

    def __init__(self) -> None:
        super().__init__()
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss)
        self.losses.append(loss.item())
        return loss


def test_rules_see_the_modules_own_logged_values_beside_connmons(tmp_path):
    seen = []
    rules = [Rule("loss seen", "train_loss", Threshold(-1.0), cooldown=1), Rule("logit", LOGIT, Threshold(-1.0))]
    alert = DriftAlert(rules=rules, actions=(), on_alert=seen.append)
    module = LoggingGPT()
    fit(tmp_path, [monitor(), alert], max_steps=3, logger=False, module=module)
    losses = [(a.step, a.value) for a in seen if a.rule == "loss seen"]
    assert [step for step, _ in losses] == [0, 1, 2]
    assert [value for _, value in losses] == pytest.approx(module.losses)  # the loss of the sampled step itself
    assert any(a.rule == "logit" for a in seen)


def test_an_all_of_rule_combines_the_logged_loss_with_a_geometric_key(tmp_path):
    seen = []
    both = AllOf(
        "loss and logits together",
        [Rule("loss seen", "train_loss", Threshold(-1.0)), Rule("logit", LOGIT, Threshold(-1.0))],
        within=0,
        cooldown=1,
    )
    alert = DriftAlert(rules=[both], actions=(), on_alert=seen.append)
    module = LoggingGPT()
    fit(tmp_path, [monitor(), alert], max_steps=3, logger=False, module=module)
    assert [(a.rule, a.step, a.key) for a in seen] == [("loss and logits together", s, "train_loss") for s in range(3)]
    assert [a.value for a in seen] == pytest.approx(module.losses)
    saved = alert.state_dict()["rules"]["loss and logits together"]
    assert sorted(saved["members"]) == ["logit", "loss seen"] and saved["count"] == 3


class ExplodingAt20(LitGPT):
    """Its query and key weights are multiplied by 8 at step 20 (attention logits x64): a logit explosion."""

    def on_train_batch_start(self, batch, batch_idx):
        if self.trainer.global_step == 20 and not getattr(self, "exploded", False):
            self.exploded = True
            n_embd = self.model.blocks[0].attn.n_embd
            with torch.no_grad():
                for block in self.model.blocks:
                    block.attn.c_attn.weight[: 2 * n_embd] *= 8


@pytest.mark.parametrize("module", [LitGPT, ExplodingAt20])
def test_the_default_logit_rule_reads_every_steps_whole_batch_and_names_the_head(tmp_path, module):
    """ConnectionMonitor (reading every step's logits) and DriftAlert() at its defaults: each sample logs the largest
    logit of every step since the previous one; 'attention logits exploding' fires on the explosion, naming layer
    and head, and never on the plain run."""
    sampler = ConnectionMonitor(every_n_steps=10, diagnostics=("walk",), figures_every_n_samples=None,
                                logit_every_n_steps=1)  # fmt: skip
    alert = DriftAlert(actions=("log",))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(tmp_path, [sampler, alert], max_steps=40, module=module())
    rows = {int(r["step"]): r for r in read_csv(tmp_path) if r.get("connmon/step_max_logit/L00")}
    assert sorted(rows) == [10, 20, 30]  # step 0's sample: no step read before it
    peaks = [float(rows[s]["connmon/step_max_logit/L00"]) for s in (10, 20, 30)]
    said = [str(w.message) for w in caught if "attention logits exploding" in str(w.message)]
    if module is ExplodingAt20:
        assert peaks[2] > 30 * peaks[1]  # the window of steps 20-29
        assert [(a.rule, a.step) for a in alert.alerts] == [("attention logits exploding", 30)]
        assert len(said) == 1 and re.search(r"\[WARN\]: L0\d head \d: max logit [\d.]+ at step 30, x\d+", said[0])
    else:
        assert list(alert.alerts) == [] and said == [] and max(peaks) < 3 * min(peaks)


class ScheduledGPT(LitGPT):
    """LitGPT under Lightning's scheduler configuration: LambdaLR stepped every step, the rate halved from
    ``halve_from`` on in the schedule itself (the reference for a back-off)."""

    def __init__(self, halve_from: int | None = None) -> None:
        super().__init__()
        self.halve_from = halve_from

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr)

        def rate(t):
            return (0.5 if self.halve_from is not None and t >= self.halve_from else 1.0) / (1 + 0.1 * t)

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, rate)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def test_a_back_off_under_lightnings_scheduler_trains_as_the_halved_schedule_and_is_logged(tmp_path):
    """The edge rule fires at step 0's sample (before its optimizer step, inside Lightning's closure): from step 0 on
    the rate is half the schedule's; the scheduler's own values are untouched; a run where no back-off fired is
    bitwise a plain one."""
    from connmon.alerts import LearningRateBackoff

    edge = Rule("past the edge of stability", LOGIT, Threshold(-1.0), cooldown=0)
    backed = ScheduledGPT()
    alert = DriftAlert(rules=[edge], actions=("backoff",), backoff=LearningRateBackoff(factor=0.5, cooldown=100))
    trainer = fit(tmp_path / "backed", [monitor(), alert], module=backed)
    assert alert.runner.backoff.scale == 0.5 and alert.runner.backoff.last_step == 0
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(1e-2 / (1 + 0.1 * 6))  # the schedule's own
    rows = read_csv(tmp_path / "backed")
    scales = {int(r["step"]): float(r["connmon/lr_scale"]) for r in rows if r.get("connmon/lr_scale")}
    assert scales == {s: 0.5 for s in range(6)}
    reference = ScheduledGPT(halve_from=0)
    fit(tmp_path / "reference", [], module=reference)
    for a, b in zip(backed.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8)
    quiet, plain = ScheduledGPT(), ScheduledGPT()
    never = Rule("past the edge of stability", LOGIT, Threshold(1e9))
    fit(tmp_path / "quiet", [monitor(), DriftAlert(rules=[never], actions=("backoff",))], module=quiet)
    fit(tmp_path / "plain", [], module=plain)
    assert all(torch.equal(a, b) for a, b in zip(quiet.parameters(), plain.parameters(), strict=True))
    assert not any(o._optimizer_step_pre_hooks for o in trainer.optimizers)  # removed at teardown


def test_a_run_resumed_from_a_checkpoint_keeps_its_back_off_and_its_cooldown(tmp_path):
    edge = Rule("past the edge of stability", LOGIT, Threshold(-1.0), cooldown=0)
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
    first = DriftAlert(rules=[edge], actions=("backoff",))
    fit(tmp_path / "a", [monitor(), first], max_steps=3, extra=[checkpoint])
    assert (first.runner.backoff.scale, first.runner.backoff.last_step) == (0.5, 0)
    path = str(next((tmp_path / "ckpt").glob("*.ckpt")))
    resumed = DriftAlert(rules=[edge], actions=("backoff",))
    fit(tmp_path / "b", [monitor(), resumed], ckpt_path=path)
    assert (resumed.runner.backoff.scale, resumed.runner.backoff.last_step) == (0.5, 0)  # in its cooldown: no more
    rows = read_csv(tmp_path / "b")
    assert {int(r["step"]): float(r["connmon/lr_scale"]) for r in rows if r.get("connmon/lr_scale")} == {
        3: 0.5, 4: 0.5, 5: 0.5
    }  # fmt: skip
    forgetful = DriftAlert(rules=[edge], actions=("backoff",))
    forgetful.load_state_dict = lambda state: None  # the control: the same resume without the saved state
    fit(tmp_path / "c", [monitor(), forgetful], ckpt_path=path)
    assert (forgetful.runner.backoff.scale, forgetful.runner.backoff.last_step) == (0.5, 3)  # backs off anew


class AdamGPT(LitGPT):
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def weights(trainer):
    return {name: p.detach().clone() for name, p in trainer.lightning_module.named_parameters()}


class ResumableLoader:
    """The test loader with Lightning's ``state_dict`` / ``load_state_dict``: a mid-epoch resume skips what was seen."""

    def __init__(self) -> None:
        self.batches, self.seen, self.skip = list(loader()), 0, 0

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        skip, self.skip = self.skip, 0
        for seen, batch in enumerate(self.batches[skip:], start=skip + 1):
            self.seen = seen
            yield batch

    def state_dict(self) -> dict:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict) -> None:
        self.skip = state["seen"]


def test_a_restore_point_is_a_lightning_checkpoint_that_resumes_bitwise(tmp_path):
    """The "checkpoint" action's restore point resumes as ModelCheckpoint's does, and as the uninterrupted run."""
    rule = Rule("any logit", LOGIT, Threshold(-1.0), cooldown=100, since=3)  # fires at step 3 only
    saved = {}
    for data in ("plain", "resumable"):
        alert = DriftAlert(rules=[rule], actions=("checkpoint",))
        with pytest.warns(UserWarning, match=r"restore point after step 4 \(alert at step 3\): .*step=4\.ckpt"):
            saved[data, "whole"] = weights(fit(tmp_path / data, [monitor(), alert], max_steps=8, module=AdamGPT(),
                                               data=ResumableLoader() if data == "resumable" else None))  # fmt: skip
        path = tmp_path / data / "csv" / "version_0" / "connmon_restore_points" / "step=4.ckpt"  # beside checkpoints/
        assert alert.runner.restore_points.paths == [str(path)] and path.is_file()
        control = ModelCheckpoint(dirpath=tmp_path / data / "ckpt", every_n_train_steps=4, save_top_k=-1)
        fit(tmp_path / data / "control", [monitor(), DriftAlert(rules=[rule], actions=())], max_steps=4,
            module=AdamGPT(), extra=[control], data=ResumableLoader() if data == "resumable" else None)  # fmt: skip
        for name, ckpt in (("restore point", path), ("ModelCheckpoint", next((tmp_path / data / "ckpt").iterdir()))):
            again = DriftAlert(rules=[rule], actions=("checkpoint",))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the plain loader's "not resumable" warning
                trainer = fit(tmp_path / data / name, [monitor(), again], max_steps=8, module=AdamGPT(),
                              ckpt_path=ckpt, data=ResumableLoader() if data == "resumable" else None)  # fmt: skip
            assert trainer.global_step == 8 and again.total == 1  # the alert at step 3, restored; none since
            saved[data, name] = weights(trainer)
    for data, name in set(saved) - {("plain", "whole")}:  # a plain loader restarts its epoch on resume
        reference = saved["resumable", "whole"] if data == "resumable" else saved["plain", "ModelCheckpoint"]
        for key, value in reference.items():
            assert torch.equal(saved[data, name][key], value), (data, name, key)
    assert not torch.equal(
        saved["plain", "whole"]["model.wte.weight"], saved["plain", "restore point"]["model.wte.weight"]
    )


def test_a_second_fit_into_the_same_folder_keeps_the_firsts_restore_points(tmp_path):
    """Restore points of one run are never written over by the next run's (the same dirpath): its own names."""
    from connmon.alerts import RestorePoints

    rule = Rule("any logit", LOGIT, Threshold(-1.0), cooldown=100, since=3)  # fires at step 3: saved after step 4
    folder = tmp_path / "points"
    contents = []
    for lr in (1e-2, 3e-2):
        points = RestorePoints(dirpath=folder)
        alert = DriftAlert(rules=[rule], actions=("checkpoint",), restore_points=points)
        with pytest.warns(UserWarning, match="restore point after step 4"):
            fit(tmp_path / str(lr), [monitor(), alert], module=AdamGPT(lr=lr))
        contents.append((points.paths, {p.name: p.read_bytes() for p in folder.iterdir()}))
    (first, before), (second, after) = contents
    assert [os.path.basename(p) for p in first + second] == ["step=4.ckpt", "step=4-v1.ckpt"]
    assert after["step=4.ckpt"] == before["step=4.ckpt"] and after["step=4-v1.ckpt"] != before["step=4.ckpt"]


def test_keep_holds_across_a_resume_from_a_restore_point(tmp_path):
    """The state inside a restore point lists the point itself: a run resumed from it rotates it away in turn."""
    from connmon.alerts import RestorePoints

    rule = Rule("any logit", LOGIT, Threshold(-1.0), cooldown=0)  # fires on every sample
    folder = tmp_path / "points"

    def alert():
        return DriftAlert(rules=[rule], actions=("checkpoint",), restore_points=RestorePoints(keep=2, dirpath=folder))

    first = alert()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fit(tmp_path / "first", [monitor(), first], max_steps=6, module=AdamGPT())
        assert len(first.runner.restore_points.paths) == 2 and len(os.listdir(folder)) == 2
        again = alert()
        fit(tmp_path / "again", [monitor(), again], max_steps=12, module=AdamGPT(),
            ckpt_path=first.runner.restore_points.paths[-1])  # fmt: skip
    kept = again.runner.restore_points.paths
    assert again.total > first.total and len(kept) == 2
    assert sorted(os.listdir(folder)) == sorted(os.path.basename(p) for p in kept)


def test_a_run_resumed_from_a_checkpoint_logs_the_uninterrupted_runs_curvature(tmp_path):
    """The sampler's state carries its difference length: a resumed run's samples read what the uninterrupted run's
    read (the search for the length starts where the uninterrupted run's did)."""
    from connmon.callbacks import SharpnessMonitor
    from tests.callbacks.test_sharpness_monitor import gpt_loss

    def run(name, max_steps, ckpt_path=None, extra=()):
        series = {}
        sampler = SharpnessMonitor(gpt_loss, every_n_steps=2, cadence="fixed", budget=None)
        sampler.add_listener(lambda trainer, step, values: series.update({step: values["connmon/sharpness_ratio"]}))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fit(tmp_path / name, [sampler], max_steps=max_steps, module=AdamGPT(), data=ResumableLoader(),
                ckpt_path=ckpt_path, extra=extra)  # fmt: skip
        return series, sampler

    whole, _ = run("whole", 10)
    control = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=5, save_top_k=-1)
    _, first = run("first", 5, extra=[control])
    assert 0 < first.sampler.state_dict()["difference_length"] < 0.1
    resumed, _ = run("resumed", 10, ckpt_path=next((tmp_path / "ckpt").iterdir()))
    assert sorted(resumed) == [6, 8] and resumed == {step: whole[step] for step in (6, 8)}


def test_a_notice_reaches_the_console_and_not_the_wandb_run(tmp_path, monkeypatch):
    logger = offline_logger(tmp_path, monkeypatch)
    notice = Rule("logits at risk", LOGIT, Threshold(-1.0), cooldown=100, kind="notice")
    warning = Rule("any logit", LOGIT, Threshold(-1.0), cooldown=100)
    alert = DriftAlert(rules=[notice, warning], actions=("log", "wandb"))
    with pytest.warns(UserWarning, match=r"connmon notice \(at risk, not a claim that the run will fail\): logits at"):
        fit(tmp_path, [monitor(), alert], max_steps=2, logger=logger)
    records = finish_and_read(logger)
    text = json.dumps([r for r in records if r.get("type") == "alert" or "alert" in r])
    assert "connmon: any logit" in text and "logits at risk" not in text
    assert [a.rule for a in alert.alerts] == ["any logit"] and any(
        item.get("connmon/alerts/total") == 1 for item in history(records)
    )
