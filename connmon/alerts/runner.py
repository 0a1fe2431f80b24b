"""The trainer-agnostic alert loop: rules over each sample's values, then warn, W&B alert, stop, user handler.

Lightning's :class:`connmon.callbacks.DriftAlert`, the Hugging Face callback and the plain-loop
:class:`connmon.Monitor` all run their rules through one :class:`AlertRunner`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, TypeVar, get_args

from typing_extensions import TypedDict

from connmon import keys
from connmon._options import check_callable, check_choice, check_items, check_number
from connmon._ranks import warn_rank_zero
from connmon.alerts._head_rows import HeadClipCount
from connmon.alerts.action import AlertAction, Alerted
from connmon.alerts.backoff import LearningRateBackoff
from connmon.alerts.log_alerts import LogAlerts
from connmon.alerts.qk_clip import QKClip
from connmon.alerts.restore import RestorePoints
from connmon.alerts.rules import LEVELS, Alert, AllOf, Level, Rule, RuleSet, default_rules
from connmon.alerts.stop import StopRun
from connmon.alerts.transport_clip import TransportClip
from connmon.alerts.wandb_alerts import WandbAlerts

Action = Literal["log", "wandb", "stop", "backoff", "checkpoint", "qk_clip", "transport_clip"]
DEFAULT_ACTIONS: tuple[Action, ...] = ("log", "wandb", "stop")  # the others are opt-in
_A = TypeVar("_A", bound=AlertAction)
KNOWN_ACTIONS: tuple[Action, ...] = get_args(Action)
ANSWER_ORDER: tuple[Action, ...] = ("log", "wandb", "backoff", "checkpoint", "stop")  # the alert actions
STEP_ACTIONS: tuple[Action, ...] = ("qk_clip", "transport_clip")  # act after every optimizer step, not on alerts


class AlertOptions(TypedDict, total=False):
    """:class:`AlertRunner`'s options as keywords (what :class:`connmon.callbacks.DriftAlert` takes), for editors.

    Documented, defaulted and checked once, by :class:`AlertRunner`; a test holds the two to the same names and types.
    """

    actions: Sequence[Action]
    stop_level: Level
    on_alert: Callable[[Alert], Any] | None
    wait_duration: float
    history: int
    backoff: LearningRateBackoff | None
    restore_points: RestorePoints | None
    qk_clip: QKClip | None
    transport_clip: TransportClip | None


class AlertRunner:
    """Runs rules on every sample and acts on the alerts they raise.

    A warning rule's alert (``Rule(kind="warning")``, the default: a claim that the run will fail) is acted on; a
    notice rule's (``kind="notice"``: the run is at risk) is one line (rank zero), kept in :attr:`notices`, and
    nothing else: no W&B alert, no action, no ``on_alert``, not counted in ``connmon/alerts/total``.

    Each alert is, by ``actions``: ``"log"``, a warning with the evidence (rank zero); ``"wandb"``, a W&B
    ``run.alert`` when a W&B sink is given (rank zero); ``"stop"``, a stop request when its level is at least
    ``stop_level`` (the values are synced, so every process decides the same); ``"backoff"`` (opt-in), the
    learning rate scaled down when the edge-of-stability rule fires (:class:`connmon.alerts.LearningRateBackoff`:
    the entry points attach it to the optimizer; logged as ``connmon/lr_scale``); ``"checkpoint"`` (opt-in), a
    restore point asked for when its level is at least ``restore_points.level`` (:class:`connmon.alerts.RestorePoints`:
    the entry points save it; ``restore_points.due`` says the step); ``"qk_clip"`` (opt-in), not an answer to an
    alert but a step-by-step action: after every optimizer step, each head whose max logit over the step's whole
    batch exceeds ``qk_clip.threshold`` has its query and key projections scaled down (:class:`connmon.alerts.QKClip`;
    the entry points read the logits and apply it); ``"transport_clip"`` (opt-in, an experiment), a step-by-step
    action too: each head's transport ``O_h V_h`` is held within ``transport_clip.factor`` of a scaled isometry
    (:class:`connmon.alerts.TransportClip`). ``on_alert(alert)`` is called on every process; an exception
    there is reported, never raised. Every action that answers alerts is one
    :class:`connmon.alerts.action.AlertAction` in its own module (:attr:`parts`, answered in the order log, W&B,
    ``on_alert``, back-off, restore point, stop); the clips are step actions (:attr:`step_actions`), driven after
    every optimizer step by :class:`connmon.alerts.step_clips.StepClips`.

    Args:
        rules: the rules; None for :func:`connmon.alerts.default_rules`.
        actions: any of ``"log"``, ``"wandb"``, ``"stop"``, ``"backoff"``, ``"checkpoint"``, ``"qk_clip"``,
            ``"transport_clip"``.
        stop_level: the lowest level that requests a stop.
        on_alert: called with every :class:`connmon.alerts.Alert`.
        wait_duration: seconds W&B waits before sending another alert with the same title.
        history: how many recent alerts ``alerts`` keeps.
        backoff: the :class:`connmon.alerts.LearningRateBackoff` for ``"backoff"`` (None: its defaults, factor 0.5).
        restore_points: the :class:`connmon.alerts.RestorePoints` for ``"checkpoint"`` (None: its defaults, level
            ``"WARN"``, the last 3 kept).
        qk_clip: the :class:`connmon.alerts.QKClip` for ``"qk_clip"`` (None: its defaults, threshold 100).
        transport_clip: the :class:`connmon.alerts.TransportClip` for ``"transport_clip"`` (None: factor 2).

    Raises:
        ValueError: for an unknown action or level, a ``qk_clip`` or ``transport_clip`` given without its action, a
            history that is not an integer >= 0, a wait that is not a number >= 0, rules that are not Rule or AllOf
            objects (a rule factory such as ``default_rules`` passed uncalled is named), an on_alert that is not
            callable, or duplicate rule names.

    Examples:
        >>> from connmon.alerts import AlertRunner, Rule, Threshold
        >>> runner = AlertRunner([Rule("big", "x", Threshold(1.0))], actions=("stop",))
        >>> runner.run({"x": 0.5}, step=0)
        ([], False)
        >>> alerts, stop = runner.run({"x": 2.0}, step=1)
        >>> [a.rule for a in alerts], stop, runner.total
        (['big'], False, 1)
    """

    def __init__(
        self,
        rules: Sequence[Rule | AllOf] | None = None,
        *,
        actions: Sequence[Action] = DEFAULT_ACTIONS,
        stop_level: Level = "ERROR",
        on_alert: Callable[[Alert], Any] | None = None,
        wait_duration: float = 300.0,
        history: int = 100,
        backoff: LearningRateBackoff | None = None,
        restore_points: RestorePoints | None = None,
        qk_clip: QKClip | None = None,
        transport_clip: TransportClip | None = None,
    ) -> None:
        if isinstance(actions, (str, bytes)) or not isinstance(actions, (list, tuple)):
            raise ValueError(f"actions must be a list or tuple of {KNOWN_ACTIONS}, got actions={actions!r}")
        for i, action in enumerate(actions):
            check_choice(f"actions[{i}]", action, KNOWN_ACTIONS)
        if backoff is not None and not isinstance(backoff, LearningRateBackoff):
            raise ValueError(f"backoff must be a connmon.alerts.LearningRateBackoff or None, got {backoff!r}")
        if restore_points is not None and not isinstance(restore_points, RestorePoints):
            raise ValueError(f"restore_points must be a connmon.alerts.RestorePoints or None, got {restore_points!r}")
        if qk_clip is not None and not isinstance(qk_clip, QKClip):
            raise ValueError(f"qk_clip must be a connmon.alerts.QKClip or None, got {qk_clip!r}")
        if transport_clip is not None and not isinstance(transport_clip, TransportClip):
            raise ValueError(f"transport_clip must be a connmon.alerts.TransportClip or None, got {transport_clip!r}")
        for name, given in (("qk_clip", qk_clip), ("transport_clip", transport_clip)):
            if given is not None and name not in actions:
                raise ValueError(
                    f"{name}={given!r} is configured, but {name!r} is not in actions={tuple(actions)!r}, so it would "
                    f"never act: add {name!r} to actions, or leave {name} out"
                )
        check_choice("stop_level", stop_level, LEVELS)
        check_number("history", history, low=0, integer=True)
        check_number("wait_duration", wait_duration, low=0)  # checked whether or not "wandb" is among the actions
        if rules is not None:
            check_items("rules", rules, (Rule, AllOf), "connmon.alerts.Rule or AllOf objects", hint=_rule_hint)
        check_callable("on_alert", on_alert, optional=True, signature="on_alert(alert)")
        self.rules = RuleSet(default_rules() if rules is None else rules)
        self.actions = tuple(actions)
        self.stop_level = stop_level
        self.on_alert = on_alert
        self.wait_duration = wait_duration
        self.alerts: deque[Alert] = deque(maxlen=history)
        self.notices: deque[Alert] = deque(maxlen=history)  # what the notice rules said (``Rule(kind="notice")``)
        self.total = 0
        self._raised: set[str] = set()  # the actions whose answer raised (said once each)
        made: dict[str, Callable[[], AlertAction]] = {
            "log": LogAlerts,
            "wandb": lambda: WandbAlerts(wait_duration),
            "stop": lambda: StopRun(stop_level),
            "backoff": lambda: backoff or LearningRateBackoff(),
            "checkpoint": lambda: restore_points or RestorePoints(),
        }
        self.parts: dict[str, AlertAction] = {name: made[name]() for name in ANSWER_ORDER if name in self.actions}
        self.backoff = self._part("backoff", LearningRateBackoff)
        self.restore_points = self._part("checkpoint", RestorePoints)
        self.qk_clip = (qk_clip or QKClip()) if "qk_clip" in self.actions else None
        self.transport_clip = (transport_clip or TransportClip()) if "transport_clip" in self.actions else None
        clips: list[HeadClipCount | None] = [self.qk_clip, self.transport_clip]
        self.step_actions: dict[str, HeadClipCount] = {clip.name: clip for clip in clips if clip is not None}

    def _part(self, name: str, kind: type[_A]) -> _A | None:
        part = self.parts.get(name)
        return part if isinstance(part, kind) else None

    def run(
        self,
        values: Mapping[str, float],
        step: int,
        wandb: Any = None,
        agree: Callable[[bool], bool] = bool,
    ) -> tuple[list[Alert], bool]:
        """Feed one sample's values; returns the alerts raised and whether they ask the run to stop.

        Args:
            values: every logged key of the sample and its value.
            step: the sample's step.
            wandb: a :class:`connmon.sinks.wandb.WandbSink`, or None.
            agree: a decision every process takes together (a trainer's any-process reduction); the restore point
                asked for and the stop are agreed through it, so one process's request is every process's.
        """
        fired = self.rules.update(values, step)
        alerts = [alert for alert in fired if alert.kind == "warning"]
        for notice in (alert for alert in fired if alert.kind == "notice"):
            self.notices.append(notice)
            warn_rank_zero(
                f"connmon notice (at risk, not a claim that the run will fail): {notice.rule}: {notice.text}"
            )
        self.total += len(alerts)
        self.alerts.extend(alerts)
        alerted = Alerted(alerts, step, wandb, agree)
        handled = False  # the user's handler sees the alerts after the log and W&B, before any action moves the run
        for name, part in self.parts.items():
            if name not in ("log", "wandb") and not handled:
                handled = True
                self._call_on_alert(alerts)
            try:
                part.answer(alerted)
            except Exception as error:  # an action must not end the training run; the others still answer
                if name not in self._raised:
                    self._raised.add(name)
                    warn_rank_zero(
                        f"connmon: the {getattr(part, 'name', name)!r} action raised {type(error).__name__}: {error} "
                        f"answering the alerts of step {step}; the run and the other actions go on (said once per "
                        "action)"
                    )
        if not handled:
            self._call_on_alert(alerts)
        stop = self.parts.get("stop")
        return alerts, isinstance(stop, StopRun) and stop.requested

    def _call_on_alert(self, alerts: Sequence[Alert]) -> None:
        if self.on_alert is None:
            return
        for alert in alerts:
            try:
                self.on_alert(alert)
            except Exception as error:  # a user's handler must not end the training run
                warn_rank_zero(f"connmon: on_alert raised {type(error).__name__}: {error}; the run goes on")

    def attach(self, optimizers: Sequence[Any], owner: str) -> None:
        """The ``"backoff"`` action, for every entry point: its hooks on ``optimizers`` (one warning if there are none).

        Examples:
            >>> import torch
            >>> from connmon.alerts import AlertRunner
            >>> optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
            >>> runner = AlertRunner([], actions=("backoff",))
            >>> runner.attach([optimizer], owner="my loop")
            >>> len(optimizer._optimizer_step_pre_hooks), runner.detach(), len(optimizer._optimizer_step_pre_hooks)
            (1, None, 0)
        """
        if self.backoff is None:
            return
        if not optimizers:
            warn_rank_zero(
                f"{owner}: the 'backoff' action scales the optimizer's learning rate, and no optimizer was given "
                "(optimizer=...): no back-off in this run"
            )
            return
        self.backoff.attach(list(optimizers))

    def detach(self) -> None:
        """Remove the back-off's optimizer hooks (the run is over)."""
        if self.backoff is not None:
            self.backoff.detach()

    def say_stop(self, owner: str, step: int) -> None:
        """The ``"stop"`` action's one line, said by the entry point that stops its trainer (rank zero)."""
        StopRun(self.stop_level).say(owner, step)

    def counts(self, alerts: Sequence[Alert]) -> dict[str, float]:
        """The alert counts to log beside a sample (``connmon/alerts/count``, ``/total``; ``connmon/lr_scale``)."""
        counts = {keys.ALERT_COUNT: float(len(alerts)), keys.ALERT_TOTAL: float(self.total)}
        if self.backoff is not None:
            counts[keys.LR_SCALE] = self.backoff.scale
        return counts

    def state_dict(self) -> dict[str, Any]:
        """The rules' state, the alert count, and each action's (the back-off's scale, the restore points kept, ...)."""
        state = {"rules": self.rules.state_dict(), "total": self.total}
        for key, part in self._saved_parts():
            state[key] = part.state_dict()
        return state

    def _saved_parts(self) -> list[tuple[str, AlertAction | HeadClipCount]]:
        """Every action with a state to save, by its key: the alert actions', then the step actions'."""
        parts: list[AlertAction | HeadClipCount] = [*self.parts.values(), *self.step_actions.values()]
        return [(part.state_key, part) for part in parts if part.state_key is not None]

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved."""
        self.rules.load_state_dict(state_dict.get("rules", {}))
        self.total = state_dict.get("total", 0)
        for key, part in self._saved_parts():
            if state_dict.get(key) is not None:
                part.load_state_dict(state_dict[key])


def _rule_hint(item: object) -> str:
    """Advice for a wrong item of ``rules``: a factory passed uncalled, or a list where its items belong."""
    if callable(item) and not isinstance(item, type):
        name = getattr(item, "__name__", "it")
        return f" (the function {name} itself: call it, {name}(), and unpack the rules it returns)"
    if isinstance(item, (list, tuple)):
        return " (a list inside the list: unpack it, rules=[*rules, ...])"
    return ""
