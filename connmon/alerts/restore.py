"""Acting on a warning before the spike: a restore point, a checkpoint saved when an alert fires.

The loss-spike tools large runs use (a restart from the last checkpoint, batches skipped) need a checkpoint from
before the spike, which they have only by luck of the checkpoint cadence. connmon's curvature warning comes tens of
steps before a divergence on the instability suite (docs/monitoring.md), so the ``"checkpoint"`` action saves one
then. Where
and how depends on the entry point: :class:`connmon.callbacks.DriftAlert` through ``trainer.save_checkpoint`` (a
complete Lightning checkpoint, resumable with ``ckpt_path=``), the Hugging Face callback through the ``Trainer``'s own
saving, :class:`connmon.Monitor` through ``save(path, step)`` or, without one, a file with the model's and the
optimizer's state.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import shutil
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from connmon._collectives import from_rank_zero
from connmon._options import check_callable, check_choice, check_number
from connmon._ranks import is_rank_zero, warn_rank_zero
from connmon.alerts.action import AlertAction, Alerted
from connmon.alerts.rules import LEVELS, Alert, Level


class RestorePoints(AlertAction):
    """When the ``"checkpoint"`` action saves a restore point, where, and how many are kept.

    An alert at ``level`` or above asks for one (at most one per step); the entry point saves it at the end of that
    training step (Lightning, Hugging Face) or at the start of the next ``monitor.step()`` (a plain loop), and says
    where in one line. The alerts come from synced values, so every process asks at the same step. The last ``keep``
    restore points are kept, older ones removed (Lightning and plain loops; the Hugging Face ``Trainer`` rotates its
    checkpoints itself, by ``save_total_limit``). The paths saved are in :meth:`state_dict`, so a resumed run goes
    on rotating them. A restore point is never written over a file this run did not write, nor is one rotated away:
    where another run's ``step=<N>.ckpt`` lies in the folder, this run's is ``step=<N>-v1.ckpt`` (as Lightning's
    ``ModelCheckpoint`` names a second file of one name), said once; the Hugging Face callback, whose ``Trainer``
    names its own folders, saves none over another run's ``checkpoint-<N>`` and says so.

    An ``ERROR`` alert (a non-finite value) comes after the damage: a restore point saved then may hold it. The
    earlier ones, kept by ``keep``, do not; pass ``level="WARN"`` with ``keep`` >= 2, or ``level`` above what you
    want saved.

    Args:
        level: the lowest alert level that saves a restore point.
        keep: how many restore points are kept (the oldest is removed when one more is saved).
        dirpath: where they go; None for the entry point's default (Lightning: ``connmon_restore_points`` beside
            ModelCheckpoint's ``checkpoints`` directory; plain loop: ``./connmon_restore_points``; Hugging Face: the
            ``Trainer``'s ``output_dir``).
        save: for :class:`connmon.Monitor` only, ``save(path, step)`` writes the restore point (called on every
            process); None for :func:`write_restore_point` (the model, the optimizer and the monitor's state; a
            sharded model's with ``torch.distributed.checkpoint``), read back by :func:`load_restore_point`.

    Raises:
        ValueError: for an unknown level, a ``keep`` below 1, or a ``save`` that is not callable.

    Examples:
        >>> from connmon.alerts import Alert, RestorePoints
        >>> points = RestorePoints(level="WARN", keep=2, dirpath="/tmp/run")
        >>> points.request([Alert("edge", "connmon/sharpness_ratio", 120, 1.3, 1.3, 1.0, None, "WARN")], step=120)
        True
        >>> points.path(120), points.due
        ('/tmp/run/step=120.ckpt', 120)
        >>> points.saved("/tmp/run/step=120.ckpt"), points.due
        ([], None)
    """

    def __init__(
        self,
        level: Level = "WARN",
        keep: int = 3,
        dirpath: str | os.PathLike[str] | None = None,
        save: Callable[[str, int], Any] | None = None,
    ) -> None:
        check_choice("level", level, LEVELS)
        check_number("keep", keep, low=1, integer=True)
        check_callable("save", save, optional=True, signature="save(path, step)")
        self.level, self.keep, self.save = level, keep, save
        self.dirpath = None if dirpath is None else os.fspath(dirpath)
        self.due: int | None = None  # the step whose alert asked for a restore point not yet saved
        self.paths: list[str] = []  # the restore points saved and kept, oldest first
        self._others_said = False  # the warning that another run's restore points lie in the folder
        self._writing: str | None = None  # the restore point being written (its own state lists it)

    name: ClassVar[str] = "checkpoint"
    state_key: ClassVar[str | None] = "restore_points"

    def answer(self, alerted: Alerted) -> None:
        """Ask for a restore point at an alert of ``level`` or above; one process's request is every process's."""
        self.request(alerted.alerts, alerted.step)
        if alerted.agree(self.due is not None) and self.due is None:
            self.due = alerted.step  # asked on another process

    def request(self, alerts: Sequence[Alert], step: int) -> bool:
        """Ask for a restore point at ``step`` if one of ``alerts`` is at ``level`` or above; whether one was."""
        if not any(LEVELS.index(alert.level) >= LEVELS.index(self.level) for alert in alerts):
            return False
        if self.due is None:
            self.due = step
        return True

    def path(self, step: int, root: str | os.PathLike[str] = "connmon_restore_points") -> str:
        """Where the restore point of ``step`` goes: in ``dirpath``, else in ``root`` (the entry point's default).

        ``step=<step>.ckpt``, or ``step=<step>-v<i>.ckpt`` with the first ``i`` whose name holds no file that this
        run did not write (another run's restore point is never written over).
        """
        folder = self.dirpath if self.dirpath is not None else os.fspath(root)
        path, version = os.path.join(folder, f"step={step}.ckpt"), 0
        while os.path.exists(path) and path not in self.paths:
            version += 1
            path = os.path.join(folder, f"step={step}-v{version}.ckpt")
        if version and not self._others_said:
            self._others_said = True
            warn_rank_zero(
                f"RestorePoints: {folder} holds step={step}.ckpt, which this run did not write: it is kept, and "
                f"this run's restore points there get their own names ({os.path.basename(path)}); pass dirpath= "
                "to keep each run's apart"
            )
        return path

    def foreign(self, path: str | os.PathLike[str]) -> bool:
        """Whether ``path`` exists and is not a restore point this run wrote (not to be written over or removed)."""
        return os.path.exists(path) and os.fspath(path) not in self.paths

    def save_loop_point(
        self,
        step: int,
        model: nn.Module | None,
        optimizer: torch.optim.Optimizer | None,
        connmon_state: Callable[[], Mapping[str, Any]],
        owner: str,
    ) -> str | None:
        """A plain loop's restore point, if one is due: ``save(path, step)``, else :func:`write_restore_point`.

        Every process calls it (rank zero's path); returns the path, or None.
        """
        if self.due is None:
            return None

        def write(path: str) -> None:
            if self.save is not None:
                self.save(path, step)
            else:
                write_restore_point(path, step, model=model, optimizer=optimizer, connmon_state=connmon_state())

        return self.save_due(step, from_rank_zero(self.path(step)), write, remove_restore_point, owner=owner)

    def save_due(
        self,
        step: int,
        path: str,
        write: Callable[[str], Any],
        remove: Callable[[str], Any] | None = None,
        *,
        owner: str,
        saves: str = "saved",
    ) -> str | None:
        """The ``"checkpoint"`` action, for every entry point: save the restore point asked for, rotate, say where.

        Every process calls it at the same step (the request comes from synced values) with the same ``path`` (rank
        zero's name). A ``path`` holding what this run did not write is left alone (nothing saved, one warning);
        else ``write(path)`` saves it (the entry point's own way: ``trainer.save_checkpoint``, the Hugging Face
        ``Trainer``'s saving, ``torch.save``), ``remove(old)`` removes each restore point beyond ``keep``, and one
        line says where. A ``write`` that raises is reported and the run goes on. Returns the path, or None.

        Examples:
            >>> import warnings
            >>> from connmon.alerts import RestorePoints
            >>> points, written = RestorePoints(keep=1, dirpath="/tmp/run"), []
            >>> points.due = 7
            >>> with warnings.catch_warnings(record=True) as said:
            ...     points.save_due(8, "/tmp/run/step=8.ckpt", written.append, owner="my loop")
            '/tmp/run/step=8.ckpt'
            >>> written, points.due, str(said[0].message)
            (['/tmp/run/step=8.ckpt'], None, 'my loop saved a restore point after step 8 (alert at step 7): /tmp/run/step=8.ckpt')
        """  # noqa: E501
        if self.due is None:
            return None
        due = self.due
        if from_rank_zero(self.foreign(path)):
            self.due = None
            warn_rank_zero(
                f"{owner}: no restore point after step {step} (alert at step {due}): {path} holds a checkpoint this "
                "run did not write, and it is not written over; give each run its own output folder"
            )
            return None
        try:
            self._writing = path  # the state written into it lists it: a run resumed from it rotates it too
            write(path)
        except Exception as error:  # a full disk or a failing hook must not end the training run
            self.due = None
            warn_rank_zero(f"{owner} could not save the restore point {path}: {type(error).__name__}: {error}")
            return None
        finally:
            self._writing = None
        for old in self.saved(path):
            if remove is not None:
                remove(old)
        warn_rank_zero(f"{owner} {saves} a restore point after step {step} (alert at step {due}): {path}")
        return path

    def saved(self, path: str) -> list[str]:
        """Record that ``path`` was saved (the request is met); returns the older paths to remove beyond ``keep``."""
        self.due = None
        if path in self.paths:
            self.paths.remove(path)
        self.paths.append(path)
        removed, self.paths = self.paths[: -self.keep], self.paths[-self.keep :]
        return removed

    def state_dict(self) -> dict[str, Any]:
        """The restore points kept (a resumed run goes on rotating them), the one being written among them.

        Examples:
            >>> from connmon.alerts import RestorePoints
            >>> points = RestorePoints(keep=2)
            >>> points.paths = ["a.ckpt", "b.ckpt"]
            >>> points._writing = "c.ckpt"  # what the state inside c.ckpt holds: c and the one before it
            >>> points.state_dict()
            {'paths': ['b.ckpt', 'c.ckpt']}
        """
        paths = list(self.paths)
        if self._writing is not None:
            paths = [p for p in paths if p != self._writing] + [self._writing]
        return {"paths": paths[-self.keep :]}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved."""
        self.paths = [str(path) for path in state_dict.get("paths", [])]


def sharded(model: nn.Module | None) -> bool:
    """Whether ``model`` has a parameter sharded across processes (a ``DTensor``: FSDP2, tensor parallelism)."""
    return model is not None and any(hasattr(p, "device_mesh") for p in model.parameters())


def remove_restore_point(path: str) -> None:
    """Rank zero removes a restore point beyond ``keep``: a file, or a folder (a ``save`` hook's, a trainer's own).

    Examples:
        >>> import os, tempfile
        >>> from connmon.alerts.restore import remove_restore_point
        >>> folder = tempfile.mkdtemp()
        >>> remove_restore_point(folder)
        >>> os.path.exists(folder)
        False
    """
    if not is_rank_zero():
        return
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    with contextlib.suppress(OSError):
        os.remove(path)


def write_restore_point(
    path: str, step: int, model: nn.Module | None, optimizer: torch.optim.Optimizer | None, connmon_state: Any
) -> None:
    """Write a restore point of ``model``, ``optimizer`` and the monitor's state after ``step`` steps at ``path``.

    Called on every process. A model with sharded parameters (FSDP2, tensor parallelism) is written the way its
    ecosystem writes checkpoints: ``torch.distributed.checkpoint.save`` of the sharded state dicts
    (``get_state_dict``), each process writing its own shards into the folder ``path`` (no process gathers the whole
    model), rank zero the metadata, the step and the monitor's state. Any other model: rank zero writes one file,
    ``torch.save`` of ``{"step", "model", "optimizer", "connmon"}`` (each a ``state_dict``). Either is read back,
    into any layout, by :func:`load_restore_point`.

    Examples:
        >>> import os, tempfile, torch
        >>> from connmon.alerts.restore import load_restore_point, write_restore_point
        >>> model = torch.nn.Linear(2, 2)
        >>> path = os.path.join(tempfile.mkdtemp(), "step=3.ckpt")
        >>> write_restore_point(path, 3, model, None, {"samples": 1})
        >>> load_restore_point(path, torch.nn.Linear(2, 2))
        3
    """
    from connmon._ranks import is_rank_zero

    model = getattr(model, "_orig_mod", model)
    if not sharded(model):
        if is_rank_zero():
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            torch.save({
                "step": step,
                "model": model.state_dict() if model is not None else None,
                "optimizer": optimizer.state_dict() if optimizer is not None else None,
                "connmon": connmon_state,
            }, path)  # fmt: skip
        return
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    assert model is not None  # sharded(None) is False
    optimizers = [optimizer] if optimizer is not None else []
    model_state, optimizer_state = get_state_dict(model, optimizers)
    extra = io.BytesIO(pickle.dumps({"step": step, "connmon": connmon_state}))
    dcp.save({"model": model_state, "optimizer": optimizer_state, "extra": extra}, checkpoint_id=path)


def load_restore_point(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    monitor: Any = None,
) -> int:
    """Load a restore point into ``model``, ``optimizer`` and ``monitor`` (a ``connmon.Monitor``); the step it is of.

    Reads both forms :func:`write_restore_point` writes (a folder written by ``torch.distributed.checkpoint`` for a
    sharded model, a ``torch.save`` file otherwise) into a model held in any layout: a sharded run's restore point
    loads into the same sharding (call it on every process, after ``fully_shard``/``parallelize_module`` and with the
    optimizer built), or into an unsharded model in one process; the training then goes on bitwise from where the
    point was saved.

    Raises:
        RestorePointError: (a ``ValueError``) naming the path and what is wrong: missing, truncated or torn (a file
            cut short, a ``torch.distributed.checkpoint`` folder missing a shard), not a restore point, or of another
            model.

    Examples:
        >>> import os, tempfile, torch
        >>> from connmon.alerts.restore import load_restore_point, write_restore_point
        >>> model = torch.nn.Linear(2, 2)
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> path = os.path.join(tempfile.mkdtemp(), "step=5.ckpt")
        >>> write_restore_point(path, 5, model, optimizer, None)
        >>> other = torch.nn.Linear(2, 2)
        >>> load_restore_point(path, other, torch.optim.SGD(other.parameters(), lr=0.1)), torch.equal(other.weight, model.weight)
        (5, True)
    """  # noqa: E501
    path = os.fspath(path)
    model = getattr(model, "_orig_mod", model)
    if not os.path.exists(path):
        raise RestorePointError(f"{path}: no such restore point (neither a file nor a folder)")
    if os.path.isdir(path):
        saved = _load_folder(path, model, optimizer)
    else:
        if sharded(model):
            raise RestorePointError(
                f"{path} is a one-file restore point of an unsharded model: load it into the model as it was saved "
                "(unsharded), or shard after loading"
            )
        saved = _load_file(path, model, optimizer)
    if monitor is not None and saved.get("connmon") is not None:
        monitor.load_state_dict(saved["connmon"])
    return int(saved["step"])


class RestorePointError(ValueError):
    """A restore point that cannot be loaded: the message names the path and what is wrong with it.

    One ``Exception`` for every way a restore point fails to load (``torch.distributed.checkpoint`` raises
    ``CheckpointException``, a ``BaseException``, which a resume script's ``except Exception`` would not catch).

    Examples:
        >>> import torch
        >>> from connmon.alerts.restore import RestorePointError, load_restore_point
        >>> try:
        ...     load_restore_point("no/such/step=3.ckpt", torch.nn.Linear(2, 2))
        ... except RestorePointError as error:
        ...     print(error)
        no/such/step=3.ckpt: no such restore point (neither a file nor a folder)
    """


def _load_file(path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """A ``torch.save`` restore point into ``model`` and ``optimizer``; any failure a :class:`RestorePointError`."""
    try:
        saved = torch.load(path, weights_only=False)
    except Exception as error:
        size = os.path.getsize(path)
        raise RestorePointError(
            f"{path}: not readable as a restore point ({size} bytes; {type(error).__name__}: {error}): the file is "
            "truncated or damaged (a save cut short), or not one write_restore_point wrote"
        ) from error
    if not isinstance(saved, Mapping) or not {"model", "step"} <= set(saved):
        found = sorted(saved) if isinstance(saved, Mapping) else type(saved).__name__
        raise RestorePointError(f"{path}: not a restore point (it holds {found}, not 'model' and 'step')")
    try:
        model.load_state_dict(saved["model"])
        if optimizer is not None and saved.get("optimizer") is not None:
            optimizer.load_state_dict(saved["optimizer"])
    except Exception as error:
        raise RestorePointError(
            f"{path}: does not fit this model or optimizer ({type(error).__name__}: {error})"
        ) from error
    return dict(saved)


def _load_folder(path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """A ``torch.distributed.checkpoint`` restore point into ``model`` and ``optimizer``, each process its part."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    optimizers = [optimizer] if optimizer is not None else []
    model_state, optimizer_state = get_state_dict(model, optimizers)
    state: dict[str, Any] = {"model": model_state, "extra": io.BytesIO()}
    if optimizer is not None:
        state["optimizer"] = optimizer_state
    try:
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, optimizers, model_state_dict=state["model"], optim_state_dict=state.get("optimizer", {}))
        state["extra"].seek(0)
        saved = pickle.loads(state["extra"].read())
    except (Exception, CheckpointException) as error:
        what = _first_failure(error)
        raise RestorePointError(
            f"{path}: this torch.distributed.checkpoint restore point cannot be loaded ({what}): a shard file is "
            "missing, truncated or damaged (a save cut short), or it was written for another model"
        ) from None
    return saved


def _first_failure(error: BaseException) -> str:
    """What went wrong, in one line: a ``CheckpointException``'s first rank's failure, or the error itself."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, Mapping) and failures:
        rank, failure = next(iter(failures.items()))
        inner = failure[0] if isinstance(failure, tuple) else failure
        return f"rank {rank}: {type(inner).__name__}: {inner}"
    return f"{type(error).__name__}: {error}"
