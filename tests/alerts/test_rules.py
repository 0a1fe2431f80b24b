import json
import math

import pytest

from connmon.alerts import EWMAZScore, NonFinite, Rule, RuleSet, Threshold, default_rules


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
