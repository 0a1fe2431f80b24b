"""What a monitor costs: the time spent in connmon against the training time on the same clock, and a budget.

Every monitor holds a :class:`CostClock`. Its sections (:meth:`CostClock.measuring`) enclose all of the monitor's
work on a sampled step; on an accelerator the device is synchronized at both ends of a section, so asynchronous
kernels are counted where they run (and a section's start waits for the training work queued before it, which is
not counted). The training time is the wall time since :meth:`CostClock.start` minus the time of every monitor
running beside it (one base for all of a run's monitors: the attention's and the curvature's shares add up to the
total), so ``fraction`` is connmon's time over the time the training would have taken without it.

A ``budget`` (a fraction such as 0.01) holds a monitor's costly part inside that share of the training: the
attention's full samples by their measured time (:mod:`connmon._budget`), the curvature's readings by the passes of the
step's batch they take (:class:`connmon.curvature.sampler.SharpnessSampler`). Every process decides from the same
figures, so the cadence is the same everywhere.

Examples:
    >>> from connmon._cost import CostClock
    >>> clock = CostClock("curvature")
    >>> clock.spent  # seconds in connmon so far
    0.0
"""

from __future__ import annotations

import contextlib
import math
import time
import weakref
from collections.abc import Iterator, Sequence

import torch

from connmon import keys
from connmon._copying import CopiesDetached


class CostClock(CopiesDetached):
    """Seconds spent in connmon, and the training time around them, on one clock.

    Args:
        part: what it measures, in the logged key ``connmon/overhead/<part>`` (``"attention"``, ``"curvature"``).
        device: where the work runs; CUDA (or another accelerator) is synchronized at each section's ends.

    Examples:
        >>> import time
        >>> from connmon._cost import CostClock
        >>> clock = CostClock("attention")
        >>> clock.start()
        >>> with clock.measuring():
        ...     time.sleep(0.01)
        >>> clock.spent >= 0.01
        True
        >>> clock.stop()
    """

    _not_copied = (("_others", weakref.WeakKeyDictionary),)  # a copy runs alone

    def __init__(self, part: str = "connmon", device: torch.device | str = "cpu") -> None:
        self.part = part
        self.device = torch.device(device)
        self.spent = 0.0
        self.sections = 0
        self._started: float | None = None
        self._stopped: float | None = None
        # the other monitors' clocks running beside this one: their spent seconds when they met (not ours before)
        self._others: weakref.WeakKeyDictionary[CostClock, float] = weakref.WeakKeyDictionary()
        self._depth = 0  # sections nest (a recording inside a sample): only the outermost counts
        _RUNNING.discard(self)

    def start(self) -> None:
        """Start the training clock (a new run): nothing spent yet."""
        self.spent, self.sections, self._started, self._stopped = 0.0, 0, time.perf_counter(), None
        self._others = weakref.WeakKeyDictionary({c: c.spent for c in _RUNNING})  # their time so far is not ours
        for other in _RUNNING:
            other._others[self] = 0.0  # from now on, this clock's time is not the other's training time either
        _RUNNING.add(self)

    def stop(self) -> None:
        """The run ended: the training clock stops, and this clock no longer counts towards :func:`total_fraction`."""
        if self._started is not None and self._stopped is None:
            self._stopped = time.perf_counter()
        _RUNNING.discard(self)

    def to(self, device: torch.device | str) -> CostClock:
        """Synchronize ``device`` from now on."""
        self.device = torch.device(device)
        return self

    @contextlib.contextmanager
    def measuring(self) -> Iterator[None]:
        """Count the block as connmon's time (synchronizing the device at both ends); nested blocks count once.

        Inside a ``torch.compile`` trace (a capture hook traced into a graph) nothing is timed.
        """
        if self._depth or torch.compiler.is_compiling():
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
            return
        self._synchronize()
        begin = time.perf_counter()
        self._depth = 1
        try:
            yield
        finally:
            self._depth = 0
            self._synchronize()
            self.spent += time.perf_counter() - begin
            self.sections += 1

    @property
    def others(self) -> float:
        """Seconds the other monitors running beside this one spent since they met it."""
        return sum(max(other.spent - spent, 0.0) for other, spent in list(self._others.items()))

    @property
    def training(self) -> float:
        """Seconds of training since :meth:`start`: every monitor's time excluded (this one's and the others')."""
        if self._started is None:
            return 0.0
        end = self._stopped if self._stopped is not None else time.perf_counter()
        return max(end - self._started - self.spent - self.others, 0.0)

    @property
    def fraction(self) -> float:
        """The time spent in connmon over the training time (NaN before any training time has passed)."""
        training = self.training
        return self.spent / training if training > 0 else math.nan

    def _synchronize(self) -> None:
        if self.device.type == "cuda" and torch.cuda.is_available():
            torch.cuda.synchronize(self.device)
        elif self.device.type not in ("cpu", "meta"):
            module = getattr(torch, self.device.type, None)
            if module is not None and hasattr(module, "synchronize"):
                module.synchronize()


_RUNNING: weakref.WeakSet[CostClock] = weakref.WeakSet()  # the clocks of the monitors of the runs now training


def total_fraction(clock: CostClock) -> float:
    """Every running monitor's time since ``clock`` started, over the training time since then.

    A monitor left running by an earlier run (never stopped) adds only what it spends from then on.

    Examples:
        >>> from connmon._cost import CostClock, total_fraction
        >>> clock = CostClock("attention")
        >>> clock.start()
        >>> total_fraction(clock) >= 0
        True
        >>> clock.stop()
    """
    training = clock.training
    return (clock.spent + clock.others) / training if training > 0 else math.nan


def overhead_values(clock: CostClock, steps_trained: int | None = None) -> dict[str, float]:
    """``connmon/overhead`` (every running monitor) and ``connmon/overhead/<part>`` (this one), as logged.

    ``steps_trained``, the optimizer steps trained since the clock started: with none yet (a sample at a run's first
    step) there is no training time to compare with, and nothing is returned (a startup against a single forward
    would read 10x).

    Examples:
        >>> from connmon._cost import CostClock, overhead_values
        >>> clock = CostClock("curvature")
        >>> clock.start()
        >>> sorted(overhead_values(clock)), overhead_values(clock, steps_trained=0)
        (['connmon/overhead', 'connmon/overhead/curvature'], {})
        >>> clock.stop()
    """
    if steps_trained is not None and steps_trained < 1:
        return {}
    values = {keys.OVERHEAD: total_fraction(clock), keys.overhead_key(clock.part): clock.fraction}
    return {key: value for key, value in values.items() if math.isfinite(value)}


def cost_line(owner: str, clocks: Sequence[CostClock]) -> str:
    """What an entry point's monitors cost over a run, in one line (every entry point says it at the run's end).

    Args:
        owner: the entry point.
        clocks: the clocks of its parts (attention, curvature); those that timed nothing are left out.

    Examples:
        >>> from connmon._cost import CostClock, cost_line
        >>> cost_line("connmon.Monitor", [CostClock("attention")])
        'connmon.Monitor cost nothing measurable (no sample was taken)'
    """
    timed = [clock for clock in clocks if clock.sections and math.isfinite(clock.fraction)]
    if not timed:
        return f"{owner} cost nothing measurable (no sample was taken)"
    parts = ", ".join(f"{clock.part} {100 * clock.fraction:.2f}%" for clock in timed)
    spent = sum(clock.spent for clock in timed)
    return (
        f"{owner} cost {100 * sum(clock.fraction for clock in timed):.2f}% of training time ({parts}; {spent:.2f} s "
        f"in connmon against {max(clock.training for clock in timed):.1f} s of training)"
    )


def check_budget(budget: object) -> None:
    """A budget is None or a fraction in (0, 1).

    Examples:
        >>> from connmon._cost import check_budget
        >>> check_budget(2)
        Traceback (most recent call last):
        ...
        ValueError: budget must be None or a fraction of training time in (0, 1) such as 0.01, got budget=2
    """
    if budget is None:
        return
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0 < budget < 1:
        raise ValueError(
            f"budget must be None or a fraction of training time in (0, 1) such as 0.01, got budget={budget!r}"
        )
