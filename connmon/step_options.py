"""StepOptions: how often a run reads its per-step signals, declared, checked and documented once.

Every entry point takes them as keywords: the attention monitors (:class:`connmon.Monitor`, Lightning's
``ConnectionMonitor``, the Hugging Face and OLMo-core callbacks) through their sampling options
(:class:`connmon.sampling.SamplingOptions` extends :class:`StepOptions`), Lightning's ``SharpnessMonitor`` beside its
curvature options, so a run without attention sets them too; a Lightning run reads what any of its callbacks sets
(:func:`run_step_options`). :class:`connmon.step_signals.StepSignals` reads them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TypedDict

from connmon._options import check_int
from connmon._ranks import warn_rank_zero

__all__ = ["STEP_OPTION_NAMES", "StepKeywords", "StepOptions", "run_step_options"]


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class StepOptions:
    """How often the per-step signals are read, checked when built.

    Attributes:
        logit_every_n_steps: read every head's max attention logit over the whole batch of every this-many-th
            optimizer step exactly (every training forward of it, MAX-reduced across processes:
            :mod:`connmon.capture.max_logit`), shown to the alert rules and logged at each sample as
            ``connmon/step_max_logit/L<ll>``; None for never. An exact reading costs a training step 5% (256 tokens)
            to 25% (4096 tokens) on a CPU (``benchmarks/bench_max_logit.py``); on the other steps each head's bound
            comes free from the attention kernel's logsumexp (``connmon/max_logit_bound/L<ll>``), and the
            ``"qk_clip"`` action reads exactly only a call whose bound passes its threshold. Read where an attention
            monitor is (it reads the logits).
        optimizer_every_n_steps: after every this-many-th optimizer step, read the update the optimizer took from
            its own state (Adam's and AdamW's update RMS, stale-second-moment share and update-to-weight ratio;
            RMSprop's and Adagrad's RMS and ratio; SGD momentum's ratio: :mod:`connmon.curvature.optimizer_state`),
            logged at each sample (attention or curvature) as the largest over the steps read since the previous one
            (``connmon/update_rms``, ``connmon/stale_second_moment``, ``connmon/update_to_weight``); None for never.
            One reading costs 1.2-1.5% of a CPU step at widths 128-768 and 256+ tokens and 7.8% of the example's
            small step (width 128, 16 x 64 tokens; ``benchmarks/bench_step_signals.py``), so the default 10 spends
            0.8% there.

    Raises:
        ValueError: for an invalid option (the message names it and the valid values).

    Examples:
        >>> from connmon.step_options import StepOptions
        >>> StepOptions(optimizer_every_n_steps=1).logit_every_n_steps
        25
        >>> StepOptions(logit_every_n_steps=0)
        Traceback (most recent call last):
        ...
        ValueError: logit_every_n_steps must be an integer >= 1 or None, got logit_every_n_steps=0
    """

    logit_every_n_steps: int | None = 25
    optimizer_every_n_steps: int | None = 10

    def __post_init__(self) -> None:
        for name in STEP_OPTION_NAMES:
            check_int(name, getattr(self, name), optional=True)

    def step_options(self) -> StepOptions:
        """These options alone (a subclass's others dropped).

        Examples:
            >>> from connmon.sampling import SamplingOptions
            >>> SamplingOptions(every_n_steps=5, optimizer_every_n_steps=2).step_options()
            StepOptions(logit_every_n_steps=25, optimizer_every_n_steps=2)
        """
        return StepOptions(**{name: getattr(self, name) for name in STEP_OPTION_NAMES})


STEP_OPTION_NAMES: tuple[str, ...] = tuple(field.name for field in dataclasses.fields(StepOptions))


class StepKeywords(TypedDict, total=False):
    """The step options as keywords, for an entry point's ``**options: Unpack[...]``.

    Names and types only: each is documented, defaulted and checked in :class:`StepOptions` (a test holds the two to
    the same names and types).
    """

    logit_every_n_steps: int | None
    optimizer_every_n_steps: int | None


def run_step_options(parts: Sequence[tuple[str, StepOptions]]) -> StepOptions:
    """The step options of a run whose ``parts`` (each ``(name, options)``) each bring theirs: what any sets.

    An option keeps its default unless a part sets another value; where two parts set different values the first
    part's is read, with one line that says so (rank zero).

    Examples:
        >>> import warnings
        >>> from connmon.step_options import StepOptions, run_step_options
        >>> run_step_options([("ConnectionMonitor", StepOptions()),
        ...                   ("SharpnessMonitor", StepOptions(optimizer_every_n_steps=1))])
        StepOptions(logit_every_n_steps=25, optimizer_every_n_steps=1)
        >>> with warnings.catch_warnings(record=True) as said:
        ...     warnings.simplefilter("always")
        ...     run_step_options([("ConnectionMonitor", StepOptions(optimizer_every_n_steps=5)),
        ...                       ("SharpnessMonitor", StepOptions(optimizer_every_n_steps=1))])
        StepOptions(logit_every_n_steps=25, optimizer_every_n_steps=5)
        >>> str(said[0].message).split(":")[0]
        'optimizer_every_n_steps is set to 5 by ConnectionMonitor and to 1 by SharpnessMonitor'
    """
    default, chosen = StepOptions(), {}
    for name in STEP_OPTION_NAMES:
        set_to = [(owner, getattr(options, name)) for owner, options in parts]
        set_to = [(owner, value) for owner, value in set_to if value != getattr(default, name)]
        if not set_to:
            chosen[name] = getattr(default, name)
            continue
        (first, value), others = set_to[0], [each for each in set_to if each[1] != set_to[0][1]]
        if others:
            warn_rank_zero(
                f"{name} is set to {value} by {first} and to {others[0][1]} by {others[0][0]}: it is one setting of "
                f"the run's step signals, so the run reads {value} ({first}'s); set it on one of them"
            )
        chosen[name] = value
    return StepOptions(**chosen)
