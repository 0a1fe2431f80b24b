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
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from connmon import keys
from connmon._options import check_choice, check_items, check_number
from connmon.alerts.detectors import Detector, EWMAZScore, NonFinite, Surge, Threshold

__all__ = [
    "KINDS",
    "Alert",
    "AllOf",
    "Kind",
    "Level",
    "Rule",
    "RuleSet",
    "attention_collapse_rules",
    "default_rules",
    "edge_crossing_rule",
    "edge_of_stability_rule",
    "logit_bound_rule",
    "logit_edge_rule",
    "logit_explosion_rule",
]

Level = Literal["INFO", "WARN", "ERROR"]
LEVELS: tuple[Level, ...] = get_args(Level)
Kind = Literal["warning", "notice"]
KINDS: tuple[Kind, ...] = get_args(Kind)


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
        evidence: for a conjunction (:class:`AllOf`), what its other rules saw, in words.
        kind: its rule's kind: ``"warning"`` (a claim that the run will fail) or ``"notice"`` (the run is at risk).
    """

    rule: str
    key: str
    step: int
    value: float
    statistic: float
    threshold: float
    baseline: float | None
    level: Level
    evidence: str = ""
    kind: Kind = "warning"

    @property
    def title(self) -> str:
        """A short title, ``connmon: <rule>``."""
        return f"connmon: {self.rule}"

    @property
    def text(self) -> str:
        """One line with the evidence: what was seen where, at which step, against what.

        Examples:
            >>> from connmon.alerts import Alert
            >>> Alert("attention logits exploding", "connmon/head_max_logit/L02H03", 300, 640.0, 40.0, 10.0, 16.0,
            ...       "WARN").text
            'L02 head 3: max logit 640 at step 300, x40 its lowest of the samples before (16)'
        """
        text = f"{keys.describe(self.key, self.value)} at step {self.step}"
        base = self.baseline
        if not math.isfinite(self.value):
            text += ", not a finite number (an overflow or a NaN in the forward)"
        elif base is not None and base > 0 and math.isclose(self.value / base, self.statistic, rel_tol=1e-6):
            text += f", x{self.statistic:.3g} its lowest of the samples before ({base:.4g})"
        elif base is not None:
            text += f", baseline {base:.4g} (statistic {self.statistic:.4g} > {self.threshold:.4g})"
        elif self.statistic != self.value:
            text += f" (statistic {self.statistic:.4g} > {self.threshold:.4g})"
        elif math.isfinite(self.threshold):
            text += f" (bound {self.threshold:.4g})"
        return f"{text}; {self.evidence}" if self.evidence else text


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
        kind: ``"warning"``, a claim that the run will fail (judged by its precision on runs that do not: an
            :class:`AlertRunner` logs it, sends it to W&B and hands it to the actions), or ``"notice"``, the run is at
            risk (a state many healthy runs pass through): one line when it fires, and nothing else.

    Raises:
        ValueError: for an unknown level or kind, or a negative cooldown.

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
    kind: Kind = "warning"

    def __post_init__(self) -> None:
        _check_text("name", self.name)
        _check_text("keys", self.keys)
        check_choice("level", self.level, LEVELS)
        check_choice("kind", self.kind, KINDS)
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
        kind: ``"warning"`` or ``"notice"``, as :class:`Rule`'s.

    Raises:
        ValueError: for fewer than two rules, duplicate member names, a negative window or cooldown, or an unknown
            level or kind.

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
    kind: Kind = "warning"

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
        check_choice("kind", self.kind, KINDS)


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
                alerts.append(dataclasses.replace(fired, rule=rule.name, level=rule.level, kind=rule.kind))
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

        A rule that watches only the first steps (``until=U``) needs samples in ``[0, U]`` to compare: where the cadence
        puts fewer than three there (step 0 included), steps ``U // 2`` and ``U`` are sampled too.

        Examples:
            >>> from connmon.alerts import Growth, Rule, RuleSet
            >>> early = RuleSet([Rule("logits tripled early", "connmon/max_attention_logit/L*", Growth(3.0), until=50)])
            >>> sorted(early.regime_steps(100)), sorted(early.regime_steps(25))
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
        if not recent or completing is None:
            return None
        others = [m.last_hit for m in state.members.values() if m.last_hit is not None and m.last_hit is not completing]
        return dataclasses.replace(
            completing, evidence="; ".join(dataclasses.replace(o, evidence="").text for o in others)
        )

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
            fired = Alert(
                rule.name,
                key,
                step,
                value,
                statistic=hit.statistic,
                threshold=hit.threshold,
                baseline=hit.baseline,
                level=rule.level,
            )
    return fired


def default_rules() -> list[Rule | AllOf]:
    """DriftAlert's default rules: four warnings (a claim that the run will fail) and two notices (it is at risk).

    Chosen on ``benchmarks/bench_mechanisms.py`` (benchmarks/README.md and docs/monitoring.md have the tables): runs
    that fail by attention-logit growth (no QK-norm: a warmup to a high constant rate, or the suite's slow LR ramp,
    whose QK-norm twin at the same ramp does not diverge), their QK-norm twins living at Adam's edge of stability at
    the same rates, and healthy runs whose logits grow tenfold as attention learns (the copy task's induction head).

    * ``non-finite attention`` (ERROR, stops the run): a layer's max attention logit (the sample's, the step's whole
      batch, or its bound from the kernel's logsumexp, said for the step it was read at) is NaN or infinite, which
      only a non-finite forward produces.
    * ``attention logits exploding`` (WARN, :func:`logit_explosion_rule`): a head's max logit over the whole batch
      has multiplied tenfold within two samples and is above 30.
    * ``crossing the edge of stability`` (WARN, :func:`edge_crossing_rule`): the curvature along the optimizer's
      step (``connmon/sharpness_ratio``, from a :class:`~connmon.curvature.sampler.SharpnessSampler`) at 4 times its
      edge on two samples in a row: far past where runs that live at the edge hover.
    * ``attention logits pushing past the edge`` (WARN, :func:`logit_edge_rule`): the curvature past the edge on two
      samples in a row while some head's max logit grows (x1.5 within four samples, above 20).
    * ``at the edge along the update`` (a notice, :func:`critical_edge_notice`): critical sharpness at its edge on
      two readings in a row.
    * ``second moment out of date`` (a notice, :func:`stale_second_moment_notice`): Adam's second moment far above
      the squared gradients it now sees.

    Each warning is judged by its precision: on the mechanisms benchmark the warnings raised 5 false alarms on 48
    runs that did not fail (benchmarks/README.md). A notice is one line, never an action or a W&B alert.

    The rules of earlier versions are opt-in: the curvature alone (:func:`edge_of_stability_rule`) also fires on
    runs that live at the edge and never diverge (the QK-norm twins); logits that tripled by step 50 fired on every
    run, healthy ones included; entropy collapsing and logits surging (:func:`attention_collapse_rules`) fire during
    a healthy phase change; a fixed bound (:func:`logit_bound_rule`) depends on the model's own level. No geometric
    diagnostic, the connection spectrum included, led divergence without false alarms, so none is a default.

    Examples:
        >>> from connmon.alerts import default_rules
        >>> [rule.name for rule in default_rules()]  # doctest: +NORMALIZE_WHITESPACE
        ['non-finite attention', 'attention logits exploding', 'crossing the edge of stability',
         'attention logits pushing past the edge', 'at the edge along the update', 'second moment out of date']
    """
    return [
        Rule("non-finite attention", f"{keys.PREFIX}*max*logit*/L*", NonFinite(), level="ERROR", cooldown=0),
        logit_explosion_rule(),
        edge_crossing_rule(),
        logit_edge_rule(),
        critical_edge_notice(),
        stale_second_moment_notice(),
    ]


def critical_edge_notice(bound: float = 1.0, consecutive: int = 2, cooldown: int = 200, since: int = 20) -> Rule:
    """A notice, not a warning: critical sharpness at or past its edge (``bound``) on ``consecutive`` readings.

    ``connmon/critical_sharpness_ratio`` (``eta / eta_c``: a :class:`~connmon.curvature.sampler.SharpnessSampler`
    with ``estimator="critical"`` or ``first_look_every_n_steps``) at 1 means the step just taken is the largest along
    its direction that does not raise its batch's loss. Runs that live at the edge and never diverge sit there for long
    stretches, so this says the run is at risk, and claims nothing more (docs/monitoring.md has its record).

    Examples:
        >>> from connmon.alerts import RuleSet, critical_edge_notice
        >>> rules = RuleSet([critical_edge_notice()])
        >>> [[a.kind for a in rules.update({"connmon/critical_sharpness_ratio": r}, s)] for s, r in [(20, 1.1),
        ...  (40, 1.2)]]
        [[], ['notice']]
    """
    detector = Threshold(bound, consecutive=consecutive)
    return Rule(keys.CRITICAL_EDGE_NOTICE, keys.CRITICAL_SHARPNESS_RATIO, detector, "INFO", cooldown=cooldown,
                since=since, kind="notice")  # fmt: skip


def stale_second_moment_notice(bound: float = 0.2, cooldown: int = 500, since: int = 100) -> Rule:
    """A notice, not a warning: Adam's second moment out of date (Bai et al. 2026's decoupling).

    ``connmon/gradient_to_second_moment`` (the median over 50 steps of ``sum g^2 / sum v_hat``, read in the optimizer
    state's pass: :mod:`connmon.curvature.optimizer_state`) below ``bound``: the second moment Adam divides by is
    far larger than the gradients it now sees, so a burst of gradient meets steps sized for a calmer past. Not
    tested before step ``since``: ``v_hat`` is then an average of few steps. On the mechanisms benchmark's seed
    ensembles (benchmarks/README.md) beta2 0.999 at a peak of 0.3 (QK-norm, z-loss, 300 warmup steps) blew up on 4
    of 4 seeds and read 0.13-0.18, below 0.2 from step 100, 151-179 steps before the loss passed 10; its beta2 0.95
    twin (never blew up) read 0.36-0.57 and 52 other runs 0.29-0.92; the same beta2 0.999 run at 0.03 (safe on 4
    seeds) read 0.19-0.23: at risk, as a notice says.

    Examples:
        >>> from connmon.alerts import RuleSet, stale_second_moment_notice
        >>> rules = RuleSet([stale_second_moment_notice()])
        >>> [a.text for a in rules.update({"connmon/gradient_to_second_moment": 0.06}, 300)]  # doctest: +ELLIPSIS
        ['... at step 300 (bound 0.2)']
    """
    detector = Threshold(bound, "fall")
    return Rule(keys.STALE_MOMENT_NOTICE, keys.GRADIENT_TO_SECOND_MOMENT, detector, "INFO", cooldown=cooldown,
                since=since, kind="notice")  # fmt: skip


def logit_explosion_rule(
    factor: float = 10.0, samples: int = 2, floor: float = 30.0, level: Level = "WARN", cooldown: int = 1000
) -> Rule:
    """Alerts when a head's max logit over the whole batch is above ``floor`` and ``factor`` times its recent low.

    Watches ``connmon/head_max_logit/L<ll>H<hh>`` (every head of every layer, the window of steps since the previous
    sample: :mod:`connmon.capture.max_logit`), each against the smallest of its previous ``samples`` values
    (:class:`Surge`). On the mechanisms benchmark (attention sampled every 25 steps) tenfold within two samples
    above 30 fired only on runs whose logits exploded (to 144-745), and on no healthy run nor QK-norm twin: the copy
    task's induction head multiplies its logits tenfold too, but to about 20, and runs whose logits grew to 100 and
    fell back grew more slowly. Of the runs it fired on, 2 never left the unigram plateau while their QK-norm twins
    learned; 3 ended 16-21% behind their twins. The answer to it is :class:`QKClip` (``actions=("qk_clip",)``).

    Examples:
        >>> from connmon.alerts import RuleSet, logit_explosion_rule
        >>> rules = RuleSet([logit_explosion_rule()])
        >>> key = "connmon/head_max_logit/L02H03"
        >>> [[a.text for a in rules.update({key: v}, s)] for s, v in [(0, 3.0), (25, 9.0), (50, 60.0)]]
        [[], [], ['L02 head 3: max logit 60 at step 50, x20 its lowest of the samples before (3)']]
    """
    return Rule(keys.LOGIT_RULE, keys.HEAD_MAX_LOGIT + "*", Surge(factor, samples, floor), level, cooldown=cooldown)


def edge_crossing_rule(
    bound: float = 4.0, consecutive: int = 2, level: Level = "WARN", cooldown: int = 100, since: int = 20
) -> Rule:
    """Alerts when the curvature stays far past the edge of stability: ``bound`` (4) times it on two samples in a row.

    A run that lives at Adam's adaptive edge (Cohen et al. 2022) has its ratio above 1 for long stretches without
    diverging: on the mechanisms benchmark the QK-norm twins of the diverging runs hovered at 1 to 3.7 (one sample
    each time), so the theory's bound of 1 (:func:`edge_of_stability_rule`, opt-in) fired on them, and so did 2 or 3
    on two samples; 4 on two samples fired on none of the 24 runs that did not fail, and warned a QK-norm run that
    diverged anyway (its logits bounded, its curvature not) 193 steps ahead. What it costs: on the suite's LR ramps
    it warns later than the bound of 1 (ramp seed 2 of ``bench_sharpness.py``: 21 steps ahead against 61; seed 0:
    missed, 73 before), which :func:`logit_edge_rule` recovers in part where the logits grow.

    Examples:
        >>> from connmon.alerts import RuleSet, edge_crossing_rule
        >>> rules = RuleSet([edge_crossing_rule()])
        >>> [[a.text for a in rules.update({"connmon/sharpness_ratio": r}, s)] for s, r in [(40, 3.7), (80, 5.0),
        ...  (120, 6.1)]][-1]
        ["curvature along the step 6.1x the optimizer's edge of stability at step 120 (bound 4)"]
    """
    detector = Threshold(bound, consecutive=consecutive)
    return Rule(keys.EDGE_RULE, keys.SHARPNESS_RATIO, detector, level, cooldown=cooldown, since=since)


def logit_edge_rule(
    bound: float = 1.0,
    consecutive: int = 2,
    growth: float = 1.5,
    samples: int = 4,
    floor: float = 20.0,
    within: int = 100,
    level: Level = "WARN",
    cooldown: int = 100,
) -> AllOf:
    """Alerts when the curvature is past the edge of stability while attention logits grow: logits pushing it across.

    Both within ``within`` steps: :func:`edge_of_stability_rule` (``connmon/sharpness_ratio`` above ``bound`` on
    ``consecutive`` samples in a row) and some head's max logit at least ``growth`` times the smallest of its
    previous ``samples`` values and above ``floor``. A QK-norm run that lives at the edge keeps its logits bounded; on
    the mechanisms benchmark the conjunction fired on none of the runs that stayed healthy, where the ratio alone
    fired on the QK-norm twins, and it warned the LR ramp's logit-growth divergence 73 steps ahead (as the ratio
    alone), once on a run whose logits exploded. It needs the max logits (``logit_every_n_steps``, on by default).

    Examples:
        >>> from connmon.alerts import RuleSet, logit_edge_rule
        >>> rules = RuleSet([logit_edge_rule()])
        >>> head, ratio = "connmon/head_max_logit/L00H01", "connmon/sharpness_ratio"
        >>> logits = [(step, {head: value}) for step, value in zip(range(0, 101, 25), (16.0, 16.5, 17.0, 20.0, 26.0))]
        >>> series = sorted(logits + [(80, {ratio: 1.3}), (120, {ratio: 1.6})], key=lambda item: item[0])
        >>> fired = [(step, a.text) for step, values in series for a in rules.update(values, step)]
        >>> fired  # doctest: +NORMALIZE_WHITESPACE
        [(120, "curvature along the step 1.6x the optimizer's edge of stability at step 120 (bound 1);
          L00 head 1: max logit 26 at step 100, x1.62 its lowest of the samples before (16)")]
    """
    edge = edge_of_stability_rule(bound, consecutive)
    logits = Rule("attention logits growing", keys.HEAD_MAX_LOGIT + "*", Surge(growth, samples, floor))
    return AllOf(keys.LOGIT_EDGE_RULE, [edge, logits], within=within, level=level, cooldown=cooldown)


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
    return Rule(keys.PAST_EDGE_RULE, keys.SHARPNESS_RATIO, detector, level, cooldown=cooldown, since=since)


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
                cooldown=cooldown)  # fmt: skip


def _check_text(name: str, value: object) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty string, got {name}={value!r}")
