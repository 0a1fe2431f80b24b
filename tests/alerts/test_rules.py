import json
import math

import pytest

from connmon.alerts import (
    AllOf,
    EWMAZScore,
    Growth,
    NonFinite,
    Rule,
    RuleSet,
    Threshold,
    attention_collapse_rules,
    default_rules,
    edge_of_stability_rule,
)


def test_a_rule_watches_every_matching_key_with_its_own_detector_and_alerts_once_per_cooldown():
    rules = RuleSet([Rule("logit", "connmon/max_attention_logit/L*", EWMAZScore(threshold=4.0, warmup=3), cooldown=10)])
    calm = {"connmon/max_attention_logit/L00": 1.0, "connmon/max_attention_logit/L01": 50.0, "connmon/other/L00": 0.0}
    for step, wobble in enumerate([0.0, 0.1, -0.1, 0.05]):
        assert rules.update({k: v + wobble for k, v in calm.items()}, step) == []
    detectors = rules._state["logit"].detectors
    assert sorted(detectors) == ["connmon/max_attention_logit/L00", "connmon/max_attention_logit/L01"]
    assert detectors["connmon/max_attention_logit/L01"].mean == pytest.approx(50.0125)  # its own baseline
    both_jump = {**calm, "connmon/max_attention_logit/L00": 9.0, "connmon/max_attention_logit/L01": 90.0}
    alerts = rules.update(both_jump, step=4)
    assert [(a.key, a.step) for a in alerts] == [("connmon/max_attention_logit/L00", 4)]  # one alert for one cause
    assert alerts[0].baseline == pytest.approx(1.0125) and alerts[0].value == 9.0 and alerts[0].level == "WARN"
    assert "connmon/max_attention_logit/L00 = 9 at step 4, baseline 1.012" in alerts[0].text
    assert rules.update(both_jump, step=13) == [] and rules.counts == {"logit": 1}  # cooldown: 4 + 10 > 13


def test_regime_rules_stop_testing_after_until():
    rules = RuleSet([Rule("early", "x", Threshold(1.0), until=10)])
    assert rules.update({"x": 0.0}, 10) == [] and rules.update({"x": 2.0}, 11) == []
    assert len(RuleSet([Rule("early", "x", Threshold(1.0), until=10)]).update({"x": 2.0}, 10)) == 1


def test_state_dict_round_trips_through_json_and_continues_identically():
    def fresh():
        return RuleSet(
            [Rule("z", "k/*", EWMAZScore(threshold=3.0, warmup=3), cooldown=5), Rule("n", "k/*", NonFinite())]
        )

    series = [
        {"k/a": math.sin(i) + (8.0 if i in (12, 30) else 0.0), "k/b": float("nan") if i == 20 else 1.0}
        for i in range(40)
    ]
    straight = fresh()
    expected = [(a.rule, a.step) for i, v in enumerate(series) for a in straight.update(v, i)]
    first = fresh()
    got = [(a.rule, a.step) for i, v in enumerate(series[:16]) for a in first.update(v, i)]
    resumed = fresh()
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    got += [(a.rule, a.step) for i, v in enumerate(series[16:], start=16) for a in resumed.update(v, i)]
    assert got == expected and ("z", 12) in expected and ("n", 20) in expected


def test_bad_rules_are_rejected():
    with pytest.raises(ValueError, match="level"):
        Rule("a", "*", NonFinite(), level="LOUD")
    with pytest.raises(ValueError, match="cooldown"):
        Rule("a", "*", NonFinite(), cooldown=-1)
    with pytest.raises(ValueError, match="Detector"):
        Rule("a", "*", lambda v: None)
    with pytest.raises(ValueError, match="unique"):
        RuleSet(default_rules() + default_rules())
    with pytest.raises(ValueError, match=r"cooldown must be an integer >= 0, got cooldown=1.5"):
        Rule("a", "*", NonFinite(), cooldown=1.5)
    with pytest.raises(ValueError, match=r"until must be an integer >= 0 or None, got until='50'"):
        Rule("a", "*", NonFinite(), until="50")
    with pytest.raises(ValueError, match=r"keys must be a non-empty string, got keys=\['a'\]"):
        Rule("a", ["a"], NonFinite())
    with pytest.raises(ValueError, match=r"a class: construct it"):
        Rule("a", "*", Threshold)


def conjunction(**options) -> AllOf:
    # a member's level and cooldown are not used: the conjunction's are
    spike = Rule("loss spike", "train_loss", Threshold(5.0), level="INFO", cooldown=1000)
    logits = Rule("large logits", "connmon/max_attention_logit/L*", Threshold(30.0), until=options.pop("until", None))
    return AllOf("loss spike with large logits", [spike, logits], **options)


def test_all_of_alerts_when_every_rule_fired_within_the_window():
    rules = RuleSet([conjunction(within=20, level="ERROR", cooldown=30)])
    quiet, logit = {"train_loss": 2.0, "connmon/max_attention_logit/L00": 10.0}, "connmon/max_attention_logit/L01"
    assert rules.update({**quiet, logit: 40.0}, step=0) == []  # one rule alone
    assert rules.update({**quiet, "train_loss": 6.0}, step=25) == []  # the other, 25 > 20 steps later
    alerts = rules.update({**quiet, logit: 35.0}, step=40)  # 15 steps after the spike: both within the window
    assert [(a.rule, a.key, a.value, a.step, a.level) for a in alerts] == [
        ("loss spike with large logits", logit, 35.0, 40, "ERROR")  # the evidence that completed it
    ]
    assert rules.update({**quiet, "train_loss": 7.0, logit: 50.0}, step=60) == []  # in the conjunction's cooldown
    late = rules.update({**quiet, "train_loss": 7.0}, step=75)  # 35 after the last alert; logits fired at 60
    assert [(a.key, a.step) for a in late] == [("train_loss", 75)] and rules.counts == {late[0].rule: 2}
    assert rules.update({**quiet, "train_loss": 9.0}, step=96) == []  # the logits' last firing is 36 steps back


def test_all_of_respects_a_members_until():
    rules = RuleSet([conjunction(within=100, until=10)])
    assert rules.update({"connmon/max_attention_logit/L00": 40.0, "train_loss": 1.0}, step=20) == []
    assert rules.update({"connmon/max_attention_logit/L00": 40.0, "train_loss": 9.0}, step=21) == []


def test_all_of_state_round_trips_mid_run():
    series = [{"train_loss": 2.0 + (s % 7 == 3) * 5, "connmon/max_attention_logit/L00": 10.0 + (s % 11 == 5) * 30}
              for s in range(120)]  # fmt: skip
    whole = RuleSet([conjunction(within=10, cooldown=5)])
    expected = [(a.step, a.key) for step, values in enumerate(series) for a in whole.update(values, step)]
    assert expected  # the series does fire
    first = RuleSet([conjunction(within=10, cooldown=5)])
    got = [(a.step, a.key) for step, values in enumerate(series[:60]) for a in first.update(values, step)]
    resumed = RuleSet([conjunction(within=10, cooldown=5)])
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))  # through a checkpoint's plain values
    got += [(a.step, a.key) for step, values in enumerate(series[60:], 60) for a in resumed.update(values, step)]
    assert got == expected


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda r: AllOf("c", [r]), "two or more"),
        (lambda r: AllOf("c", [r, r]), "unique"),
        (lambda r: AllOf("c", [r, Rule("b", "y", Threshold(1.0))], within=-1), "within"),
        (lambda r: AllOf("c", [r, Rule("b", "y", Threshold(1.0))], level="LOUD"), "level"),
        (lambda r: AllOf("c", [r, "not a rule"]), r"rules\[1\] must be connmon.alerts.Rule objects, got .not a rule."),
    ],
)
def test_all_of_rejects_bad_arguments(make, message):
    with pytest.raises(ValueError, match=message):
        make(Rule("a", "x", Threshold(1.0)))


def test_attention_collapse_rules_are_opt_in_and_fire_on_a_collapse_not_on_a_warmup_wobble():
    entropy, logit = "connmon/attention_entropy/L00", "connmon/max_attention_logit/L00"
    # nearly uniform attention during warmup: entropy wobbles by 0.01 nats, logits near 1; then layer 0 collapses
    calm = [{entropy: 4.15 + 0.01 * (-1) ** i, logit: 1.0 + 0.02 * (-1) ** i} for i in range(30)]
    collapse = [{entropy: 2.0, logit: 6.0}]
    steps = range(200, 200 + 5 * 31, 5)  # past the regime rule's first 50 steps
    opt_in, defaults = RuleSet(attention_collapse_rules(level="INFO")), RuleSet(default_rules())
    fired = [
        (a.rule, a.step, a.level) for s, v in zip(steps, calm + collapse, strict=True) for a in opt_in.update(v, s)
    ]
    assert fired == [("attention entropy collapsing", 350, "INFO"), ("attention logits surging", 350, "INFO")]
    assert [a for s, v in zip(steps, calm + collapse, strict=True) for a in defaults.update(v, s)] == []
    assert {r.name for r in default_rules()}.isdisjoint(r.name for r in attention_collapse_rules())


def test_a_checkpoint_of_the_earlier_default_rules_resumes_under_the_current_ones():
    logits = "connmon/max_attention_logit/L*"
    earlier = RuleSet(  # DriftAlert()'s rules before issue 47, with the opt-in rules of before that
        [Rule("non-finite attention", logits, NonFinite(), level="ERROR", cooldown=0),
         Rule("attention logits growing early", logits, Growth(3.0), until=50, cooldown=1000),
         edge_of_stability_rule(), *attention_collapse_rules()]
    )  # fmt: skip
    earlier.update({"connmon/max_attention_logit/L00": 1.0, "connmon/attention_entropy/L00": 4.0}, 0)
    earlier.update({"connmon/max_attention_logit/L00": math.nan}, 5)
    current = RuleSet(default_rules())
    current.load_state_dict(json.loads(json.dumps(earlier.state_dict())))  # rules it does not know are ignored
    assert current.counts == {"non-finite attention": 1, "attention logits exploding": 0,
                              "crossing the edge of stability": 0,
                              "attention logits pushing past the edge": 0, "at the edge along the update": 0,
                              "second moment out of date": 0}  # fmt: skip
    head = "connmon/head_max_logit/L00H00"
    assert [current.update({head: value}, step) for step, value in [(25, 2.0), (50, 4.0)]] == [[], []]
    saved = json.loads(json.dumps(current.state_dict()))
    resumed = RuleSet(default_rules())
    resumed.load_state_dict(saved)  # the surge's window comes back: 40 is 20x the window's low (2.0)
    assert [a.rule for a in resumed.update({head: 40.0}, 75)] == ["attention logits exploding"]
