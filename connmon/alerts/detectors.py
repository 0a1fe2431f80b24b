"""Online change detectors over one scalar series: threshold, EWMA z-score, CUSUM, non-finite.

Design notes:

* A detector sees one value per sample (``update(value)``) and answers with a :class:`Detection` when its test
  fires, else None. It keeps only O(1) state, which round-trips through ``state_dict``/``load_state_dict``, so a
  resumed run continues its baselines instead of re-learning them (and re-alerting).
* Non-finite values are not data: every detector except :class:`NonFinite` ignores them, so one NaN neither
  fires a z-score nor poisons a baseline. :class:`NonFinite` fires on them immediately.
* ``direction`` says which deviation counts: ``"rise"`` (larger than the baseline), ``"fall"`` or ``"both"``.
* The statistical detectors standardize against an exponentially weighted mean and variance (West 1979's
  incremental form) and stay silent for their first ``warmup`` finite values, while that baseline forms.
* CUSUM is Page's (1954) one-sided cumulative sum on standardized values, ``S = max(0, S + z - drift)``, firing at
  ``S > threshold``, and restarting from 0 after it fires. Its baseline absorbs each value clipped to 2 standard
  deviations, so a shift is accumulated before it is learned.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Literal, get_args

from connmon._options import check_choice, check_int, check_number

__all__ = ["CUSUM", "Detection", "Detector", "Direction", "EWMAZScore", "Growth", "NonFinite", "Surge", "Threshold"]

Direction = Literal["rise", "fall", "both"]
_DIRECTIONS: tuple[Direction, ...] = get_args(Direction)


@dataclass(frozen=True)
class Detection:
    """What a detector saw when it fired.

    Attributes:
        statistic: the test statistic (the value itself, a z-score or a cumulative sum).
        threshold: the bound it crossed.
        baseline: the baseline the value was compared with (None where there is none).
    """

    statistic: float
    threshold: float
    baseline: float | None = None


class Detector(ABC):
    """A stateful online test over one scalar series."""

    @abstractmethod
    def update(self, value: float) -> Detection | None:
        """Take the next value; a Detection when the test fires."""

    def state_dict(self) -> dict[str, Any]:
        """The detector's state (plain Python numbers)."""
        return dict(self.__dict__)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved (missing entries keep their current value)."""
        for key, value in state.items():
            if key in self.__dict__:
                setattr(self, key, value)


def _check_direction(direction: str) -> None:
    check_choice("direction", direction, _DIRECTIONS)


def _signed(deviation: float, direction: Direction) -> float:
    """The deviation in the watched direction (positive = towards an alert)."""
    if direction == "rise":
        return deviation
    if direction == "fall":
        return -deviation
    return abs(deviation)


class Threshold(Detector):
    """Fires when a value crosses a fixed bound (on ``consecutive`` finite values in a row).

    Args:
        bound: the bound.
        direction: ``"rise"`` fires on ``value > bound``, ``"fall"`` on ``value < bound``; ``"both"`` on
            ``|value| > bound``.
        consecutive: how many successive finite values must cross the bound; the detector fires on the last of them,
            and then on every further one while the streak lasts. A value that does not cross restarts the count;
            a non-finite value neither counts nor restarts it.

    Raises:
        ValueError: for an unknown direction or ``consecutive < 1``.

    Examples:
        >>> from connmon.alerts import Threshold
        >>> detector = Threshold(50.0)
        >>> [detector.update(v) is not None for v in (10.0, 49.0, 51.0)]
        [False, False, True]
        >>> detector = Threshold(1.0, consecutive=2)
        >>> [detector.update(v) is not None for v in (1.2, 0.9, 1.1, 1.3, 1.4)]
        [False, False, False, True, True]
    """

    def __init__(self, bound: float, direction: Direction = "rise", consecutive: int = 1) -> None:
        _check_direction(direction)
        check_number("bound", bound)
        check_int("consecutive", consecutive)
        self.bound, self.direction, self.consecutive = float(bound), direction, consecutive
        self.streak = 0  # successive values across the bound so far

    def update(self, value: float) -> Detection | None:  # noqa: D102
        if not math.isfinite(value):
            return None
        if self.direction == "both":
            crossed = abs(value) > abs(self.bound)
        else:
            crossed = _signed(value - self.bound, self.direction) > 0
        self.streak = self.streak + 1 if crossed else 0
        return Detection(value, self.bound) if self.streak >= self.consecutive else None


class Growth(Detector):
    """Fires when a positive series has grown (or shrunk) by a factor relative to the first finite value it saw.

    Scale-free, and needs no baseline to form: it is the detector for the first steps of a run, where an LR too high
    shows as attention logits that multiply within tens of steps while a good run's barely move.

    Args:
        factor: the ratio that fires (> 1).
        direction: ``"rise"`` fires on ``value > factor * first``, ``"fall"`` on ``value < first / factor``,
            ``"both"`` on either.

    Examples:
        >>> from connmon.alerts import Growth
        >>> detector = Growth(4.0)
        >>> [detector.update(v) is not None for v in (1.5, 2.0, 5.0, 7.0)]
        [False, False, False, True]
    """

    def __init__(self, factor: float, direction: Direction = "rise") -> None:
        _check_direction(direction)
        check_number("factor", factor, low=1, low_open=True)
        self.factor, self.direction = float(factor), direction
        self.first: float | None = None

    def update(self, value: float) -> Detection | None:  # noqa: D102
        if not math.isfinite(value):
            return None
        if self.first is None:
            self.first = value
            return None
        ratio = value / self.first if self.first else math.inf
        rose = self.direction != "fall" and ratio > self.factor
        fell = self.direction != "rise" and ratio < 1 / self.factor
        return Detection(ratio, self.factor if rose else 1 / self.factor, self.first) if rose or fell else None


class Surge(Detector):
    """Fires on a value at least ``floor`` and ``factor`` times the smallest of the ``span`` values before it.

    A level and a sustained rate together: the value must be large in itself, and must have multiplied within the
    window the last ``span`` samples cover (at 25 steps a sample, 4 samples: 100 steps). A series that lives high
    and steady never fires; one that multiplies from a small level never fires until it is large. Needs ``span``
    values before it can fire.

    Args:
        factor: the growth over the window that fires (> 1).
        span: how many earlier values the window holds (>= 1).
        floor: the smallest value that fires.

    Examples:
        >>> from connmon.alerts import Surge
        >>> detector = Surge(4.0, span=2, floor=100.0)
        >>> [detector.update(v) is not None for v in (2.0, 20.0, 60.0, 150.0, 160.0)]
        [False, False, False, True, False]
        >>> detector = Surge(4.0, span=2, floor=100.0)
        >>> [detector.update(v) is not None for v in (120.0, 130.0, 125.0, 140.0)]  # high and steady
        [False, False, False, False]
    """

    def __init__(self, factor: float, span: int = 4, floor: float = 0.0) -> None:
        check_number("factor", factor, low=1, low_open=True)
        check_int("span", span)
        check_number("floor", floor)
        self.factor, self.span, self.floor = float(factor), span, float(floor)
        self.window: list[float] = []

    def update(self, value: float) -> Detection | None:  # noqa: D102
        if not math.isfinite(value):
            return None
        low = min(self.window) if len(self.window) == self.span else None
        self.window = [*self.window, value][-self.span :]
        if low is None or value < self.floor or value < self.factor * low:
            return None
        return Detection(value / low if low > 0 else math.inf, self.factor, low)

    def load_state_dict(self, state: dict[str, Any]) -> None:  # noqa: D102
        super().load_state_dict(state)
        self.window = list(self.window)


class _Baseline(Detector):
    """An exponentially weighted mean and variance, with a warmup count."""

    def __init__(self, alpha: float, warmup: int, min_std: float, log: bool) -> None:
        check_number("alpha", alpha, low=0, high=1, low_open=True)
        check_number("warmup", warmup, low=2, integer=True)  # a variance needs two values
        check_number("min_std", min_std, low=0)
        if not isinstance(log, bool):
            raise ValueError(f"log must be True or False, got log={log!r}")
        self.alpha, self.warmup, self.min_std, self.log = float(alpha), int(warmup), float(min_std), bool(log)
        self.seen, self.mean, self.var = 0, 0.0, 0.0

    def _scale(self, value: float) -> float:
        """The value on the detector's scale: ``log(value)`` with ``log=True`` (NaN for ``value <= 0``)."""
        if not self.log:
            return value
        return math.log(value) if value > 0 else math.nan

    def _baseline(self) -> float:
        """The baseline mean in the series' units (the geometric mean with ``log=True``)."""
        return math.exp(self.mean) if self.log else self.mean

    def _std(self) -> float:
        return max(math.sqrt(self.var), self.min_std, 1e-12 * max(abs(self.mean), 1.0))

    def _z(self, value: float) -> float:
        return (value - self.mean) / self._std()

    def update(self, value: float) -> Detection | None:
        """Take the next value; a Detection when the test fires (no test during the warmup)."""
        value = self._scale(value)
        if not math.isfinite(value):
            return None
        hit = None
        if self.seen >= self.warmup:
            hit, value = self._test(value, self._z(value))
        self._absorb(value)
        return hit

    @abstractmethod
    def _test(self, value: float, z: float) -> tuple[Detection | None, float]:
        """The test on a value (z its z-score): a Detection or None, and the value the baseline absorbs."""

    def _absorb(self, value: float) -> None:
        self.seen += 1
        if self.seen == 1:
            self.mean, self.var = value, 0.0
            return
        # equal weights (a plain running mean) until 1 / alpha values are in, exponential weights after that
        alpha = max(self.alpha, 1.0 / self.seen)
        delta = value - self.mean
        self.mean += alpha * delta
        self.var = (1 - alpha) * (self.var + alpha * delta * delta)


class EWMAZScore(_Baseline):
    """Fires when a value is more than ``threshold`` standard deviations from its exponentially weighted baseline.

    Args:
        threshold: z-score that fires.
        direction: which deviation counts.
        alpha: weight of the newest value in the baseline (``0.1``: a memory of about 10 samples).
        warmup: finite values absorbed before the detector may fire.
        min_std: floor of the baseline's standard deviation (in the series' units), so a flat series does not
            turn a tiny wobble into a huge z-score.
        log: test ``log(value)`` (positive series whose changes are multiplicative, such as attention logits);
            nonpositive values are then ignored. The baseline and ``min_std`` are on that scale.

    Examples:
        >>> from connmon.alerts import EWMAZScore
        >>> detector = EWMAZScore(threshold=4.0, warmup=5)
        >>> hits = [detector.update(v) for v in (1.0, 1.1, 0.9, 1.0, 1.1, 0.9, 1.0, 3.0)]
        >>> [h is not None for h in hits]
        [False, False, False, False, False, False, False, True]
    """

    def __init__(
        self, threshold: float = 4.0, direction: Direction = "rise", alpha: float = 0.1, warmup: int = 10,
        min_std: float = 0.0, log: bool = False,
    ) -> None:  # fmt: skip
        _check_direction(direction)
        check_number("threshold", threshold, low=0, low_open=True)  # a z-score
        super().__init__(alpha, warmup, min_std, log)
        self.threshold, self.direction = float(threshold), direction

    def _test(self, value: float, z: float) -> tuple[Detection | None, float]:
        fired = _signed(z, self.direction) > self.threshold
        return (Detection(z, self.threshold, self._baseline()) if fired else None), value


class CUSUM(_Baseline):
    """Page's cumulative sum of standardized deviations from an exponentially weighted baseline.

    ``S = max(0, S + z - drift)`` with ``z`` the value's z-score in the watched direction; fires when
    ``S > threshold`` and restarts from 0. It catches a sustained small shift that no single z-score shows.

    Args:
        threshold: the cumulative sum that fires (``h``, in standard deviations).
        drift: slack subtracted per value (``k``): shifts below ``drift`` standard deviations do not accumulate.
        direction: which deviation counts (``"both"`` keeps one sum per side).
        alpha: weight of the newest value in the baseline; small, so a shift is not absorbed before it is seen.
        warmup: finite values absorbed before the detector may fire.
        min_std: floor of the baseline's standard deviation.
        log: test ``log(value)`` (see :class:`EWMAZScore`).

    Examples:
        >>> from connmon.alerts import CUSUM
        >>> detector = CUSUM(threshold=5.0, warmup=5)
        >>> hits = [detector.update(v) for v in [1.0, 1.2, 0.8, 1.1, 0.9] + [1.4] * 4]  # a ~3-sigma shift
        >>> [h is not None for h in hits]  # fires on the third shifted value (no single z-score here exceeds 4)
        [False, False, False, False, False, False, False, True, False]
    """

    def __init__(
        self, threshold: float = 5.0, drift: float = 0.5, direction: Direction = "rise", alpha: float = 0.02,
        warmup: int = 10, min_std: float = 0.0, log: bool = False,
    ) -> None:  # fmt: skip
        _check_direction(direction)
        check_number("threshold", threshold, low=0, low_open=True)
        check_number("drift", drift, low=0)
        super().__init__(alpha, warmup, min_std, log)
        self.threshold, self.drift, self.direction = float(threshold), float(drift), direction
        self.high, self.low = 0.0, 0.0

    def _test(self, value: float, z: float) -> tuple[Detection | None, float]:
        self.high = max(0.0, self.high + z - self.drift) if self.direction != "fall" else 0.0
        self.low = max(0.0, self.low - z - self.drift) if self.direction != "rise" else 0.0
        statistic, hit = max(self.high, self.low), None
        if statistic > self.threshold:
            hit = Detection(statistic, self.threshold, self._baseline())
            self.high = self.low = 0.0
        # clipped to 2 standard deviations, a shift moves the baseline slowly enough to be accumulated first
        return hit, self.mean + max(-2.0, min(2.0, z)) * self._std()


class NonFinite(Detector):
    """Fires on a NaN or infinite value, at once.

    Examples:
        >>> from connmon.alerts import NonFinite
        >>> detector = NonFinite()
        >>> [detector.update(v) is not None for v in (1.0, float("nan"), float("inf"))]
        [False, True, True]
    """

    def update(self, value: float) -> Detection | None:  # noqa: D102
        return None if math.isfinite(value) else Detection(value, math.inf)
