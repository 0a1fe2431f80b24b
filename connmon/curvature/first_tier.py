"""When the free per-step signals move: where the curvature, the costly second tier, is read densely.

Every step gives, at no extra cost, each head's max-logit bound from the attention kernel's logsumexp
(:mod:`connmon.capture.max_logit`) and the optimizer's own state (:mod:`connmon.curvature.optimizer_state`).
:class:`FirstTierGate` keeps the last ``window`` steps of each, takes their largest as the reference at each curvature
sample, and says a signal *moved* when a later step's value reaches ``factor`` times that reference and is above
the signal's floor. A
:class:`~connmon.curvature.sampler.SharpnessSampler` with ``cadence="gated"`` then samples at its densest interval
(:meth:`~connmon.curvature.sampler.SharpnessSampler.signal_moved`) instead of its slow base one.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from typing import Any

from connmon import keys

__all__ = ["FIRST_TIER_FACTORS", "FirstTierGate"]

# the signals the gate watches: (the factor over its reference that counts as a move, the floor it must pass).
# benchmarks/README.md (bench_mechanisms.py, the cadence table) has how they were chosen: the logits above 20 (a
# healthy head's level at 64 tokens; their growth as attention learns, from 2 to 6, is no move), Adam's update RMS
# (the update-to-weight ratio follows the learning rate's warmup, and the stale share moved on healthy runs)
FIRST_TIER_FACTORS: dict[str, tuple[float, float]] = {
    keys.metric_key(keys.MAX_LOGIT_BOUND): (1.5, 20.0),  # the largest bound over every layer and head
    keys.UPDATE_RMS: (2.0, 0.0),
}


class FirstTierGate:
    """Whether a first-tier signal moved since the last curvature sample.

    Args:
        factors: each watched signal's key, the factor over its reference that counts as a move and the floor a
            value must pass to count.
        window: steps whose largest value is a signal's reference at a curvature sample.

    Examples:
        >>> from connmon.curvature.first_tier import FirstTierGate
        >>> gate = FirstTierGate({"logit": (1.5, 4.0)}, window=3)
        >>> [gate.step({"logit": v}) for v in (2.0, 3.0, 2.5)]  # no curvature sample yet: no reference
        [False, False, False]
        >>> gate.sampled()  # the reference: 3.0, the largest of the last 3 steps
        >>> [gate.step({"logit": v}) for v in (4.0, 4.6)]  # 4.0 is below 1.5 x 3.0; 4.6 passes it and the floor
        [False, True]
    """

    def __init__(self, factors: Mapping[str, tuple[float, float]] | None = None, window: int = 40) -> None:
        self.factors = dict(FIRST_TIER_FACTORS if factors is None else factors)
        self.window = window
        self.recent: dict[str, deque[float]] = {key: deque(maxlen=window) for key in self.factors}
        self.reference: dict[str, float] = {}

    def step(self, values: Mapping[str, float]) -> bool:
        """One step's values (any keys; the watched ones are kept): whether one reached its factor x reference."""
        moved = False
        for key, value in values.items():
            if key not in self.factors or not math.isfinite(value):
                continue
            reference = self.reference.get(key)
            factor, floor = self.factors[key]
            moved |= reference is not None and reference > 0 and value >= factor * reference and value > floor
            self.recent[key].append(value)
        return moved

    def sampled(self) -> None:
        """A curvature sample was taken: each signal's reference is now the largest of its last ``window`` steps."""
        self.reference = {key: max(recent) for key, recent in self.recent.items() if recent}

    def state_dict(self) -> dict[str, Any]:
        """The recent values and the references (a resumed run gates as the uninterrupted one)."""
        return {"recent": {key: list(recent) for key, recent in self.recent.items()}, "reference": dict(self.reference)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved."""
        for key, values in state.get("recent", {}).items():
            if key in self.recent:
                self.recent[key] = deque(values, maxlen=self.window)
        self.reference = {key: value for key, value in state.get("reference", {}).items() if key in self.factors}
