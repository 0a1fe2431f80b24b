"""ConnectionMonitorCallback: the monitor for the Hugging Face ``Trainer``.

Needs the ``transformers`` extra: ``pip install "torch-connmon[transformers]"``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_callback import PrinterCallback, ProgressCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from typing_extensions import Unpack

from connmon._options import check_callable
from connmon._ranks import is_rank_zero, warn_rank_zero
from connmon.alerts.runner import AlertRunner
from connmon.curvature.sampler import SharpnessSampler
from connmon.monitor import DIAGNOSTICS, Monitor, RestorePointWriter
from connmon.sampling import SamplingKeywords, SamplingOptions, sampling_options
from connmon.sinks.wandb import find_sink

STATE_FILE = "connmon_monitor.pt"  # written into each checkpoint-<step> folder
RUN_KEY = "connmon"  # in TrainerState.stateful_callbacks (every checkpoint's trainer_state.json): the run's output_dir
STEP_KEY = "train/global_step"  # the step metric the Trainer's W&B integration defines
PREFIX = "train/"  # the Trainer's W&B integration writes training logs as train/<key>


class ConnectionMonitorCallback(TrainerCallback):
    """Reads every self-attention layer as a connection walk every ``every_n_steps`` optimizer steps of a ``Trainer``.

    The same sampler as Lightning's :class:`connmon.callbacks.ConnectionMonitor` (:class:`connmon.Monitor`, the same
    options and metrics): the forward after 0, ``every_n_steps``, ``2 * every_n_steps``, ... optimizer steps (its
    first micro-batch) is recorded, as in every entry point, and the synced values are logged through ``trainer.log``
    in the row of that forward's loss (the Trainer counts it as step ``k + 1`` after ``k`` steps), so every
    ``report_to`` backend receives ``connmon/<metric>/L<ll>`` and ``/all`` (W&B shows them as ``train/connmon/...``)
    and ``trainer.state.log_history`` keeps them. With W&B in ``report_to`` the histograms and figures go to the
    same run. With ``alerts`` the rules run on every sample (on connmon's keys and on the Trainer's latest logged
    ``loss``, ``grad_norm`` and ``learning_rate``) and an alert at or above their ``stop_level`` sets
    ``control.should_training_stop``; with the ``"checkpoint"`` action (:class:`connmon.alerts.RestorePoints`) an
    alert at its level sets ``control.should_save``, so the Trainer saves its own checkpoint folder
    (``output_dir/checkpoint-<step>``, rotated by ``save_total_limit``) at the end of that step, and says where; with
    ``"backoff"`` the learning rate is scaled inside ``optimizer.step()`` (the Trainer's scheduler is untouched). The
    monitor's state (cadence, drift references, alert baselines) is saved
    as ``connmon_monitor.pt`` in every checkpoint folder and read back when training resumes from one.

    connmon's rows reach every ``report_to`` backend and ``log_history`` but not the console (the Trainer's progress
    printer shows its own rows only).

    Args:
        trainer: the Trainer whose ``log`` carries the values (the callback is added with ``trainer.add_callback``).
        options: the sampling options (:class:`~connmon.sampling.SamplingOptions`: what is recorded and how often);
            a ``probe`` is a dict of the model's inputs, e.g. a tokenizer's output, recorded after the sampled
            optimizer steps; ``probe_fn`` defaults to ``model(**probe)``.
        alerts: an :class:`connmon.alerts.AlertRunner` (e.g. ``AlertRunner()`` for the default rules), or None.
        sharpness: a :class:`connmon.curvature.sampler.SharpnessSampler`: the curvature against the optimizer's edge of
            stability on its own cadence, logged through ``trainer.log`` and shown to ``alerts`` on its steps.
            ``"finite_difference_lanczos"`` and ``"exact_lanczos"`` read ``loss_fn`` on every micro-batch of the sampled
            step (the inputs taken from the model's forwards before they run), after the backward and before
            ``optimizer.step()``; ``"difference"`` reads it on the step's first micro-batch before its forward;
            ``"secant"`` reads the Trainer's own gradients (after clipping, before ``optimizer.step()``).
        loss_fn: ``loss_fn(model, inputs)``, the scalar loss of the Trainer's ``inputs`` dict as the Trainer computes
            it (keep ``num_items_in_batch`` when the inputs carry it: the Trainer then sums the micro-batches' losses,
            each normalised over the whole step, where it otherwise averages them); default ``model(**inputs).loss``
            (the inputs carry labels). The reading is of the loss the optimizer step trains on, whatever the
            gradient-accumulation steps.
        **sampling: the sampling options by keyword (``every_n_steps=50``, ``diagnostics=("walk",)``, ...), in place
            of those of ``options`` (typed by :class:`~connmon.sampling.SamplingKeywords` for editors).

    Every sample logs what connmon costs (``connmon/overhead``, ``connmon/overhead/attention``,
    ``connmon/overhead/curvature``); the end of training logs it once more and says it at INFO level.

    Raises:
        TypeError: for a keyword that is not a sampling option (the message names them).
        ValueError: for an invalid option (the message names the valid ones).

    Examples:
        >>> import tempfile
        >>> import transformers
        >>> from connmon.integrations.transformers import ConnectionMonitorCallback
        >>> config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=16)
        >>> args = transformers.TrainingArguments(tempfile.mkdtemp(), report_to=[], use_cpu=True, max_steps=4)
        >>> trainer = transformers.Trainer(model=transformers.GPT2LMHeadModel(config), args=args)
        >>> trainer.add_callback(ConnectionMonitorCallback(trainer, every_n_steps=2))
    """

    def __init__(
        self,
        trainer: Trainer,
        *,
        options: SamplingOptions | None = None,
        alerts: AlertRunner | None = None,
        sharpness: SharpnessSampler | None = None,
        loss_fn: Callable[[Any, dict], torch.Tensor] | None = None,
        **sampling: Unpack[SamplingKeywords],
    ) -> None:
        if not isinstance(trainer, Trainer):
            raise ValueError(
                f"trainer must be the transformers.Trainer whose log carries the values, got {type(trainer).__name__}"
            )
        check_callable("loss_fn", loss_fn, optional=True, signature="loss_fn(model, inputs)")
        self.trainer = trainer
        options = sampling_options(options, "ConnectionMonitorCallback", **sampling)
        # Trainer.log runs on every process, and its reporters pick rank zero
        self.monitor = Monitor(
            options=options, owner="ConnectionMonitorCallback", log=self._log, log_on_every_rank=True,
            optimizer_hook=False, trainer_values=lambda: _latest_logged(trainer.state),
        )  # fmt: skip
        self.monitor.use(alerts=alerts, sharpness=sharpness)  # not the constructor's: the optimizer comes with train()
        self.loss_fn = loss_fn or _model_loss
        self._reading = False  # the curvature's own forwards are running: the capture's guard ignores them
        self._batch_hook: Any = None
        self._curvature_step: int | None = None  # the step whose forwards the batch hook keeps
        if sharpness is not None:
            sharpness.owner = "ConnectionMonitorCallback (sharpness)"
        self._step = 0  # the optimizer steps taken before the step under way (the Trainer's row of it is one more)
        self._unlogged: dict[str, float] = {}  # values whose row the Trainer has not reached yet
        self._guard: Any = None  # the model's forward hook that disarms and ends the max logits' reading

    @property
    def sharpness(self) -> SharpnessSampler | None:
        """The curvature sampler (the monitor's)."""
        return self.monitor.sharpness

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, model: Any = None, **kwargs: Any
    ) -> None:
        """Find the attention layers, the W&B run, and the state saved in the checkpoint training resumes from."""
        self.monitor.forward_end(raised=True)  # an earlier train() ended inside a sampled step: its sample is dropped
        self._forward_done()  # what a KeyboardInterrupt inside an earlier train()'s forward left (no hook ran then)
        self._unlogged = {}  # an earlier train() that raised before its step's row: its values are not this run's
        self.monitor.reset()
        optimizer = kwargs.get("optimizer") or self.trainer.optimizer
        if model is None or not self.monitor.attach(model, optimizer):  # the optimizer: curvature and "backoff"
            return
        self.monitor.sink = _wandb_sink(args)
        saved = _saved_state_file(args, state)
        if saved is None:
            return
        device = next(model.parameters(), torch.empty(0)).device  # drift references live beside the model
        saved_state = torch.load(saved, map_location=device, weights_only=True)
        if saved_state.get("sharpness") is None:
            saved_state["sharpness"] = saved_state.get("curvature")  # as 0.1.0 named it
        self.monitor.load_state_dict(saved_state)

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, model: Any = None, **kwargs: Any
    ) -> None:
        """Arm the capture for the first micro-batch of a sampled optimizer step; keep the curvature's batches."""
        self._step = state.global_step
        if model is None:
            return
        self.monitor.model_updated(self._step, model)  # a probe, before the hooks below
        sharpness = self.monitor.sharpness
        if sharpness is not None and sharpness.reads_forward(self._step):
            self._batch_hook = model.register_forward_pre_hook(self._read_curvature, with_kwargs=True, prepend=True)
            self._curvature_step = self._step
        self._forward_starts(model, first=True)

    def on_pre_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """After the backward (and clipping), before the step: the step's sample ends, then the curvature's readings."""
        self._forward_done()
        self.monitor.step_end(self._step)
        if self.monitor.sharpness is not None:
            self._drop_batch_hook()
            self._reading = True
            try:
                self.monitor.before_optimizer_step(state.global_step)
            finally:
                self._reading = False

    def _read_curvature(self, module: Any, args: tuple, kwargs: dict | None = None) -> None:
        """Each forward of a sampled step, before it runs: its inputs kept for the curvature (or read, difference).

        The hook is not removed here (torch calls the hooks it listed before the forward, removed or not, and a
        removed one without its keyword arguments); it is removed before the optimizer step.
        """
        if self._reading or self._curvature_step is None:
            return
        step = self._curvature_step
        inputs = dict(kwargs) if kwargs else (args[0] if args and isinstance(args[0], dict) else None)
        loss = None if inputs is None else lambda: self.loss_fn(module, inputs)
        weight = None if inputs is None else _loss_factor(self.trainer, inputs)
        self._reading = True
        try:
            self.monitor.read_forward(step, loss, module, weight)
        finally:
            self._reading = False

    def on_substep_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """The first micro-batch of an accumulation is done: stop recording (the curvature keeps every batch)."""
        self._forward_done()
        self._forward_starts(kwargs.get("model"), first=False)  # the next micro-batch's max logits

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> TrainerControl:
        """The step is over: its values logged in its row, its outcome (stop, restore point) carried out."""
        self._forward_done()
        self._drop_batch_hook()
        outcome = self.monitor.step_end(self._step)  # ended before its optimizer step
        self._log_unlogged()

        def stop() -> bool:
            stopping, control.should_training_stop = control.should_training_stop, True
            return not stopping

        def restore_point() -> RestorePointWriter:  # the Trainer saves at this step's end, rotated by save_total_limit
            folder = str(_checkpoint_folder(args, state.global_step))
            return RestorePointWriter(folder, lambda path: setattr(control, "should_save", True), saves="saves")

        self.monitor.carry_out(outcome, state.global_step, owner="ConnectionMonitorCallback", stop=stop,
                               restore_point=restore_point)  # fmt: skip
        return control

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        """Save the monitor's state beside the checkpoint (rank zero)."""
        folder = _checkpoint_folder(args, state.global_step)
        if is_rank_zero() and folder.is_dir():
            torch.save(self.monitor.state_dict(), folder / STATE_FILE)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Remove every hook; log and say what connmon cost."""
        self._forward_done()
        self._drop_batch_hook()
        self.monitor.close(state.global_step)
        self._log_unlogged()

    def _forward_starts(self, model: Any, first: bool) -> None:
        """The model's next forward (one micro-batch): recorded on a sampled step's first, its max logits read.

        The Trainer has no exception hook: a guard on the model's forward ends it when it returns or raises.
        """
        if model is None:
            return
        self.monitor.step_start(self._step, model, first=first)
        if self._guard is None:
            self._guard = model.register_forward_hook(self._forward_ended, always_call=True)

    def _forward_ended(self, model: Any, args: tuple, output: Any) -> None:
        """The guard on the model's forward: no output means it raised, and its partial sample is discarded."""
        self._forward_done(raised=output is None)

    def _forward_done(self, raised: bool = False) -> None:
        if self._reading:
            return  # a forward of the curvature reading, inside the training forward's pre-hook
        self.monitor.forward_end(raised=raised)
        if self._guard is not None:
            self._guard.remove()
            self._guard = None

    def _drop_batch_hook(self) -> None:
        if self._batch_hook is not None:
            self._batch_hook.remove()
            self._batch_hook = None
        self._curvature_step = None

    def _log(self, values: dict[str, float], step: int) -> None:
        """The values of the forward after ``step`` steps, logged in the Trainer's row of that forward's loss.

        The Trainer counts that forward's step as ``step + 1`` and logs at its current count, so values read before
        its optimizer step (the curvature, a probe) wait for the step's end.
        """
        self._unlogged.update(values)
        if step < self.trainer.state.global_step:
            self._log_unlogged()

    def _log_unlogged(self) -> None:
        """A row as ``trainer.log`` writes one (``log_history``, every reporter's ``on_log``), not to the console.

        The reporters are called through a copy of the Trainer's callback handler without its console printers; the
        Trainer's own handler is left as it is, and ``control.should_log`` (this step's loss row) is not cleared.
        """
        values, self._unlogged = self._unlogged, {}
        if not values:
            return
        trainer, state = self.trainer, self.trainer.state
        if state.epoch is not None:
            values["epoch"] = state.epoch
        state.log_history.append({**values, "step": state.global_step})
        reporters = copy.copy(trainer.callback_handler)
        reporters.callbacks = [
            cb for cb in reporters.callbacks if not isinstance(cb, (ProgressCallback, PrinterCallback))
        ]
        reporters.call_event("on_log", trainer.args, state, trainer.control, logs=values)


def _saved_state_file(args: TrainingArguments, state: TrainerState) -> Path | None:
    """The monitor's state saved in the checkpoint this ``train()`` resumes from (None: a fresh run); one line if none.

    The Trainer hands its callbacks no checkpoint path, so every checkpoint's ``trainer_state.json`` carries the
    output folder of the run that saved it (``TrainerState.stateful_callbacks["connmon"]``): the checkpoint resumed
    from is ``checkpoint-<step>`` there (or in this run's ``output_dir``), wherever this run writes.
    """
    callbacks: Any = state.stateful_callbacks  # a dict once the TrainerState is built (annotated as its input)
    if not isinstance(callbacks, dict):
        callbacks = {}
        setattr(state, "stateful_callbacks", callbacks)  # noqa: B010  # its annotation is a list's
    saved_in = (callbacks.get(RUN_KEY) or {}).get("output_dir")  # the loaded state's: the run that saved it
    callbacks[RUN_KEY] = {"output_dir": str(Path(str(args.output_dir)).resolve())}  # what this run's checkpoints say
    if state.global_step == 0:
        return None
    here = _checkpoint_folder(args, state.global_step)
    folders = [Path(saved_in) / here.name, here] if saved_in is not None else [here]
    found = next((folder / STATE_FILE for folder in folders if (folder / STATE_FILE).is_file()), None)
    if found is None:
        warn_rank_zero(
            f"ConnectionMonitorCallback: training resumes at step {state.global_step}, but no {STATE_FILE} is in "
            f"{' or '.join(str(folder) for folder in dict.fromkeys(folders))}, so connmon's cadence, time-drift "
            "references and alert baselines start afresh"
        )
    return found


def _checkpoint_folder(args: TrainingArguments, step: int) -> Path:
    """The folder the Trainer saves its checkpoint of step ``step`` in."""
    return Path(str(args.output_dir)) / f"{PREFIX_CHECKPOINT_DIR}-{step}"


def _loss_factor(trainer: Trainer, inputs: dict) -> float | None:
    """The factor ``Trainer.training_step`` puts on a micro-batch's loss before its backward, by the Trainer's rule.

    None where the Trainer divides the loss by its gradient-accumulation steps (a per-micro-batch mean: the sampler
    reads the mean of the micro-batches). Where the loss is already normalised over the whole step (the model took
    ``num_items_in_batch``, the tokens of every micro-batch, or a ``compute_loss_func`` or ``loss_is_scaled_for_ga``
    says so) the Trainer sums the micro-batches' losses as they are: 1, times the number of processes when it averages
    the token count across devices (it multiplies the loss by it, and DDP averages the gradients again).
    """
    counted = inputs.get("num_items_in_batch") is not None
    scaled = getattr(trainer, "loss_is_scaled_for_ga", None)
    if scaled is None:
        scaled = (getattr(trainer, "model_accepts_loss_kwargs", False) and counted) or (
            getattr(trainer, "compute_loss_func", None) is not None
        )
    if not scaled:
        return None
    if counted and trainer.args.average_tokens_across_devices:
        tp_size = trainer.get_tp_size() if hasattr(trainer, "get_tp_size") else 1
        return float(max(trainer.accelerator.num_processes // tp_size, 1))
    return 1.0


def _model_loss(model: Any, inputs: dict) -> torch.Tensor:
    """The loss a transformers model returns for inputs with labels."""
    return model(**inputs).loss


def _latest_logged(state: TrainerState) -> dict[str, Any]:
    """The Trainer's latest logged training row (``loss``, ``grad_norm``, ``learning_rate``), for the rules."""
    for row in reversed(state.log_history):
        if "loss" in row:
            return {key: value for key, value in row.items() if key not in ("step", "epoch")}
    return {}


def _wandb_sink(args: TrainingArguments) -> Any:
    """The run the Trainer's W&B integration opened, if any."""
    if "wandb" not in (args.report_to or []):
        return None
    import wandb

    return find_sink(wandb.run, step_key=STEP_KEY, prefix=PREFIX, row_offset=1)


__all__ = ["DIAGNOSTICS", "ConnectionMonitorCallback"]
