"""Hugging Face ``transformers`` (>= 5) models, through the library's own attention dispatch.

While armed, an attention function named ``"connmon"`` is registered with ``AttentionInterface`` (it records the
probabilities from the exact ``query``, ``key``, mask and ``scaling`` it receives, after RoPE and GQA, then calls
the library's ``sdpa_attention_forward``), the matching mask function is registered under the same name with
``AttentionMaskInterface`` (without it padding would be silently dropped), and the live model is switched to it
with ``set_attn_implementation``; its own implementation is restored afterwards.

Families: GPT-2 (``c_attn``/``c_proj`` Conv1D), the LLaMA family (``q/k/v/o_proj``, GQA; Mistral, Qwen2 and
most decoders share it) and the BERT family and ViT (``query/key/value`` with the output projection in the
sibling ``output.dense``).
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

IMPLEMENTATION = "connmon"
_SESSIONS: list[CaptureSession] = []


def _transformers_available() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


class HuggingFaceAttention(Adapter):
    """Adapter for self-attention modules of ``transformers`` models that dispatch through ``AttentionInterface``."""

    name = "transformers"

    def __init__(self) -> None:
        self._out_proj: dict[int, nn.Module] = {}  # BERT/ViT: attention module -> sibling output.dense, while armed

    def matches(self, module: nn.Module) -> bool:  # noqa: D102
        return type(module).__module__.startswith("transformers.") and _family(module) is not None

    def weights(self, module: nn.Module) -> tuple[Tensor, Tensor, Tensor]:  # noqa: D102
        family = _family(module)
        heads = _heads(module)
        if family == "gpt2":  # Conv1D: y = x W + b with W (d, 3d)
            d = module.c_attn.weight.shape[0]
            value, value_bias = module.c_attn.weight[:, 2 * d :].T, module.c_attn.bias[2 * d :]
            return head_maps(value, module.c_proj.weight.T, heads, value_bias, module.c_proj.bias)
        value, out = (module.v_proj, module.o_proj) if family == "llama" else (module.value, self._out_proj[id(module)])
        return head_maps(value.weight, out.weight, heads, value.bias, out.bias)

    def hooks(self, model: nn.Module, name: str, module: nn.Module, session: CaptureSession) -> list[RemovableHandle]:  # noqa: D102
        family = _family(module)
        if getattr(module, "is_cross_attention", False) or "CrossAttention" in type(module).__name__:
            warn_once(f"connmon: {name} is cross-attention (queries and keys from different sequences); skipped")
            return []
        if family == "gpt2":
            out = module.c_proj
        elif family == "llama":
            out = module.o_proj
        else:  # BERT, ViT: the output projection is the sibling <parent>.output.dense
            parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
            out = self._out_proj[id(module)] = parent.output.dense

        def enter(mod: nn.Module, args: tuple, kwargs: dict) -> None:
            session.put(mod, x=args[0] if args else kwargs["hidden_states"])

        def projected(proj: nn.Module, args: tuple, output: Tensor) -> None:
            session.put(module, output=output)

        return [
            module.register_forward_pre_hook(enter, with_kwargs=True),
            out.register_forward_hook(projected),
            _Forget(self._out_proj, id(module)),
        ]

    @contextlib.contextmanager
    def armed(self, model: nn.Module, session: CaptureSession) -> Iterator[None]:  # noqa: D102
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        AttentionInterface.register(IMPLEMENTATION, _attention)
        AttentionMaskInterface.register(IMPLEMENTATION, sdpa_mask)
        previous = model.config._attn_implementation
        _SESSIONS.append(session)
        model.set_attn_implementation(IMPLEMENTATION)
        try:
            yield
        finally:
            _SESSIONS.remove(session)
            model.set_attn_implementation(previous)


class _Forget:
    """A handle-like object that drops one key from a dict on ``remove()``."""

    def __init__(self, mapping: dict, key: int) -> None:
        self.mapping, self.key = mapping, key

    def remove(self) -> None:
        self.mapping.pop(self.key, None)


def _attention(
    module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, **kwargs: object
) -> tuple[Tensor, Tensor | None]:
    """The registered attention function: record, then run the library's SDPA attention unchanged."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    for session in _SESSIONS:
        if session.wants(module):
            n = session.num_sequences
            is_causal = kwargs.get("is_causal")
            is_causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
            is_causal = bool(is_causal) and attention_mask is None and query.shape[2] > 1  # as sdpa_attention_forward
            mask = None if attention_mask is None else attention_mask[:n]
            with session.guarded(module), torch.no_grad():
                logits, probs, allowed = attention_scores(
                    query[:n], key[:n], mask, scale=kwargs.get("scaling"), is_causal=is_causal
                )
                session.put(module, logits=logits, probs=probs, allowed=allowed)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _family(module: nn.Module) -> str | None:
    if hasattr(module, "c_attn") and hasattr(module, "c_proj"):
        return "gpt2"
    if all(hasattr(module, a) for a in ("q_proj", "k_proj", "v_proj", "o_proj")):
        return "llama"
    if all(isinstance(getattr(module, a, None), nn.Linear) for a in ("query", "key", "value")):
        return "bert"
    return None


def _heads(module: nn.Module) -> int:
    config = module.config
    return getattr(module, "num_heads", None) or getattr(config, "num_attention_heads", None) or config.n_head
