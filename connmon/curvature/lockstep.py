"""Failures kept in step across processes during a curvature sample: no process is ever left waiting in a collective.

A sample on several processes runs collectives of its own (inner products, the plain parameters' average) and,
sharded, the model's: FSDP2's all-gathers and reduce-scatters, tensor parallelism's redistributions, in every forward
and backward it takes. When the loss raises on one process only (a bad batch, an out-of-memory error), that process
leaves the sample while the others go on into the next collective, and wait in it for ever.

So every process passes through the same *checkpoints*, each a one-number all-reduce of whether it failed:

* before each of the sample's own collectives (:class:`connmon.curvature.shards.Shards` checks first);
* around the model's collectives, while :meth:`Lockstep.armed` holds: before the forward of the root module and of
  every module with forward hooks (where FSDP2 gathers and tensor parallelism redistributes: the check runs before
  their hooks), after its forward (before its output hooks), and in the backward before each such module's backward
  (a hook on its outputs' gradients), after it (a hook on its inputs' gradients, before FSDP2's reduce-scatter) and
  before the end-of-backward callbacks (FSDP2's last reduce-scatters).

A process that fails takes part in exactly one more checkpoint, saying so (:meth:`Lockstep.announce`), and then in no
collective of the sample; the others, at their next checkpoint, learn of it and raise :class:`PeerFailure` before any
other collective. Every process then leaves the sample together, and FSDP2's per-iteration state is reset
(:func:`settle`), so the next training step runs as if the sample had not been taken. A checkpoint is one all-reduce
of one number: on the suite's models a few per module per gradient, inside samples only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from connmon._collectives import sum_over_processes


class PeerFailure(RuntimeError):
    """The sample failed on another process (that process's warning says why); this one stopped with it."""

    def __init__(self) -> None:
        super().__init__("the loss or its gradient failed on another process (that process's warning says why)")


class Lockstep:
    """The checkpoints of one sample across ``world`` processes (one process: every call does nothing).

    Args:
        world: the number of processes (the default process group's size).
        device: where the one-number flag lives (the parameters' device: CPU for gloo, CUDA for NCCL).

    Examples:
        >>> import torch
        >>> from connmon.curvature.lockstep import Lockstep
        >>> lockstep = Lockstep(world=1, device=torch.device("cpu"))
        >>> lockstep.check(), lockstep.checks  # one process: nothing to agree on
        (None, 0)
    """

    def __init__(self, world: int, device: torch.device) -> None:
        self.world = world
        self.device = device
        self.checks = 0  # checkpoints passed (all-reduces issued), for the tests and the cost
        self.failed = False  # a process failed: no further collective of this sample

    def check(self) -> None:
        """A checkpoint: raise :class:`PeerFailure` if a process has announced a failure, else go on."""
        if self.world > 1 and self._flags(0.0) > 0:
            self.failed = True
            raise PeerFailure()

    def announce(self) -> None:
        """This process failed: its one last checkpoint says so (once; nothing after an agreed failure)."""
        if self.world > 1 and not self.failed:
            self.failed = True
            self._flags(1.0)

    def _flags(self, mine: float) -> float:
        flag = torch.tensor([mine], dtype=torch.float32, device=self.device)
        sum_over_processes(flag)
        self.checks += 1
        return float(flag.item())

    @contextlib.contextmanager
    def armed(self, model: nn.Module | None) -> Iterator[None]:
        """Checkpoints around the collectives ``model``'s forwards and backwards run, while the block runs.

        Hooks on ``model`` and on every module of it with forward hooks (FSDP2's units, tensor-parallel modules);
        all removed on leaving, also when the block raises. One process, or no model: nothing is registered.
        """
        if self.world == 1 or model is None:
            yield
            return
        handles: list[Any] = []
        state = {"callback": False}

        def in_backward(_grad: Tensor) -> None:
            if not state["callback"]:  # before FSDP2's end-of-backward reduce-scatters (queued after this)
                state["callback"] = True
                torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward(state))
            self.check()

        def before(_module: nn.Module, args: Any, kwargs: Any) -> None:
            self.check()

        def inputs(_module: nn.Module, args: Any, kwargs: Any) -> None:
            for tensor in _grad_tensors((args, kwargs)):
                handles.append(tensor.register_hook(in_backward))

        def after(_module: nn.Module, _args: Any, output: Any) -> None:
            self.check()
            for tensor in _grad_tensors(output):
                handles.append(tensor.register_hook(in_backward))

        for module in model.modules():
            if module is model or module._forward_pre_hooks or module._forward_hooks:
                handles.append(module.register_forward_pre_hook(before, prepend=True, with_kwargs=True))
                handles.append(module.register_forward_pre_hook(inputs, with_kwargs=True))  # after FSDP2's own
                handles.append(module.register_forward_hook(after, prepend=True))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _end_of_backward(self, state: dict[str, bool]) -> Any:
        def callback() -> None:
            state["callback"] = False
            self.check()

        return callback


def settle(model: nn.Module | None) -> None:
    """After a forward or backward cut short: FSDP2's per-iteration state reset, its gathered weights freed.

    ``reset_iter_state`` on each root FSDP2 module (what FSDP2 asks for after an exception mid-forward or
    mid-backward; the cut-short gradients are discarded), else ``reshard`` on every FSDP2 module (older torch). The next
    forward gathers the restored shards again.
    """
    if model is None:
        return
    fsdp: list[Any] = [m for m in model.modules() if hasattr(m, "reshard") and type(m).__name__.startswith("FSDP")]
    roots = [m for m in fsdp if hasattr(m, "reset_iter_state") and getattr(m._get_fsdp_state(), "_is_root", False)]
    if roots:
        for root in roots:
            root.reset_iter_state()
        return
    for module in fsdp:
        module.reshard()


def release_gathered(model: nn.Module | None) -> None:
    """After forwards outside training (no backward follows): every FSDP2 module's gathered weights freed.

    A forward under ``no_grad`` leaves the root's parameters gathered (it reshards only after its backward); the
    training's next forward would then read them instead of the shards the optimizer steps.
    """
    if model is None:
        return
    for module in model.modules():
        reshard = getattr(module, "reshard", None)
        if callable(reshard) and type(module).__name__.startswith("FSDP"):
            reshard()


def _grad_tensors(value: Any) -> list[Tensor]:
    """The tensors in a (nested) forward input or output that take part in the backward."""
    found: list[Tensor] = []
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, Tensor):
            if item.requires_grad:
                found.append(item)
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif hasattr(item, "__dataclass_fields__") or hasattr(item, "to_tuple"):  # HF ModelOutput, dataclasses
            stack.extend(vars(item).values())
    return found
