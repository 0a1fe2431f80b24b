"""ConnectionMonitorCallback: the monitor for OLMo-core's ``Trainer``.

Needs the ``olmo-core`` extra: ``pip install "torch-connmon[olmo-core]"`` (``ai2-olmo-core`` 3.0.0, torch >= 2.10,
< 2.14). OLMo-core 3.0.0 reaches ``huggingface_hub < 2`` through ``cached-path``, and transformers >= 5.25 needs
``huggingface_hub >= 2.4``, so this extra and ``[transformers]`` are installed in separate environments.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from olmo_core.train.callbacks import Callback
from typing_extensions import Unpack

from connmon._ranks import warn_rank_zero
from connmon.alerts.runner import AlertRunner
from connmon.monitor import Monitor
from connmon.sampling import SamplingKeywords, SamplingOptions, sampling_options

_LOG = logging.getLogger(__name__)
OWNER = "olmo_core ConnectionMonitorCallback"


class ConnectionMonitorCallback(Callback):
    """Reads every self-attention layer as a connection walk every ``every_n_steps`` steps of an OLMo-core run.

    The same sampler as Lightning's :class:`connmon.callbacks.ConnectionMonitor` (:class:`connmon.Monitor`, the same
    options and metrics), driven by OLMo-core's callback events: ``pre_step`` arms the capture for the step's first
    micro-batch (its forward is recorded; every micro-batch's max logits are read), ``pre_optim_step`` runs the
    monitor's before-the-step work after the backward, ``post_train_batch`` (after ``optim_step``) logs the sample,
    runs the rules and the clips. The values go through ``trainer.record_metric`` as ``connmon/<metric>/L<ll>`` and
    ``/all``, so OLMo-core's console, W&B and Comet callbacks show them, at the step OLMo-core numbers (its first
    batch is step 1; a sample of the state after ``k`` optimizer steps is recorded at step ``k + 1``). OLMo-core's
    ``Attention`` modules on its SDPA backend (GQA, RoPE, QK-norm) are read exactly; the flash, ring and Transformer
    Engine backends call kernels connmon does not see, so their layers are skipped with one warning that says why.
    With ``alerts`` an alert at the runner's ``stop_level`` cancels the run (``trainer.cancel_run``, on every process
    at once). The monitor's state rides in OLMo-core's checkpoints (:meth:`state_dict`).

    Not yet: the curvature sampler (``sharpness``) and the ``"checkpoint"`` action (restore points) here.

    Args:
        options: the sampling options (:class:`~connmon.sampling.SamplingOptions`); ``probe`` is not read here.
        alerts: the alert rules and actions (:class:`connmon.alerts.AlertRunner`), or None.
        **sampling: the sampling options by keyword (``every_n_steps=100``, ...).

    Examples:
        >>> from connmon.integrations.olmo_core import ConnectionMonitorCallback
        >>> callback = ConnectionMonitorCallback(every_n_steps=100, diagnostics=("walk",))
        >>> callback.monitor.options.every_n_steps
        100
    """

    priority = -1  # after OLMo-core's own callbacks at each event (its metric collection runs after them all)

    def __init__(
        self,
        *,
        options: SamplingOptions | None = None,
        alerts: AlertRunner | None = None,
        **sampling: Unpack[SamplingKeywords],
    ) -> None:
        options = sampling_options(options, "ConnectionMonitorCallback", **sampling)
        self.monitor = Monitor(options=options, owner=OWNER, log=self._log, log_on_every_rank=True)
        self.monitor.use(alerts=alerts)
        self._model: torch.nn.Module | None = None
        self._hooks: list[Any] = []
        self._forwards = 0  # forwards of the step under way (its micro-batches)

    def _taken(self) -> int:
        """Optimizer steps taken before the step under way (OLMo-core counts its first batch as step 1)."""
        return self.trainer.global_step - 1

    def pre_train(self) -> None:
        """Find the attention layers of the train module's model and watch its optimizer."""
        self.monitor.reset()
        self._model = None
        module = self.trainer.train_module
        model, optimizer = getattr(module, "model", None), getattr(module, "optim", None)
        if not isinstance(model, torch.nn.Module):
            warn_rank_zero(f"{OWNER}: the train module has no torch model at .model, so nothing is read this run")
            return
        self._model = model if self.monitor.attach(model, optimizer) else None

    def pre_step(self, batch: dict[str, Any]) -> None:
        """Before the step's micro-batches: each forward is watched (the first recorded on a sampled step)."""
        if self._model is None:
            return
        self._forwards = 0
        self._hooks = [
            self._model.register_forward_pre_hook(self._forward_starts),
            self._model.register_forward_hook(self._forward_ended, always_call=True),
        ]

    def _forward_starts(self, model: torch.nn.Module, args: tuple) -> None:
        self.monitor.step_start(self._taken(), model, first=self._forwards == 0)
        self._forwards += 1

    def _forward_ended(self, model: torch.nn.Module, args: tuple, output: Any) -> None:
        self.monitor.forward_end(raised=output is None)  # no output: the forward raised, its sample is dropped

    def _unhook(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def pre_optim_step(self) -> None:
        """After the backward of every micro-batch, before ``optim_step``."""
        self._unhook()
        if self._model is not None:
            self.monitor.before_optimizer_step(self._taken())

    def post_train_batch(self) -> None:
        """After ``optim_step``: log the sample, run the rules, carry out a stop."""
        self._unhook()  # a step OLMo-core skipped has no pre_optim_step
        if self._model is None:
            return
        step = self._taken()
        outcome = self.monitor.step_end(step)
        if outcome.stop is not None and not self.trainer.is_canceled and self.monitor.alerts is not None:
            self.monitor.alerts.say_stop(OWNER, outcome.stop)
            self.trainer.cancel_run(f"connmon: an alert at step {outcome.stop} asked to stop", no_sync=True)

    def post_train(self) -> None:
        """Remove every hook; say what connmon cost."""
        self._unhook()
        _LOG.info("connmon: %s", self.monitor.cost_summary())
        self.monitor.close()

    def _log(self, values: dict[str, float], step: int) -> None:
        for key, value in values.items():
            self.trainer.record_metric(key, float(value))

    def state_dict(self) -> dict[str, Any]:
        """The monitor's state (cadence, drift references, alert baselines), saved in OLMo-core's checkpoints."""
        return {"monitor": self.monitor.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved."""
        if state_dict.get("monitor") is not None:
            self.monitor.load_state_dict(state_dict["monitor"])


__all__ = ["ConnectionMonitorCallback"]
