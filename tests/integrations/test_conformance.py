"""One contract: the same model, data and options through every entry point log the same rows and act alike.

Each entry point is one fixture entry in ``ENTRY_POINTS``: a function that trains LitGPT's model (SGD, unshuffled
batches) for ``STEPS`` steps under connmon with the given options and returns what it did: the connmon rows it
logged, keyed by the optimizer steps taken before the sampled forward (every entry point samples the forwards after
0, 2, 4, 6 steps; the Hugging Face ``Trainer`` logs the forward after ``s`` steps in its row ``s + 1``, beside that
forward's loss); the alerts; the step the run stopped at; the final weights. Each runs every case of ``CASES``:
rules that only warn, an ERROR that stops the run, actions (back-off, QK-clip every step, restore points), and a run
interrupted after ``RESUME_AT`` steps and resumed from the entry point's own checkpoint. A new integration passes the
suite by adding its function. The Hugging Face ``Trainer`` runs where transformers is installed (the default
environment), OLMo-core's (through a small train module over the same model) where olmo-core is (an environment of
its own: the two cannot share one).
"""

from __future__ import annotations

import importlib.util
import itertools
import logging
import re
import warnings
from collections.abc import Callable
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import Logger

import connmon
from connmon.alerts import AlertRunner, LearningRateBackoff, QKClip, RestorePoints, logit_bound_rule
from connmon.callbacks import ConnectionMonitor, DriftAlert
from tests.callbacks.lightning_models import LitGPT, corpus

STEPS = 7
CLIP_AT = 0.5  # below the model's max logits from its first step: QK-clip acts on every step
OPTIONS: dict[str, Any] = {"every_n_steps": 2, "diagnostics": ("walk", "transport", "drift"),
                           "figures_every_n_samples": None}  # fmt: skip


CASES = ("watch", "stop", "act", "resume")
RESUME_AT = 4


def runner_for(case: str, alerts: list, tmp_path: Any) -> AlertRunner:
    """The rules and actions of a case, each alert appended to ``alerts``.

    Every case has a WARN rule that fires at every other sample (its cooldown); ``"stop"`` adds an ERROR one that
    fires at the first and stops the run; in ``"act"`` the WARN rule backs the learning rate off and saves restore
    points, and QK-clip acts every step.
    """
    warn = logit_bound_rule(bound=0.0, level="WARN", cooldown=3)
    if case == "act":
        points = RestorePoints(level="WARN", dirpath=str(tmp_path / "restore_points"))
        backoff = LearningRateBackoff(factor=0.5, cooldown=3, rules=(warn.name,))
        return AlertRunner([warn], on_alert=alerts.append, actions=("log", "backoff", "checkpoint", "qk_clip"),
                           qk_clip=QKClip(threshold=CLIP_AT), restore_points=points, backoff=backoff)  # fmt: skip
    rules = [warn, logit_bound_rule(bound=1e-9, level="ERROR")] if case == "stop" else [warn]
    return AlertRunner(rules, on_alert=alerts.append, actions=("log", "stop"))


def connmon_rows(rows: dict[int, dict[str, float]]) -> dict[int, dict[str, float]]:
    """connmon's readings by step (not what it cost: a timing, and the run's end logs it once more)."""
    readings = {step: {k: v for k, v in row.items() if k.startswith("connmon/") and "overhead" not in k}
                for step, row in rows.items()}  # fmt: skip
    return {step: row for step, row in readings.items() if row}


def result(rows: dict, alerts: list, steps_taken: int, model: torch.nn.Module) -> dict[str, Any]:
    """What an entry point did: connmon's rows, the alerts, the step the run stopped at (None: all), the weights."""
    return {"rows": connmon_rows(rows), "alerts": [(a.rule, a.step) for a in alerts],
            "stopped": steps_taken if steps_taken < STEPS else None,
            "weights": [p.detach().clone() for p in model.parameters()]}  # fmt: skip


def plain_loop(case: str, tmp_path: Any) -> dict[str, Any]:
    rows: dict[int, dict[str, float]] = {}
    alerts: list = []
    done: dict[str, Any] = {}

    def train(first: int, last: int, saved: dict[str, Any] | None = None) -> dict[str, Any]:
        module = LitGPT()
        model = module.model
        optimizer = torch.optim.SGD(model.parameters(), lr=module.lr)
        monitor = connmon.Monitor(model, optimizer=optimizer, alerts=runner_for(case, alerts, tmp_path),
                                  log=lambda values, step: rows.setdefault(step, {}).update(values),
                                  **OPTIONS)  # fmt: skip
        if saved is not None:
            model.load_state_dict(saved["model"])
            optimizer.load_state_dict(saved["optimizer"])
            monitor.load_state_dict(saved["connmon"])
        batches = itertools.islice(itertools.cycle(loader()), first, None)
        done["steps"] = last
        for step in range(first, last):
            idx, target = next(batches)
            with monitor.step(step):
                loss = torch.nn.functional.cross_entropy(model(idx).flatten(0, 1), target.flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if monitor.should_stop:
                done["steps"] = step + 1  # the optimizer steps taken when the run ended
                break
        saved = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "connmon": monitor.state_dict()}
        monitor.close()
        done["model"] = model
        return saved

    if case == "resume":
        train(RESUME_AT, STEPS, torch.load(save(train(0, RESUME_AT), tmp_path), weights_only=True))
    else:
        train(0, STEPS)
    return result(rows, alerts, done["steps"], done["model"])


def save(state: dict[str, Any], tmp_path: Any) -> str:
    path = str(tmp_path / "checkpoint.pt")
    torch.save(state, path)
    return path


class Rows(Logger):
    """A Lightning logger that keeps every logged row by its step."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: dict[int, dict[str, float]] = {}

    name, version = "rows", "0"

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.rows.setdefault(int(step or 0), {}).update(metrics)

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


def lightning(case: str, tmp_path: Any) -> dict[str, Any]:
    alerts: list = []
    logger = Rows()

    def fit(max_steps: int, path: str | None = None) -> L.Trainer:
        module = LitGPT()
        callbacks = [ConnectionMonitor(**OPTIONS), DriftAlert(runner=runner_for(case, alerts, tmp_path))]
        trainer = L.Trainer(max_steps=max_steps, callbacks=callbacks, logger=logger, enable_progress_bar=False,
                            enable_model_summary=False, enable_checkpointing=False, accelerator="cpu",
                            log_every_n_steps=1)  # fmt: skip
        trainer.fit(module, loader(), ckpt_path=path)
        return trainer

    if case == "resume":
        fit(RESUME_AT).save_checkpoint(tmp_path / "resume.ckpt")
        trainer = fit(STEPS, str(tmp_path / "resume.ckpt"))
    else:
        trainer = fit(STEPS)
    return result(logger.rows, alerts, trainer.global_step, trainer.lightning_module.model)


class NextToken(torch.nn.Module):
    """LitGPT's model as a Hugging Face ``Trainer`` holds one: a forward of the inputs dict that returns the loss."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, idx: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": torch.nn.functional.cross_entropy(self.model(idx).flatten(0, 1), target.flatten())}


def loader() -> torch.utils.data.DataLoader:
    """The training data: one batch of 4 sequences, every step (so each trainer's data position resumes alike)."""
    return torch.utils.data.DataLoader(corpus(n=4), batch_size=4, shuffle=False)


class Batches(torch.utils.data.IterableDataset):
    """The plain loop's sequences in its order (the Trainer shuffles a map-style dataset)."""

    def __iter__(self) -> Any:
        for idx, target in loader().dataset:
            yield {"idx": idx, "target": target}


def hugging_face(case: str, tmp_path: Any) -> dict[str, Any]:
    transformers = pytest.importorskip("transformers")
    from connmon.integrations.transformers import ConnectionMonitorCallback

    alerts: list = []
    rows: dict[int, dict[str, float]] = {}

    def train(max_steps: int, path: str | None = None) -> Any:
        module = LitGPT()
        model = NextToken(module.model)
        optimizer = torch.optim.SGD(model.parameters(), lr=module.lr)
        args = transformers.TrainingArguments(str(tmp_path), max_steps=max_steps, per_device_train_batch_size=4,
                                              max_grad_norm=0.0, report_to=[], use_cpu=True, disable_tqdm=True,
                                              logging_steps=1, save_steps=RESUME_AT,
                                              save_strategy="steps" if max_steps == RESUME_AT else "no")  # fmt: skip
        constant = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=Batches(),
                                       optimizers=(optimizer, constant))  # fmt: skip
        runner = runner_for(case, alerts, tmp_path)
        trainer.add_callback(ConnectionMonitorCallback(trainer, alerts=runner, **OPTIONS))
        trainer.train(resume_from_checkpoint=path)
        for row in trainer.state.log_history:  # its row s + 1: the forward after s steps
            rows.setdefault(int(row["step"]) - 1, {}).update(row)
        return trainer

    if case == "resume":
        train(RESUME_AT)
        trainer = train(STEPS, str(tmp_path / f"checkpoint-{RESUME_AT}"))
    else:
        trainer = train(STEPS)
    return result(rows, alerts, trainer.state.global_step, trainer.model.model)


def olmo_core(case: str, tmp_path: Any) -> dict[str, Any]:
    """OLMo-core's ``Trainer`` over LitGPT's model: a train module of SGD on the loss, the batch every step."""
    from olmo_core.data.data_loader import DataLoaderBase
    from olmo_core.train import Duration, TrainerConfig
    from olmo_core.train.callbacks import Callback
    from olmo_core.train.train_module import TrainModule

    from connmon.integrations.olmo_core import ConnectionMonitorCallback

    ids = torch.cat([torch.cat([idx[:, :1], target], dim=1) for idx, target in loader()])  # each sequence whole

    class Batches(DataLoaderBase):
        def _iter_batches(self) -> Any:
            yield {"input_ids": ids}

        def get_mock_batch(self) -> dict[str, Any]:
            return {"input_ids": ids}

        def reshuffle(self, epoch: int | None = None, **kwargs: Any) -> None:
            pass

        def state_dict(self) -> dict[str, Any]:
            return {}

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            pass

        @property
        def total_batches(self) -> int:
            return 1

    class NextTokenModule(TrainModule):
        def __init__(self) -> None:
            super().__init__()
            module = LitGPT()
            self.model = module.model
            self.optim = torch.optim.SGD(self.model.parameters(), lr=module.lr)

        def train_batch(self, batch: dict[str, Any], dry_run: bool = False) -> None:
            if not dry_run:
                idx, target = batch["input_ids"][:, :-1], batch["input_ids"][:, 1:]
                torch.nn.functional.cross_entropy(self.model(idx).flatten(0, 1), target.flatten()).backward()

        def optim_step(self) -> None:
            self.optim.step()

        def zero_grads(self) -> None:
            self.optim.zero_grad()

        def state_dict(self, *, optim: bool | None = None) -> dict[str, Any]:
            return {"model": self.model.state_dict()}

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            self.model.load_state_dict(state_dict["model"])

        def eval_batch(self, batch: dict[str, Any], labels: Any = None) -> Any:
            raise NotImplementedError

        @property
        def eval_batch_spec(self) -> Any:
            raise NotImplementedError

        def num_flops_per_token(self, seq_len: int) -> int | None:
            return None

        def global_num_flops_in_batch(self, batch: dict[str, Any]) -> int | None:
            return None

    rows: dict[int, dict[str, float]] = {}

    class Rows(Callback):
        def log_metrics(self, step: int, metrics: dict[str, float]) -> None:  # its step k + 1: the forward after k
            rows.setdefault(step - 1, {}).update({k: float(v) for k, v in metrics.items()})

    alerts: list = []

    def fit(steps: int) -> Any:
        module = NextTokenModule()
        config = TrainerConfig(save_folder=str(tmp_path / "save"), max_duration=Duration.steps(steps),
                               metrics_collect_interval=1, save_overwrite=True)  # fmt: skip
        trainer = config.build(module, Batches(work_dir=str(tmp_path / "data"), global_batch_size=len(ids)))
        runner = runner_for(case, alerts, tmp_path)
        trainer.add_callback("connmon", ConnectionMonitorCallback(alerts=runner, **OPTIONS))
        trainer.add_callback("rows", Rows())
        trainer.fit()  # resumes from the latest checkpoint in its save folder, as OLMo-core does
        return trainer

    if case == "resume":
        fit(RESUME_AT).save_checkpoint()
    trainer = fit(STEPS)
    return result(rows, alerts, trainer.global_step, trainer.train_module.model)


ENTRY_POINTS: dict[str, Callable[..., dict[str, Any]]] = {"plain loop": plain_loop, "Lightning": lightning}
if importlib.util.find_spec("transformers") is not None:  # the default environment
    ENTRY_POINTS["Hugging Face Trainer"] = hugging_face
if importlib.util.find_spec("olmo_core") is not None:  # an environment of its own (it cannot hold transformers)
    ENTRY_POINTS["OLMo-core Trainer"] = olmo_core


class Said(logging.Handler):
    """What connmon says at INFO level during a run."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def said_by(run: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """``run(*args)``, with the restore points it said it saved (their steps) and what connmon said at INFO level."""
    said, logger = Said(), logging.getLogger("connmon.monitor")
    level = logger.level
    logger.setLevel(logging.INFO)  # setLevel, not the attribute: the logger caches what its level let through
    logger.addHandler(said)
    try:
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            done = run(*args)
    finally:
        logger.removeHandler(said)
        logger.setLevel(level)
    points = [re.search(r"a restore point after step (\d+)", str(w.message)) for w in warned]
    return {**done, "said": said.lines, "restore_points": [int(point[1]) for point in points if point]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[tuple[str, str], dict[str, Any]]:
    return {(name, case): said_by(run, case, tmp_path_factory.mktemp("run")) for name, run in ENTRY_POINTS.items()
            for case in CASES}  # fmt: skip


@pytest.mark.parametrize("entry_point", [name for name in ENTRY_POINTS if name != "plain loop"])
def test_every_entry_point_logs_the_plain_loops_rows_alerts_and_weights(runs, entry_point):
    reference, run = runs[("plain loop", "watch")], runs[(entry_point, "watch")]
    assert sorted(run["rows"]) == sorted(reference["rows"]) == [0, 2, 4, 6]  # the states after 0, 2, 4, 6 steps
    for step, row in reference["rows"].items():
        assert sorted(run["rows"][step]) == sorted(row), step
        assert run["rows"][step] == pytest.approx(row, rel=1e-6, nan_ok=True), step
    assert run["alerts"] == reference["alerts"] and reference["alerts"]  # the WARN rule, at the same samples
    assert all(torch.equal(a, b) for a, b in zip(run["weights"], reference["weights"], strict=True))
    assert run["stopped"] is reference["stopped"] is None


@pytest.mark.parametrize("entry_point", list(ENTRY_POINTS))
def test_every_entry_point_stops_after_the_step_whose_sample_raised_an_error_alert(runs, entry_point):
    run = runs[(entry_point, "stop")]
    assert run["stopped"] == 1  # the ERROR rule's first sample is step 0's: the run ends after that step
    assert runs[("plain loop", "stop")]["alerts"] == run["alerts"]


@pytest.mark.parametrize("entry_point", list(ENTRY_POINTS))
def test_every_entry_point_says_what_connmon_cost_once_at_the_runs_end(runs, entry_point):
    for case in CASES:
        lines = [line for line in runs[(entry_point, case)]["said"] if " cost " in line]
        assert len(lines) == (2 if case == "resume" else 1), lines  # once a run: the resumed case trains twice
        assert all(line.startswith("connmon: ") and "% of training time (attention " in line for line in lines)


@pytest.mark.parametrize("entry_point", [name for name in ENTRY_POINTS if name != "plain loop"])
def test_every_entry_point_backs_off_clips_and_saves_restore_points_as_the_plain_loop_does(runs, entry_point):
    """Each step's sample ends before its optimizer step everywhere: the back-off scales that step's update, and a
    row holds what QK-clip did (and each step's max logits) in the steps before it."""
    reference, run = runs[("plain loop", "act")], runs[(entry_point, "act")]
    clipped = [k for row in reference["rows"].values() for k in row if k.startswith("connmon/qk_clip")]
    assert clipped and reference["rows"][0]["connmon/lr_scale"] == 0.5
    assert sorted(run["rows"]) == sorted(reference["rows"])
    for step, row in reference["rows"].items():
        assert run["rows"][step] == pytest.approx(row, rel=1e-6, nan_ok=True), step
    assert all(torch.equal(a, b) for a, b in zip(run["weights"], reference["weights"], strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(run["weights"], runs[(entry_point, "watch")]["weights"],
                                                     strict=True))  # fmt: skip  # the clips acted
    # the WARN rule fires at the samples after 0 and 4 steps: each restore point is the state after the next step
    assert run["restore_points"] == reference["restore_points"] == [1, 5]


@pytest.mark.parametrize("entry_point", list(ENTRY_POINTS))
def test_every_entry_point_resumed_from_its_checkpoint_logs_and_trains_as_the_uninterrupted_run(runs, entry_point):
    whole, resumed = runs[(entry_point, "watch")], runs[(entry_point, "resume")]
    assert sorted(resumed["rows"]) == sorted(whole["rows"]) == [0, 2, 4, 6]
    assert "connmon/time_drift/L00" in resumed["rows"][4]  # against the sample saved with the checkpoint
    for step, row in whole["rows"].items():
        assert resumed["rows"][step] == pytest.approx(row, rel=1e-6, nan_ok=True), step
    assert resumed["alerts"] == whole["alerts"]  # the rule's cooldown resumed too: at 0 and 4, not again at 4's
    assert all(torch.equal(a, b) for a, b in zip(resumed["weights"], whole["weights"], strict=True))
