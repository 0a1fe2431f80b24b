"""Reading a batch beside training: the fixed ``probe`` batch, and the batch of a ``torch.compile``'d model.

Both run one more forward of the model, in eval mode and under ``no_grad``, on ``nn.MultiheadAttention``'s Python
path (whose output is connmon's own), and put every module's mode back as it was: the training's own forward and
backward are untouched.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from connmon.capture import python_attention_path


@contextlib.contextmanager
def probing(model: nn.Module) -> Iterator[None]:
    """``model`` in eval mode under ``no_grad`` on the Python attention path, every module's mode put back after.

    Examples:
        >>> import torch
        >>> from connmon._probe import probing
        >>> model = torch.nn.Sequential(torch.nn.Dropout(0.5)).train()
        >>> with probing(model):
        ...     model.training, torch.is_grad_enabled()
        (False, False)
        >>> model.training
        True
    """
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        with torch.no_grad(), python_attention_path():
            yield
    finally:
        for module, training in modes:
            module.training = training


def run_forward(model: nn.Module, probe: Any, probe_fn: Callable[[nn.Module, Any], Any] | None = None) -> None:
    """Run ``model`` on ``probe``, moved to the model's device.

    ``probe_fn(model, probe)`` if given, else ``model(**probe)`` for a mapping, ``model(*probe)`` for a tuple and
    ``model(probe)`` for anything else.

    Examples:
        >>> import torch
        >>> from connmon._probe import run_forward
        >>> run_forward(torch.nn.Linear(2, 1), (torch.ones(1, 2),))
    """
    probe = to_device(probe, device_of(model))
    if probe_fn is not None:
        probe_fn(model, probe)
    elif isinstance(probe, Mapping):
        model(**probe)
    elif isinstance(probe, tuple):
        model(*probe)
    else:
        model(probe)


@contextlib.contextmanager
def read_beside(compiled: nn.Module, read: Callable[[nn.Module, Callable[[nn.Module], Any]], Any]) -> Iterator[None]:
    """For a compiled model: its first call in the block is first read by an eager forward of its original module.

    No hook ever sits inside the compiled graph (a hook there splits it, and the training forward and backward then
    differ in the last bits): a pre-hook on the compiled wrapper, which runs outside the graph, calls
    ``read(original, forward)``, where ``forward(original)`` runs the original module on the call's inputs, so the
    reading is of the same batch and weights the training forward sees.

    Examples:
        >>> import torch
        >>> from connmon._probe import read_beside
        >>> compiled = torch.compile(torch.nn.Linear(2, 1))
        >>> seen = []
        >>> with read_beside(compiled, lambda original, forward: seen.append(type(original).__name__)):
        ...     _ = compiled._orig_mod(torch.ones(1, 2))  # the eager module: no read
        >>> seen
        []
    """
    done: list[bool] = []

    def before(wrapper: nn.Module, args: tuple, kwargs: dict) -> None:
        if not done:
            done.append(True)
            original: nn.Module = compiled._orig_mod  # type: ignore[assignment]
            read(original, lambda module: module(*args, **kwargs))

    handle = compiled.register_forward_pre_hook(before, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` (tensors, nested in mappings, lists and tuples) on ``device``."""
    if isinstance(batch, Tensor):
        return batch.to(device)
    if isinstance(batch, Mapping):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def device_of(model: nn.Module) -> torch.device:
    """Where ``model``'s first parameter lives (CPU for a model without parameters)."""
    for tensor in model.parameters():
        return tensor.device
    return torch.device("cpu")
