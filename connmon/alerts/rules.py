"""Rules: which logged keys a detector watches, how loud an alert is, and how long one cause stays quiet.

A :class:`Rule` pairs a glob over logged keys (``"connmon/max_attention_logit/L*"``) with a detector prototype;
:class:`RuleSet` gives every matching key its own copy of the detector, feeds it the values of each sample and
turns firings into :class:`Alert` objects. After an alert the rule is quiet for ``cooldown`` steps *for all of its
keys*, so one cause that shows in every layer at once alerts once, not once per layer. :class:`AllOf` alerts when
several rules have all fired within a window of steps (a loss spike together with a geometric signal). The whole
state (detector baselines, cooldowns, counts) round-trips through ``state_dict``, so a resumed run neither
re-alerts nor re-learns.
"""

from __future__ import annotations

import copy
import dataclasses
import fnmatch
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from connmon import keys
from connmon._options import check_choice, check_items, check_number
from connmon.alerts.detectors import Detector, EWMAZScore, Growth, NonFinite, Threshold

__all__ = [
    "Alert",
    "AllOf",
    "Level",
    "Rule",
    "RuleSet",
    "attention_collapse_rules",
    "default_rules",
    "edge_of_stability_rule",
    "logit_bound_rule",
]

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
        since: if set, values before this step are not tested (nor fed to the detector): a rule whose input means
            nothing yet in a run's first steps.

    Raises:
        ValueError: for an unknown level or a negative cooldown.

    Examples:
        >>> from connmon.alerts import EWMAZScore, Rule
        >>> rule = Rule("max logit rising", "connmon/max_attention_logit/L*", EWMAZScore(threshold=4.0))
    """

    name: str
    keys: str
    detector: Detector
    level: Level = "WARN"
    cooldown: int = 100
    until: int | None = None
    since: int | None = None

    def __post_init__(self) -> None:
        _check_text("name", self.name)
        _check_text("keys", self.keys)
        check_choice("level", self.level, LEVELS)
        check_number("cooldown", self.cooldown, low=0, integer=True)
        check_number("until", self.until, low=0, integer=True, optional=True)
        check_number("since", self.since, low=0, integer=True, optional=True)
        if not isinstance(self.detector, Detector):
            hint = " (a class: construct it, e.g. Threshold(1.0))" if isinstance(self.detector, type) else ""
            raise ValueError(
                f"detector must be a connmon.alerts.Detector, got {type(self.detector).__name__}: "
                f"{self.detector!r}{hint}"
            )


@dataclass
class AllOf:
    """Alerts when every one of its rules has fired within the last ``within`` steps: a conjunction of evidence.

    Each member is a :class:`Rule` whose detectors run on every sample as usual; a member's firing is evidence,
    not an alert (its own level and cooldown are not used; its ``until`` is). The conjunction alerts at the first
    sample at which each member has fired at most ``within`` steps earlier, with its own level and cooldown. The
    alert carries the evidence that completed it (the member that fired at that sample).

    On the instability suite of benchmarks/README.md (41 runs), the attention rules (:func:`attention_collapse_rules`)
    together with a z-score on the logged loss (``within=50``) raised 5 false alarms, against 19 for the attention
    rules alone and 7 for the loss rule alone, and warned 10 of 13 divergences, but at a median of 6.5 steps ahead
    (12 and 14.5 alone).

    Args:
        name: what the alert is called.
        rules: two or more rules with distinct names.
        within: how many steps back a member's firing still counts.
        level: ``"INFO"``, ``"WARN"`` or ``"ERROR"``.
        cooldown: steps after an alert during which this conjunction does not alert again.

    Raises:
        ValueError: for fewer than two rules, duplicate member names, a negative window or cooldown, or an unknown
            level.

    Examples:
        >>> from connmon.alerts import AllOf, EWMAZScore, Rule, RuleSet, Threshold
        >>> spike = Rule("loss spike", "train_loss", Threshold(5.0))
        >>> logits = Rule("large logits", "connmon/max_attention_logit/L*", Threshold(30.0))
        >>> rules = RuleSet([AllOf("loss spike with large logits", [spike, logits], within=20)])
        >>> rules.update({"train_loss": 2.0, "connmon/max_attention_logit/L00": 40.0}, step=10)  # logits alone
        []
        >>> [a.key for a in rules.update({"train_loss": 6.0, "connmon/max_attention_logit/L00": 12.0}, step=25)]
        ['train_loss']
    """

    name: str
    rules: list[Rule]
    within: int = 100
    level: Level = "WARN"
    cooldown: int = 100

    def __post_init__(self) -> None:
        _check_text("name", self.name)
        check_items("rules", self.rules, (Rule,), "connmon.alerts.Rule objects", hint=lambda item: "")
        self.rules = list(self.rules)
        if len(self.rules) < 2:
            raise ValueError(f"AllOf needs two or more Rule objects, got {self.rules!r}")
        names = [rule.name for rule in self.rules]
        if len(set(names)) != len(names):
            raise ValueError(f"AllOf's rule names must be unique, got {names}")
        check_number("within", self.within, low=0, integer=True)
        check_choice("level", self.level, LEVELS)
        check_number("cooldown", self.cooldown, low=0, integer=True)


@dataclass
class _RuleState:
    detectors: dict[str, Detector] = field(default_factory=dict)
    last_alert_step: int | None = None
    count: int = 0
    last_hit: Alert | None = None  # an AllOf member's latest firing
    members: dict[str, _RuleState] = field(default_factory=dict)  # an AllOf's members

    def to_dict(self) -> dict[str, Any]:
        state = {
            "detectors": {key: d.state_dict() for key, d in self.detectors.items()},
            "last_alert_step": self.last_alert_step,
            "count": self.count,
        }
        if self.last_hit is not None:
            state["last_hit"] = dataclasses.asdict(self.last_hit)
        if self.members:
            state["members"] = {name: member.to_dict() for name, member in self.members.items()}
        return state


class RuleSet:
    """Runs rules over the values of successive samples and returns the alerts they raise.

    Args:
        rules: the rules (:class:`Rule` or :class:`AllOf`); their names must be unique.

    Raises:
        ValueError: for duplicate rule names.

    Examples:
        >>> from connmon.alerts import NonFinite, Rule, RuleSet, Threshold
        >>> rules = RuleSet([Rule("logit", "connmon/max_attention_logit/*", Threshold(50.0), cooldown=10)])
        >>> rules.update({"connmon/max_attention_logit/L00": 12.0}, step=0)
        []
        >>> [a.step for a in rules.update({"connmon/max_attention_logit/L00": 80.0}, step=5)]
        [5]
        >>> rules.update({"connmon/max_attention_logit/L00": 90.0}, step=10)  # in the cooldown
        []
    """

    def __init__(self, rules: Iterable[Rule | AllOf]) -> None:
        self.rules = list(rules)
        names = [rule.name for rule in self.rules]
        if len(set(names)) != len(names):
            raise ValueError(f"rule names must be unique, got {names}")
        self._state = {rule.name: _fresh(rule) for rule in self.rules}

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
            state = self._state[rule.name]
            if isinstance(rule, AllOf):
                fired = self._conjunction(rule, state, values, step)
            else:
                fired = _feed(rule, state, values, step)
            quiet = state.last_alert_step is not None and step - state.last_alert_step < rule.cooldown
            if fired is not None and not quiet:
                state.last_alert_step, state.count = step, state.count + 1
                alerts.append(dataclasses.replace(fired, rule=rule.name, level=rule.level))
        return alerts

    def ready_step(self, key: str, every_n_steps: int) -> int | None:
        """The first step from which samples of ``key`` every ``every_n_steps`` can raise an alert again, or None.

        While every rule watching ``key`` is in the cooldown of its last alert, no value of ``key`` can alert: a
        monitor whose samples cost (the curvature) need not take them. A rule that needs ``n`` values in a row
        (``Threshold(consecutive=n)``) needs them at the last ``n - 1`` intervals of its cooldown, so that it can fire
        when the cooldown ends. None when a rule watching ``key`` is not in a cooldown (or is a conjunction, whose
        members' evidence keeps counting), or none watches it.

        Examples:
            >>> from connmon.alerts import RuleSet, edge_of_stability_rule
            >>> rules = RuleSet([edge_of_stability_rule(cooldown=100, consecutive=2, since=0)])
            >>> [len(rules.update({"connmon/sharpness_ratio": 1.5}, step)) for step in (20, 40)]
            [0, 1]
            >>> rules.ready_step("connmon/sharpness_ratio", 20), rules.ready_step("connmon/alerts/count", 20)
            (120, None)
        """
        ready = []
        for rule in self.rules:
            members = rule.rules if isinstance(rule, AllOf) else (rule,)
            if not any(fnmatch.fnmatchcase(key, member.keys) for member in members):
                continue
            last = self._state[rule.name].last_alert_step
            if isinstance(rule, AllOf) or last is None:
                return None
            ready.append(last + rule.cooldown - (getattr(rule.detector, "consecutive", 1) - 1) * every_n_steps)
        return min(ready) if ready else None

    def regime_steps(self, every_n_steps: int) -> frozenset[int]:
        """The steps a monitor sampling every ``every_n_steps`` adds so that its regime rules can fire.

        A rule that watches only the first steps (``until=U``, such as the default ``attention logits growing early``)
        needs samples in ``[0, U]`` to compare: where the cadence puts fewer than three there (step 0 included), steps
        ``U // 2`` and ``U`` are sampled too, the cadence the rule was measured at (every 25 steps for ``U = 50``).

        Examples:
            >>> from connmon.alerts import RuleSet, default_rules
            >>> sorted(RuleSet(default_rules()).regime_steps(100)), sorted(RuleSet(default_rules()).regime_steps(25))
            ([25, 50], [])
        """
        check_number("every_n_steps", every_n_steps, low=1, integer=True)
        steps: set[int] = set()
        for rule in self.rules:
            for member in rule.rules if isinstance(rule, AllOf) else (rule,):
                if member.until is not None and member.until // every_n_steps < 2:
                    steps.update((member.until // 2, member.until))
        return frozenset(step for step in steps if step % every_n_steps)

    @staticmethod
    def _conjunction(rule: AllOf, state: _RuleState, values: Mapping[str, float], step: int) -> Alert | None:
        """Feed every member; the evidence that completes the conjunction at this step, or None."""
        completing = None
        for member in rule.rules:
            hit = _feed(member, state.members[member.name], values, step)
            if hit is not None:
                state.members[member.name].last_hit = hit
                completing = completing or hit
        recent = all(m.last_hit is not None and step - m.last_hit.step <= rule.within for m in state.members.values())
        return completing if recent else None

    def state_dict(self) -> dict[str, Any]:
        """Detector states, last alert steps and counts per rule (plain Python values)."""
        return {name: state.to_dict() for name, state in self._state.items()}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved; rules it does not know are ignored, missing ones start fresh."""
        rules = {rule.name: rule for rule in self.rules}
        for name, saved in state_dict.items():
            if name in rules:
                self._state[name] = _restored(rules[name], saved)


def _fresh(rule: Rule | AllOf) -> _RuleState:
    members = {m.name: _RuleState() for m in rule.rules} if isinstance(rule, AllOf) else {}
    return _RuleState(members=members)


def _restored(rule: Rule | AllOf, saved: Mapping[str, Any]) -> _RuleState:
    """A rule's state from what :meth:`_RuleState.to_dict` wrote (missing entries start fresh)."""
    state = _fresh(rule)
    state.last_alert_step, state.count = saved.get("last_alert_step"), saved.get("count", 0)
    if saved.get("last_hit") is not None:
        state.last_hit = Alert(**saved["last_hit"])
    if isinstance(rule, AllOf):
        for member in rule.rules:
            if member.name in saved.get("members", {}):
                state.members[member.name] = _restored(member, saved["members"][member.name])
        return state
    for key, detector_state in saved.get("detectors", {}).items():
        detector = copy.deepcopy(rule.detector)
        detector.load_state_dict(detector_state)
        state.detectors[key] = detector
    return state


def _feed(rule: Rule, state: _RuleState, values: Mapping[str, float], step: int) -> Alert | None:
    """Feed the rule's detectors their values (every matching key); the first firing as an Alert, or None."""
    if (rule.until is not None and step > rule.until) or (rule.since is not None and step < rule.since):
        return None
    fired: Alert | None = None
    for key in sorted(k for k in values if fnmatch.fnmatchcase(k, rule.keys)):
        detector = state.detectors.get(key)
        if detector is None:  # not setdefault: that would deep-copy the prototype on every update
            detector = state.detectors[key] = copy.deepcopy(rule.detector)
        value = float(values[key])
        hit = detector.update(value)
        if hit is not None and fired is None:
            fired = Alert(rule.name, key, step, value, hit.statistic, hit.threshold, hit.baseline, rule.level)
    return fired


def default_rules() -> list[Rule]:
    """DriftAlert's default rules: scale-free, none tuned to one model's level.

    Chosen on the instability suite of ``benchmarks/bench_instability.py`` (benchmarks/README.md has the tables):
    widths, depths, AdamW and SGD with momentum, a Markov corpus and a copy task whose induction head forms in a
    healthy phase change, smooth and staircase LR ramps, qk-norm controls and warmup runs.

    * ``non-finite attention`` (ERROR, stops the run): a layer's max attention logit is NaN or infinite, which
      only a non-finite forward produces.
    * ``attention logits growing early`` (WARN, steps <= 50 only): a layer's max logit has tripled since the first
      sample, the sign of an LR too high for the run to learn well (the regime alert: on the suite it fired by step
      25 on every constant-LR run that ended on a worse plateau, sampling attention every 5 or 25 steps, and on no
      good one; watching until step 100, it also fired once while a copy-task run's induction head formed).
    * ``past the edge of stability`` (WARN, :func:`edge_of_stability_rule`): the optimizer's step is past its edge
      of stability on two samples in a row. It watches ``connmon/sharpness_ratio``, which only the opt-in
      :class:`connmon.callbacks.SharpnessMonitor` logs, so without one it never fires.

    With a SharpnessMonitor at its defaults they warned every divergence of ``bench_sharpness.py``'s suite ahead of it,
    with no alert on a healthy run, the copy task's phase change included (the leads and the tables:
    docs/monitoring.md and benchmarks/README.md). The attention rules of earlier versions, entropy collapsing and
    logits surging, are opt-in (:func:`attention_collapse_rules`): they warned later and fired during that phase
    change.
    The fixed bound of the first version (max logit above 30) is opt-in too (:func:`logit_bound_rule`): a healthy
    pretrained all-MiniLM-L6-v2 sits near 34 in layer 0. No geometric diagnostic, the connection spectrum
    included, led divergence without false alarms, so none is a default.

    Examples:
        >>> from connmon.alerts import default_rules
        >>> [rule.name for rule in default_rules()]
        ['non-finite attention', 'attention logits growing early', 'past the edge of stability']
    """
    logits = keys.every_layer("max_attention_logit")
    return [
        Rule("non-finite attention", logits, NonFinite(), level="ERROR", cooldown=0),
        Rule("attention logits growing early", logits, Growth(3.0), until=50, cooldown=1000),
        edge_of_stability_rule(),
    ]


def attention_collapse_rules(level: Level = "WARN") -> list[Rule]:
    """Opt-in rules on attention sharpening fast: entropy collapsing and logits surging, each against its own layer.

    * ``attention entropy collapsing``: a layer's attention entropy falls more than 4 standard deviations below its
      exponentially weighted baseline, on the log scale, with the spread floored at 0.02 (a drop of at least about
      8%), so the near-constant entropy of nearly uniform attention during warmup cannot fire on a wobble (Zhai et
      al. 2023, entropy collapse).
    * ``attention logits surging``: a layer's max attention logit jumps more than 4 floored standard deviations
      above its slow baseline on the log scale (``alpha=0.05``, spread floored at 0.2: at least about 2.2x the
      baseline), the attention-logit growth of Dehghani et al. 2023 and Wortsman et al. 2023.

    What they tell is true (the attention of a layer sharpened abruptly) but it is not a forecast: on the 41-run
    suite they warned 10 of 13 divergences only a median of 12 steps ahead (sampling every 5 steps; at every 100
    steps, almost never), and they fired 16 times while the copy task's induction head formed, a healthy phase
    change in which attention sharpens before the loss falls. Use them where the task has no such phase change,
    or at ``level="INFO"``, or gated by the loss with :class:`AllOf`.

    Examples:
        >>> from connmon.alerts import RuleSet, attention_collapse_rules, default_rules
        >>> rules = RuleSet(default_rules() + attention_collapse_rules(level="INFO"))
        >>> [rule.name for rule in attention_collapse_rules()]
        ['attention entropy collapsing', 'attention logits surging']
    """
    entropy = EWMAZScore(4.0, "fall", log=True, min_std=0.02)
    surge = EWMAZScore(4.0, "rise", alpha=0.05, log=True, min_std=0.2)
    return [
        Rule("attention entropy collapsing", keys.every_layer("attention_entropy"), entropy, level),
        Rule("attention logits surging", keys.every_layer("max_attention_logit"), surge, level, cooldown=500),
    ]


def edge_of_stability_rule(
    bound: float = 1.0, consecutive: int = 2, level: Level = "WARN", cooldown: int = 100, since: int = 20
) -> Rule:
    """Alerts when ``connmon/sharpness_ratio`` (a :class:`connmon.callbacks.SharpnessMonitor`) stays above ``bound``.

    The ratio is the curvature of the loss against the optimizer's edge of stability (:mod:`connmon.curvature`):
    1 is where, on the quadratic model, the step starts to oscillate with a growing amplitude, for any model,
    optimizer or learning rate, so the bound comes from theory and is scale-free. On the instability suite of
    ``benchmarks/bench_instability.py`` (two seeds per setting), above 1 on two samples in a row warned every
    divergence ahead of it and never fired on the controls and warmup runs, which include the copy task's phase
    change (the leads, and how they move with the cadence: docs/monitoring.md). A single sample above 1 leads more,
    but fired on healthy copy-task runs at their phase change. It also fires on runs that fall back to a worse
    plateau without diverging. SGD with momentum hovers at the edge before it diverges (ratio 1.1-2): sample it
    every 20 steps or pass ``consecutive=1``. benchmarks/README.md has the tables and the caveats. Full-batch
    training can hover at the edge for long stretches without diverging (Cohen et al. 2021), so this rule is for
    mini-batch training.

    Values before step ``since`` (20) are not tested: Adam's second moment is then an average of fewer than 20
    squared gradients, so some coordinates' step sizes are far too large, and a healthy run at LR 1e-3 reads 5-100
    in its first five steps (``tests/callbacks/test_sharpness_monitor.py``); the ratio means nothing yet.

    Examples:
        >>> from connmon.alerts import RuleSet, edge_of_stability_rule
        >>> rules = RuleSet([edge_of_stability_rule()])
        >>> [[a.step for a in rules.update({"connmon/sharpness_ratio": r}, s)] for s, r in [(50, 1.2), (100, 0.8),
        ...  (150, 1.1), (200, 1.3)]]
        [[], [], [], [200]]
    """
    detector = Threshold(bound, consecutive=consecutive)
    return Rule(keys.EDGE_RULE, keys.SHARPNESS_RATIO, detector, level, cooldown, since=since)


def logit_bound_rule(bound: float = 30.0, level: Level = "WARN", cooldown: int = 500) -> Rule:
    """An opt-in absolute bound on every layer's max attention logit (not scale-free: know your model's level).

    In the instability suite a bound of 30 warned 3/3 divergences 32-52 steps ahead (healthy layers there peaked
    near 23), earlier than any default rule; but healthy pretrained models sit above it (all-MiniLM-L6-v2: about 34
    in layer 0 at rest), so set ``bound`` above what your own model shows when it is healthy.

    Examples:
        >>> from connmon.alerts import RuleSet, logit_bound_rule
        >>> rules = RuleSet([logit_bound_rule(50.0)])
        >>> [a.value for a in rules.update({"connmon/max_attention_logit/L03": 61.0}, step=7)]
        [61.0]
    """
    return Rule(f"attention logits above {bound:g}", keys.every_layer("max_attention_logit"), Threshold(bound), level,
                cooldown)  # fmt: skip


def _check_text(name: str, value: object) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty string, got {name}={value!r}")
