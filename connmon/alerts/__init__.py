"""Alerts on logged series: online detectors (threshold, EWMA z-score, CUSUM, non-finite) and rules over keys.

The pure core (:class:`AlertRunner`) that :class:`connmon.callbacks.DriftAlert`, the Hugging Face callback and
:class:`connmon.Monitor` share; usable on its own in a plain loop.

Examples:
    >>> from connmon.alerts import EWMAZScore, Rule, RuleSet
    >>> rules = RuleSet([Rule("logit", "connmon/max_attention_logit/*", EWMAZScore(threshold=4.0, warmup=3))])
    >>> series = [10.0, 10.5, 9.5, 10.2, 30.0]
    >>> key = "connmon/max_attention_logit/L00"
    >>> alerts = [alert for step, v in enumerate(series) for alert in rules.update({key: v}, step)]
    >>> [(a.step, a.key) for a in alerts]
    [(4, 'connmon/max_attention_logit/L00')]
"""

from connmon.alerts.backoff import LearningRateBackoff
from connmon.alerts.detectors import (
    CUSUM,
    Detection,
    Detector,
    Direction,
    EWMAZScore,
    Growth,
    NonFinite,
    Surge,
    Threshold,
)
from connmon.alerts.qk_clip import QKClip
from connmon.alerts.restore import RestorePointError, RestorePoints, load_restore_point, write_restore_point
from connmon.alerts.rules import (
    KINDS,
    LEVELS,
    Alert,
    AllOf,
    Kind,
    Level,
    Rule,
    RuleSet,
    attention_collapse_rules,
    critical_edge_notice,
    default_rules,
    edge_crossing_rule,
    edge_of_stability_rule,
    logit_bound_rule,
    logit_edge_rule,
    logit_explosion_rule,
    stale_second_moment_notice,
)
from connmon.alerts.runner import DEFAULT_ACTIONS, KNOWN_ACTIONS, Action, AlertRunner
from connmon.alerts.transport_clip import TransportClip

__all__ = [
    "CUSUM",
    "DEFAULT_ACTIONS",
    "KINDS",
    "KNOWN_ACTIONS",
    "LEVELS",
    "Action",
    "Alert",
    "AlertRunner",
    "AllOf",
    "Detection",
    "Detector",
    "Direction",
    "EWMAZScore",
    "Growth",
    "Kind",
    "LearningRateBackoff",
    "Level",
    "NonFinite",
    "QKClip",
    "RestorePointError",
    "RestorePoints",
    "Rule",
    "RuleSet",
    "Surge",
    "Threshold",
    "TransportClip",
    "attention_collapse_rules",
    "critical_edge_notice",
    "default_rules",
    "edge_crossing_rule",
    "edge_of_stability_rule",
    "load_restore_point",
    "logit_bound_rule",
    "logit_edge_rule",
    "logit_explosion_rule",
    "stale_second_moment_notice",
    "write_restore_point",
]
