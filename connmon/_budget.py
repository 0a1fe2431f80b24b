"""A monitor held to a budget: how often a sample may compute the costly diagnostics, from what samples cost.

A full sample (the spectrum group and the edge isometry gap) costs more than a light one. With ``budget`` (a fraction
of training time), :class:`FullSampleBudget` sets ``full_every_n_samples`` from the costs measured in the run, the
smallest stride whose mean cost per step stays inside the budget; every process decides from the same figures (the
largest across processes), so the stride is the same everywhere.
"""

from __future__ import annotations

import math

from connmon._collectives import largest_over_processes
from connmon._cost import CostClock
from connmon._ranks import warn_rank_zero

NO_FULL_SAMPLES = 10**6  # the stride when not even the light samples fit


class FullSampleBudget:
    """The stride of full samples that keeps a monitor sampling every ``every_n_steps`` steps inside ``budget``.

    Args:
        budget: the fraction of training time the monitor may take.
        every_n_steps: the monitor's cadence.
        owner: the entry point named in the warning that says each new stride.

    Examples:
        >>> from connmon._budget import FullSampleBudget
        >>> from connmon._cost import CostClock
        >>> budget, clock = FullSampleBudget(0.5, every_n_steps=1, owner="doc"), CostClock()
        >>> budget.record(clock, step=0, full=True, began=0.0, stride=25) is None  # a full sample, no light one yet
        True
    """

    def __init__(self, budget: float, every_n_steps: int, owner: str) -> None:
        self.budget, self.every_n_steps, self.owner = budget, every_n_steps, owner
        self.reset()

    def reset(self) -> None:
        """A new run: no cost measured yet."""
        self._costs = {True: [0.0, 0], False: [0.0, 0]}  # full?: [seconds, samples] this run
        self._first_step: int | None = None

    def record(self, clock: CostClock, step: int, full: bool, began: float, stride: int) -> int | None:
        """Count the sample just finished (``clock.spent`` since ``began``); a new stride for the current ``stride``.

        None while the costs are not measured yet or when ``stride`` still fits.

        Every process must call it at the same samples (the costs are agreed across processes).
        """
        if self._first_step is None:
            self._first_step = step
        self._costs[full][0] += clock.spent - began
        self._costs[full][1] += 1
        (full_s, full_n), (light_s, light_n) = self._costs[True], self._costs[False]
        if not full_n or (not light_n and stride > 1):
            return None  # a full sample measured, and a light one unless every sample is full (then light counts as 0)
        steps = max(step - self._first_step, 1)
        full_cost, light_cost, step_time = largest_over_processes(
            full_s / full_n, light_s / light_n if light_n else 0.0, clock.training / steps, device=clock.device
        )
        allowed = self.budget * self.every_n_steps * step_time  # seconds a sample may cost on average
        if light_cost >= allowed:
            fitting = NO_FULL_SAMPLES
        else:
            fitting = max(1, math.ceil((full_cost - light_cost) / (allowed - light_cost) - 1e-9))
        if fitting == stride:
            return None
        stride = fitting
        fits = (
            f"a full sample every {stride} samples"
            if stride < NO_FULL_SAMPLES
            else f"no full samples (light ones alone cost {100 * light_cost / allowed * self.budget:.2g}%: raise "
            "every_n_steps)"
        )
        warn_rank_zero(
            f"{self.owner}: budget {100 * self.budget:g}%: a full sample costs {full_cost:.3g} s, a light one "
            f"{light_cost:.3g} s and a training step {step_time:.3g} s, so {fits}"
        )
        return stride
