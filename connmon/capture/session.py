"""One armed capture: collects the pieces of each layer's forward pass and turns them into AttentionRecords.

Adapters feed a session four pieces per attention module: the input ``x`` of its value projection, the attention
``scores`` (computed here from the kernel's own ``q``, ``k``, mask and score features), the transport ``weights``
and the ``output`` of its output projection. When all have arrived the session builds the record, checks that the
connection walk rebuilt from it reproduces the output, and hands it to ``on_record`` (or keeps it). A record that
does not reproduce its output is dropped with one warning: a layer is recorded exactly or not at all. A module is
recorded once per session, so activation checkpointing's second forward is ignored.

Only the first ``num_sequences`` sequences and the leading ``max_tokens`` positions are ever scored or copied,
and copies leave the autograd graph at once, so records never keep activations alive.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from connmon._collectives import gathered
from connmon._cost import CostClock
from connmon._pause import is_paused
from connmon._ranks import user_stacklevel
from connmon.capture.record import AttentionRecord, reconstruction_error
from connmon.capture.scores import allowed_by, attention_scores

if TYPE_CHECKING:  # the adapters import the session
    from connmon.capture.adapters.base import Adapter

# The largest reconstruction error of an exact record, per dtype the module computed in: far above the round-off
# of that dtype over a layer (float32 ~1e-7, bf16 ~1e-2) and far below what a module that is not a walk gives.
RECONSTRUCTION_TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-3, torch.float16: 2e-2, torch.bfloat16: 6e-2}
_BUSY = threading.local()  # .depth > 0 while a session's guarded recording work runs in this thread


def remove_mode(mode: object) -> None:
    """Take ``mode`` off this thread's torch-function mode stack wherever it is; the modes above it stay, in order.

    Two readers of the same forward (a capture and the per-step max logit) push their modes in hook order, which
    need not be the reverse of the order their post-hooks run in.
    """
    above = []
    while torch._C._len_torch_function_stack():
        top = torch._C._pop_torch_function_stack()
        if top is mode:
            break
        above.append(top)
    for other in reversed(above):
        torch._C._push_on_torch_function_stack(other)


def busy() -> int:
    """Above 0 while connmon's own recording work runs in this thread (its torch calls are not the model's)."""
    return getattr(_BUSY, "depth", 0)


@dataclass
class Layer:
    """A module to capture and the adapter that reads it."""

    name: str
    index: int
    module: nn.Module
    adapter: Adapter


@dataclass
class _Pending:
    entered: bool = False  # the module's forward ran in this session
    scored: bool = False  # an attention kernel call was read
    x: Tensor | None = None
    probs: Tensor | None = None  # (B_s, H, m, m), the recorded window
    max_logit: Tensor | None = None  # (B_s,)
    key_mask: Tensor | None = None  # (B_s, m) bool
    truncated: bool = False  # the window cut keys that some kept query reads
    dropout: bool = False  # attention dropout was active: the output is not the walk of the probabilities
    weights: tuple[Tensor, Tensor, Tensor] | None = None
    output: Tensor | None = None
    output_dtype: torch.dtype = torch.float32
    adapter_state: dict = field(default_factory=dict)  # the adapter's own bookkeeping for this module
    missing: str = ""  # why nothing was recorded, if the session ends without a record


class CaptureSession:
    """Collects pieces from the adapters' hooks while a capture is armed."""

    def __init__(
        self,
        layers: list[Layer],
        num_sequences: int,
        max_tokens: int | None,
        dtype: torch.dtype,
        on_record: Callable[[AttentionRecord], None] | None,
        cost_clock: CostClock | None = None,
        owner: str = "connmon.Monitor",
    ) -> None:
        self.layers = {id(layer.module): layer for layer in layers}
        self.owner = owner  # the entry point a hint names (its probe option)
        self.cost_clock = cost_clock
        self.num_sequences = num_sequences
        self.max_tokens = max_tokens
        self.dtype = dtype
        self.on_record = on_record
        self.records: list[AttentionRecord] = []
        self.done: set[int] = set()
        self._pending: dict[int, _Pending] = {}
        self.thread = threading.get_ident()

    def name(self, module: nn.Module) -> str:
        """The module's path in the model (its class name if it is not armed here, or is the model itself)."""
        layer = self.layers.get(id(module))
        return layer.name if layer and layer.name else type(module).__name__

    def skip(self, module: nn.Module, why: str | None = None) -> None:
        """Record nothing for ``module`` in this session; ``why`` is warned once per cause and layer."""
        if why is not None and self._watching(module):  # also after its record was handed on
            warn_once(f"connmon: {self.name(module)} is not recorded: {why}", key=why, module=module)
        self.done.add(id(module))
        self._pending.pop(id(module), None)

    @contextlib.contextmanager
    def guarded(self, module: nn.Module) -> Iterator[None]:
        """Run recording work for ``module`` in full precision; an error there skips it with one warning.

        Autocast is switched off inside (the records are float32), and no error escapes into the user's forward. The
        time spent inside counts as connmon's on the session's ``cost_clock``.
        """
        _BUSY.depth = busy() + 1
        try:
            with self._measuring(), full_precision(), torch.no_grad():
                yield
        except Exception as error:  # the user's forward must go on whatever a record's bookkeeping hits
            self.skip(module, f"recording failed ({type(error).__name__}: {error})")
        finally:
            _BUSY.depth -= 1

    def _measuring(self) -> contextlib.AbstractContextManager:
        return self.cost_clock.measuring() if self.cost_clock is not None else contextlib.nullcontext()

    def wants(self, module: nn.Module) -> bool:
        """Whether ``module`` is armed here, not recorded yet, not :func:`paused`, and this thread armed the session.

        A session records the forwards of the thread that armed it; other threads' calls run unchanged, unread.
        """
        return self._watching(module) and id(module) not in self.done

    def _watching(self, module: nn.Module) -> bool:
        return not is_paused() and id(module) in self.layers and self.is_own_thread()

    def is_own_thread(self) -> bool:
        """Whether the calling thread is the one that armed the session."""
        return torch.compiler.is_compiling() or threading.get_ident() == self.thread  # a trace runs in the caller

    def pending(self, module: nn.Module) -> _Pending:
        """The pieces gathered so far for ``module`` (created on first use)."""
        return self._pending.setdefault(id(module), _Pending())

    def window(self, tensor: Tensor, dim: int = 1) -> Tensor:
        """The first ``num_sequences`` along dim 0 and the leading ``max_tokens`` along ``dim`` (a view)."""
        return tensor[: self.num_sequences].narrow(dim, 0, min(tensor.shape[dim], self.max_tokens or tensor.shape[dim]))

    def take(self, tensor: Tensor, dim: int = 1) -> Tensor:
        """:meth:`window`, detached and copied in the record dtype."""
        return self.window(tensor, dim).detach().to(self.dtype, copy=True)

    def put(
        self,
        module: nn.Module,
        *,
        x: Tensor | None = None,
        output: Tensor | None = None,
        weights: tuple[Tensor, Tensor, Tensor] | None = None,
        heads_over: object = None,
    ) -> None:
        """Hand over a piece: ``x`` or ``output`` as ``(B, n, d)`` (windowed here), or ``(w_v, w_o, bias)``.

        ``heads_over``: the process group the module's heads are split over (tensor parallelism): the weights are
        every head's already, and the attention read on this process (its heads) is assembled over the group.
        """
        if not self.wants(module):
            return
        pending = self.pending(module)
        with self.guarded(module):
            if heads_over is not None and pending.probs is not None:
                assert pending.max_logit is not None and pending.key_mask is not None  # put with the probabilities
                pending.probs = torch.cat(gathered(pending.probs, heads_over), dim=1)  # (B_s, H, m, m), head order
                maxima = gathered(pending.max_logit, heads_over)
                pending.max_logit = torch.stack(maxima).amax(dim=0)
                pending.key_mask = torch.stack(gathered(pending.key_mask.to(torch.uint8), heads_over)).any(dim=0)
            if x is not None:
                pending.x = self.take(x)
            if output is not None:
                pending.output, pending.output_dtype = self.take(output), output.dtype
            if weights is not None:
                w_v, w_o, bias = (t.detach().to(self.dtype, copy=True) for t in weights)
                pending.weights = w_v, w_o, bias
            self._maybe_finish(module, pending)

    def put_scores(
        self,
        module: nn.Module,
        query: Tensor,
        key: Tensor,
        mask: Tensor | None = None,
        *,
        scale: float | None = None,
        is_causal: bool = False,
        softcap: float | None = None,
        bias: Tensor | None = None,
        sinks: Tensor | None = None,
        dropout: bool = False,
    ) -> None:
        """Score the recorded window from the kernel's own inputs (``(B, H, L, E)`` queries, ``(B, H_kv, S, E)`` keys).

        Only the first ``num_sequences`` sequences and the leading ``max_tokens`` queries and keys are scored, so the
        memory of a sampled step is one window's map whatever the sequence length. For causal attention the window
        is closed (no kept query reads a dropped key) and exact; for bidirectional attention it is the walk
        restricted to the window, rows renormalized over the kept keys, and the record's reconstruction is NaN.
        """
        if not self.wants(module):
            return
        pending = self.pending(module)
        with self.guarded(module):
            if query.shape[-2] != key.shape[-2]:
                raise ValueError(
                    f"queries and keys differ in length ({query.shape[-2]} vs {key.shape[-2]}): cross-attention or "
                    "cached decoding, which is not a walk on one sequence"
                )
            n = query.shape[-2]
            m = n if self.max_tokens is None else min(n, self.max_tokens)
            query, key = self.window(query, dim=-2), self.window(key, dim=-2)
            mask, bias = (None if t is None else _first(t, self.num_sequences) for t in (mask, bias))
            if m < n and not is_causal:
                pending.truncated = mask is None or _reads_beyond(mask, m)
            if m < n:
                mask, bias = (None if t is None else _square(t, m) for t in (mask, bias))
            probs, max_logit, allowed = attention_scores(
                query, key, mask, scale=scale, is_causal=is_causal, softcap=softcap, bias=bias, sinks=sinks
            )
            if pending.truncated:  # the walk restricted to the window: rows renormalized over the kept keys
                probs /= probs.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(probs.dtype).tiny)
            self._scored(module, pending, probs, max_logit, allowed=allowed, dropout=dropout)

    def put_probabilities(
        self,
        module: nn.Module,
        probs: Tensor,
        logits: Tensor,
        *,
        dropout: bool = False,
        truncated: bool | None = None,
    ) -> None:
        """Hand over the probabilities a module's own softmax computed, ``(B, H, n, n)``, and the logits it read.

        The window is taken as in :meth:`put_scores`; an entry is allowed where its probability is above zero and
        its logit above :data:`~connmon.capture.scores.BLOCKED_AT` (a masked logit, ``-inf``, ``-1e9`` or the dtype's
        minimum, gives zero, or a row masked entirely its softmax of equal logits), so padding keys are those no
        query reaches. ``truncated`` says whether a kept query reads a key beyond the window, for probabilities that
        were computed on the window alone (default: read from ``probs``).
        """
        if not self.wants(module):
            return
        pending = self.pending(module)
        with self.guarded(module):
            if probs.shape[-1] != probs.shape[-2]:
                raise ValueError(f"the attention map {tuple(probs.shape)} is not square: not a walk on one sequence")
            n = probs.shape[-1]
            m = n if self.max_tokens is None else min(n, self.max_tokens)
            dtype = torch.float64 if probs.dtype == torch.float64 else torch.float32
            window = self.window(probs.detach(), dim=-2)
            pending.truncated = m < n and bool((window[..., m:] != 0).any()) if truncated is None else truncated
            probs = window[..., :m].to(dtype, copy=True)
            logits = self.window(logits.detach(), dim=-2)[..., :m].to(dtype)
            if pending.truncated:
                probs /= probs.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(dtype).tiny)
            allowed = (probs > 0) & allowed_by(logits)  # a row all of whose logits are masked keeps its softmax
            attended = allowed.any(dim=-2, keepdim=True).any(dim=-3, keepdim=True)  # (B_s, 1, 1, m)
            seen = logits.masked_fill(~allowed | ~attended.transpose(-1, -2), float("-inf"))
            max_logit = seen.flatten(1).amax(dim=-1)
            self._scored(module, pending, probs, max_logit, allowed=allowed, dropout=dropout)

    def _scored(
        self, module: nn.Module, pending: _Pending, probs: Tensor, max_logit: Tensor, allowed: Tensor, dropout: bool
    ) -> None:
        pending.probs = probs.to(self.dtype)
        pending.max_logit = max_logit.to(self.dtype)
        keys = allowed.any(dim=-2).any(dim=-2)  # (B_s | 1, m): keys some query of some head may attend
        pending.key_mask = keys.expand(probs.shape[0], probs.shape[-1]).clone()
        pending.scored, pending.dropout = True, dropout
        self._maybe_finish(module, pending)

    def abandon(self) -> None:
        """The forward this session armed for raised: forget every partial piece, so :meth:`close` reports nothing."""
        self._pending.clear()

    def close(self) -> None:
        """End the session: every armed layer that ran but left no record is reported once, with the reason."""
        for layer in self.layers.values():
            pending = self._pending.get(id(layer.module))
            if pending is not None and pending.entered and self.wants(layer.module):
                self.skip(layer.module, pending.missing or self._missing(pending))
        self._pending.clear()

    @staticmethod
    def _missing(pending: _Pending) -> str:
        if not pending.scored:
            ran = pending.adapter_state.get("softmax_ran")
            if ran:
                return (
                    "it ran a softmax over a square map but connmon did not see those probabilities multiplied with "
                    "values (matmul, @, bmm or einsum) as they came out of it (a sink, a slice or a mix of heads in "
                    "between?), so the walk is unknown; register an adapter (connmon.capture.register_adapter)"
                )
            return (
                "it ran no attention connmon reads: no F.scaled_dot_product_attention, transformers 'sdpa'/'eager' "
                "function, flex_attention call or softmax over a square map ran inside its forward (compiled code, "
                "a flash or varlen kernel?); register an adapter (connmon.capture.register_adapter)"
            )
        if pending.x is None:
            return (
                "the values its attention read are not the output columns of one of its Linear layers, so its "
                "value projection is unknown; register an adapter (connmon.capture.register_adapter)"
            )
        return (
            "no Linear layer took its attention output unchanged (a gate or a norm before the output projection?), "
            "so the walk does not model it"
        )

    def _maybe_finish(self, module: nn.Module, pending: _Pending) -> None:
        if pending.x is None or pending.output is None or pending.probs is None:
            return
        layer = self.layers[id(module)]
        if pending.weights is None:
            w_v, w_o, bias = (t.detach().to(self.dtype, copy=True) for t in layer.adapter.weights(module))
            pending.weights = w_v, w_o, bias
        self.done.add(id(module))
        self._pending.pop(id(module), None)
        record = self._record(layer, pending)
        error = record.reconstruction_error.item()
        tolerance = RECONSTRUCTION_TOLERANCE.get(pending.output_dtype, 1e-3)
        if pending.dropout:
            warn_once(
                f"connmon: attention dropout is active in the recorded training forward ({layer.name}, and every "
                "layer with it): the walk is read from the attention probabilities before dropout, and "
                "reconstruction_error is not logged (the output is not that walk's). For exact records of the model "
                f"in eval mode pass a fixed batch, {self.owner}(probe=batch, ...)",
                key="dropout",
            )
        elif error > tolerance and bool(torch.isfinite(record.max_logit).all()):
            # NaN passes (a truncated window), and so does a non-finite forward, which the metrics flag as NaN: a
            # kernel turns NaN score rows into zero or NaN rows, so its rebuilt output is no test of the capture
            warn_once(
                f"connmon: {layer.name} ({type(module).__name__}) is not recorded: the connection walk rebuilt "
                f"from its capture reproduces its output only to a relative error of {error:.2g} (tolerance "
                f"{tolerance:g}), so it computes something the walk does not model (gating, a norm before the "
                "output projection, ...); register an adapter that reads it exactly",
                key="reconstruction",
                module=module,
            )
            return
        if self.on_record is not None:
            self.on_record(record)
        else:
            self.records.append(record)

    def _record(self, layer: Layer, pending: _Pending) -> AttentionRecord:
        probs, x, output, weights = pending.probs, pending.x, pending.output, pending.weights
        assert probs is not None and x is not None and output is not None and weights is not None  # _maybe_finish
        assert pending.max_logit is not None and pending.key_mask is not None  # put with the probabilities
        w_v, w_o, bias = weights
        if x.shape[-2] != probs.shape[-1] or output.shape != (*x.shape[:-1], w_o.shape[-2]):
            raise ValueError(
                f"{layer.name}: attention {tuple(probs.shape)} does not fit input {tuple(x.shape)} and output "
                f"{tuple(output.shape)}"
            )
        error = reconstruction_error(probs, w_v, w_o, bias, x=x, output=output)
        if pending.truncated or pending.dropout:
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


def assembled(group: object, weights: tuple[Tensor, Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """Every head's ``(w_v, w_o, c)`` under tensor parallelism, from each process's heads (in rank order).

    The processes' parts of the bias constant are added; the output projection's own bias is not among them.
    """
    w_v, w_o, bias = weights
    w_vs, w_os, biases = (gathered(t.detach(), group) for t in (w_v, w_o, bias))
    return torch.cat(w_vs), torch.cat(w_os), torch.stack(biases).sum(dim=0)


def _first(mask: Tensor, n: int) -> Tensor:
    """The first ``n`` sequences of a mask whose leading dim is the batch (a broadcast dim of 1 is kept)."""
    return mask[:n] if mask.dim() == 4 and mask.shape[0] > 1 else mask


def _square(mask: Tensor, m: int) -> Tensor:
    """The leading ``m`` queries and keys of a mask (broadcast dims of 1 are kept)."""
    if mask.shape[-2] > 1:
        mask = mask[..., :m, :]
    return mask[..., :m] if mask.shape[-1] > 1 else mask


def _reads_beyond(mask: Tensor, m: int) -> bool:
    """Whether some query in the window may attend a key after it (bool: True = allowed; float: above BLOCKED_AT)."""
    beyond = mask[..., :m, m:] if mask.shape[-2] > 1 else mask[..., m:]
    return bool(allowed_by(beyond).any())


@contextlib.contextmanager
def full_precision() -> Iterator[None]:
    """Switch autocast off (CPU, and CUDA where present) for connmon's own math inside a user's forward."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.autocast("cpu", enabled=False))
        if torch.cuda.is_available():
            stack.enter_context(torch.autocast("cuda", enabled=False))
        yield


_WARNED: set[object] = set()
_WARNED_ABOUT: weakref.WeakKeyDictionary[nn.Module, set[object]] = weakref.WeakKeyDictionary()


def warn_once(message: str, key: object = None, module: nn.Module | None = None) -> None:
    """Warn once per ``key`` (default: the message), per ``module`` while it lives, else for the life of the process.

    A module is held by a weak reference, not its ``id``: a new module that reuses a freed one's address is warned
    about again.
    """
    key = message if key is None else key
    said = _WARNED if module is None else _WARNED_ABOUT.setdefault(module, set())
    if key not in said:
        said.add(key)
        warnings.warn(message, stacklevel=user_stacklevel())
