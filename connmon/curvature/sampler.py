"""SharpnessSampler: the curvature against the edge of stability on a cadence that follows it, for every entry point.

Lightning's :class:`connmon.callbacks.SharpnessMonitor`, the Hugging Face
:class:`connmon.integrations.transformers.ConnectionMonitorCallback` (``sharpness=``) and :class:`connmon.Monitor`
(``sharpness=``) drive one :class:`SharpnessSampler` from their hooks, so the estimator, its cadence, the budget and
what is logged are defined here once. The estimators (:mod:`connmon.curvature` has the derivations):

* ``"finite_difference_lanczos"`` (the default): :func:`connmon.curvature.sharpness_ratio`, the top of the
  preconditioned Hessian's spectrum against the edge (1), by Lanczos with Hessian products from differences of
  first-order gradients, through the model's own kernels (fused and flash SDPA, compiled graphs): ``lanczos_steps + 1``
  gradients of the sampled step's whole batch (every micro-batch of an accumulated step) per sample. Logged as
  ``connmon/sharpness_ratio`` and ``connmon/sharpness_eigenvalue``, what :func:`connmon.alerts.edge_of_stability_rule`
  watches.
* ``"exact_lanczos"``: the same quantity with exact products by double backward through SDPA's math kernel (the
  reference; about ``2 lanczos_steps + 1`` gradients' time and a double-backward graph's memory; no fused kernels,
  no compiled graphs).
* ``"difference"``: the curvature along the optimizer's own update ``u`` (:class:`connmon.curvature.UpdateProbe`)
  from three forwards of ``loss_fn`` at ``theta - u``, ``theta``, ``theta + u`` on the sampled step's (first) batch.
* ``"secant"``: the same from ``u . (g_{t+1} - g_t)``, the gradients of the step before a sampled one and of the
  sampled one: no forward, no loss function, a few dot products and one copy of the parameters for one step.

The update readings are a lower bound of the Lanczos ratio (a Rayleigh quotient of the same matrix). On the
instability suite they read 2-30% of it and never reached the edge before a divergence (benchmarks/README.md),
so they are logged under their own keys, ``connmon/update_sharpness_ratio`` and
``connmon/update_sharpness_eigenvalue``, which no default rule watches.

The cadence (``cadence="adaptive"``, the default) follows the risk: ``every_n_steps`` is the densest interval,
taken while the latest ratio is at least 0.5 (on the suite it passes 0.5 some 220-300 steps before a divergence);
from 0.25 the next sample comes ``3 every_n_steps`` later, below 0.25 ``8 every_n_steps`` later (:data:`LADDER`,
:func:`adaptive_interval`).
``cadence="fixed"`` samples every ``every_n_steps``. The readings are held to a budget (``budget=0.05``, the default):
the passes of the step's batch they take (a gradient is one pass; a forward a third of one, since a backward costs
about two forwards) may be at most that fraction of the passes the training has taken since the sampler started,
counted from the first reading on and with the next one priced at the most a reading of its kind has cost
(:func:`passes_allowed`); a reading the budget cannot afford waits for the first step that can. Every sample logs the
interval it chose, ``connmon/curvature_interval``, what the curvature has cost in passes of the step's batch per
training step, ``connmon/overhead/curvature_gradients``, and its time, ``connmon/overhead`` and
``connmon/overhead/curvature`` (see :mod:`connmon._cost`).

The events, with ``step`` the number of optimizer steps taken so far:

* :meth:`SharpnessSampler.before_forward` before every forward of a step (it keeps the batch's loss on a sampled
  step; the ``"difference"`` reading runs here);
* :meth:`SharpnessSampler.before_step` after the backward and before ``optimizer.step()`` (the gradient-difference,
  Lanczos and secant readings run here, on every micro-batch kept);
* ``optimizer.step()`` itself is watched through the optimizer's step post-hook (registered by :meth:`attach`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal, TypedDict, get_args

import torch
from torch import Tensor, nn

from connmon import keys
from connmon._collectives import gathered_objects, is_distributed, sum_over_processes
from connmon._copying import CopiesDetached
from connmon._cost import CostClock, check_budget, overhead_values
from connmon._optimizer import unwrap_optimizer
from connmon._options import check_int, check_number
from connmon._pause import paused
from connmon._ranks import warn_rank_zero
from connmon.curvature import CriticalSharpness, UpdateProbe, check_optimizer, sharpness_ratio
from connmon.curvature.lockstep import PeerFailure
from connmon.curvature.products import Products
from connmon.curvature.ratio import STORAGES, Storage

if TYPE_CHECKING:  # the rules are handed in by the entry points: the curvature imports nothing from alerts/
    from connmon.alerts.rules import RuleSet

Estimator = Literal["finite_difference_lanczos", "exact_lanczos", "difference", "secant", "critical"]
ESTIMATORS: tuple[Estimator, ...] = get_args(Estimator)
Cadence = Literal["adaptive", "fixed"]
CADENCES: tuple[Cadence, ...] = get_args(Cadence)
RATIO_KEY = keys.SHARPNESS_RATIO
EIGENVALUE_KEY = keys.SHARPNESS_EIGENVALUE
UPDATE_RATIO_KEY = keys.UPDATE_SHARPNESS_RATIO
UPDATE_EIGENVALUE_KEY = keys.UPDATE_SHARPNESS_EIGENVALUE
INTERVAL_KEY = keys.CURVATURE_INTERVAL
GRADIENTS_KEY = keys.CURVATURE_GRADIENTS
# The adaptive cadence: (ratio from which, times every_n_steps), densest first. benchmarks/README.md
# (bench_sharpness.py: the suite's runs replayed under candidate ladders) has how this one was chosen.
LADDER: tuple[tuple[float, int], ...] = ((0.5, 1), (0.25, 3), (0.0, 8))
_MAX_MICRO_BATCHES = 1024  # losses kept for one sampled step (a loop that never steps must not grow a list)
DEFAULT_BUDGET = 0.05
FORWARD_PASSES = 1 / 3  # a forward in passes of the step's batch: a gradient (forward and backward) is one


def first_reading_price(estimator: Estimator, lanczos_steps: int) -> float:
    """What a reading is priced at before any has been taken, in passes of the step's batch.

    A Lanczos reading is ``lanczos_steps`` products and the gradient at ``theta``, and on the suite one or two retaken
    products (11 gradients at the median with 8 steps); a critical reading is a cold line search of up to 7 forwards;
    ``"difference"`` is 3 forwards; ``"secant"`` reads gradients the training took.

    Examples:
        >>> from connmon.curvature.sampler import first_reading_price
        >>> first_reading_price("finite_difference_lanczos", 8), round(first_reading_price("critical", 8), 2)
        (11, 2.33)
    """
    if estimator in ("finite_difference_lanczos", "exact_lanczos"):
        return lanczos_steps + 3
    return {"critical": 7 * FORWARD_PASSES, "difference": 3 * FORWARD_PASSES, "secant": 0.0}[estimator]


def passes_allowed(budget: float, steps: int) -> float:
    """The passes of the step's batch that ``steps`` training steps allow the readings under ``budget``.

    A reading is taken at a step where the passes spent so far plus its price fit: ``spent + price <=
    passes_allowed(budget, steps)``, so the mean stays inside the budget from the first reading on.

    Examples:
        >>> from connmon.curvature.sampler import passes_allowed
        >>> passes_allowed(0.05, 220)  # one 11-gradient Lanczos reading
        11.0
    """
    return budget * steps + 1e-9


def keys_of(estimator: Estimator) -> tuple[str, str]:
    """The ratio and eigenvalue keys an estimator logs.

    Examples:
        >>> from connmon.curvature.sampler import keys_of
        >>> keys_of("secant")
        ('connmon/update_sharpness_ratio', 'connmon/update_sharpness_eigenvalue')
    """
    if estimator in ("finite_difference_lanczos", "exact_lanczos"):
        return RATIO_KEY, EIGENVALUE_KEY
    if estimator == "critical":
        return keys.CRITICAL_SHARPNESS_RATIO, keys.CRITICAL_SHARPNESS
    return UPDATE_RATIO_KEY, UPDATE_EIGENVALUE_KEY


def adaptive_interval(ratio: float, every_n_steps: int, ladder: tuple[tuple[float, int], ...] = LADDER) -> int:
    """Steps to the next sample after ``ratio``: ``every_n_steps`` times the first rung of ``ladder`` it reaches.

    A ratio that is not finite (or not above any rung) samples at the densest interval.

    Examples:
        >>> from connmon.curvature.sampler import adaptive_interval
        >>> [adaptive_interval(r, 20) for r in (1.3, 0.5, 0.3, 0.01, float("nan"))]
        [20, 20, 60, 160, 20]
    """
    if math.isfinite(ratio):
        for bound, factor in ladder:
            if ratio >= bound:
                return every_n_steps * factor
    return every_n_steps * ladder[0][1]


class SharpnessKeywords(TypedDict, total=False):
    """:class:`SharpnessSampler`'s options as keywords, for ``SharpnessMonitor(loss_fn, **sampler)``.

    Names and types only: each is documented, defaulted and checked in :class:`SharpnessSampler` (a test holds the
    two to the same names and types).
    """

    every_n_steps: int
    estimator: Estimator
    lanczos_steps: int
    budget: float | None
    cadence: Cadence
    storage: Storage
    first_look_every_n_steps: int | None
    first_look_trigger: float


class SharpnessSampler(CopiesDetached):
    """Reads the curvature against the optimizer's edge of stability on a cadence of optimizer steps.

    Nothing of the training run changes: parameters (written from a saved copy for each product and copied back,
    bitwise), gradients, optimizer state, random streams (forked) and buffers (restored) are as they were. Anything
    it cannot measure (an unsupported optimizer, an error, running out of memory) turns it off for the run with one
    warning, on every process alike; the training run goes on. Under ``torch.distributed`` every process reads its
    own batch and the mean is logged (one all-reduce per sample; every process must drive the sampler on the same
    steps).

    Args:
        every_n_steps: the densest interval: with ``cadence="fixed"``, sample at optimizer steps ``every_n_steps``,
            ``2 every_n_steps``, ...; with ``"adaptive"``, the first sample is at ``every_n_steps`` and each sample
            sets the next one's distance from its ratio (:func:`adaptive_interval`).
        estimator: ``"finite_difference_lanczos"``, ``"exact_lanczos"``, ``"difference"``, ``"secant"`` or
            ``"critical"`` (see the module docstring). ``"critical"`` logs ``connmon/critical_sharpness_ratio``, ``eta /
            eta_c``: the step the optimizer took over the smallest step along the same update that raises the loss of
            the batch it trained on (all its micro-batches; the mean over processes), by a line search of 4-7 forwards
            (:meth:`connmon.curvature.UpdateProbe.critical`), read at the next step's start, warm-started from the
            previous reading; and ``connmon/critical_sharpness_eigenvalue``, ``2 / eta_c`` in the first parameter
            group's learning-rate units (Kalra et al.'s critical sharpness).
        lanczos_steps: Hessian-vector products per sample with the two Lanczos estimators.
        budget: the fraction of the training's passes over its batches the readings may take (0.05: 5%), or None
            for no limit. Counted in passes of the step's batch (a gradient one, a forward a third), from the step
            the sampler starts and from the first reading on: a reading is taken only where the passes spent plus
            its price (the most a reading of its kind has cost in this run, :func:`first_reading_price` before the
            first) fit ``budget`` times the steps taken (:func:`passes_allowed`), else at the first step that fits.
            Deterministic, and the same on every process (each reading's passes are their mean over processes).
            The wait is said once; ``connmon/overhead/curvature_gradients`` logs the passes spent per step, and
            ``connmon/overhead/curvature`` their time.
        cadence: ``"adaptive"`` or ``"fixed"``.
        storage: ``"device"``, or ``"cpu"`` to keep a gradient-difference solve's six parameter-sized vectors in host
            memory (see :func:`connmon.curvature.sharpness_ratio`).
        first_look_every_n_steps: with a Lanczos estimator, None, or two looks: critical sharpness (as
            ``estimator="critical"`` reads it, a few forwards) after every this many optimizer steps as the first
            look, and the Lanczos sample as the second look, on its own cadence and brought forward to the next step
            where the first look reads ``first_look_trigger`` or more (at most once per ``every_n_steps``).
        first_look_trigger: the first look's ratio from which the second look is taken.
        owner: the entry point named in warnings.

    Raises:
        ValueError: for an invalid option (the message names the valid ones).

    Examples:
        >>> import torch
        >>> from connmon.curvature.sampler import SharpnessSampler
        >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
        <torch._C.Generator object at ...>
        >>> model = torch.nn.Linear(4, 1)
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> sampler = SharpnessSampler(every_n_steps=2, budget=None)  # every reading (the default budget: 5%)
        >>> sampler.attach(optimizer)
        >>> x, y = torch.randn(64, 4), torch.randn(64, 1)
        >>> loss_fn = lambda: torch.nn.functional.mse_loss(model(x), y)
        >>> for step in range(4):
        ...     _ = sampler.before_forward(step, loss_fn, model)
        ...     optimizer.zero_grad()
        ...     loss_fn().backward()
        ...     values = sampler.before_step(step)
        ...     optimizer.step()
        >>> sampler.samples, round(sampler.last_values["connmon/sharpness_ratio"], 2)  # lr * lambda_max(H) / 2
        (1, 0.15)
        >>> sampler.last_values["connmon/curvature_interval"]  # far below the edge: 8 every_n_steps
        16
        >>> sampler.detach()
    """

    _not_copied = (("_hook", lambda: None),)  # a copy watches no optimizer until attached

    def __init__(
        self,
        every_n_steps: int = 20,
        estimator: Estimator = "finite_difference_lanczos",
        lanczos_steps: int = 8,
        budget: float | None = DEFAULT_BUDGET,
        cadence: Cadence = "adaptive",
        storage: Storage = "device",
        first_look_every_n_steps: int | None = None,
        first_look_trigger: float = 1.0,
        owner: str = "SharpnessSampler",
    ) -> None:
        check_int("every_n_steps", every_n_steps)
        check_int("lanczos_steps", lanczos_steps)
        check_budget(budget)
        if first_look_every_n_steps is not None:
            check_int("first_look_every_n_steps", first_look_every_n_steps)
        check_number("first_look_trigger", first_look_trigger, low=0.0)
        if estimator not in ESTIMATORS:
            raise ValueError(f"estimator must be one of {ESTIMATORS}, got estimator={estimator!r}")
        if cadence not in CADENCES:
            raise ValueError(f"cadence must be one of {CADENCES}, got cadence={cadence!r}")
        if storage not in STORAGES:
            raise ValueError(f"storage must be one of {STORAGES}, got storage={storage!r}")
        if first_look_every_n_steps is not None and estimator not in ("finite_difference_lanczos", "exact_lanczos"):
            raise ValueError(
                f"first_look_every_n_steps takes a Lanczos estimator for the second look, got estimator={estimator!r}"
            )
        self.every_n_steps = every_n_steps
        self.estimator = estimator
        self.lanczos_steps = lanczos_steps
        self.budget = budget
        self.cadence = cadence
        self.storage = storage
        self.first_look_every_n_steps = first_look_every_n_steps
        self.first_look_trigger = first_look_trigger
        self.owner = owner
        self.clock = CostClock("curvature")
        self.off: str | None = None  # why the sampler is off for this run, if it is
        self.samples = 0
        self.gradients = 0.0  # passes of a step's batch the readings took (the cost in units of a training step's)
        self._prices: dict[str, float] = {}  # the most a reading of each kind has cost, in passes (the budget's price)
        self._counted_from: int | None = None  # the step the budget counts the training's passes from
        self._waited = False  # the budget's wait was said
        self.next_step: int | None = None  # adaptive: the next sampled step (None: the first, at every_n_steps)
        self.held_until = 0  # no sample before this step: the rules watching the ratio are in their cooldown
        self.last_values: dict[str, float] = {}
        self.optimizer: torch.optim.Optimizer | None = None
        self.backoff: Any = None  # a LearningRateBackoff scaling the optimizer's rate inside its steps
        self._device = torch.device("cpu")
        self._hook: Any = None
        self._probe: UpdateProbe | None = None
        self._probe_step = -1  # the step the probe's update leads to (read at that step)
        self._stepped = False  # the probe's optimizer step happened
        self._losses: list[Callable[[], Tensor]] = []  # the sampled step's micro-batches, read before its step
        self._weights: list[float | None] = []  # each one's factor in the step's loss (None: 1 / k)
        self._loss_step = -1  # the step they belong to
        self._model: nn.Module | None = None
        self._last_step: int | None = None  # the step last measured (once, however many micro-batches)
        self._start_step: int | None = None  # the first step seen since attach (the clock's start)
        self._failure: str | None = None  # why the pending probe could not be used
        self._difference_length = math.nan  # the gradient differences' last ||h w|| / ||theta||
        self._critical: tuple[list, list[float] | None, Any] = ([], None, None)  # the probed step's losses
        self._critical_start = 1.0  # where the next line search starts: the last critical step
        self.first_looks = 0  # first looks taken in this run (two looks)
        self._last_lanczos: int | None = None  # the step of the latest second look (two looks)

    @property
    def reads_lanczos(self) -> bool:
        """Whether the estimator is one of the Lanczos ones (the whole step's batch, read before its step)."""
        return self.estimator in ("finite_difference_lanczos", "exact_lanczos")

    @property
    def reads_critical(self) -> bool:
        """Whether critical sharpness is read: the estimator, or the first of two looks."""
        return self.estimator == "critical" or self.first_look_every_n_steps is not None

    def reading_keys(self) -> tuple[str, ...]:
        """The ratio and eigenvalue keys the readings log (the first look's too, with two looks).

        Examples:
            >>> from connmon.curvature.sampler import SharpnessSampler
            >>> SharpnessSampler(first_look_every_n_steps=20).reading_keys()  # doctest: +NORMALIZE_WHITESPACE
            ('connmon/sharpness_ratio', 'connmon/sharpness_eigenvalue', 'connmon/critical_sharpness_ratio',
             'connmon/critical_sharpness_eigenvalue')
        """
        second = keys_of("critical") if self.first_look_every_n_steps is not None else ()
        return (*keys_of(self.estimator), *second)

    # --- life cycle -----------------------------------------------------------------------------------------------

    def attach(
        self, optimizer: torch.optim.Optimizer, device: torch.device | str | None = None, backoff: Any = None
    ) -> None:
        """Watch ``optimizer``'s steps (a step post-hook) and start the cost clock (:meth:`reset` starts a new run).

        More than one optimizer, or an optimizer without a known edge of stability, turns the sampler off with one
        warning. ``backoff``, a :class:`connmon.alerts.LearningRateBackoff` that scales this optimizer's rate inside
        its steps: the readings are of the rate the step applies (its ``pending_scale``).
        """
        self.detach()
        self.backoff = backoff
        self.off, self.last_values, self._last_step, self._start_step = None, {}, None, None
        self.optimizer = optimizer = unwrap_optimizer(optimizer)
        self._device = torch.device(device) if device is not None else _device_of(optimizer)
        self.clock.to(self._device).start()
        try:
            check_optimizer(optimizer)
        except ValueError as error:
            self.turn_off(str(error))
            return
        self._hook = optimizer.register_step_post_hook(self._after_step)

    def reset(self) -> None:
        """A new run: no sample taken, nothing spent against the budget, the cadence from its start."""
        self.samples, self.gradients, self.next_step, self.last_values = 0, 0.0, None, {}
        self._prices, self._counted_from, self._waited = {}, None, False
        self.held_until, self.first_looks, self._last_lanczos, self._critical_start = 0, 0, None, 1.0

    def detach(self) -> None:
        """Remove the optimizer hook and drop any pending probe (its parameter copy) and kept losses."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._probe = None
        self._drop_losses()
        self.clock.stop()

    # --- the cadence ------------------------------------------------------------------------------------------------

    def due(self, step: int) -> bool:
        """Whether optimizer step ``step`` (steps taken so far) is sampled."""
        if self.off is not None or step <= 0 or step < self.held_until:
            return False
        if self.cadence == "fixed" and self.first_look_every_n_steps is None:
            due = step % self.every_n_steps == 0
        else:
            due = step >= (self.next_step if self.next_step is not None else self.every_n_steps)
        return due and self.affords(step, self.estimator)

    def affords(self, step: int, kind: Estimator) -> bool:
        """Whether the budget affords a reading of ``kind`` at step ``step`` (steps taken so far).

        Examples:
            >>> from connmon.curvature.sampler import SharpnessSampler
            >>> sampler = SharpnessSampler(budget=0.05)  # a first Lanczos reading is priced at 11 gradients
            >>> sampler.affords(219, "finite_difference_lanczos"), sampler.affords(220, "finite_difference_lanczos")
            (False, True)
        """
        if self.budget is None:
            return True
        price = self._prices.get(kind, first_reading_price(kind, self.lanczos_steps))
        counted_from = self._counted_from or 0
        if self.gradients + price <= passes_allowed(self.budget, step - counted_from):
            return True
        if not self._waited:
            self._waited = True
            steps = math.ceil((self.gradients + price) / self.budget - 1e-9) + counted_from
            warn_rank_zero(
                f"{self.owner}: budget {100 * self.budget:g}%: a curvature reading ({kind}) is priced at {price:.3g} "
                f"passes of the step's batch (a gradient is one), so readings come at most once every "
                f"{price / self.budget:.0f} steps on average; the next at step {steps} (budget=None: no limit)"
            )
        return False

    def _critical_due(self, step: int) -> bool:
        """Whether the update that leads to step ``step`` is read by critical sharpness."""
        if self.first_look_every_n_steps is None:
            return self.estimator == "critical" and self.due(step)
        return (
            self.off is None
            and step > 0
            and step % self.first_look_every_n_steps == 0
            and self.affords(step, "critical")
        )

    def hold_for(self, rules: RuleSet) -> None:
        """After its values went to ``rules``: no sample while none of its values could raise an alert.

        Once the edge-of-stability rule has fired, it stays quiet for its ``cooldown`` (100 steps by default);
        dense samples past the edge then buy nothing, and cost the most (a run past its edge is sampled at the
        densest interval, with the noise check's second solve). So the next sample comes when a rule watching the
        ratio can fire again (:meth:`connmon.alerts.RuleSet.ready_step`): that is also when a back-off is seen to
        have worked or not. The approach to the edge, where the lead comes from, is sampled as before.
        """
        ready = rules.ready_step(keys_of(self.estimator)[0], self.every_n_steps)
        if ready is not None and ready > self.held_until:
            self.held_until = ready

    # --- events -----------------------------------------------------------------------------------------------------

    def before_step(self, step: int) -> dict[str, float] | None:
        """After the backward of the step that follows ``step`` steps, before ``optimizer.step()``.

        A sampled step is read here with ``"finite_difference_lanczos"``, ``"exact_lanczos"`` (on every micro-batch
        :meth:`before_forward` kept) and ``"secant"`` (the values returned, as logged; None otherwise); with an
        update estimator, the parameters are copied here when the next step is sampled.
        """
        if self.off is not None or self.optimizer is None:
            return None
        if self._start_step is None:
            self._start_step = step
        if self._counted_from is None:
            self._counted_from = step
        values: dict[str, float] | None = None
        if self.reads_critical and self._probe is not None and self._probe_step == step:
            losses, weights, model = self._critical
            self._critical = ([], None, None)
            values = self._read(step, lambda probe: probe.critical(
                losses, weights=weights, model=model, seed=step, start=self._critical_start),
                kind="critical")  # fmt: skip
        if self.reads_lanczos:
            if self._losses and self._loss_step == step and self.due(step):
                losses, weights, model = list(self._losses), _weights(self._weights), self._model
                lanczos = self._read(step, lambda _: self._lanczos(losses, weights, model, step), needs_probe=False)
                values = {**(values or {}), **(lanczos or {})} or None
            if self.first_look_every_n_steps is None:
                self._drop_losses()
                return values
        if self.estimator == "secant" and self._probe is not None and self._probe_step == step:
            values = self._read(step, lambda probe: probe.secant())
        if self.reads_critical and self._loss_step == step and self._critical_due(step + 1):
            self._critical = (list(self._losses), _weights(self._weights), self._model)  # the step about to be taken
        if self.reads_critical:  # the Lanczos estimators alone returned above
            self._drop_losses()
        wanted = self._critical_due(step + 1) if self.reads_critical else self.due(step + 1)
        if wanted and self.off is None:
            with self.clock.measuring():
                try:
                    probe = UpdateProbe(self.optimizer, self._lr_scale())
                    self._probe, self._probe_step, self._stepped = probe, step + 1, False
                except torch.OutOfMemoryError:
                    self._probe = None
                    self.turn_off("it ran out of memory copying the parameters (it holds one copy for one step)")
        return values

    def skip_step(self, step: int) -> None:
        """Read nothing at step ``step`` (only some processes took it): its kept losses and any copy for it dropped."""
        self._drop_losses()
        if self._probe is not None and self._probe_step in (step, step + 1):
            self._probe = None

    def reads_forward(self, step: int) -> bool:
        """Whether :meth:`before_forward` wants the loss at ``step`` (an entry point fetches the batch only then)."""
        if self.off is not None or self.optimizer is None or self.estimator == "secant" or step == self._last_step:
            return False
        if self._counted_from is None:
            self._counted_from = step
        if self.estimator == "difference":
            return self._probe is not None and self._probe_step == step
        if self.reads_critical and self._critical_due(step + 1):  # the batch of a step whose update is read
            return True
        return self.estimator != "critical" and self.due(step)

    def before_forward(
        self,
        step: int,
        loss_fn: Callable[[], Tensor] | None,
        model: nn.Module | None = None,
        weight: float | None = None,
    ) -> dict[str, float] | None:
        """Before a forward after ``step`` steps: keep the micro-batch's loss on a sampled step, or read "difference".

        With the Lanczos estimators every micro-batch of a sampled step is kept (a closure over its batch) and read
        together in :meth:`before_step`; ``"difference"`` reads the step's first batch here (the values returned).
        ``weight`` is the factor the training step puts on this micro-batch's loss before its backward: None for a
        per-micro-batch mean that the trainer divides by the number of micro-batches (Lightning, a plain loop that
        divides by ``k``), ``1`` for a loss already normalised over the whole step (the Hugging Face ``Trainer``
        with ``num_items_in_batch``), so the reading is of the loss the step trains on.
        """
        if not self.reads_forward(step):
            return None
        if loss_fn is None:
            self.turn_off(f"estimator={self.estimator!r} needs a loss function (or use estimator='secant')")
            return None
        if self.estimator == "difference":
            return self._read(step, lambda probe: probe.difference(loss_fn, model=model, seed=step))
        if self._loss_step != step:
            self._drop_losses()
            self._loss_step = step
        if len(self._losses) < _MAX_MICRO_BATCHES:
            self._losses.append(loss_fn)
            self._weights.append(weight)
            self._model = model
        return None

    # --- state ------------------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to go on as the uninterrupted one.

        Samples taken, the passes spent, each kind's price and the step the budget counts from, the next sampled step,
        the hold, and the difference length the gradient differences settled on (where the next sample's search
        starts).
        """
        return {
            "samples": self.samples,
            "gradients": self.gradients,
            "prices": dict(self._prices),
            "counted_from": self._counted_from,
            "next_step": self.next_step,
            "held_until": self.held_until,
            "difference_length": self._difference_length,
            "critical_start": self._critical_start,
            "first_looks": self.first_looks,
            "last_lanczos": self._last_lanczos,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved."""
        self.samples = int(state_dict.get("samples", 0))
        self.gradients = float(state_dict.get("gradients", 0.0))
        self._prices = {str(kind): float(price) for kind, price in state_dict.get("prices", {}).items()}
        counted_from = state_dict.get("counted_from")
        self._counted_from = int(counted_from) if counted_from is not None else None
        next_step = state_dict.get("next_step")
        self.next_step = int(next_step) if next_step is not None else None
        self.held_until = int(state_dict.get("held_until", 0))
        self._difference_length = float(state_dict.get("difference_length", math.nan))
        self._critical_start = float(state_dict.get("critical_start", 1.0))
        self.first_looks = int(state_dict.get("first_looks", 0))
        last = state_dict.get("last_lanczos")
        self._last_lanczos = int(last) if last is not None else None

    # --- workers ----------------------------------------------------------------------------------------------------

    def _lanczos(
        self, losses: list[Callable[[], Tensor]], weights: list[float] | None, model: nn.Module | None, step: int
    ) -> Any:
        assert self.optimizer is not None  # attached
        products: Products = "double_backward" if self.estimator == "exact_lanczos" else "gradient_difference"
        initial = self._difference_length if 0 < self._difference_length < 0.1 else None
        result = sharpness_ratio(
            losses, self.optimizer, steps=self.lanczos_steps, model=model, seed=step, products=products,
            storage=self.storage, initial_length=initial, weights=weights, lr_scale=self._lr_scale(),
        )  # fmt: skip
        if math.isfinite(result.difference_length):
            self._difference_length = (
                result.difference_length
            )  # the next sample's search starts here: fewer retaken products
        return result

    def _lr_scale(self) -> float:
        """The factor the attached back-off applies beyond the groups' rates at the next step (1.0: none)."""
        return self.backoff.pending_scale(self.optimizer) if self.backoff is not None else 1.0

    def _drop_losses(self) -> None:
        self._losses, self._weights, self._loss_step, self._model = [], [], -1, None

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._probe is None or self._stepped or self.off is not None:
            return
        with self.clock.measuring():
            try:
                self._probe.stepped()
                self._stepped = True
            except Exception as error:  # never end the training run; _read reports it on every process
                self._probe, self._failure = None, f"{type(error).__name__}: {error}"

    def _read(
        self, step: int, read: Callable[[Any], Any], needs_probe: bool = True, kind: Estimator | None = None
    ) -> dict[str, float] | None:
        """One reading (``kind``: ``"critical"`` for a first look, else the estimator's), reduced and scheduled."""
        kind = kind or self.estimator
        first_look = kind != self.estimator
        with self.clock.measuring():
            self._last_step = step
            if self._start_step is None:
                self._start_step = step - 1
            failure = self._failure
            ratio, constant, passes = math.nan, math.nan, 0.0
            if failure is None and needs_probe and not self._stepped:
                failure = "the optimizer did not step after its parameters were copied"
            if failure is None:
                try:
                    with paused():
                        result = read(self._probe)
                    ratio, passes = result.ratio, passes_of(result)
                    if isinstance(result, CriticalSharpness):  # its second key: 2 / eta_c in the rate's units
                        assert self.optimizer is not None  # attached: it read a probe of the optimizer's step
                        self._critical_start = result.critical_step
                        constant = 2 / (float(self.optimizer.param_groups[0]["lr"]) * self._lr_scale())
                    else:
                        constant = result.constant
                except torch.OutOfMemoryError:
                    if torch.cuda.is_available():
                        torch.cuda.empty_cache()
                    failure = "it ran out of memory"
                except PeerFailure:
                    failure = ""  # another process's failure, which it reports
                except Exception as error:  # never end the training run
                    failure = f"{type(error).__name__}: {error}"
            self._probe, self._failure = None, None
            measured = failure is None
            total = torch.tensor([ratio if measured else 0.0, float(measured), float(not measured), passes],
                                 dtype=torch.float64, device=self._device)  # fmt: skip
            distributed = is_distributed()
            if distributed:
                sum_over_processes(total)  # every process takes part in exactly one reduction per sample
            summed, count, failed, passes = total.tolist()
            if failed:
                self.turn_off(_first_reason(failure) if distributed else failure or "it failed")
                return None
            ratio, passes = summed / count, passes / count  # the same on every process: the budget decides alike
            self.gradients += passes
            self._prices[kind] = max(self._prices.get(kind, 0.0), passes)
            if first_look:
                self.first_looks += 1
            else:
                self.samples += 1
        ratio_key, eigenvalue_key = keys_of(kind)
        values = {ratio_key: ratio, eigenvalue_key: ratio * constant}
        if first_look:
            if not ratio < self.first_look_trigger:  # NaN too: the second look at the next step, once per interval
                soonest = step + 1 if self._last_lanczos is None else self._last_lanczos + self.every_n_steps
                due = self.next_step if self.next_step is not None else self.every_n_steps
                self.next_step = min(due, max(step + 1, soonest))
        else:
            values[INTERVAL_KEY] = self._schedule(step, ratio)
            if self.reads_lanczos:
                self._last_lanczos = step
        values.update(overhead_values(self.clock, step - (self._start_step or 0)))
        # the run's passes (a resumed run's restored) over its optimizer steps since the sampler started
        values[GRADIENTS_KEY] = self.gradients / max(step - (self._counted_from or 0), 1)
        two_looks = self.first_look_every_n_steps is not None
        self.last_values = {**self.last_values, **values} if two_looks else values
        return values

    def _schedule(self, step: int, ratio: float) -> int:
        """The steps to the next sample (the same on every process: ``ratio`` is their mean)."""
        if self.cadence == "fixed":
            if self.first_look_every_n_steps is not None:  # a second look brought forward moves the fixed grid on
                self.next_step = step + self.every_n_steps
            return self.every_n_steps
        interval = adaptive_interval(ratio, self.every_n_steps)
        self.next_step = step + interval
        return interval

    def turn_off(self, why: str) -> None:
        """Stop sampling for the rest of this run (dropping any parameter copy), with one warning that says why."""
        self.off = why
        self._probe = None
        self._drop_losses()
        warn_rank_zero(f"{self.owner} is off for the rest of this run: {why}")


def _first_reason(mine: str | None) -> str:
    """Why a sample failed, from the first process that failed itself (every process calls it: an all-gather)."""
    reasons = gathered_objects(mine)
    for rank, reason in enumerate(reasons):
        if reason:
            return reason if len(reasons) == 1 else f"on process {rank}, {reason}"
    return "it failed on another process"


def passes_of(result: Any) -> float:
    """The passes of the step's batch a reading took: its gradients, and a third of a pass per forward."""
    if isinstance(result, CriticalSharpness):
        return result.forwards * FORWARD_PASSES
    if getattr(result, "reading", None) == "difference":
        return 3 * FORWARD_PASSES
    return float(getattr(result, "gradient_evaluations", 0))


def _weights(kept: list[float | None]) -> list[float] | None:
    """The micro-batches' factors in the step's loss: None (their mean) unless one was given; a missing one is 1/k."""
    if all(weight is None for weight in kept):
        return None
    return [1 / len(kept) if weight is None else weight for weight in kept]


def _device_of(optimizer: torch.optim.Optimizer) -> torch.device:
    for group in optimizer.param_groups:
        for p in group["params"]:
            return p.device
    return torch.device("cpu")
