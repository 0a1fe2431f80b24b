"""Any self-attention module, read from the attention calls that run inside its forward, whatever its names.

The calls: ``torch.nn.functional.scaled_dot_product_attention`` (nanoGPT, litgpt, x-transformers, timm, your own),
the attention functions that Hugging Face ``transformers`` models dispatch to through ``AttentionInterface``
(``"sdpa"`` and ``"eager"``, with each family's own eager function), ``flex_attention``
(:mod:`~connmon.capture.adapters.flex`) and attention computed by hand
(:mod:`~connmon.capture.adapters.handwritten`), at any depth inside the module.

Nothing is switched: the model keeps its own attention implementation and kernel. While a capture is armed, the
kernel is wrapped so that it runs first, unchanged, and then connmon scores the recorded window from the exact
``query``, ``key``, mask and score features it received (scaling, soft-capping, position bias, attention sinks,
after RoPE, qk-norm and GQA). A feature connmon does not model (an unknown keyword of the attention call, a
``BlockMask`` handed to a transformers function, a flash kernel) leaves that layer unrecorded with one warning that
names it.

The transport maps are found from the data, not from names: the value projection is the Linear (or GPT-2
``Conv1D``, or an ``F.linear`` call on the module's parameters) whose output columns are exactly the values the
attention read (separate, fused ``[q; k; v]``, per-head interleaved as in GPT-NeoX, grouped as in Falcon, any other
column layout; GQA repeated or not; through a normed latent as in DeepSeek's multi-head latent attention), and the
output projection is the Linear that takes the attention output unchanged (inside the module, or the sibling
``output.dense`` of the BERT family). The record's reconstruction error then proves the capture exact.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from connmon._collectives import local
from connmon._copying import CopiesDetached
from connmon.capture.adapters import flex, handwritten
from connmon.capture.adapters._discovery import calls_attention_kernel, remember_sdpa, sdpa_original
from connmon.capture.adapters._values import find_value, matching_columns, same
from connmon.capture.adapters.base import Adapter, transport_maps
from connmon.capture.session import CaptureSession, assembled, busy, remove_mode, warn_once

_CROSS_KWARGS = ("key_value_states", "encoder_hidden_states", "cross_attention_states")
# Keywords of a transformers attention call: those connmon reads into the scores, and those that do not change what
# the kernel computes. Any other keyword with a value leaves the layer unrecorded, with a warning naming it.
_READ_KWARGS = frozenset({"dropout", "scaling", "is_causal", "softcap", "position_bias", "s_aux", "sliding_window"})
_INERT_KWARGS = frozenset(
    {
        "position_ids", "cache_position", "past_key_values", "past_key_value", "use_cache", "output_attentions",
        "output_hidden_states", "return_dict", "layer_idx", "position_embeddings", "token_type_ids",
        "output_router_logits", "num_items_in_batch", "seq_idx",
        "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k",  # flash only; sdpa and eager read the mask
        "deterministic",  # flash only (ModernBERT): the sdpa and eager functions take it and ignore it
    }
)  # fmt: skip

_SESSIONS: list[CaptureSession] = []  # every armed session, whatever its thread (the kernel wrapper is process-wide)
_LOCAL = threading.local()  # per thread: .stack, the armed modules whose forward runs (innermost last), and .inside,
# > 0 while a transformers attention function runs (its own SDPA call is not read twice)


def _stack() -> list[nn.Module]:
    if not hasattr(_LOCAL, "stack"):
        _LOCAL.stack = []
    return _LOCAL.stack


def _inside() -> int:
    return getattr(_LOCAL, "inside", 0)


def linear_weight(module: nn.Module) -> tuple[Tensor, Tensor | None] | None:
    """``(W, b)`` with ``y = x W^T + b`` for an ``nn.Linear`` or a transformers ``Conv1D``; None for anything else.

    Examples:
        >>> import torch
        >>> from connmon.capture.adapters.kernel import linear_weight
        >>> tuple(linear_weight(torch.nn.Linear(4, 6))[0].shape), linear_weight(torch.nn.ReLU())
        ((6, 4), None)
    """
    if isinstance(module, nn.Linear):
        return module.weight, module.bias
    weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf") and isinstance(weight, Tensor):
        return weight.T, bias if isinstance(bias, Tensor) else None  # GPT-2: y = x W + b, W (d_in, d_out)
    return None


def kernel_caller_hooks(module: nn.Module) -> list[RemovableHandle]:
    """Hooks that keep an attention module that is not armed on the caller stack while its forward runs.

    Its kernel calls are then its own, never read as those of an armed module it runs inside.
    """
    return [module.register_forward_pre_hook(_entered), module.register_forward_hook(_left, always_call=True)]


def _entered(module: nn.Module, *args: object) -> None:
    """A forward pre-hook: ``module`` is now the innermost running attention module of this thread.

    Only a thread that armed a session keeps the stack and pushes the reading mode: another thread's forwards are
    never read, and its hooks may be removed by the arming thread while it is inside, so it must hold nothing that
    only a later hook would release. The same module entered through two sessions' hooks is stacked once.
    """
    if not any(session.is_own_thread() for session in _SESSIONS):  # a trace (torch.compile) runs in its caller
        return
    stack = _stack()
    if stack and stack[-1] is module:
        return
    stack.append(module)
    if len(stack) == 1 and not torch.compiler.is_compiling():  # a mode would trace as a graph break
        _LOCAL.reader = _Reader()
        _LOCAL.reader.__enter__()


def _left(module: nn.Module, *args: object) -> None:
    """A forward hook (``always_call``): ``module``'s forward is over, also when it raised."""
    stack = _stack()
    if stack and stack[-1] is module:
        stack.pop()
    if not stack:
        _release_reader()


def _release_reader() -> None:
    """Pop this thread's reading mode, if it pushed one."""
    reader = getattr(_LOCAL, "reader", None)
    if reader is not None:
        _LOCAL.reader = None
        remove_mode(reader)


class _Reader(TorchFunctionMode):
    """Sees every torch call while an attention module runs in this thread; runs it unchanged, then reads it.

    The call's result goes back to the model as it is; the reading (:func:`handwritten.observe`) is for the innermost
    running attention module, if an armed session wants it. Under ``torch.compile`` (a compiled region called
    inside the module, such as flex_attention's own) the mode only runs the call, so that it traces as nothing.
    """

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if torch.compiler.is_compiling():
            return func(*args, **kwargs)
        result = func(*args, **kwargs)
        for module, session in _readers():
            with session.guarded(module):
                handwritten.observe(session, module, func, args, kwargs=kwargs, result=result)
        return result


def _readers() -> Iterator[tuple[nn.Module, CaptureSession]]:
    """``(module, session)`` for the innermost running attention module of this thread, per session that wants it.

    Nothing while a transformers attention function runs (it is read as a whole) or connmon's own work does.
    """
    stack = _stack()
    if not stack or _inside() or busy():
        return
    module = stack[-1]
    for session in _SESSIONS:
        if session.wants(module) and isinstance(session.layers[id(module)].adapter, KernelAttention):
            yield module, session


_TENSOR_PARALLEL = (
    "its projections are sharded over more than one device mesh dimension while it runs (tensor parallelism on a "
    "2-D mesh), which connmon does not read yet; it runs unchanged"
)


def _tensor_parallel_group(projection: nn.Module) -> object:
    """The process group a projection's weight is split over while the forward runs (tensor parallelism), or None.

    ``"2-D"`` for a weight sharded over a mesh of several dimensions.
    """
    weight = getattr(projection, "weight", None)
    placements = getattr(weight, "placements", ())
    if not any(placement.is_shard() for placement in placements):
        return None
    mesh = getattr(weight, "device_mesh")  # noqa: B009  # a DTensor's
    return mesh.get_group() if mesh.ndim == 1 else "2-D"


def projections(module: nn.Module) -> list[nn.Module]:
    """The Linear and ``Conv1D`` layers inside ``module``: the candidates for its value and output projections."""
    return [m for m in module.modules() if m is not module and linear_weight(m) is not None]


def _has_projection(module: nn.Module) -> bool:
    return any(m is not module and linear_weight(m) is not None for m in module.modules())


class KernelAttention(CopiesDetached, Adapter):
    """Adapter for any module whose forward calls an attention kernel and that holds its projections.

    A module matches when its forward calls the kernel and it contains Linear layers, or when a child without
    Linear layers calls the kernel for it (x-transformers' ``Attend``). Cross-attention is skipped with a warning.

    Examples:
        >>> import torch
        >>> import connmon
        >>> class Mixer(torch.nn.Module):  # any class name, any attribute names
        ...     def __init__(self, d=8, heads=2):
        ...         super().__init__()
        ...         self.heads, self.wqkv, self.wo = heads, torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        ...     def forward(self, x):
        ...         b, n, d = x.shape
        ...         q, k, v = self.wqkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)  # 3 x (B, H, n, e)
        ...         y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        ...         return self.wo(y.transpose(1, 2).reshape(b, n, d))
        >>> (record,) = connmon.capture(Mixer(), torch.randn(1, 5, 8))
        >>> tuple(record.w_v.shape), float(record.reconstruction_error) < 1e-5
        ((2, 4, 8), True)
    """

    name = "attention kernel"
    _not_copied = (("_resolved", weakref.WeakKeyDictionary),)  # found again by a copy's first capture

    def __init__(self) -> None:
        # the maps found by each module's last capture; weak keys: nothing is kept once a model is gone
        self._resolved: weakref.WeakKeyDictionary[nn.Module, tuple[Tensor, Tensor, Tensor]] = (
            weakref.WeakKeyDictionary()
        )

    def matches(self, module: nn.Module) -> bool:  # noqa: D102
        calls = calls_attention_kernel(module) or any(
            calls_attention_kernel(child) and not _has_projection(child) for child in module.children()
        )
        return calls and _has_projection(module)

    def weights(self, module: nn.Module) -> tuple[Tensor, Tensor, Tensor]:
        """The maps found for ``module`` by its last capture (they are read from the data flowing through it).

        Raises:
            ValueError: if the module was never captured.
        """
        if module not in self._resolved:
            raise ValueError(
                f"{type(module).__name__} has not been captured yet: its projections are found by a capture"
            )
        return self._resolved[module]

    def hooks(self, model: nn.Module, name: str, module: nn.Module, session: CaptureSession) -> list[RemovableHandle]:  # noqa: D102
        if getattr(module, "is_cross_attention", False) or "CrossAttention" in type(module).__name__:
            session.skip(module, "it is cross-attention (queries and keys from different sequences)")
            return []
        candidates = projections(module)
        parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        sibling = getattr(getattr(parent, "output", None), "dense", None)  # the BERT family's output projection
        if parent is not module and sibling is not None and linear_weight(sibling) is not None:
            candidates.append(sibling)

        def enter(mod: nn.Module, args: tuple, kwargs: dict) -> None:
            _entered(mod)
            if session.wants(mod):
                pending = session.pending(mod)
                pending.entered = True
                pending.adapter_state.setdefault("calls", [])
                if any(kwargs.get(key) is not None for key in _CROSS_KWARGS):
                    session.skip(mod, "it is called as cross-attention (queries and keys from different sequences)")
                else:  # FSDP2's weights are whole in a forward: a shard then is tensor parallelism's
                    groups = {group for group in map(_tensor_parallel_group, candidates) if group is not None}
                    if len(groups) > 1 or "2-D" in groups:
                        session.skip(mod, _TENSOR_PARALLEL)
                    elif groups:
                        pending.adapter_state["tensor_parallel"] = groups.pop()

        def projected(proj: nn.Module, args: tuple, output: Tensor) -> None:
            found = linear_weight(proj)
            if found and session.wants(module) and args and isinstance(args[0], Tensor) and isinstance(output, Tensor):
                with session.guarded(module):
                    self.read_projection(session, module, found[0], found[1], inp=args[0], out=output)

        def normed(norm: nn.Module, args: tuple, output: Tensor) -> None:  # a latent norm (DeepSeek's kv_a_layernorm)
            if session.wants(module) and module in _stack() and args and isinstance(args[0], Tensor):
                session.pending(module).adapter_state.setdefault("norms", []).append((norm, args[0], output))

        norms = [m for m in module.modules() if "Norm" in type(m).__name__ and _gain(m) is not None]
        return [
            module.register_forward_pre_hook(enter, with_kwargs=True),
            module.register_forward_hook(_left, with_kwargs=True, always_call=True),
            *(proj.register_forward_hook(projected) for proj in candidates),
            *(norm.register_forward_hook(normed) for norm in norms),
        ]

    @contextlib.contextmanager
    def armed(self, model: nn.Module, session: CaptureSession) -> Iterator[None]:  # noqa: D102
        modules = [layer.module for layer in session.layers.values() if layer.adapter is self]
        with intercepted(session), flex.wrapped(modules, _flex_call):
            yield

    def read_projection(
        self, session: CaptureSession, module: nn.Module, weight: Tensor, bias: Tensor | None, inp: Tensor, out: Tensor
    ) -> None:
        """A projection ``out = inp W^T + b`` ran for ``module``: a value candidate, or its output projection.

        Called by the hooks on its Linear layers and for ``F.linear`` calls on its parameters (the same call seen
        both ways is read once).
        """
        # under tensor parallelism each process reads its own part: its shard of the weight, its heads' features;
        # an output that is still a sum of the processes' parts (a row-sharded projection, before its all-reduce) whole
        placements = getattr(out, "placements", None)
        if placements and any(placement.is_partial() for placement in placements):
            out = getattr(out, "full_tensor")()  # noqa: B009  # a DTensor's
        weight, inp, out = local(weight), local(inp), local(out)
        bias = None if bias is None else local(bias)
        state = session.pending(module).adapter_state
        if "consumes" in state:  # after the kernel call: is this the output projection?
            self._output(session, module, (weight, bias), inp, out=out)
        elif module in _stack():
            calls = state.setdefault("calls", [])
            if not any(out is call[4] for call in calls):
                flat = inp.dim() == out.dim() == 4 and inp.shape[1] == out.shape[1] == 1  # (B, 1, n, F): DeepSeek
                calls.append((weight, bias, inp[:, 0] if flat else inp, out[:, 0] if flat else out, out))

    def _output(self, session: CaptureSession, module: nn.Module, projection: tuple, inp: Tensor, out: Tensor) -> None:
        state = session.pending(module).adapter_state
        consumed = state["consumes"]  # (B_s, m, H d_h), the kernel's output as an output projection reads it
        seen = session.window(inp)
        if seen.shape != consumed.shape or not same(seen.detach(), consumed.to(seen.dtype)):
            return
        value, value_bias = state["value"]
        if value.shape[-1] != out.shape[-1]:  # the values are not linear in the module's input
            value, x = self._latent(session, state, value)
            session.put(module, x=x)
        out_weight, out_bias = projection
        value_bias, out_bias = (None if b is None else b.detach() for b in (value_bias, out_bias))
        group = state.get("tensor_parallel")
        if group is not None:  # this process's heads; the output projection's bias is added once, after the sum
            weights = transport_maps(value.detach(), value_bias, state["rows"], out_weight.detach(), output_bias=None)
            w_v, w_o, bias = assembled(group, weights)
            weights = (w_v, w_o, bias + out_bias if out_bias is not None else bias)
        else:
            weights = transport_maps(
                value.detach(), value_bias, state["rows"], out_weight.detach(), output_bias=out_bias
            )
        self._resolved[module] = weights
        session.put(module, output=out, weights=weights, heads_over=group)

    def read_kernel_call(
        self,
        session: CaptureSession,
        module: nn.Module,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        output: Tensor,
        **scores: Any,
    ) -> None:
        """Record one kernel call of ``module``: its scores, its value projection and the output to look for.

        Args:
            session: the armed session.
            module: the attention module on whose behalf the kernel ran.
            query: ``(B, H, L, E)``.
            key: ``(B, H_kv, S, E)``.
            value: ``(B, H_v, S, E)``.
            output: the kernel's output as ``(B, L, H, E)``.
            **scores: mask and score features for :meth:`CaptureSession.put_scores`.
        """
        if session.pending(module).scored:
            return
        session.put_scores(module, query, key, **scores)
        if session.wants(module):
            self.read_values(session, module, value, output)

    def read_values(self, session: CaptureSession, module: nn.Module, value: Tensor, output: Tensor) -> None:
        """The values ``(B, H_v, S, E)`` an attention call of ``module`` read and its output ``(B, L, H, E)``.

        Finds the value projection among the projections that ran before (their output columns are the values),
        and remembers the output that the output projection must take unchanged.
        """
        pending = session.pending(module)
        with session.guarded(module):
            heads = output.shape[-2]
            calls = pending.adapter_state.pop("calls", [])
            pending.adapter_state["projections"] = calls
            found = find_value(session, calls, session.window(value, dim=-2), heads)
            if found is None:
                return  # reported when the session closes
            projection, rows, inp = found
            pending.adapter_state.update(value=projection, rows=rows, value_input=session.window(inp).detach())
            session.put(module, x=inp)
            window = session.window(output).detach()
            pending.adapter_state["consumes"] = window.reshape(*window.shape[:2], -1)

    @staticmethod
    def _latent(session: CaptureSession, state: dict, value: Tensor) -> tuple[Tensor, Tensor]:
        """Values read from a normed latent ``z_j = s_j g * (A x_j)``: the map ``V diag(g) A`` and the input ``s x``.

        Multi-head latent attention (DeepSeek-V2/V3) projects each token to a latent ``A x_j``, normalizes it (an
        RMS norm: a per-token factor ``s_j`` and a gain ``g``) and projects the values from it, so each value is
        ``V diag(g) A (s_j x_j)``: linear in the input scaled by its token's factor. That scaled input is what the
        record holds as ``x``; ``s_j`` is read from the norm's own input and output (least squares per token, checked
        by the reconstruction error).

        Raises:
            ValueError: if the values come from no such latent (the layer is skipped with this reason).
        """
        latent = state["value_input"]  # (B_s, m, r)
        for norm, inp, out in state.get("norms", []):
            out = session.window(out).detach()
            if out.shape != latent.shape or not same(out, latent.to(out.dtype)):
                continue
            norm_gain = _gain(norm)
            if norm_gain is None:
                continue
            gain = norm_gain.detach().to(torch.float64)
            normed_input = session.window(inp).detach()
            for weight, bias, x, projected, _ in state.get("projections", []):
                columns = matching_columns(session.window(projected).detach(), normed_input.unsqueeze(1))
                if columns is None or (bias is not None and bool(bias.detach().any())):
                    continue
                scaled = gain * normed_input.to(torch.float64)  # g * (A x_j), without the factor s_j
                factor = (latent.to(torch.float64) * scaled).sum(-1) / scaled.square().sum(-1).clamp_min(1e-300)
                folded = value.detach().to(torch.float64) @ (
                    gain[:, None] * weight.detach()[columns[0]].to(torch.float64)
                )
                return folded.to(value.dtype), session.window(x).detach().to(torch.float64) * factor[..., None]
        raise ValueError(
            f"its values are linear in a {value.shape[-1]}-wide latent, not in its input, and connmon found no "
            "per-token norm of a projection of the input between them, so the walk does not model it"
        )

    def read_flex_call(
        self,
        session: CaptureSession,
        module: nn.Module,
        output: Tensor,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        *,
        score_mod: Callable[..., Any] | None,
        block_mask: object,
        scale: float | None,
    ) -> None:
        """Read one ``flex_attention`` call (its output ``(B, H, L, E)``) from its own score and mask functions."""
        if session.pending(module).scored:
            return
        with session.guarded(module):
            if query.shape[-2] != key.shape[-2]:
                raise ValueError("queries and keys differ in length: cross-attention or cached decoding")
            probs, logits, truncated = flex.flex_scores(
                query.detach(), key.detach(), score_mod=score_mod, block_mask=block_mask, scale=scale,
                window=session.max_tokens or query.shape[-2], sequences=session.num_sequences,
            )  # fmt: skip
        session.put_probabilities(module, probs, logits, truncated=truncated)
        if session.wants(module):
            self.read_values(session, module, value, output.transpose(1, 2))

    def read_sdpa_call(
        self, session: CaptureSession, module: nn.Module, args: tuple, kwargs: dict, output: Tensor
    ) -> None:
        """Read one ``F.scaled_dot_product_attention(*args, **kwargs)`` call that returned ``output``."""
        query, key, value, *rest = args
        bound = dict(zip(_SDPA_PARAMETERS, rest, strict=False)) | kwargs
        with session.guarded(module):
            self.read_kernel_call(
                session, module, query, key, value=value, output=output.transpose(1, 2),
                mask=bound.get("attn_mask"), scale=bound.get("scale"), is_causal=bool(bound.get("is_causal")),
                dropout=float(bound.get("dropout_p") or 0.0) > 0,
            )  # fmt: skip


def _gain(norm: nn.Module) -> Tensor | None:
    """A norm's per-feature gain (its 1-dim ``weight``), or None."""
    weight = getattr(norm, "weight", None)
    return weight if isinstance(weight, Tensor) and weight.dim() == 1 else None


# --- the kernels, wrapped while any session is armed ---------------------------------------------------------------


@contextlib.contextmanager
def intercepted(session: CaptureSession) -> Iterator[None]:
    """Wrap SDPA (and transformers' attention dispatch, when transformers is loaded) while the block runs.

    Re-entrant: nested sessions share one wrapper, and the originals are restored when the last one ends.
    """
    if session in _SESSIONS:
        yield
        return
    _SESSIONS.append(session)
    first = len(_SESSIONS) == 1
    if first:
        remember_sdpa(torch.nn.functional.scaled_dot_product_attention)
        torch.nn.functional.scaled_dot_product_attention = _sdpa
        interface: Any = _attention_interface()
        if interface is not None:
            _Interface.original = interface.get_interface
            interface.get_interface = _get_interface
    try:
        yield
    finally:
        _SESSIONS.remove(session)
        if not any(other.is_own_thread() for other in _SESSIONS):  # this thread's last session: nothing of it stays
            _stack().clear()
            _release_reader()
        if not _SESSIONS:  # the last session armed, wherever it started: another may outlive the first
            torch.nn.functional.scaled_dot_product_attention = sdpa_original()
            interface = _attention_interface()
            if interface is not None and _Interface.original is not None:
                interface.get_interface = _Interface.original
                _Interface.original = None


def _attention_interface() -> type | None:
    """Transformers' ``AttentionInterface`` if the user's process has loaded transformers (never imported here)."""
    modeling_utils = sys.modules.get("transformers.modeling_utils")
    return getattr(modeling_utils, "AttentionInterface", None)


_SDPA_PARAMETERS = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def _sdpa(query: Tensor, key: Tensor, value: Tensor, *args: object, **kwargs: object) -> Tensor:
    """``F.scaled_dot_product_attention``, run unchanged; then read for the innermost armed module."""
    output = sdpa_original()(query, key, value, *args, **kwargs)
    for module, session in _readers():
        _kernel_adapter(session, module).read_sdpa_call(
            session, module, (query, key, value, *args), kwargs, output=output
        )
    return output


def _flex_call(output: Tensor, query: Tensor, key: Tensor, value: Tensor, **features: Any) -> None:
    """After a wrapped flex_attention call: read it for the innermost armed module."""
    for module, session in _readers():
        _kernel_adapter(session, module).read_flex_call(
            session, module, output, query, key=key, value=value, **features
        )


def _kernel_adapter(session: CaptureSession, module: nn.Module) -> KernelAttention:
    """The adapter of a module the kernel wrappers read: a kernel adapter (only those push it on the stack)."""
    adapter = session.layers[id(module)].adapter
    assert isinstance(adapter, KernelAttention)
    return adapter


class _Interface:
    """Transformers' own ``AttentionInterface.get_interface`` while connmon's wraps it (None otherwise)."""

    original: Any = None


def _get_interface(self: object, attn_implementation: str, default: object) -> object:
    """``AttentionInterface.get_interface``, returning the model's own function wrapped so that it is read."""
    function = _Interface.original(self, attn_implementation, default)
    return functools.partial(_transformers_attention, function, attn_implementation)


def _transformers_attention(
    function: Any,
    implementation: str,
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: object = None,
    **kwargs: object,
) -> tuple[Tensor, Tensor | None]:
    """The model's own attention function, run unchanged; then read for ``module``."""
    _LOCAL.inside = _inside() + 1
    try:
        result = function(module, query, key, value, attention_mask, **kwargs)
    finally:
        _LOCAL.inside -= 1
    for session in _SESSIONS:
        if session.wants(module):
            with session.guarded(module):
                _read_transformers_call(session, module, function, implementation, query=query, key=key, value=value,
                                        mask=attention_mask, output=result[0], kwargs=kwargs)  # fmt: skip
    return result


def _read_transformers_call(
    session: CaptureSession,
    module: nn.Module,
    function: object,
    implementation: str,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    mask: object,
    output: Tensor,
    kwargs: dict,
) -> None:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    layer = session.layers[id(module)]
    if not isinstance(layer.adapter, KernelAttention):
        return
    sdpa = function is sdpa_attention_forward
    if not (sdpa or implementation == "eager"):
        session.skip(module, f"its attention implementation {implementation!r} is not read (connmon reads 'sdpa' "
                             "and 'eager'); it runs unchanged")  # fmt: skip
        return
    if mask is not None and not isinstance(mask, Tensor):
        session.skip(module, f"its attention mask is a {type(mask).__name__}, which connmon does not read")
        return
    unknown = sorted(k for k, v in kwargs.items() if v is not None and k not in _READ_KWARGS | _INERT_KWARGS)
    if unknown:
        session.skip(module, f"its attention call passes {', '.join(unknown)}, which connmon does not model; the "
                             "model's own attention runs unchanged")  # fmt: skip
        return
    if not sdpa and mask is not None and mask.dtype == torch.bool:
        warn_once(
            f"connmon: {layer.name}: its eager attention function adds the boolean attention mask to the scores as "
            "numbers (True +1, False 0), so it masks no key; recorded as the model computes it (transformers' eager "
            "attention takes an additive float mask, 0 where a key may be attended)",
            key="boolean eager mask",
            module=module,
        )
        mask = mask.to(query.dtype)
    is_causal = False
    if sdpa:  # as sdpa_attention_forward decides it
        given = kwargs.get("is_causal")
        given = getattr(module, "is_causal", True) if given is None else given
        is_causal = bool(given) and mask is None and query.shape[-2] > 1
    sinks = kwargs.get("s_aux")
    layer.adapter.read_kernel_call(
        session, module, query, key, value=value, output=output,
        mask=mask, scale=kwargs.get("scaling"), is_causal=is_causal, softcap=kwargs.get("softcap"),
        bias=kwargs.get("position_bias"), sinks=None if sinks is None else sinks.detach(),
        dropout=float(kwargs.get("dropout") or 0.0) > 0,
    )  # fmt: skip


class FusedQKVAttention(KernelAttention):
    """A named attention class, for a module whose forward reaches SDPA through code connmon cannot see.

    Projections are still found from the data (see the module docstring); the names say which module is attention
    and which of its attributes must be the identity for the walk to be exact.

    Args:
        class_name: the module's class name (``"Attention"`` for timm), or ``"*"`` for any module that has the
            projections.
        qkv: attribute of the fused ``[q; k; v]`` projection, a Linear.
        proj: attribute of the output projection, a Linear.
        heads: attribute holding the number of heads.
        identity: attributes that must be ``nn.Identity`` (or absent) for the walk to be exact, such as timm's
            ``norm`` between the attention and the output projection (scale-norm attention); a module where one is
            not is reported once and skipped, never recorded wrongly.

    Examples:
        >>> from connmon.capture import FusedQKVAttention
        >>> timm_vit = FusedQKVAttention("Attention", qkv="qkv", proj="proj", heads="num_heads", identity=("norm",))
    """

    def __init__(self, class_name: str, *, qkv: str, proj: str, heads: str, identity: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.class_name, self.qkv, self.proj, self.heads, self.identity = class_name, qkv, proj, heads, identity
        self.name = f"{class_name} (fused {qkv}/{proj})"

    def matches(self, module: nn.Module) -> bool:  # noqa: D102
        if self.class_name != "*" and type(module).__name__ != self.class_name:
            return False
        qkv, proj = getattr(module, self.qkv, None), getattr(module, self.proj, None)
        return (
            isinstance(qkv, nn.Module)
            and isinstance(proj, nn.Module)
            and linear_weight(qkv) is not None
            and linear_weight(proj) is not None
            and isinstance(getattr(module, self.heads, None), int)
        )

    def hooks(self, model: nn.Module, name: str, module: nn.Module, session: CaptureSession) -> list[RemovableHandle]:  # noqa: D102
        for attribute in self.identity:
            if not isinstance(getattr(module, attribute, nn.Identity()), nn.Identity):
                session.skip(module, f"{name}.{attribute} transforms the attention output before {self.proj} (for "
                                     "example scale-norm attention), which the walk does not model")  # fmt: skip
                return []
        return super().hooks(model, name, module, session)
