"""SharpnessSampler: the curvature against the edge of stability every N optimizer steps, for every entry point.

Lightning's :class:`connmon.callbacks.SharpnessMonitor`, the Hugging Face
:class:`connmon.integrations.transformers.ConnectionMonitorCallback` (``sharpness=``) and :class:`connmon.Monitor`
(``sharpness=``) drive one :class:`SharpnessSampler` from their hooks, so the estimator, its cadence, the budget and
what is logged are defined here once. The estimators (:mod:`connmon.curvature` has the derivations):

* ``"lanczos"`` (the default): :func:`connmon.curvature.sharpness_ratio`, the top of the preconditioned Hessian's
  spectrum against the edge (1), by double backward through SDPA's math kernel: about ``lanczos_steps + 1`` double
  backward passes per sample. Logged as ``connmon/sharpness_ratio`` and ``connmon/sharpness_eigenvalue``, what
  :func:`connmon.alerts.edge_of_stability_rule` watches.
* ``"difference"``: the curvature along the optimizer's own update ``u`` (:class:`connmon.curvature.UpdateProbe`)
  from three forwards of ``loss_fn`` at ``theta - u``, ``theta``, ``theta + u`` on the sampled step's (first) batch,
  on the model's own kernels (flash, fused, compiled, FSDP2).
* ``"secant"``: the same from ``u . (g_{t+1} - g_t)``, the gradients of the step before a sampled one and of the
  sampled one: no forward, no loss function, a few dot products and one copy of the parameters for one step.

The update readings are a lower bound of the Lanczos ratio (a Rayleigh quotient of the same matrix). On the
instability suite they read 2-30% of it and never reached the edge before a divergence (benchmarks/README.md),
so they are logged under their own keys, ``connmon/update_sharpness_ratio`` and
``connmon/update_sharpness_eigenvalue``, which no default rule watches: a cheap panel of the curvature along the
step, not the divergence warning. Every sample also logs ``connmon/overhead`` and ``connmon/overhead/curvature``
(see :mod:`connmon._cost`).

The events, with ``step`` the number of optimizer steps taken so far:

* :meth:`SharpnessSampler.before_step` after the backward and before ``optimizer.step()``;
* ``optimizer.step()`` itself is watched through the optimizer's step post-hook (registered by :meth:`attach`);
* :meth:`SharpnessSampler.before_forward` before the first forward of the next step (difference and Lanczos).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, Literal

import torch
from torch import Tensor, nn

from connmon._cost import CostClock, agreed, check_budget, overhead_values, stride_for
from connmon._options import check_int
from connmon._ranks import warn_rank_zero
from connmon.capture import paused
from connmon.curvature import UpdateProbe, check_optimizer, sharpness_ratio

Estimator = Literal["lanczos", "difference", "secant"]
ESTIMATORS: tuple[Estimator, ...] = ("lanczos", "difference", "secant")
RATIO_KEY = "connmon/sharpness_ratio"
EIGENVALUE_KEY = "connmon/sharpness_eigenvalue"
UPDATE_RATIO_KEY = "connmon/update_sharpness_ratio"
UPDATE_EIGENVALUE_KEY = "connmon/update_sharpness_eigenvalue"


def keys_of(estimator: Estimator) -> tuple[str, str]:
    """The ratio and eigenvalue keys an estimator logs.

    Examples:
        >>> from connmon.integrations.sharpness import keys_of
        >>> keys_of("secant")
        ('connmon/update_sharpness_ratio', 'connmon/update_sharpness_eigenvalue')
    """
    return (RATIO_KEY, EIGENVALUE_KEY) if estimator == "lanczos" else (UPDATE_RATIO_KEY, UPDATE_EIGENVALUE_KEY)


class SharpnessSampler:
    """Reads the curvature against the optimizer's edge of stability on every ``every_n_steps``-th optimizer step.

    Nothing of the training run changes: parameters, gradients, optimizer state, random streams (forked) and buffers
    (restored) are as they were, bitwise. Anything it cannot measure (an unsupported optimizer, an error, running
    out of memory) turns it off for the run with one warning, on every process alike; the training run goes on.
    Under ``torch.distributed`` every process reads its own value and the mean is logged (one all-reduce per
    sample; every process must drive the sampler on the same steps).

    Args:
        every_n_steps: sample at optimizer steps ``every_n_steps``, ``2 every_n_steps``, ...
        estimator: ``"lanczos"``, ``"difference"`` or ``"secant"`` (see the module docstring).
        lanczos_steps: Hessian-vector products per sample with ``"lanczos"``.
        budget: None, or the fraction of training time the samples may take (e.g. 0.01): after each sample, the
            sampler keeps only every ``k``-th of the candidate steps, ``k`` the smallest stride whose measured mean
            cost fits (decided from the largest figures across processes, so identical everywhere, and saved in
            :meth:`state_dict`). Said once per change.
        owner: the entry point named in warnings.

    Raises:
        ValueError: for an invalid option (the message names the valid ones).

    Examples:
        >>> import torch
        >>> from connmon.integrations.sharpness import SharpnessSampler
        >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
        <torch._C.Generator object at ...>
        >>> model = torch.nn.Linear(4, 1)
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> sampler = SharpnessSampler(every_n_steps=2, estimator="secant")
        >>> sampler.attach(optimizer)
        >>> x, y = torch.randn(64, 4), torch.randn(64, 1)
        >>> for step in range(4):
        ...     optimizer.zero_grad()
        ...     torch.nn.functional.mse_loss(model(x), y).backward()
        ...     values = sampler.before_step(step)
        ...     optimizer.step()
        >>> sorted(sampler.last_values)[-2:]  # one batch, a quadratic loss: the secant is exact
        ['connmon/update_sharpness_eigenvalue', 'connmon/update_sharpness_ratio']
        >>> sampler.detach()
    """

    def __init__(
        self,
        every_n_steps: int = 40,
        estimator: Estimator = "lanczos",
        lanczos_steps: int = 8,
        budget: float | None = None,
        owner: str = "SharpnessSampler",
    ) -> None:
        check_int("every_n_steps", every_n_steps)
        check_int("lanczos_steps", lanczos_steps)
        check_budget(budget)
        if estimator not in ESTIMATORS:
            raise ValueError(f"estimator must be one of {ESTIMATORS}, got estimator={estimator!r}")
        self.every_n_steps = every_n_steps
        self.estimator = estimator
        self.lanczos_steps = lanczos_steps
        self.budget = budget
        self.owner = owner
        self.clock = CostClock("curvature")
        self.off: str | None = None  # why the sampler is off for this run, if it is
        self.samples = 0
        self.stride = 1  # with a budget: sample every stride-th candidate step
        self.last_values: dict[str, float] = {}
        self.optimizer: torch.optim.Optimizer | None = None
        self._device = torch.device("cpu")
        self._hook: Any = None
        self._probe: UpdateProbe | None = None
        self._probe_step = -1  # the step the probe's update leads to (read at that step)
        self._stepped = False  # the probe's optimizer step happened
        self._last_step: int | None = None  # the step last measured (once, however many micro-batches)
        self._start_step: int | None = None  # the first step seen since attach (the clock's start)
        self._failure: str | None = None  # why the pending probe could not be used

    # --- life cycle -----------------------------------------------------------------------------------------------

    def attach(self, optimizer: torch.optim.Optimizer, device: torch.device | str | None = None) -> None:
        """Watch ``optimizer``'s steps (a step post-hook) and start the cost clock (:meth:`reset` starts a new run).

        More than one optimizer, or an optimizer without a known edge of stability, turns the sampler off with one
        warning.
        """
        self.detach()
        self.off, self.last_values, self._last_step, self._start_step = None, {}, None, None
        self.optimizer = optimizer
        self._device = torch.device(device) if device is not None else _device_of(optimizer)
        self.clock.to(self._device).start()
        try:
            check_optimizer(optimizer)
        except ValueError as error:
            self.turn_off(str(error))
            return
        self._hook = optimizer.register_step_post_hook(self._after_step)

    def reset(self) -> None:
        """A new run: no sample taken, the budget's stride back to 1."""
        self.samples, self.stride, self.last_values = 0, 1, {}

    def detach(self) -> None:
        """Remove the optimizer hook and drop any pending probe (its parameter copy)."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._probe = None
        self.clock.stop()

    # --- the cadence ------------------------------------------------------------------------------------------------

    def due(self, step: int) -> bool:
        """Whether optimizer step ``step`` (steps taken so far) is sampled."""
        return self.off is None and step > 0 and step % (self.every_n_steps * self.stride) == 0

    # --- events -----------------------------------------------------------------------------------------------------

    def before_step(self, step: int) -> dict[str, float] | None:
        """After the backward of the step that follows ``step`` steps, before ``optimizer.step()``.

        With ``"secant"``, a sampled step is read here (the values returned, as logged; None otherwise); with an
        update estimator, the parameters are copied here when the next step is sampled.
        """
        if self.off is not None or self.optimizer is None:
            return None
        if self._start_step is None:
            self._start_step = step
        values = None
        if self.estimator == "secant" and self._probe is not None and self._probe_step == step:
            values = self._read(step, lambda probe: probe.secant())
        if self.estimator != "lanczos" and self.due(step + 1) and self.off is None:
            with self.clock.measuring():
                try:
                    self._probe, self._probe_step, self._stepped = UpdateProbe(self.optimizer), step + 1, False
                except torch.OutOfMemoryError:
                    self._probe = None
                    self.turn_off("it ran out of memory copying the parameters (it holds one copy for one step)")
        return values

    def reads_forward(self, step: int) -> bool:
        """Whether :meth:`before_forward` reads a loss at ``step`` (an entry point fetches the batch only then)."""
        if self.off is not None or self.optimizer is None or self.estimator == "secant" or step == self._last_step:
            return False
        if self.estimator == "difference":
            return self._probe is not None and self._probe_step == step
        return self.due(step)

    def before_forward(
        self, step: int, loss_fn: Callable[[], Tensor] | None, model: nn.Module | None = None
    ) -> dict[str, float] | None:
        """Before the first forward after ``step`` steps: read ``"difference"`` or ``"lanczos"`` on ``loss_fn()``."""
        if not self.reads_forward(step):
            return None
        if loss_fn is None:
            self.turn_off(f"estimator={self.estimator!r} needs a loss function (or use estimator='secant')")
            return None
        if self.estimator == "difference":
            return self._read(step, lambda probe: probe.difference(loss_fn, model=model, seed=step))
        optimizer = self.optimizer

        def lanczos(_: Any) -> Any:
            return sharpness_ratio(loss_fn, optimizer, steps=self.lanczos_steps, model=model, seed=step)

        return self._read(step, lanczos, needs_probe=False)

    # --- state ------------------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Samples taken and the budget's stride."""
        return {"samples": self.samples, "stride": self.stride}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved."""
        self.samples = int(state_dict.get("samples", 0))
        self.stride = int(state_dict.get("stride", 1))

    # --- workers ----------------------------------------------------------------------------------------------------

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._probe is None or self._stepped or self.off is not None:
            return
        with self.clock.measuring():
            try:
                self._probe.stepped()
                self._stepped = True
            except Exception as error:  # never end the training run; _read reports it on every process
                self._probe, self._failure = None, f"{type(error).__name__}: {error}"

    def _read(self, step: int, read: Callable[[Any], Any], needs_probe: bool = True) -> dict[str, float] | None:
        with self.clock.measuring():
            self._last_step = step
            if self._start_step is None:
                self._start_step = step - 1
            failure = self._failure
            ratio, constant = math.nan, math.nan
            if failure is None and needs_probe and not self._stepped:
                failure = "the optimizer did not step after its parameters were copied"
            if failure is None:
                try:
                    with paused():
                        result = read(self._probe)
                    ratio, constant = result.ratio, result.constant
                except torch.OutOfMemoryError:
                    if torch.cuda.is_available():
                        torch.cuda.empty_cache()
                    failure = "it ran out of memory"
                except Exception as error:  # never end the training run
                    failure = f"{type(error).__name__}: {error}"
            self._probe, self._failure = None, None
            measured = failure is None
            total = torch.tensor([ratio if measured else 0.0, float(measured), float(not measured)],
                                 dtype=torch.float64, device=self._device)  # fmt: skip
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                torch.distributed.all_reduce(total)  # every process takes part in exactly one reduction per sample
            summed, count, failed = total.tolist()
            if failed:
                self.turn_off(failure or "it failed on another process (that process's warning says why)")
                return None
            ratio = summed / count
            self.samples += 1
        ratio_key, eigenvalue_key = keys_of(self.estimator)
        values = {ratio_key: ratio, eigenvalue_key: ratio * constant, **overhead_values(self.clock)}
        self.last_values = values
        if self.budget is not None:
            self._rebudget(step)
        return values

    def _rebudget(self, step: int) -> None:
        """Choose the stride whose mean cost per sample fits the budget (the same on every process)."""
        steps = max(step - (self._start_step or 0), 1)
        cost, training = agreed(self.clock.spent / self.samples, self.clock.training / steps, device=self._device)
        stride = stride_for(self.budget, cost, training * self.every_n_steps)
        if stride != self.stride:
            self.stride = stride
            warn_rank_zero(
                f"{self.owner}: budget {100 * self.budget:g}%: a curvature sample costs {cost:.3g} s and a training "
                f"step {training:.3g} s, so it samples every {stride * self.every_n_steps} steps "
                f"(every_n_steps={self.every_n_steps} x {stride})"
            )

    def turn_off(self, why: str) -> None:
        """Stop sampling for the rest of this run (dropping any parameter copy), with one warning that says why."""
        self.off = why
        self._probe = None
        warn_rank_zero(f"{self.owner} is off for the rest of this run: {why}")


def _device_of(optimizer: torch.optim.Optimizer) -> torch.device:
    for group in optimizer.param_groups:
        for p in group["params"]:
            return p.device
    return torch.device("cpu")
