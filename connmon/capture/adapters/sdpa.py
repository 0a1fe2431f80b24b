"""Modules that call ``torch.nn.functional.scaled_dot_product_attention``: nanoGPT, timm, and your own.

While armed, ``F.scaled_dot_product_attention`` is replaced by a wrapper that computes the probabilities from the
exact ``q``, ``k``, mask, ``is_causal``, ``scale`` and ``enable_gqa`` it receives (so RoPE, qk-norm and scaling are
the model's own), then calls the original kernel: outputs and gradients are unchanged. Each call is tied to the
innermost armed module whose forward is running. The value/output maps come from a fused ``qkv`` projection and an
output projection, named per family; the recorded output is the output projection's (before residual dropout).

Register your own module with, for example,
``connmon.capture.register_adapter(FusedQKVAttention("MyAttention", qkv="in_proj", proj="out", heads="n_heads"))``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from connmon.capture.adapters.base import Adapter, head_maps
from connmon.capture.scores import attention_scores
from connmon.capture.session import CaptureSession, warn_once

_STACK: list[nn.Module] = []  # armed modules whose forward is running, innermost last


class FusedQKVAttention(Adapter):
    """A self-attention module with a fused ``[q; k; v]`` Linear, an output Linear and a head count attribute.

    Args:
        class_name: the module's class name (``"CausalSelfAttention"`` for nanoGPT, ``"Attention"`` for timm), or
            ``"*"`` for any module that has the three attributes.
        qkv: attribute of the fused projection, an ``nn.Linear(d, 3 d)``.
        proj: attribute of the output projection, an ``nn.Linear(d, d)``.
        heads: attribute holding the number of heads.
        identity: attributes that must be ``nn.Identity`` (or absent) for the walk to be exact, such as timm's
            ``norm`` between the attention and the output projection (scale-norm attention); a module where one is
            not is reported once and skipped, never recorded wrongly.

    Example:
        >>> from connmon.capture.adapters.sdpa import FusedQKVAttention
        >>> nanogpt = FusedQKVAttention("CausalSelfAttention", qkv="c_attn", proj="c_proj", heads="n_head")
    """

    def __init__(self, class_name: str, *, qkv: str, proj: str, heads: str, identity: tuple[str, ...] = ()) -> None:
        self.class_name, self.qkv, self.proj, self.heads, self.identity = class_name, qkv, proj, heads, identity
        self.name = f"{class_name} (fused {qkv}/{proj})"

    def matches(self, module: nn.Module) -> bool:  # noqa: D102
        if self.class_name != "*" and type(module).__name__ != self.class_name:
            return False
        qkv, proj = getattr(module, self.qkv, None), getattr(module, self.proj, None)
        return (
            isinstance(qkv, nn.Linear)
            and isinstance(proj, nn.Linear)
            and isinstance(getattr(module, self.heads, None), int)
            and qkv.out_features == 3 * qkv.in_features
        )

    def weights(self, module: nn.Module) -> tuple[Tensor, Tensor, Tensor]:  # noqa: D102
        qkv, proj = getattr(module, self.qkv), getattr(module, self.proj)
        d = qkv.in_features
        value_bias = None if qkv.bias is None else qkv.bias[2 * d :]
        return head_maps(qkv.weight[2 * d :], proj.weight, getattr(module, self.heads), value_bias, proj.bias)

    def hooks(self, model: nn.Module, name: str, module: nn.Module, session: CaptureSession) -> list[RemovableHandle]:  # noqa: D102
        for attribute in self.identity:
            if not isinstance(getattr(module, attribute, nn.Identity()), nn.Identity):
                warn_once(f"connmon: {name}.{attribute} transforms the attention output before {self.proj} "
                          "(for example scale-norm attention), which the walk does not model; skipped")  # fmt: skip
                return []

        def enter(mod: nn.Module, args: tuple, kwargs: dict) -> None:
            _STACK.append(mod)
            x = args[0] if args else next(iter(kwargs.values()))
            session.put(mod, x=x)

        def leave(mod: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
            if _STACK and _STACK[-1] is mod:
                _STACK.pop()

        def projected(proj: nn.Module, args: tuple, output: Tensor) -> None:
            session.put(module, output=output)

        handles = [
            module.register_forward_pre_hook(enter, with_kwargs=True),
            module.register_forward_hook(leave, with_kwargs=True, always_call=True),
            getattr(module, self.proj).register_forward_hook(projected),
        ]
        if getattr(module, "fused_attn", True) is False:  # timm's eager path skips SDPA: use it while armed
            module.fused_attn = True
            handles.append(_Restore(module, "fused_attn", False))
        return handles

    @contextlib.contextmanager
    def armed(self, model: nn.Module, session: CaptureSession) -> Iterator[None]:  # noqa: D102
        with intercept_sdpa(session):
            yield


class _Restore:
    """A handle-like object that puts an attribute back on ``remove()``."""

    def __init__(self, obj: object, attribute: str, value: object) -> None:
        self.obj, self.attribute, self.value = obj, attribute, value

    def remove(self) -> None:
        setattr(self.obj, self.attribute, self.value)


_ARMED_SESSIONS: list[CaptureSession] = []


@contextlib.contextmanager
def intercept_sdpa(session: CaptureSession) -> Iterator[None]:
    """Replace ``F.scaled_dot_product_attention`` by the recording wrapper while the block runs (re-entrant)."""
    _ARMED_SESSIONS.append(session)
    original = torch.nn.functional.scaled_dot_product_attention
    patched = len(_ARMED_SESSIONS) == 1
    if patched:
        wrapper.original = original
        torch.nn.functional.scaled_dot_product_attention = wrapper
    try:
        yield
    finally:
        _ARMED_SESSIONS.remove(session)
        if patched:
            torch.nn.functional.scaled_dot_product_attention = wrapper.original


def wrapper(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """``F.scaled_dot_product_attention`` that also records the probabilities for the running armed module."""
    module = _STACK[-1] if _STACK else None
    for session in _ARMED_SESSIONS:
        if module is not None and session.wants(module):
            with session.guarded(module), torch.no_grad():
                n = session.num_sequences
                logits, probs, allowed = attention_scores(
                    query[:n],
                    key[:n],
                    None if attn_mask is None else _first(attn_mask, n),
                    scale=scale,
                    is_causal=is_causal,
                )
                session.put(module, logits=logits, probs=probs, allowed=allowed)
    return wrapper.original(
        query,
        key,
        value,
        attn_mask=attn_mask,
        dropout_p=dropout_p,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=enable_gqa,
    )


wrapper.original = torch.nn.functional.scaled_dot_product_attention


def _first(mask: Tensor, n: int) -> Tensor:
    return mask[:n] if mask.dim() == 4 and mask.shape[0] > 1 else mask
