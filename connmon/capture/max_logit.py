"""The largest attention logit of every head, over the whole batch of every training forward, read every step.

The logit is ``scale * q . k`` over the query-key pairs the mask allows: the quantity Kimi K2's QK-Clip bounds
(the soft-cap, position bias and additive mask values are not part of it, and neither are the pairs a mask blocks).
It is computed from the exact ``query`` and ``key`` each ``scaled_dot_product_attention`` call of an attention
module receives (after RoPE, qk-norm and GQA), blockwise over queries in float32 under ``no_grad``, so no ``(B, H,
L, S)`` map of the whole batch is ever made, and the model's own computation is untouched (the call runs first,
unchanged). :class:`HeadMaxLogits` keeps the running max per layer and head over every training forward (all
micro-batches of a step) until it is read; :meth:`HeadMaxLogits.read` reduces it across processes with one MAX
all-reduce (data-parallel replicas; under tensor parallelism each process's own heads are first gathered in their
group).

While it watches a layer's first forward, it also finds which output rows of which projection weight make each
head's query, key and value (from the data: the projection's output at position 0, where RoPE is the identity, equals
the query bitwise), and which input columns of the output projection read each head's output: the layout
:class:`connmon.alerts.QKClip` and :class:`connmon.alerts.TransportClip` change.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from connmon._collectives import gathered, is_distributed, local, max_over_processes, process_count
from connmon._cost import CostClock
from connmon._pause import is_paused
from connmon.capture.forward_wrapper import ForwardWrapper
from connmon.capture.scores import allowed_by
from connmon.capture.session import busy, remove_mode, warn_once

__all__ = ["HeadLayout", "HeadMaxLogits", "fused_path_modules", "head_max_logit"]

BLOCK_ELEMENTS = 1 << 22  # scores per block: 16 MiB of float32


def head_max_logit(
    query: Tensor,
    key: Tensor,
    mask: Tensor | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    block_elements: int = BLOCK_ELEMENTS,
) -> Tensor:
    """``(H,)``: each head's largest ``scale * q . k`` over the batch and the allowed query-key pairs, blockwise.

    Args:
        query: ``(B, H, L, E)`` (or ``(H, L, E)``).
        key: ``(B, H_kv, S, E)``, ``H_kv`` divides ``H`` (a key head serves ``H / H_kv`` query heads, GQA).
        mask: bool (True: may attend) or additive float mask (a key is blocked at or below ``-1e4``), broadcastable
            to ``(B, H, L, S)``.
        scale: the score scale; default ``1 / sqrt(E)``.
        is_causal: the upper-left aligned lower triangle, as in ``scaled_dot_product_attention``.
        block_elements: the most scores held at once (queries are taken in blocks).

    Returns:
        float32 ``(H,)`` (float64 for float64 input); ``-inf`` for a head with no allowed pair.

    Examples:
        >>> import torch
        >>> from connmon.capture.max_logit import head_max_logit
        >>> q, k = torch.randn(2, 4, 16, 8), torch.randn(2, 2, 16, 8)
        >>> dense = (q @ k.repeat_interleave(2, dim=1).mT / 8**0.5).amax(dim=(0, 2, 3))
        >>> torch.allclose(head_max_logit(q, k, block_elements=64), dense)
        True
    """
    if query.dim() == 3:
        query, key = query.unsqueeze(0), key.unsqueeze(0)
    query, key = query.flatten(0, -4), key.flatten(0, -4)
    dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    batch, heads, length, dim = query.shape
    keys = key.to(dtype)
    if keys.shape[-3] != heads:
        keys = keys.repeat_interleave(heads // keys.shape[-3], dim=-3)
    scale = 1 / math.sqrt(dim) if scale is None else scale
    allowed = None if mask is None else allowed_by(mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape)))
    rows = max(1, block_elements // max(1, batch * heads * keys.shape[-2]))
    best = torch.full((heads,), float("-inf"), dtype=dtype, device=query.device)
    for start in range(0, length, rows):
        end = min(start + rows, length)
        reach = min(end, keys.shape[-2]) if is_causal else keys.shape[-2]  # a causal block reads no later key
        if reach == 0:
            continue
        scores = (query[..., start:end, :].to(dtype) @ keys[..., :reach, :].mT).mul_(scale)  # (B, H, r, reach)
        if is_causal:
            positions = torch.arange(start, end, device=query.device)[:, None]
            scores.masked_fill_(torch.arange(reach, device=query.device) > positions, float("-inf"))
        if allowed is not None:
            block = allowed[..., start:end, :] if allowed.shape[-2] > 1 else allowed
            scores.masked_fill_(~block[..., :reach], float("-inf"))
        best = torch.maximum(best, scores.amax(dim=(0, 2, 3)))
    return best


def fused_path_modules(model: nn.Module) -> list[nn.Module]:
    """The attention modules of ``model`` whose layer has a fused path that any hook inside it turns off.

    ``nn.TransformerEncoderLayer`` runs ``torch._transformer_encoder_layer_fwd`` in eval mode without gradients
    unless a forward hook sits on it or inside it: its ``self_attn`` is read without one.

    Examples:
        >>> import torch
        >>> from connmon.capture.max_logit import fused_path_modules
        >>> layer = torch.nn.TransformerEncoderLayer(16, 4, batch_first=True)
        >>> fused_path_modules(torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False))[0].num_heads
        4
    """
    return [m.self_attn for m in model.modules() if isinstance(m, nn.TransformerEncoderLayer)]


@dataclass(frozen=True)
class Projection:
    """One side of a layer's heads (queries, keys, values or the output): a weight and its features per head.

    Attributes:
        weight: the weight's name in the attention module (``"c_attn.weight"``, ``"in_proj_weight"``).
        bias: the bias's name, or None.
        rows: ``(heads, d_h)`` each head's features along the weight's dimension 0 (dimension 1 when ``transposed``):
            output features of a query, key or value projection (``H`` query heads, ``H_kv`` key heads), input
            features of the output projection.
        transposed: the heads lie along dimension 1: a query/key/value weight stored ``(in, out)`` (GPT-2's
            ``Conv1D``), or an output projection stored ``(out, in)`` (``nn.Linear``).
    """

    weight: str
    bias: str | None
    rows: Tensor
    transposed: bool = False
    bias_rows: Tensor | None = None  # the bias's entries per head, where they are not ``rows`` (MHA's separate weights)
    local: bool = False  # rows count in this process's part of a tensor-parallel weight (its own heads)


@dataclass(frozen=True)
class HeadLayout:
    """Where one layer's heads live in its parameters (found from the data at its first training forward).

    A side is None where it was not found: the queries and keys (both or neither) where a norm, a latent or a rotation
    stands between them and a projection; the values or the output where they pass through something other than one
    projection of the attention module (BERT's output projection lies outside its self-attention module).
    """

    query: Projection | None = None
    key: Projection | None = None
    value: Projection | None = None
    output: Projection | None = None


class HeadMaxLogits:
    """Reads attention modules' SDPA calls in training forwards: each head's max logit, and its q/k layout.

    Forwards are read while :meth:`watching` (its wrappers exist only inside the block); the maxima
    add up across blocks (the micro-batches of a step) until :meth:`read`.

    Args:
        modules: the attention modules, in layer order.
        names: their names (for warnings).
        block_elements: the most scores held at once per call.
        clock: a :class:`connmon._cost.CostClock` the reading's time is counted on (it synchronizes the device).
        fused: modules read without a hook: the ``self_attn`` of an ``nn.TransformerEncoderLayer``, which refuses its
            fused eval path when any hook sits on it or inside it (:func:`fused_path_modules` finds them).

    Examples:
        >>> import torch
        >>> from connmon.capture.max_logit import HeadMaxLogits
        >>> layer = torch.nn.TransformerEncoderLayer(16, 4, dropout=0.0, batch_first=True)
        >>> tracker = HeadMaxLogits([layer.self_attn], ["self_attn"])
        >>> with tracker.watching():
        ...     _ = layer(torch.randn(2, 5, 16)).sum().backward()
        >>> tracker.read().shape, tracker.layout(0).key.weight, tracker.layout(0).key.rows[0].tolist()
        (torch.Size([1, 4]), 'in_proj_weight', [16, 17, 18, 19])
    """

    def __init__(
        self,
        modules: Sequence[nn.Module],
        names: Sequence[str],
        block_elements: int = BLOCK_ELEMENTS,
        clock: CostClock | None = None,
        fused: Sequence[nn.Module] = (),
    ) -> None:
        self.fused = list(fused)
        self.clock = clock  # the reading's time counts as the owner's (a Monitor's cost clock)
        self.modules = list(modules)
        self.names = list(names)
        self.block_elements = block_elements
        self._running: list[Tensor | None] = [None] * len(self.modules)
        self._bounds: list[Tensor | None] = [None] * len(self.modules)  # the kernel's logsumexp bound, per head
        self.exact = True  # this step's forwards read exactly (blockwise); False: the kernel's bound where it has one
        self.threshold: float | None = None  # with exact False: a call whose bound passes it is read exactly too
        self._said_no_bound: set[int] = set()  # layers whose calls carry no logsumexp (said once each)
        self._layouts: list[HeadLayout | None] = [None] * len(self.modules)
        self._seen_call = [False] * len(self.modules)
        self._tensor_parallel = False  # the projections are split over all processes by head (a 1-D mesh)
        self._unread: set[int] = set()  # layers not read: split by head beside data parallelism, or a reading failed
        self._handles: list = []
        self._modes: list[_Watch] = []

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """Read the training forwards run inside the block (re-entrant; every wrapper is removed when it ends)."""
        if self._handles:
            yield
            return
        self.watch()
        try:
            yield
        finally:
            self.unwatch()

    def watch(self) -> None:
        """Hook the modules (until :meth:`unwatch`); a no-op while hooked.

        A module in ``fused`` is read through a :class:`~connmon.capture.forward_wrapper.ForwardWrapper` instead,
        never a hook, so its layer takes the path it takes unwatched.
        """
        if self._handles:
            return
        wrapped = {id(module) for module in self.fused}
        for index, module in enumerate(self.modules):
            enter, leave = self._enter(index), self._leave(module)
            if id(module) in wrapped:
                self._handles.append(ForwardWrapper(module, lambda args, kwargs, e=enter: e(), None, leave))
                continue
            self._handles.append(module.register_forward_pre_hook(lambda *args, e=enter: e()))
            self._handles.append(module.register_forward_hook(lambda *args, f=leave: f(True), always_call=True))

    def unwatch(self) -> None:
        """Remove every hook, and any reading a forward that raised left open (between forwards).

        PyTorch runs a forward hook's clean-up for an ``Exception`` only: a ``KeyboardInterrupt`` inside a forward
        leaves its reading open until here.
        """
        for handle in reversed(self._handles):
            handle.remove()
        self._handles = []
        while self._modes:
            remove_mode(self._modes.pop())

    def _enter(self, index: int) -> Callable[[], None]:
        module = self.modules[index]

        def enter() -> None:
            if not module.training or not torch.is_grad_enabled() or busy() or is_paused():
                return
            if torch.compiler.is_compiling():  # inside a graph: nothing to read, and nothing traced
                return
            watch = _Watch(self, index, module)
            watch.__enter__()
            self._modes.append(watch)

        return enter

    def _leave(self, module: nn.Module) -> Callable[[bool], None]:
        def leave(completed: bool) -> None:
            if self._modes and self._modes[-1].module is module:
                watch = self._modes.pop()
                remove_mode(watch)
                if completed:  # a forward cut short says nothing about the layer
                    watch.finish()

        return leave

    def observe(self, index: int, value: Tensor, bound: bool = False) -> None:
        """Fold one call's ``(H,)`` maxima into layer ``index``'s running max (``bound``: the logsumexp bounds')."""
        table = self._bounds if bound else self._running
        running = table[index]
        if running is not None and running.shape != value.shape:
            value = torch.maximum(running.max(), value.max()).expand(running.shape)  # heads differ: keep the layer max
        table[index] = value if running is None else torch.maximum(running, value)

    def read(self, group: object = None) -> Tensor | None:
        """``(layers, H)``, every head's exact max logit since the last read, MAX-reduced over ``group``; then reset.

        ``-inf`` for a layer that ran no exact reading (and for heads beyond a layer's own count). None when no layer
        ran one at all on any process (every process must call it at the same steps under ``torch.distributed``).
        The bounds since the last read are dropped; :meth:`read_both` returns them too.
        """
        return self.read_both(group)[0]

    def read_both(self, group: object = None) -> tuple[Tensor | None, Tensor | None]:
        """The exact table (as :meth:`read`) and the bound table, in one MAX all-reduce; then both reset.

        The bound of a head is the largest logsumexp of its query rows that an SDPA kernel saved for its backward
        (``max_j s_ij <= LSE_i <= max_j s_ij + log n_i``): at least its max logit and at most ``log n`` above, equal
        when one key dominates. A head read exactly on a step counts its exact value in the bound table too.
        """
        width = max((r.numel() for r in [*self._running, *self._bounds] if r is not None), default=1)
        exact, bounds = self._table(self._running, width), self._table(self._bounds, width)
        both = torch.stack([exact, torch.maximum(bounds, exact)])  # an exact reading bounds itself
        self._running, self._bounds = [None] * len(self.modules), [None] * len(self.modules)
        read = [not bool(torch.isneginf(t).all()) for t in both]
        if self._tensor_parallel and is_distributed():  # each process its own heads: read or not, decided together
            flags = torch.tensor(read, dtype=torch.int32, device=both.device)
            read = [bool(flag) for flag in max_over_processes(flags, group).tolist()]
        elif is_distributed():
            device = both.device
            size = max_over_processes(torch.tensor([both.shape[2]], device=device), group)
            if int(size) > both.shape[2]:
                padding = both.new_full((2, both.shape[1], int(size) - both.shape[2]), -math.inf)
                both = torch.cat([both, padding], 2)
            max_over_processes(both, group)
            read = [not bool(torch.isneginf(t).all()) for t in both]
        return tuple(t if flag else None for t, flag in zip(both, read, strict=True))  # type: ignore[return-value]

    def drop(self) -> None:
        """Forget the maxima since the last read, unread (no collective)."""
        self._running, self._bounds = [None] * len(self.modules), [None] * len(self.modules)

    def _table(self, rows: list[Tensor | None], width: int) -> Tensor:
        device = next((r.device for r in [*self._running, *self._bounds] if r is not None), None)
        if device is None:
            device = next((p.device for m in self.modules for p in m.parameters()), torch.device("cpu"))
        table = torch.full((len(self.modules), width), float("-inf"), device=device)
        for index, running in enumerate(rows):
            if running is not None:
                table[index, : running.numel()] = running.float()
        return table

    @property
    def tensor_parallel(self) -> bool:
        """Whether the layers' heads are split over the processes (each process reads and clips its own heads)."""
        return self._tensor_parallel

    def whole(self, table: Tensor) -> Tensor:
        """``table`` with every head of the model: under tensor parallelism the processes' heads side by side.

        Every process must call it (a collective there); elsewhere the table itself.
        """
        if not self._tensor_parallel or not is_distributed():
            return table
        return torch.cat(gathered(table), dim=1)

    def state_dict(self) -> dict:
        """The maxima not read yet (this process's) and the heads' layouts found, as plain lists and dicts.

        With the layouts a resumed run clips before its first forward, as the uninterrupted run does.
        """
        return {"running": [None if r is None else r.tolist() for r in self._running],
                "bounds": [None if r is None else r.tolist() for r in self._bounds],
                "layouts": [None if layout is None else _layout_state(layout) for layout in self._layouts],
                "seen": list(self._seen_call), "tensor_parallel": self._tensor_parallel}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` saved (a checkpoint of another depth is ignored)."""
        running = state.get("running", [])
        if len(running) == len(self.modules):
            device = next((p.device for m in self.modules for p in m.parameters()), torch.device("cpu"))
            self._running = [None if r is None else torch.tensor(r, device=device) for r in running]
            bounds = state.get("bounds") or [None] * len(running)
            self._bounds = [None if r is None else torch.tensor(r, device=device) for r in bounds]
        layouts, seen = state.get("layouts"), state.get("seen")
        if layouts is not None and seen is not None and len(layouts) == len(seen) == len(self.modules):
            self._layouts = [None if layout is None else _layout_of(layout) for layout in layouts]
            self._seen_call = [bool(flag) for flag in seen]
            self._tensor_parallel = bool(state.get("tensor_parallel", False))

    def layouts_pending(self) -> bool:
        """Whether a layer's layout is still to be looked for (it has not run a read training forward yet)."""
        return any(not seen and i not in self._unread for i, seen in enumerate(self._seen_call))

    def layout(self, index: int) -> HeadLayout | None:
        """Where layer ``index``'s queries and keys come from, found at its first training forward (None: not found)."""
        return self._layouts[index]


class _Watch(TorchFunctionMode):
    """One attention module's forward: reads its SDPA calls, and its projections until its layout is known."""

    def __init__(self, tracker: HeadMaxLogits, index: int, module: nn.Module) -> None:
        super().__init__()
        self.tracker, self.index, self.module = tracker, index, module
        self.find_layout = tracker._layouts[index] is None and not tracker._seen_call[index]
        self.own = {id(p): n for n, p in module.named_parameters()} if self.find_layout else {}
        self.projections: list[tuple] = []  # (weight name, bias name, output, transposed, weight is a DTensor)
        self.attention_output: Tensor | None = None  # the first call's output, until the output projection reads it
        self.calls = 0

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if self.index in self.tracker._unread:
            return result
        try:
            if (
                func is torch.nn.functional.scaled_dot_product_attention
                or func is torch._C._nn.scaled_dot_product_attention
            ):
                with self._measuring():
                    self._sdpa(args, kwargs, result)
            elif func is torch.nn.functional.multi_head_attention_forward:  # one call: its inside is not seen
                with self._measuring():
                    self._multi_head(args, kwargs)
            elif self.find_layout and isinstance(result, Tensor):
                self._projection(func, args, kwargs, result)
        except Exception as error:  # the reading must never end the training run: this layer is not read again
            self.tracker._unread.add(self.index)
            warn_once(
                f"connmon: {self.tracker.names[self.index]}: reading its max logit raised {type(error).__name__}: "
                f"{error}; it is not read from now on, and training goes on unchanged",
                key="max-logit-error",
                module=self.module,
            )
        return result

    def _measuring(self) -> contextlib.AbstractContextManager:
        clock = self.tracker.clock
        return clock.measuring() if clock is not None else contextlib.nullcontext()

    def _sdpa(self, args: tuple, kwargs: dict, result: Tensor) -> None:
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
        call = dict(zip(names, args, strict=False)) | kwargs
        query, key = local(call["query"]).detach(), local(call["key"]).detach()
        mask = call.get("attn_mask")
        mask = None if mask is None else local(mask).detach()
        tracker = self.tracker
        bound = None if tracker.exact else self._bound(result, mask, query, key)
        if bound is not None:
            tracker.observe(self.index, bound, bound=True)
        if bound is None:  # no kernel bound: read exactly on its read steps, and on every step a clip acts on
            wanted = tracker.exact or tracker.threshold is not None
        else:
            wanted = tracker.threshold is not None and bool((bound > tracker.threshold).any())
        if wanted:
            with torch.no_grad():
                best = head_max_logit(query, key, mask, scale=call.get("scale"), is_causal=bool(call.get("is_causal")),
                                      block_elements=tracker.block_elements)  # fmt: skip
            tracker.observe(self.index, best)
        self.calls += 1
        if self.find_layout and self.calls == 1:
            value = local(call["value"]).detach()
            layout = replace(_layout(self.projections, query, key), value=_side(self.projections, value))
            self.attention_output = local(result).detach() if isinstance(result, Tensor) else None
            self.tracker._layouts[self.index] = layout

    def _bound(self, result: object, mask: Tensor | None, query: Tensor, key: Tensor) -> Tensor | None:
        """``(H,)`` each head's largest logsumexp the kernel saved for its backward, or None where it saved none.

        None too for an additive float mask: its values (ALiBi, soft biases) enter the logsumexp, which then bounds
        ``s + bias``, not the logit. Both are said once per layer; the call is then read exactly. A head whose queries
        or keys are not finite reads NaN: some kernels (CPU flash attention on some instruction sets) save a
        logsumexp of 0 for such rows.
        """
        saved = getattr(getattr(result, "grad_fn", None), "_saved_logsumexp", None)
        why = None
        if not isinstance(saved, Tensor) or saved.dim() < 2:
            why = "its attention kernel saves no logsumexp (the math backend, or a forward without gradients)"
        elif mask is not None and mask.dtype != torch.bool:
            why = "its additive float mask enters the kernel's logsumexp"
        tracker = self.tracker
        if why is not None:
            if self.index not in tracker._said_no_bound:
                tracker._said_no_bound.add(self.index)
                warn_once(
                    f"connmon: {tracker.names[self.index]}: {why}, so its per-step max logit is read exactly "
                    "(blockwise q k^T) on every read step, not from the kernel's statistics",
                    key="no-bound",
                    module=self.module,
                )
            return None
        assert isinstance(saved, Tensor)
        lse = local(saved).detach().float()
        lse = lse.reshape(-1, *lse.shape[-2:])  # (B, H, L)
        if mask is None:  # causal or unmasked, no row without a key: a NaN is the forward's own (it says most)
            bound = lse.amax(dim=(0, 2))
        else:
            bound = lse.nan_to_num(nan=-math.inf).amax(dim=(0, 2))  # a masked-out row's NaN is no reading
        return bound + 0 * (_head_sums(query, bound.numel()) + _head_sums(key, bound.numel()))  # NaN where not finite

    def _multi_head(self, args: tuple, kwargs: dict) -> None:
        """``nn.MultiheadAttention``'s self-attention: its queries and keys from its own input projection."""
        call = dict(zip(_MHA_ARGS, args, strict=False)) | kwargs
        if call.get("bias_k") is not None or call.get("add_zero_attn") or call["query"] is not call["key"]:
            return  # extra key slots or cross-attention: finish() says it is not read
        heads, x = call["num_heads"], call["query"].detach()  # (L, B, E) (or (L, E) unbatched)
        if x.dim() == 2:
            x = x.unsqueeze(1)
        width = x.shape[-1]
        bias = call.get("in_proj_bias")
        biases = (None, None) if bias is None else (bias[:width], bias[width : 2 * width])  # views: scaled in place
        if call.get("use_separate_proj_weight"):
            weights = (call["q_proj_weight"], call["k_proj_weight"])
        else:
            weights = (call["in_proj_weight"][:width], call["in_proj_weight"][width : 2 * width])
        if self.tracker.exact or self.tracker.threshold is not None:  # no kernel bound: its read steps, or a clip's
            with torch.no_grad():
                sides = [torch.nn.functional.linear(x, w, b).view(x.shape[0], x.shape[1], heads, -1).permute(1, 2, 0, 3)
                         for w, b in zip(weights, biases, strict=True)]  # fmt: skip  # (B, H, L, d)
                mask = _mha_mask(call.get("attn_mask"), call.get("key_padding_mask"))
                queries, keys = sides
                best = head_max_logit(queries, keys, mask, is_causal=bool(call.get("is_causal")) and mask is None,
                                      block_elements=self.tracker.block_elements)  # fmt: skip
            self.tracker.observe(self.index, best)
        self.calls += 1
        if self.find_layout and self.calls == 1:
            rows = torch.arange(width, device=x.device).view(heads, -1)
            if call.get("use_separate_proj_weight"):
                query, key = Projection("q_proj_weight", None, rows), Projection("k_proj_weight", None, rows)
            else:
                query, key = Projection("in_proj_weight", None, rows), Projection("in_proj_weight", None, rows + width)
            if call.get("use_separate_proj_weight"):
                value = Projection("v_proj_weight", None, rows)
            else:
                value = Projection("in_proj_weight", None, rows + 2 * width)
            if bias is not None:
                biased = ((query, rows), (key, rows + width), (value, rows + 2 * width))
                query, key, value = (replace(side, bias="in_proj_bias", bias_rows=at) for side, at in biased)
            names = {id(p): n for n, p in self.module.named_parameters()}
            out_name = names.get(id(call.get("out_proj_weight")))
            output = None if out_name is None else Projection(out_name, None, rows, transposed=True)
            self.tracker._layouts[self.index] = HeadLayout(query, key, value, output)

    def _projection(self, func: Any, args: tuple, kwargs: dict, out: Tensor) -> None:
        if func is torch.nn.functional.linear or func is torch._C._nn.linear:
            weight = args[1] if len(args) > 1 else kwargs.get("weight")
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            transposed = False
        elif func is torch.addmm and len(args) >= 3:  # GPT-2's Conv1D: b + x W
            bias, weight, transposed = args[0], args[2], True
        else:
            return
        mesh = getattr(weight, "device_mesh", None)
        if mesh is not None and any(p.is_shard() for p in getattr(weight, "placements", ())):
            self._tensor_parallel(mesh)
        if isinstance(weight, Tensor) and id(weight) in self.own:
            names = self.own[id(weight)], self.own.get(id(bias))
            self.projections.append((*names, local(out).detach(), transposed, mesh is not None))
            if self.attention_output is not None:
                inp = args[1] if transposed else (args[0] if args else kwargs.get("input"))
                if isinstance(inp, Tensor):
                    self._output_projection(self.own[id(weight)], local(inp).detach(), transposed, mesh is not None)

    def _output_projection(self, weight: str, inp: Tensor, transposed: bool, local: bool) -> None:
        """Is this projection's input the attention's output? Then its input columns per head are the output side."""
        from connmon.capture.adapters._values import matching_columns

        heads = self.attention_output
        assert heads is not None
        batch, _, length, _ = heads.shape
        if inp.dim() == 2 and inp.shape[0] == batch * length:
            inp = inp.view(batch, length, -1)
        if inp.dim() != 3 or inp.shape[:2] != (batch, length):
            return
        columns = matching_columns(inp, heads)
        layout = self.tracker._layouts[self.index]
        if columns is not None and layout is not None:
            self.attention_output = None
            output = Projection(weight, None, columns, transposed=not transposed, local=local)
            self.tracker._layouts[self.index] = replace(layout, output=output)

    def _tensor_parallel(self, mesh: Any) -> None:
        """The layer's projections are split by head (tensor parallelism): each process reads its own heads."""
        tracker = self.tracker
        if mesh.ndim == 1 and mesh.size() == process_count():
            tracker._tensor_parallel = True
            return
        tracker._unread.add(self.index)
        warn_once(
            f"connmon: {tracker.names[self.index]}'s projections are split by head over a mesh with more than one "
            "dimension (tensor parallelism beside data parallelism), so its per-step max logit is not read and "
            "QK-clip does not act there",
            key="tp-2d",
            module=self.module,
        )

    def finish(self) -> None:
        """After the module's forward: say once why a layer gave no reading."""
        tracker = self.tracker
        if self.calls:
            tracker._seen_call[self.index] = True
            layout = tracker._layouts[self.index]
            clipped = tracker.threshold is not None  # QK-clip acts: the one reader of the query and key rows
            if clipped and self.find_layout and (layout is None or layout.query is None):
                warn_once(
                    f"connmon: {tracker.names[self.index]}: its queries or keys are not output rows of one of its "
                    "projections (a norm, a latent or a rotation between them), so QK-clip cannot scale them there",
                    key="qk-layout",
                    module=self.module,
                )
        elif not tracker._seen_call[self.index]:
            warn_once(
                f"connmon: {tracker.names[self.index]} calls no scaled_dot_product_attention in its training forward "
                "(hand-written, flex or fused attention), so its per-step max logit is not read",
                key="no-sdpa",
                module=self.module,
            )


def _head_sums(side: Tensor, heads: int) -> Tensor:
    """``(heads,)`` the sum of each query head's rows of ``side`` (queries, or keys shared by a group: GQA).

    Finite where every entry is: a NaN or inf entry makes its head's sum so (one pass, no host sync), and finite
    entries overflow a float32 sum only past 3e38 in all. Half types are summed in float32 (fp16 tops out at 6.5e4).
    """
    rows = side if side.dim() >= 3 else side.unsqueeze(0)  # (L, E): one head
    wide = torch.float64 if rows.dtype == torch.float64 else torch.float32
    sums = rows.sum(dim=(-2, -1), dtype=wide).reshape(-1, rows.shape[-3]).sum(dim=0)  # (H_side,)
    return sums if sums.numel() == heads else sums.repeat_interleave(heads // sums.numel())


def _layout_state(layout: HeadLayout) -> dict:
    """A layout as plain lists and strings (a checkpoint's ``weights_only`` load reads it)."""
    sides = {}
    for side in ("query", "key", "value", "output"):
        found: Projection | None = getattr(layout, side)
        sides[side] = None if found is None else {
            "weight": found.weight, "bias": found.bias, "rows": found.rows.tolist(), "transposed": found.transposed,
            "bias_rows": None if found.bias_rows is None else found.bias_rows.tolist(), "local": found.local,
        }  # fmt: skip
    return sides


def _layout_of(state: dict) -> HeadLayout:
    """The layout :func:`_layout_state` wrote."""
    sides = {}
    for side, found in state.items():
        sides[side] = None if found is None else Projection(
            found["weight"], found["bias"], torch.tensor(found["rows"]), transposed=found["transposed"],
            bias_rows=None if found["bias_rows"] is None else torch.tensor(found["bias_rows"]), local=found["local"],
        )  # fmt: skip
    return HeadLayout(**sides)


_MHA_ARGS = (
    "query", "key", "value", "embed_dim_to_check", "num_heads", "in_proj_weight", "in_proj_bias", "bias_k", "bias_v",
    "add_zero_attn", "dropout_p", "out_proj_weight", "out_proj_bias", "training", "key_padding_mask", "need_weights",
    "attn_mask", "use_separate_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight", "static_k",
    "static_v", "average_attn_weights", "is_causal",
)  # fmt: skip


def _mha_mask(attn_mask: Tensor | None, key_padding_mask: Tensor | None) -> Tensor | None:
    """``nn.MultiheadAttention``'s masks (a bool True *blocks* there) as one allowed-pairs bool ``(B | 1, 1, L, S)``."""
    allowed = None
    if attn_mask is not None:
        allowed = ~attn_mask if attn_mask.dtype == torch.bool else allowed_by(attn_mask)
        allowed = allowed.reshape((1,) * (4 - allowed.dim()) + tuple(allowed.shape))
    if key_padding_mask is not None:
        keep = ~key_padding_mask if key_padding_mask.dtype == torch.bool else allowed_by(key_padding_mask)
        keep = keep.reshape(-1, 1, 1, keep.shape[-1])
        allowed = keep if allowed is None else allowed & keep
    return allowed


def _layout(projections: list, query: Tensor, key: Tensor) -> HeadLayout:
    """Which projection rows are each head's query and key (both or neither), matched bitwise against the outputs.

    Every position is tried first; then position 0 alone, where RoPE is the identity.
    """
    found = [_side(projections, query), _side(projections, key)]
    return HeadLayout(*found) if None not in found else HeadLayout()


def _side(projections: list, side: Tensor) -> Projection | None:
    """The projection rows whose outputs are ``side`` ``(B, H, n, d_h)``, the nearest projection first."""
    from connmon.capture.adapters._values import matching_columns

    if side.dim() != 4:
        return None
    batch, _, length, _ = side.shape
    for weight, bias, out, transposed, own_heads in reversed(projections):  # the nearest projection first
        if not out.is_floating_point() or out.dim() < 2:
            continue
        if out.dim() == 2 and out.shape[0] == batch * length:  # addmm's flattened (B n, F)
            candidates = [out.view(batch, length, -1)]
        elif out.dim() == 3:  # (B, n, F), or (n, B, F) inside nn.MultiheadAttention
            candidates = [out, out.transpose(0, 1)]
        else:
            continue
        for columns in candidates:
            if columns.shape[:2] != (batch, length):
                continue
            rows = matching_columns(columns, side)
            if rows is None:
                first, at = columns[:, :1], side[:, :, :1]
                if batch == 1:  # matching needs two tokens: the same one twice
                    first, at = first.expand(2, -1, -1), at.expand(2, -1, -1, -1)
                rows = matching_columns(first, at)
            if rows is not None:
                return Projection(weight, bias, rows, transposed, local=own_heads)
    return None
