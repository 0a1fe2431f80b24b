"""One armed capture: collects the pieces of each layer's forward pass and turns them into AttentionRecords.

Adapters feed a session three pieces per attention module, in any order: the module input ``x``, the attention
``scores`` (logits, probabilities, allowed keys) and the attention ``output``. When all three have arrived the
session builds the record, checks its reconstruction and hands it to ``on_record`` (or keeps it). A module is
recorded once per session, so activation checkpointing's second forward is ignored.

The session slices the first ``num_sequences`` sequences and copies them out of the autograd graph at once, so
records never keep activations alive.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from connmon.capture.record import AttentionRecord, reconstruction_error
from connmon.functional import max_attention_logit

SUSPECT_RECONSTRUCTION = 0.1  # far above float32 (1e-7) and bf16 (1e-2) round-off: the module is not a walk


@dataclass
class Layer:
    """A module to capture and the adapter that reads it."""

    name: str
    index: int
    module: nn.Module
    adapter: object  # connmon.capture.adapters.Adapter; typed loosely to avoid an import cycle


@dataclass
class _Pending:
    x: Tensor | None = None
    probs: Tensor | None = None  # (B_s, H, m, m), the recorded window
    max_logit: Tensor | None = None  # (B_s,)
    key_mask: Tensor | None = None  # (B_s, m) bool
    truncated: bool = False  # the window cut keys that some kept query reads
    output: Tensor | None = None


class CaptureSession:
    """Collects pieces from the adapters' hooks while a capture is armed."""

    def __init__(
        self,
        layers: list[Layer],
        num_sequences: int,
        max_tokens: int | None,
        dtype: torch.dtype,
        on_record: Callable[[AttentionRecord], None] | None,
    ) -> None:
        self.layers = {id(layer.module): layer for layer in layers}
        self.num_sequences = num_sequences
        self.max_tokens = max_tokens
        self.dtype = dtype
        self.on_record = on_record
        self.records: list[AttentionRecord] = []
        self.done: set[int] = set()
        self._pending: dict[int, _Pending] = {}

    def skip(self, module: nn.Module) -> None:
        """Record nothing for ``module`` in this session (an adapter found it unsupported)."""
        self.done.add(id(module))
        self._pending.pop(id(module), None)

    @contextlib.contextmanager
    def guarded(self, module: nn.Module) -> Iterator[None]:
        """Run recording work for ``module`` in full precision; an error there skips it with one warning.

        Autocast is switched off inside (the records are float32), and no error escapes into the user's forward.
        """
        try:
            with full_precision():
                yield
        except Exception as error:  # the user's forward must go on whatever a record's bookkeeping hits
            layer = self.layers.get(id(module))
            name = layer.name if layer else type(module).__name__
            warn_once(f"connmon: could not record {name} ({type(error).__name__}: {error}); skipped")
            self.skip(module)

    def wants(self, module: nn.Module) -> bool:
        """Whether ``module`` is armed here and not recorded yet."""
        return id(module) in self.layers and id(module) not in self.done

    def take(self, tensor: Tensor) -> Tensor:
        """The first ``num_sequences`` along dim 0, detached, copied, in the record dtype."""
        return tensor[: self.num_sequences].detach().to(self.dtype, copy=True)

    def put(
        self, module: nn.Module, *, x: Tensor | None = None, output: Tensor | None = None, **scores: Tensor
    ) -> None:
        """Hand over a piece: ``x`` or ``output`` as ``(B, n, d)``, or ``logits``, ``probs``, ``allowed``.

        Scores are reduced at once to what the record keeps (the probabilities of the window, the max logit and
        the key mask), so the logits and mask never outlive this call.
        """
        if not self.wants(module):
            return
        pending = self._pending.setdefault(id(module), _Pending())
        window = slice(None, self.max_tokens)
        with self.guarded(module), torch.no_grad():
            if x is not None:
                pending.x = self.take(x[:, window])
            if output is not None:
                pending.output = self.take(output[:, window])
            if scores:
                self._reduce(pending, scores["logits"], scores["probs"], scores["allowed"])
            if pending.x is not None and pending.output is not None and pending.probs is not None:
                self._finish(self.layers[id(module)], self._pending.pop(id(module)))

    def _reduce(self, pending: _Pending, logits: Tensor, probs: Tensor, allowed: Tensor) -> None:
        logits, probs, allowed = (t[: self.num_sequences] for t in (logits, probs, allowed))
        n = probs.shape[-1]
        allowed = allowed.expand(*allowed.shape[:-2], n, n)  # a view: allowed may come in a broadcast shape
        m = n if self.max_tokens is None else min(n, self.max_tokens)
        if m < n:
            pending.truncated = bool(allowed[..., :m, m:].any())  # a kept query reads a dropped key: not causal
            logits, probs, allowed = logits[..., :m, :m], probs[..., :m, :m], allowed[..., :m, :m]
        pending.probs = probs.detach().to(self.dtype, copy=True)
        if pending.truncated:  # the walk restricted to the window: rows renormalized over the kept keys
            pending.probs /= pending.probs.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(self.dtype).tiny)
        pending.max_logit = max_attention_logit(logits).to(self.dtype)
        keys = allowed.any(dim=-2).any(dim=-2)  # (B_s | 1, m): keys some query of some head may attend
        pending.key_mask = keys.expand(probs.shape[0], probs.shape[-1]).clone()

    def _finish(self, layer: Layer, pending: _Pending) -> None:
        self.done.add(id(layer.module))
        with torch.no_grad():
            record = self._record(layer, pending)
        error = record.reconstruction_error.item()
        if error > SUSPECT_RECONSTRUCTION:
            warn_once(
                f"connmon: {layer.name} ({type(layer.module).__name__}): the connection walk rebuilds its output only "
                f"to a relative error of {error:.2g}, so the module computes something the walk does not model "
                "(gating, a norm before the output projection, active attention dropout, ...); treat its record "
                "with care or register an adapter that reads it exactly"
            )
        if self.on_record is not None:
            self.on_record(record)
        else:
            self.records.append(record)

    def _record(self, layer: Layer, pending: _Pending) -> AttentionRecord:
        w_v, w_o, bias = (t.detach().to(self.dtype, copy=True) for t in layer.adapter.weights(layer.module))
        probs, x, output = pending.probs, pending.x, pending.output
        if probs.shape[-2] != probs.shape[-1] or x.shape[-2] != probs.shape[-1]:
            raise ValueError(
                f"{layer.name}: self-attention needs as many queries as keys, got attention {tuple(probs.shape)} "
                f"for input {tuple(x.shape)}"
            )
        error = reconstruction_error(probs, w_v, w_o, bias, x, output)
        if pending.truncated:
            error = torch.full_like(error, float("nan"))
        key_mask = pending.key_mask
        return AttentionRecord(
            name=layer.name,
            index=layer.index,
            attn=probs,
            max_logit=pending.max_logit,
            w_v=w_v,
            w_o=w_o,
            bias=bias,
            x=x,
            output=output,
            key_mask=None if bool(key_mask.all()) else key_mask,
            reconstruction_error=error,
        )


@contextlib.contextmanager
def full_precision() -> Iterator[None]:
    """Switch autocast off (CPU, and CUDA where present) for connmon's own math inside a user's forward."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.autocast("cpu", enabled=False))
        if torch.cuda.is_available():
            stack.enter_context(torch.autocast("cuda", enabled=False))
        yield


_WARNED: set[str] = set()


def warn_once(message: str) -> None:
    """Warn once per message for the life of the process (one warning per cause)."""
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, stacklevel=3)
