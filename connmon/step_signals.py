"""StepSignals: a run's per-step part, read right after every optimizer step and kept until a sample logs it.

Every step of a run has signals beside the sampled ones: each head's max logit over the step's whole batch (read by
the attention samplers, :meth:`connmon.attention_sampler.AttentionSampler.read_step_logits`), the clips that act on
it (:class:`connmon.alerts.step_clips.StepClips`), the optimizer's own state
(:class:`connmon.curvature.optimizer_state.OptimizerSignalWindow`) and the trainer's own latest values (its loss,
gradient norm, ...: :meth:`StepSignals.trainer_values`), on the cadences of its
:class:`connmon.step_options.StepOptions`. This part owns when they are read (in the optimizer's step post-hook, when
the run's optimizers are known), the clips and the optimizer's state, what of them waits for the next sample
(:meth:`StepSignals.window`), and that window in a checkpoint. :class:`connmon.Monitor` drives it from its event
protocol, as it drives the samplers.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from connmon._collectives import gathered_objects, is_distributed
from connmon._ranks import warn_rank_zero
from connmon.alerts.runner import AlertRunner
from connmon.alerts.step_clips import StepClips
from connmon.capture.max_logit import HeadMaxLogits
from connmon.curvature.optimizer_state import OptimizerSignalWindow
from connmon.step_options import StepOptions

__all__ = ["StepSignals"]

PostHook = Callable[[torch.optim.Optimizer, Any, Any], None]
TrainerValues = Callable[[], Mapping[str, Any]]


class StepSignals:
    """The per-step signals of a run: the clips, the optimizer's state, the trainer's values, and when each is read.

    Args:
        options: how often each signal is read (:class:`connmon.step_options.StepOptions`).
        owner: the entry point named in its lines.
        trainer: the trainer's own latest values, ``trainer()`` (its loss, gradient norm, learning rate, ...: what the
            entry point's trainer logged), called where the alert rules run (:meth:`trainer_values`); None for none.

    Examples:
        >>> import torch
        >>> from connmon.step_options import StepOptions
        >>> from connmon.step_signals import StepSignals
        >>> weight = torch.nn.Parameter(torch.ones(2))
        >>> optimizer = torch.optim.Adam([weight], lr=0.1)
        >>> signals = StepSignals(StepOptions(optimizer_every_n_steps=1), owner="example")
        >>> weight.grad = torch.ones(2)
        >>> optimizer.step()
        >>> signals.read_optimizer(optimizer, steps_taken=1)
        >>> "connmon/update_rms" in signals.window(None, []), signals.window(None, [])  # logged once, then afresh
        (True, {})
    """

    def __init__(self, options: StepOptions, owner: str, trainer: TrainerValues | None = None) -> None:
        self.owner = owner
        self.options = options
        self.trainer = trainer  # the trainer's own latest values, read where the rules run
        self.given: Mapping[str, Any] | None = None  # a plain loop's values for the step under way (in trainer's place)
        self._said_trainer = False
        every = options.optimizer_every_n_steps
        self.optimizer_state = OptimizerSignalWindow(owner) if every is not None else None  # since the last sample
        self.clips: StepClips | None = None
        self.logits_after_step = False  # the post-hooks read each step's max logits: an optimizer is known
        self._hooks: list[Any] = []

    def use(self, alerts: AlertRunner | None) -> None:
        """The clips of ``alerts``' step actions (none without them)."""
        clips = StepClips(alerts.qk_clip, alerts.transport_clip, self.owner) if alerts is not None else None
        self.clips = clips if clips is not None and clips.active else None

    def attach(self, optimizers: Sequence[torch.optim.Optimizer], reads_logits: bool, after_step: PostHook) -> None:
        """Call ``after_step`` right after each of ``optimizers``' steps, where there is something to read there.

        ``reads_logits``: an attention sampler reads each step's max logits (they are then read after the step).
        """
        self.detach()
        self.logits_after_step = bool(optimizers) and reads_logits
        if self.logits_after_step or self.optimizer_state is not None:
            self._hooks = [optimizer.register_step_post_hook(after_step) for optimizer in optimizers]

    def detach(self) -> None:
        """Remove the optimizers' post-hooks."""
        for handle in self._hooks:
            handle.remove()
        self._hooks, self.logits_after_step = [], False

    def reads_after_step(self, uneven: bool) -> bool:
        """Whether each step's max logits are read in the optimizer's post-hook: for a clip, or under uneven inputs.

        Elsewhere they are read at the next step's start, so a sample logs the steps before its own.
        """
        return self.logits_after_step and (self.clips is not None or uneven)

    def read_optimizer(self, optimizer: torch.optim.Optimizer | None, steps_taken: int) -> None:
        """The optimizer's state after ``steps_taken`` steps, into the window, on every ``optimizer_every_n_steps``-th.

        A reading that raises turns it off for the run, with one line; the run goes on.
        """
        every, state = self.options.optimizer_every_n_steps, self.optimizer_state
        if optimizer is None or state is None or every is None or steps_taken % every:
            return
        try:
            state.read(optimizer, steps_taken)
        except Exception as error:  # a reading must not end the training run
            warn_rank_zero(
                f"{self.owner}: reading the optimizer's state raised {type(error).__name__}: {error}; it is off for "
                "this run"
            )
            self.optimizer_state = None

    def trainer_values(self) -> dict[str, float]:
        """The trainer's own latest values for the rules: its numbers, each the mean over the processes that have it.

        :attr:`given` (a plain loop's) if set, else ``trainer()``'s. A value is a number or a one-element tensor; others
        are left out. Under ``torch.distributed`` a collective (an all-gather of the values, every process at the same
        samples; a process's own loss is of its own batch, the step trains on all of them). A ``trainer()`` that
        raises gives nothing, said once.

        Examples:
            >>> import torch
            >>> from connmon.step_options import StepOptions
            >>> from connmon.step_signals import StepSignals
            >>> signals = StepSignals(StepOptions(), "example", trainer=lambda: {"loss": torch.tensor(2.5), "tag": "a"})
            >>> signals.trainer_values()
            {'loss': 2.5}
        """
        values: Mapping[str, Any] = {}
        if self.given is not None:
            values = self.given
        elif self.trainer is not None:
            try:
                values = self.trainer()
            except Exception as error:  # the rules go on without them; the training run too
                if not self._said_trainer:
                    self._said_trainer = True
                    warn_rank_zero(
                        f"{self.owner}: reading the trainer's latest values for the rules raised "
                        f"{type(error).__name__}: {error}; the rules see none of them"
                    )
        own = {str(key): number for key, value in values.items() if (number := _number(value)) is not None}
        if not is_distributed():
            return own
        everyone = gathered_objects(own)
        return {key: sum(part[key] for part in everyone if key in part) / sum(key in part for part in everyone)
                for key in dict.fromkeys(key for part in everyone for key in part)}  # fmt: skip

    def window(self, logits: HeadMaxLogits | None, places: Sequence[int]) -> dict[str, float]:
        """What a sample logs of the steps since the last: what the clips did, the optimizer's state.

        The clips' values are of ``logits``' layers (the model's layer index of each in ``places``); both windows then
        start afresh.
        """
        values = self.clips.values(logits, places) if self.clips is not None else {}
        return {**values, **self.optimizer_window()}

    def optimizer_window(self) -> dict[str, float]:
        """The optimizer's state since the last sample (a curvature sample logs it too); the window starts afresh."""
        return self.optimizer_state.take() if self.optimizer_state is not None else {}

    def state_dict(self) -> dict[str, Any]:
        """The windows not logged yet: what QK-clip did, the optimizer's state."""
        return {
            "clip_window": self.clips.window_state() if self.clips is not None else None,
            "optimizer_state": self.optimizer_state.state_dict() if self.optimizer_state is not None else None,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved."""
        if self.clips is not None:
            self.clips.load_window(state.get("clip_window"))
        if self.optimizer_state is not None and state.get("optimizer_state") is not None:
            self.optimizer_state.load_state_dict(state["optimizer_state"])


def _number(value: Any) -> float | None:
    """``value`` as a float where it is a real number or a one-element tensor, else None."""
    if isinstance(value, torch.Tensor):
        return float(value.item()) if value.numel() == 1 and not value.is_complex() else None
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    return None
