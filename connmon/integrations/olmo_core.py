"""ConnectionMonitorCallback: the monitor for OLMo-core's ``Trainer``.

Needs the ``olmo-core`` extra: ``pip install "torch-connmon[olmo-core]"`` (``ai2-olmo-core`` 3.0.0, torch >= 2.10,
< 2.14). OLMo-core 3.0.0 reaches ``huggingface_hub < 2`` through ``cached-path``, and transformers >= 5.25 needs
``huggingface_hub >= 2.4``, so this extra and ``[transformers]`` are installed in separate environments.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from olmo_core.data.utils import get_labels, split_batch
from olmo_core.train.callbacks import Callback
from typing_extensions import Unpack

from connmon._ranks import warn_rank_zero
from connmon.alerts.restore import remove_restore_point
from connmon.alerts.runner import AlertRunner
from connmon.curvature.sampler import SharpnessSampler
from connmon.monitor import Monitor, RestorePointWriter
from connmon.sampling import SamplingKeywords, SamplingOptions, sampling_options

OWNER = "olmo_core ConnectionMonitorCallback"


class ConnectionMonitorCallback(Callback):
    """Reads every self-attention layer as a connection walk every ``every_n_steps`` steps of an OLMo-core run.

    The same sampler as Lightning's :class:`connmon.callbacks.ConnectionMonitor` (:class:`connmon.Monitor`, the same
    options and metrics), driven by OLMo-core's callback events: ``pre_step`` arms the capture for the step's first
    micro-batch (its forward is recorded; every micro-batch's max logits are read), ``pre_optim_step`` (after the
    backward) ends the step's sample (logged, ruled on) and reads the curvature, the clips act right after
    ``optim_step`` (the optimizer's post-hook), ``post_train_batch`` carries out a stop or a restore point. The
    values go through ``trainer.record_metric`` as ``connmon/<metric>/L<ll>`` and ``/all``, so OLMo-core's console,
    W&B and Comet callbacks show them, at the step OLMo-core numbers (its first batch is step 1; a sample of the
    state after ``k`` optimizer steps is recorded at step ``k + 1``). OLMo-core's
    ``Attention`` modules on its SDPA backend (GQA, RoPE, QK-norm) are read exactly; the flash, ring and Transformer
    Engine backends call kernels connmon does not see, so their layers are skipped with one warning that says why.
    With ``alerts`` an alert at the runner's ``stop_level`` cancels the run (``trainer.cancel_run``, on every process
    at once). With ``sharpness`` the curvature is read on the loss the step trains on, as OLMo-core's
    ``TransformerTrainModule`` forms it (every micro-batch's summed cross-entropy and z-loss over the step's token
    count, label masking included: :func:`step_losses`), kept at ``pre_step`` and read at ``pre_optim_step``. The
    monitor's state rides in OLMo-core's checkpoints (:meth:`state_dict`).

    With the ``"checkpoint"`` action a restore point is OLMo-core's own checkpoint of the step that follows the alert
    (``trainer.save_checkpoint()`` in ``save_folder/step<N>``: the model, the optimizer, the data loader and every
    callback's state, this one's included), rotated by ``RestorePoints.keep`` (local folders) and resumed as OLMo-core
    resumes any checkpoint (``load_path``, or the latest in ``save_folder``).

    Args:
        options: the sampling options (:class:`~connmon.sampling.SamplingOptions`); ``probe`` is not read here.
        alerts: the alert rules and actions (:class:`connmon.alerts.AlertRunner`), or None.
        sharpness: the curvature sampler (:class:`connmon.curvature.sampler.SharpnessSampler`), or None; it needs a
            ``TransformerTrainModule`` (its ``model_forward`` gives the step's loss).
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
        sharpness: SharpnessSampler | None = None,
        **sampling: Unpack[SamplingKeywords],
    ) -> None:
        options = sampling_options(options, "ConnectionMonitorCallback", **sampling)
        self.monitor = Monitor(
            options=options, owner=OWNER, log=self._log, log_on_every_rank=True, trainer_values=lambda: self._logged
        )
        self.monitor.use(alerts=alerts, sharpness=sharpness)
        if sharpness is not None:
            sharpness.owner = f"{OWNER} (sharpness)"
        self._model: torch.nn.Module | None = None
        self._hooks: list[Any] = []
        self._forwards = 0  # forwards of the step under way (its micro-batches)
        self._restored = False  # OLMo-core loaded a saved state into the monitor for the coming run
        self._logged: dict[str, Any] = {}  # OLMo-core's latest logged metrics (loss, gradient norm): for the rules

    def _taken(self) -> int:
        """Optimizer steps taken before the step under way (OLMo-core counts its first batch as step 1)."""
        return self.trainer.global_step - 1

    def pre_train(self) -> None:
        """Find the attention layers of the train module's model and watch its optimizer.

        A run OLMo-core resumed (it loads the callbacks' state before ``pre_train``) keeps what it loaded; any other
        starts afresh.
        """
        if not self._restored:
            self.monitor.reset()
        self._restored, self._logged = False, {}
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
        sharpness = self.monitor.sharpness
        if sharpness is not None and sharpness.reads_forward(self._taken()):  # before the hooks: not recorded
            for loss in step_losses(self.trainer.train_module, batch):
                self.monitor.read_forward(self._taken(), loss, self._model, 1.0)  # each already over the step's tokens
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
        """After the backward of every micro-batch, before ``optim_step``: the step's sample ends, the curvature."""
        self._unhook()
        if self._model is not None:
            self.monitor.step_end(self._taken())
            self.monitor.before_optimizer_step(self._taken())

    def post_train_batch(self) -> None:
        """After ``optim_step``: log the sample, run the rules, carry out a stop."""
        self._unhook()  # a step OLMo-core skipped has no pre_optim_step
        if self._model is None:
            return
        outcome = self.monitor.step_end(self._taken())  # ended at pre_optim_step unless skipped
        trainer = self.trainer

        def stop() -> bool:
            if trainer.is_canceled:
                return False
            trainer.cancel_run(f"connmon: an alert at step {outcome.stop} asked to stop", no_sync=True)
            return True

        def restore_point() -> RestorePointWriter:  # the state after this step's optimizer step
            path = os.path.join(trainer.save_folder, trainer.checkpointer.checkpoint_dirname(trainer.global_step))
            return RestorePointWriter(path, lambda _: trainer.save_checkpoint(), remove_restore_point)

        self.monitor.carry_out(outcome, trainer.global_step, owner=OWNER, stop=stop, restore_point=restore_point)

    def post_train(self) -> None:
        """Remove every hook; say what connmon cost."""
        self._unhook()
        self.monitor.close()

    def on_error(self, exc: BaseException) -> None:
        """The run failed (a forward raised, an interrupt): a partial sample is dropped, every hook removed."""
        self._unhook()
        self.monitor.discard()
        self.monitor.close()

    def close(self) -> None:
        """Right before ``fit()`` returns or raises, whatever happened: no hook of connmon's is left on the model."""
        self._unhook()

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        """OLMo-core's metrics as it logs them (``train/CE loss``, ``optim/total grad norm``, ...), kept for the rules.

        The rules see the latest beside connmon's keys, as they see the Lightning module's and the HF Trainer's.
        """
        self._logged = dict(metrics)  # read (its numbers) only where the rules run

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
            self._restored = True


def step_losses(module: Any, batch: dict[str, Any]) -> list[Callable[[], torch.Tensor]]:
    """The losses of a step's micro-batches as OLMo-core's ``TransformerTrainModule.train_batch`` forms them.

    Each is the micro-batch's summed cross-entropy (and z-loss, with ``z_loss_multiplier``) over the step's count of
    tokens in the loss (labels from ``get_labels``: masks applied, masked instances counted as OLMo-core counts them),
    so their sum is the loss the step trains on; each is a closure that runs ``module.model_forward`` when called.

    Args:
        module: a ``TransformerTrainModule`` (its ``model_forward``, ``rank_microbatch_size``, ``label_ignore_index``
            and ``z_loss_multiplier``).
        batch: the step's batch on this process, as ``pre_step`` gets it.

    Examples:
        >>> import torch
        >>> from connmon.integrations.olmo_core import step_losses
        >>> class Module:  # what step_losses reads of a TransformerTrainModule
        ...     rank_microbatch_size, label_ignore_index, z_loss_multiplier = 8, -100, None
        ...     def model_forward(self, input_ids, labels, loss_div_factor, **kwargs):
        ...         return None, labels.ne(-100).sum() / loss_div_factor, None, None
        >>> losses = step_losses(Module(), {"input_ids": torch.ones(4, 4, dtype=torch.long)})
        >>> len(losses), float(sum(loss() for loss in losses))  # 2 micro-batches; their sum is the step's loss
        (2, 1.0)
    """
    ignore = module.label_ignore_index
    labels = batch["labels"] if "labels" in batch else get_labels(batch, label_ignore_index=ignore)
    tokens = (labels != ignore).sum()
    masked = batch.get("instance_mask")
    if masked is not None:  # masked instances count as tokens of zero loss (OLMo-core's train_batch)
        tokens = tokens + (~masked).sum() * labels.shape[1]
    losses: list[Callable[[], torch.Tensor]] = []
    for micro in split_batch({**batch, "labels": labels}, module.rank_microbatch_size // labels.shape[1]):
        kwargs = dict(micro)
        input_ids, micro_labels = kwargs.pop("input_ids"), kwargs.pop("labels")

        def loss(input_ids: Any = input_ids, labels: Any = micro_labels, kwargs: dict = kwargs) -> torch.Tensor:
            return module.model_forward(
                input_ids, labels=labels, ignore_index=ignore, loss_reduction="sum",
                z_loss_multiplier=module.z_loss_multiplier, loss_div_factor=tokens, return_logits=False, **kwargs,
            )[1]  # fmt: skip

        losses.append(loss)
    return losses


__all__ = ["ConnectionMonitorCallback", "step_losses"]
