"""Turn one forward pass of your own model into one AttentionRecord per self-attention layer (docs/architecture.md).

Hooks and interceptors exist only while a capture is armed and are removed when it ends, also when the forward
raises. Records are detached float32 copies of the first ``num_sequences`` sequences.

Examples:
    >>> import torch
    >>> import connmon
    >>> _ = torch.manual_seed(0)
    >>> layer = torch.nn.TransformerEncoderLayer(d_model=16, nhead=4, dim_feedforward=32, batch_first=True)
    >>> model = torch.nn.TransformerEncoder(layer, num_layers=2).eval()
    >>> records = connmon.capture(model, torch.randn(3, 10, 16), num_sequences=2)
    >>> [(r.name, r.index, tuple(r.attn.shape)) for r in records]
    [('layers.0.self_attn', 0, (2, 4, 10, 10)), ('layers.1.self_attn', 1, (2, 4, 10, 10))]
    >>> all(float(r.reconstruction_error) < 1e-5 for r in records)
    True
"""

from __future__ import annotations

import contextlib
import re
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from connmon._cost import CostClock
from connmon._options import check_int
from connmon._pause import paused
from connmon.capture.adapters.base import Adapter
from connmon.capture.adapters.kernel import (
    FusedQKVAttention,
    KernelAttention,
    kernel_caller_hooks,
    linear_weight,
)
from connmon.capture.adapters.torch_mha import TorchMultiheadAttention, python_attention_path
from connmon.capture.record import AttentionRecord, reconstruction_error
from connmon.capture.session import CaptureSession, Layer

__all__ = [
    "ADAPTERS",
    "Adapter",
    "AttentionRecord",
    "FusedQKVAttention",
    "KernelAttention",
    "armed",
    "attention_layers",
    "capture",
    "paused",
    "python_attention_path",
    "reconstruction_error",
    "register_adapter",
]

_KERNEL = KernelAttention()  # any module calling SDPA, flex or transformers' attention: nanoGPT, HF, your own
ADAPTERS: list[Adapter] = [
    TorchMultiheadAttention(),
    FusedQKVAttention("Attention", qkv="qkv", proj="proj", heads="num_heads", identity=("norm",)),  # timm ViT
    _KERNEL,
]
_LOOKS_LIKE_ATTENTION = re.compile(r"attention|attn", re.IGNORECASE)


def register_adapter(adapter: Adapter) -> None:
    """Teach connmon a new attention module; it is tried before the built-in adapters.

    Args:
        adapter: an :class:`Adapter`, for example a :class:`FusedQKVAttention` naming your module's projections.

    Examples:
        >>> import connmon.capture as cc
        >>> mine = cc.FusedQKVAttention("MySelfAttention", qkv="to_qkv", proj="to_out", heads="heads")
        >>> cc.register_adapter(mine)
        >>> cc.ADAPTERS[0] is mine
        True
        >>> cc.ADAPTERS.remove(mine)
    """
    ADAPTERS.insert(0, adapter)


def attention_layers(model: nn.Module) -> list[Layer]:
    """The self-attention modules connmon can read, in module order, each with its adapter.

    An attention module inside another (an outer module that runs an inner one before its own kernel call) is a layer
    of its own: each kernel call is read as the innermost running attention module's. A module whose class name says
    attention, that has two Linear layers or more as its own children and that no adapter matches (it computes
    attention by hand: nanoGPT's ``flash=False``, minGPT, Bloom's ALiBi, timm's eager path) is a layer too, the
    innermost of such modules and only where no matched module sits inside or around it: a capture reads it from
    the calls that run in its forward (:mod:`connmon.capture.adapters.handwritten`), and a layer whose calls do not
    rebuild its output is skipped with one warning then.

    Raises:
        ValueError: if the model has none; the message lists the module types seen and how to add an adapter.

    Examples:
        >>> import torch
        >>> from connmon.capture import attention_layers
        >>> model = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(8, 2, batch_first=True), num_layers=3)
        >>> [layer.name for layer in attention_layers(model)]
        ['layers.0.self_attn', 'layers.1.self_attn', 'layers.2.self_attn']
    """
    if any(parameter.is_meta for parameter in model.parameters()):
        raise ValueError(
            "the model's parameters are on the meta device (no values): materialize it first (model.to_empty(...) "
            "and load its weights) before connmon reads it"
        )
    adapters, by_name = {}, {}
    for name, module in model.named_modules():
        adapter = next((a for a in ADAPTERS if a.matches(module)), None)
        if adapter is not None:  # one inside another is a layer of its own: each kernel call is its caller's
            adapters[name] = (module, adapter)
        elif _LOOKS_LIKE_ATTENTION.search(type(module).__name__) and _own_projections(module) >= 2:
            by_name[name] = module  # named attention, with its own input and output projections at least
    matched = list(adapters)
    for name, module in by_name.items():  # attention by hand: read from what runs, in the innermost such module
        innermost = not any(other.startswith(f"{name}.") for other in by_name)
        if innermost and not any(_nested(name, other) for other in matched):
            adapters[name] = (module, _KERNEL)  # read from the calls that run in it
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    adapters = dict(sorted(adapters.items(), key=lambda item: order[item[0]]))
    layers = [Layer(name, index, module, adapter) for index, (name, (module, adapter)) in enumerate(adapters.items())]
    if not layers:
        seen = sorted({type(m).__name__ for m in model.modules()})
        raise ValueError(
            f"connmon found no self-attention module it can read in {type(model).__name__}; module types seen: "
            f"{', '.join(seen)}. connmon reads torch.nn.MultiheadAttention and any module that calls "
            "torch.nn.functional.scaled_dot_product_attention or Hugging Face transformers' attention functions "
            "(its value and output projections are found from the data). For another module call "
            "connmon.capture.register_adapter(...) with a subclass of connmon.capture.Adapter."
        )
    return layers


def _own_projections(module: nn.Module) -> int:
    """How many Linear (or ``Conv1D``) layers are the module's own children."""
    return sum(linear_weight(child) is not None for child in module.children())


def _nested(name: str, other: str) -> bool:
    """Whether module paths ``name`` and ``other`` are the same or one holds the other."""
    return name == other or name.startswith(f"{other}.") or other.startswith(f"{name}.")


@contextlib.contextmanager
def armed(
    model: nn.Module,
    *,
    num_sequences: int = 2,
    max_tokens: int | None = 256,
    layers: list[Layer] | None = None,
    dtype: torch.dtype = torch.float32,
    on_record: Callable[[AttentionRecord], None] | None = None,
    cost_clock: CostClock | None = None,
    unarmed: list[Layer] | None = None,
    owner: str = "connmon.Monitor",
) -> Iterator[CaptureSession]:
    """Arm a capture for the forwards run inside the block; every hook is removed on exit, also on error.

    Args:
        model: the model (a ``torch.compile``'d model is unwrapped to its original module).
        num_sequences: record the first this many sequences of the batch.
        max_tokens: record at most this many leading tokens (see :func:`capture`); None for all.
        layers: the layers to arm (default: :func:`attention_layers`).
        dtype: record dtype, float32 or float64.
        on_record: called with each record as soon as its layer finishes, instead of keeping it.
        cost_clock: a :class:`connmon._cost.CostClock` that counts the recording work inside the forwards (the
            monitors' cost figure).
        unarmed: with ``layers``, the attention layers left out, whose kernel calls stay their own (one may run
            inside an armed layer); default: the rest of :func:`attention_layers`.
        owner: the entry point a warning's hint names (``ConnectionMonitor(probe=...)``, ...).

    Yields:
        The :class:`~connmon.capture.session.CaptureSession`; its ``records`` fill as the forward runs.

    Raises:
        ValueError: for a bad option or a model without readable attention.

    Examples:
        >>> import torch
        >>> import connmon.capture as cc
        >>> layer = torch.nn.TransformerEncoderLayer(8, 2, dropout=0.0, batch_first=True)
        >>> model = torch.nn.TransformerEncoder(layer, 2)
        >>> with cc.armed(model, num_sequences=1) as session:
        ...     _ = model(torch.randn(4, 5, 8))
        >>> len(session.records), tuple(session.records[0].x.shape)
        (2, (1, 5, 8))
    """
    check_int("num_sequences", num_sequences)
    check_int("max_tokens", max_tokens, optional=True)
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"dtype must be torch.float32 or torch.float64, got dtype={dtype}")
    model = getattr(model, "_orig_mod", model)  # torch.compile wraps the module; hooks go on the original
    if layers is None:
        layers, unarmed = attention_layers(model), []
    session = CaptureSession(
        layers, num_sequences, max_tokens, dtype, on_record=on_record, cost_clock=cost_clock, owner=owner
    )
    handles = []
    with contextlib.ExitStack() as stack:
        try:
            for adapter in {id(layer.adapter): layer.adapter for layer in layers}.values():
                stack.enter_context(adapter.armed(model, session))
            for layer in layers:
                registered = layer.adapter.hooks(model, layer.name, layer.module, session)
                if not registered:  # the adapter found the module unsupported and said so
                    session.skip(layer.module)
                handles.extend(registered)
            if unarmed is None:
                armed_ids = {id(layer.module) for layer in layers}
                unarmed = [other for other in attention_layers(model) if id(other.module) not in armed_ids]
            for other in unarmed:  # the attention modules left out still own their kernel calls
                if isinstance(other.adapter, KernelAttention):
                    handles.extend(kernel_caller_hooks(other.module))
            try:
                yield session
            except BaseException:
                session.abandon()  # the forward raised: its layers' missing pieces say nothing about the model
                raise
        finally:
            for handle in handles:
                handle.remove()
            session.close()


def capture(
    model: nn.Module,
    *args: object,
    num_sequences: int = 2,
    max_tokens: int | None = 256,
    dtype: torch.dtype = torch.float32,
    on_record: Callable[[AttentionRecord], None] | None = None,
    **kwargs: object,
) -> list[AttentionRecord]:
    """Run ``model(*args, **kwargs)`` once and return one :class:`AttentionRecord` per self-attention layer.

    The forward runs under ``torch.no_grad()`` in whatever mode the model is in, on ``nn.MultiheadAttention``'s
    Python path (the output is connmon's own and not returned; see
    :func:`~connmon.capture.adapters.torch_mha.python_attention_path`). Probabilities are recorded before
    attention dropout: reconstruction is exact when dropout is inactive (eval mode, or p = 0).

    ``max_tokens`` policy: sequences longer than ``max_tokens`` are recorded on their leading ``max_tokens``
    positions. For causal attention this window is closed (no kept query reads a dropped key) and the record is
    exact. For bidirectional attention the record is the walk restricted to the window, rows renormalized over
    the kept keys, and ``reconstruction_error`` is NaN, since the true output also read the dropped keys.

    Args:
        model: the model; ``torch.compile``'d models are captured through their original module.
        *args: positional inputs of the forward.
        num_sequences: record the first this many sequences of the batch.
        max_tokens: record at most this many leading tokens; None for all.
        dtype: record dtype, float32 or float64.
        on_record: stream records layer by layer to this callable (peak memory holds one layer's maps);
            the returned list is then empty.
        **kwargs: keyword inputs of the forward.

    Returns:
        Records in the order their layers ran.

    Raises:
        ValueError: for a bad option, or a model without readable attention (listing the module types seen).

    Examples:
        >>> import torch
        >>> import connmon
        >>> mha = torch.nn.MultiheadAttention(8, 2, batch_first=True)
        >>> x = torch.randn(1, 6, 8)
        >>> (record,) = connmon.capture(mha, x, x, x)
        >>> record.name, tuple(record.w_v.shape), float(record.reconstruction_error) < 1e-5
        ('', (2, 4, 8), True)
    """
    model = getattr(model, "_orig_mod", model)  # run a torch.compile'd model's original module: hooks stay eager
    with armed(model, num_sequences=num_sequences, max_tokens=max_tokens, dtype=dtype, on_record=on_record) as session:
        with torch.no_grad(), python_attention_path():  # connmon's own forward: its output is not used
            model(*args, **kwargs)
    return session.records


class _CallableModule(types.ModuleType):
    """Makes ``connmon.capture(model, ...)`` (the public API) call :func:`capture`; the package stays a package."""

    def __call__(self, model: nn.Module, *args: Any, **kwargs: Any) -> list[AttentionRecord]:
        return capture(model, *args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
