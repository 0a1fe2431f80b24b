"""Rules: which logged keys a detector watches, how loud an alert is, and how long one cause stays quiet.

A :class:`Rule` pairs a glob over logged keys (``"connmon/max_attention_logit/L*"``) with a detector prototype;
:class:`RuleSet` gives every matching key its own copy of the detector, feeds it the values of each sample and
turns firings into :class:`Alert` objects. After an alert the rule is quiet for ``cooldown`` steps *for all of its
keys*, so one cause that shows in every layer at once alerts once, not once per layer. Its whole state (detector
baselines, cooldowns, counts) round-trips through ``state_dict``, so a resumed run neither re-alerts nor
re-learns.
"""

from __future__ import annotations

import copy
import fnmatch
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from connmon.alerts.detectors import Detector, EWMAZScore, Growth, NonFinite, Threshold

__all__ = ["Alert", "Level", "Rule", "RuleSet", "default_rules", "logit_bound_rule"]

Level = Literal["INFO", "WARN", "ERROR"]
LEVELS: tuple[Level, ...] = ("INFO", "WARN", "ERROR")


@dataclass(frozen=True)
class Alert:
    """One alert: which rule fired on which key, at which step, with the evidence.

    Attributes:
        rule: the rule's name.
        key: the logged key whose value fired.
        step: the trainer step of the value.
        value: the value.
        statistic: the detector's statistic (the value, a z-score or a cumulative sum).
        threshold: the bound the statistic crossed.
        baseline: the value's baseline (None for threshold and non-finite tests).
        level: ``"INFO"``, ``"WARN"`` or ``"ERROR"``.
    """

    rule: str
    key: str
    step: int
    value: float
    statistic: float
    threshold: float
    baseline: float | None
    level: Level

    @property
    def title(self) -> str:
        """A short title, ``connmon: <rule>``."""
        return f"connmon: {self.rule}"

    @property
    def text(self) -> str:
        """One line with the evidence."""
        baseline = "" if self.baseline is None else f", baseline {self.baseline:.4g}"
        return (
            f"{self.key} = {self.value:.4g} at step {self.step}{baseline} "
            f"(statistic {self.statistic:.4g} > {self.threshold:.4g})"
        )


@dataclass
class Rule:
    """A detector applied to every logged key that matches a glob.

    Args:
        name: what the alert is called (its W&B title is ``connmon: <name>``).
        keys: a glob (``fnmatch``) over logged keys, for example ``"connmon/max_attention_logit/L*"``.
        detector: a prototype; every matching key gets its own deep copy.
        level: ``"INFO"``, ``"WARN"`` or ``"ERROR"``.
        cooldown: steps after an alert during which this rule does not alert again, on any key.
        until: if set, values after this step are not tested (nor fed to the detector): a *regime* rule about the
            start of a run.

    Raises:
        ValueError: for an unknown level or a negative cooldown.

    Example:
        >>> from connmon.alerts import EWMAZScore, Rule
        >>> rule = Rule("max logit rising", "connmon/max_attention_logit/L*", EWMAZScore(threshold=4.0))
    """

    name: str
    keys: str
    detector: Detector
    level: Level = "WARN"
    cooldown: int = 100
    until: int | None = None

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise ValueError(f"level must be one of {LEVELS}, got level={self.level!r}")
        if self.cooldown < 0:
            raise ValueError(f"cooldown must be >= 0, got cooldown={self.cooldown}")
        if not isinstance(self.detector, Detector):
            raise ValueError(f"detector must be a connmon.alerts.Detector, got {type(self.detector).__name__}")


@dataclass
class _RuleState:
    detectors: dict[str, Detector] = field(default_factory=dict)
    last_alert_step: int | None = None
    count: int = 0


class RuleSet:
    """Runs rules over the values of successive samples and returns the alerts they raise.

    Args:
        rules: the rules; their names must be unique.

    Raises:
        ValueError: for duplicate rule names.

    Example:
        >>> from connmon.alerts import NonFinite, Rule, RuleSet, Threshold
        >>> rules = RuleSet([Rule("logit", "connmon/max_attention_logit/*", Threshold(50.0), cooldown=10)])
        >>> rules.update({"connmon/max_attention_logit/L00": 12.0}, step=0)
        []
        >>> [a.step for a in rules.update({"connmon/max_attention_logit/L00": 80.0}, step=5)]
        [5]
        >>> rules.update({"connmon/max_attention_logit/L00": 90.0}, step=10)  # in the cooldown
        []
    """

    def __init__(self, rules: Iterable[Rule]) -> None:
        self.rules = list(rules)
        names = [rule.name for rule in self.rules]
        if len(set(names)) != len(names):
            raise ValueError(f"rule names must be unique, got {names}")
        self._state = {rule.name: _RuleState() for rule in self.rules}

    @property
    def counts(self) -> dict[str, int]:
        """Alerts raised so far, per rule."""
        return {name: state.count for name, state in self._state.items()}

    def update(self, values: Mapping[str, float], step: int) -> list[Alert]:
        """Feed one sample's values (every key once); the alerts raised, at most one per rule.

        Every matching detector sees its value even during a cooldown, so baselines keep up with the run.
        """
        alerts = []
        for rule in self.rules:
            if rule.until is not None and step > rule.until:
                continue
            state = self._state[rule.name]
            quiet = state.last_alert_step is not None and step - state.last_alert_step < rule.cooldown
            fired: Alert | None = None
            for key in sorted(k for k in values if fnmatch.fnmatchcase(k, rule.keys)):
                detector = state.detectors.get(key)
                if detector is None:  # not setdefault: that would deep-copy the prototype on every update
                    detector = state.detectors[key] = copy.deepcopy(rule.detector)
                value = float(values[key])
                hit = detector.update(value)
                if hit is not None and not quiet and fired is None:
                    fired = Alert(rule.name, key, step, value, hit.statistic, hit.threshold, hit.baseline, rule.level)
            if fired is not None:
                state.last_alert_step, state.count = step, state.count + 1
                alerts.append(fired)
        return alerts

    def state_dict(self) -> dict[str, Any]:
        """Detector states, last alert steps and counts per rule (plain Python values)."""
        return {
            name: {
                "detectors": {key: d.state_dict() for key, d in state.detectors.items()},
                "last_alert_step": state.last_alert_step,
                "count": state.count,
            }
            for name, state in self._state.items()
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved; rules it does not know are ignored, missing ones start fresh."""
        prototypes = {rule.name: rule.detector for rule in self.rules}
        for name, saved in state_dict.items():
            if name not in self._state:
                continue
            state = _RuleState(last_alert_step=saved.get("last_alert_step"), count=saved.get("count", 0))
            for key, detector_state in saved.get("detectors", {}).items():
                detector = copy.deepcopy(prototypes[name])
                detector.load_state_dict(detector_state)
                state.detectors[key] = detector
            self._state[name] = state


def default_rules() -> list[Rule]:
    """DriftAlert's default rules: scale-free, each relative to its own layer's history.

    Chosen on ``benchmarks/bench_instability.py`` (benchmarks/README.md has the tables).

    * ``non-finite attention`` (ERROR, stops the run): a layer's max attention logit is NaN or infinite, which
      only a non-finite forward produces.
    * ``attention entropy collapsing`` (WARN): a layer's attention entropy falls more than 4 standard deviations
      below its exponentially weighted baseline, on the log scale, with the spread floored at 0.02 (a drop of at
      least about 8%), so the near-constant entropy of nearly uniform attention during warmup cannot fire on a
      wobble (Zhai et al. 2023, entropy collapse). In the suite: 3/3 divergences warned (leads 32, 2, 27 steps
      sampling every 5 steps), no false alarm.
    * ``attention logits surging`` (WARN): a layer's max attention logit jumps more than 4 floored standard
      deviations above its slow baseline on the log scale (``alpha=0.05``, spread floored at 0.2: at least about
      2.2x the baseline), the attention-logit growth of Dehghani et al. 2023 and Wortsman et al. 2023 measured
      against the layer's own level. In the suite: 2/3 divergences (leads 7, 17), no false alarm.
    * ``attention logits growing early`` (WARN, steps <= 100 only): a layer's max logit has tripled since the first
      sample, the sign of an LR too high for the run to learn well.

    The fixed bound of earlier versions (max logit above 30: leads 32-52 in the suite) is not scale-free: a healthy
    pretrained all-MiniLM-L6-v2 sits near 34 in layer 0. It is available as :func:`logit_bound_rule`. No geometric
    diagnostic, the connection spectrum included, warned earlier than entropy without false alarms, so none is in
    the defaults.

    On the wider suite (widths, depths, SGD, a copy task, a staircase ramp, warmup runs; 37 runs) they warned 9 of 10
    divergences, median 13 steps ahead, with no alert on any qk-norm control or warmup run, but raised 11 false
    alarms while the copy task's induction head formed (a healthy phase change; the attention sharpens before the
    loss falls). benchmarks/README.md has the tables and the trade-offs of stricter settings.

    Example:
        >>> from connmon.alerts import default_rules
        >>> [rule.name for rule in default_rules()]  # doctest: +NORMALIZE_WHITESPACE
        ['non-finite attention', 'attention entropy collapsing', 'attention logits surging',
         'attention logits growing early']
    """
    logits = "connmon/max_attention_logit/L*"
    entropy = EWMAZScore(4.0, "fall", log=True, min_std=0.02)
    surge = EWMAZScore(4.0, "rise", alpha=0.05, log=True, min_std=0.2)
    return [
        Rule("non-finite attention", logits, NonFinite(), level="ERROR", cooldown=0),
        Rule("attention entropy collapsing", "connmon/attention_entropy/L*", entropy),
        Rule("attention logits surging", logits, surge, cooldown=500),
        Rule("attention logits growing early", logits, Growth(3.0), until=100, cooldown=1000),
    ]


def logit_bound_rule(bound: float = 30.0, level: Level = "WARN", cooldown: int = 500) -> Rule:
    """An opt-in absolute bound on every layer's max attention logit (not scale-free: know your model's level).

    In the instability suite a bound of 30 warned 3/3 divergences 32-52 steps ahead (healthy layers there peaked
    near 23), earlier than any default rule; but healthy pretrained models sit above it (all-MiniLM-L6-v2: about 34
    in layer 0 at rest), so set ``bound`` above what your own model shows when it is healthy.

    Example:
        >>> from connmon.alerts import RuleSet, logit_bound_rule
        >>> rules = RuleSet([logit_bound_rule(50.0)])
        >>> [a.value for a in rules.update({"connmon/max_attention_logit/L03": 61.0}, step=7)]
        [61.0]
    """
    keys = "connmon/max_attention_logit/L*"
    return Rule(f"attention logits above {bound:g}", keys, Threshold(bound), level, cooldown)
