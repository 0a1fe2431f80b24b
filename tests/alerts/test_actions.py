"""Every action behind one interface, each in its own module; DriftAlert takes the runner's options declared once."""

from __future__ import annotations

import inspect
import warnings

import pytest

from connmon.alerts import KNOWN_ACTIONS, Alert, AlertRunner, LearningRateBackoff, RestorePoints, Rule, Threshold
from connmon.alerts.action import AlertAction
from connmon.alerts.runner import ANSWER_ORDER, STEP_ACTIONS
from connmon.callbacks import DriftAlert


def test_every_action_is_one_alert_action_or_one_step_action_named_as_in_actions_each_in_its_own_module():
    runner = AlertRunner([], actions=KNOWN_ACTIONS)
    assert list(runner.parts) == list(ANSWER_ORDER) and list(runner.step_actions) == list(STEP_ACTIONS)
    assert set(ANSWER_ORDER) | set(STEP_ACTIONS) == set(KNOWN_ACTIONS) and not set(ANSWER_ORDER) & set(STEP_ACTIONS)
    modules = set()
    for name, part in runner.parts.items():  # each answers alerts
        assert isinstance(part, AlertAction) and part.name == name
        modules.add(type(part).__module__)
    for name, clip in runner.step_actions.items():  # each acts after every optimizer step, and answers no alert
        assert not isinstance(clip, AlertAction) and clip.name == name and not hasattr(clip, "answer")
        modules.add(type(clip).__module__)
    assert runner.qk_clip is runner.step_actions["qk_clip"]
    assert len(modules) == len(KNOWN_ACTIONS)  # one module each
    assert set(runner.state_dict()) == {"rules", "total", "backoff", "restore_points", "qk_clip", "transport_clip"}


def test_the_actions_answer_in_order_and_the_users_handler_sees_the_alert_before_the_back_off_moves_the_rate():
    order = []
    backoff = LearningRateBackoff(rules=("big",))
    runner = AlertRunner(
        [Rule("big", "x", Threshold(1.0), level="ERROR")],
        actions=("log", "backoff", "checkpoint", "stop"),
        backoff=backoff,
        restore_points=RestorePoints(),
        on_alert=lambda alert: order.append(("on_alert", backoff.scale)),
    )
    agreed = []
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        alerts, stop = runner.run({"x": 2.0}, step=4, agree=lambda flag: agreed.append(flag) or flag)
    assert [a.rule for a in alerts] == ["big"] and stop and order == [("on_alert", 1.0)] and backoff.scale == 0.5
    assert runner.restore_points is not None and runner.restore_points.due == 4
    assert agreed == [True, True]  # the restore point, then the stop: every process decides both alike
    assert str(said[0].message).split(" [")[0] == alerts[0].title
    _, stop = runner.run({"x": 0.5}, step=5)
    assert not stop


def test_a_request_on_another_process_is_every_processs():
    runner = AlertRunner([], actions=("checkpoint", "stop"))
    alerts, stop = runner.run({}, step=7, agree=lambda flag: True)  # another process alerted
    assert alerts == [] and stop and runner.restore_points is not None and runner.restore_points.due == 7


def test_drift_alert_takes_the_runners_options_declared_once():
    params = {name: p for name, p in inspect.signature(AlertRunner).parameters.items() if name != "rules"}
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params.values())  # the types: tests/test_keywords.py
    alert = DriftAlert(actions=("log",), stop_level="WARN", history=3)
    assert (alert.runner.actions, alert.runner.stop_level, alert.runner.alerts.maxlen) == (("log",), "WARN", 3)
    runner = AlertRunner([Rule("r", "x", Threshold(1.0))], actions=("stop",))
    assert DriftAlert(runner=runner).runner is runner
    with pytest.raises(ValueError, match="either as runner="):
        DriftAlert(runner=runner, actions=("log",))
    with pytest.raises(ValueError, match="either as runner="):
        DriftAlert([Rule("r", "x", Threshold(1.0))], runner=runner)
    with pytest.raises(TypeError, match="stop_levle"):
        DriftAlert(stop_levle="WARN")  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        AlertRunner([], ("log",))  # type: ignore[misc]  # keywords only after the rules


def test_an_alert_action_is_answered_with_what_the_sample_saw():
    class Seen(AlertAction):
        name = "seen"

        def __init__(self):
            self.steps = []

        def answer(self, alerted):
            self.steps.append((alerted.step, [a.rule for a in alerted.alerts]))

    from connmon.alerts.action import Alerted

    seen = Seen()
    seen.answer(Alerted([Alert("r", "x", 3, 2.0, 2.0, 1.0, None, "WARN")], step=3))
    assert seen.steps == [(3, ["r"])] and seen.state_dict() is None


def test_an_action_that_raises_is_said_once_and_the_run_and_the_other_actions_go_on():
    """A user's action in ``AlertRunner.parts`` whose answer raises, inside a plain loop's monitor."""
    import torch

    import connmon
    from tests.alerts.test_clip_timing import plain_run
    from tests.capture.models import TinyGPT

    class Broken(AlertAction):
        name = "page the on-call"

        def answer(self, alerted):
            if alerted.alerts:
                raise ConnectionError("the pager is down")

    torch.manual_seed(0)
    model = TinyGPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    saved = []
    points = RestorePoints(save=lambda path, step: saved.append(step))
    runner = AlertRunner([Rule("any entropy", "connmon/attention_entropy/all", Threshold(-1.0), cooldown=1)],
                         actions=("log", "checkpoint"), restore_points=points)  # fmt: skip
    runner.parts = {"page": Broken(), **runner.parts}  # answers first, before the restore point
    monitor = connmon.Monitor(model, every_n_steps=1, diagnostics=("walk",), optimizer=optimizer, alerts=runner)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        plain_run(model, optimizer, monitor, steps=4)
    raised = [str(w.message) for w in said if "raised ConnectionError" in str(w.message)]
    assert len(raised) == 1 and "'page the on-call' action raised ConnectionError: the pager is down" in raised[0]
    assert monitor.samples == 4 and runner.total >= 4  # every step sampled and alerted
    assert saved  # the restore point, answering after the broken action, still asked for and saved


def test_a_notice_is_one_line_and_nothing_else():
    handled, backoff = [], LearningRateBackoff(rules=("edge along the update",))
    runner = AlertRunner(
        [Rule("edge along the update", "x", Threshold(1.0), level="ERROR", kind="notice")],
        actions=("log", "backoff", "checkpoint", "stop"),
        backoff=backoff,
        restore_points=RestorePoints(level="INFO"),
        on_alert=handled.append,
    )
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        alerts, stop = runner.run({"x": 2.0}, step=4)
    assert alerts == [] and not stop and handled == [] and backoff.scale == 1.0
    assert runner.restore_points is not None and runner.restore_points.due is None
    assert [str(w.message) for w in said] == [
        "connmon notice (at risk, not a claim that the run will fail): edge along the update: x = 2 at step 4 (bound 1)"
    ]
    assert [n.rule for n in runner.notices] == ["edge along the update"] and runner.total == 0
    assert runner.counts(alerts)["connmon/alerts/total"] == 0.0
    with pytest.raises(ValueError, match="kind"):
        Rule("r", "x", Threshold(1.0), kind="claim")  # type: ignore[arg-type]
