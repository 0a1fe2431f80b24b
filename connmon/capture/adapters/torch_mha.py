"""``torch.nn.MultiheadAttention`` alone or inside ``nn.Transformer*`` layers.

The scores are recomputed from the module's inputs, weights and masks exactly as
``F.multi_head_attention_forward`` does (bool masks True = blocked, float masks added, ``key_padding_mask`` over
keys). The module's own path is never switched: where ``nn.MultiheadAttention`` runs its native fast path the scores
are still recomputed on the side and verified against the output it returned, and where ``nn.TransformerEncoderLayer``
runs its fused fast path (eval mode without gradients), which never calls its ``self_attn`` module, or hands it a
nested tensor, the layer is skipped with one warning that says how to get records. Inside such a layer connmon reads
through :class:`ForwardWrapper`, never a hook: torch refuses the fused path when a forward hook sits on the layer or
inside it, so a hook would switch the path it reads. connmon's own forwards
(:func:`connmon.capture`, probes) run the Python path through :func:`python_attention_path`.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import operator
from collections.abc import Iterator

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from connmon.capture.adapters.base import Adapter, head_maps
from connmon.capture.forward_wrapper import ForwardWrapper
from connmon.capture.session import CaptureSession

_PARAMETERS = list(inspect.signature(nn.MultiheadAttention.forward).parameters)[1:]  # query, key, value, ...


class TorchMultiheadAttention(Adapter):
    """Adapter for ``torch.nn.MultiheadAttention`` (self-attention; cross-attention is skipped with a warning)."""

    name = "torch.nn.MultiheadAttention"

    def matches(self, module: nn.Module) -> bool:  # noqa: D102
        return isinstance(module, nn.MultiheadAttention)

    def weights(self, module: nn.Module) -> tuple[Tensor, Tensor, Tensor]:  # noqa: D102
        assert isinstance(module, nn.MultiheadAttention)  # matches() said so
        d = module.embed_dim
        value = module.in_proj_weight[2 * d :] if module._qkv_same_embed_dim else module.v_proj_weight
        value_bias = None if module.in_proj_bias is None else module.in_proj_bias[2 * d :]
        out = module.out_proj
        return head_maps(value, out.weight, module.num_heads, value_bias, output_bias=out.bias)

    def hooks(self, model: nn.Module, name: str, module: nn.Module, session: CaptureSession) -> list[RemovableHandle]:  # noqa: D102
        if module.bias_k is not None or module.add_zero_attn:
            session.skip(module, "it uses bias_k/bias_v or add_zero_attn, which the walk does not model")
            return []

        def entered(mod: nn.MultiheadAttention, args: tuple, kwargs: dict) -> None:
            if session.wants(mod):
                session.pending(mod).entered = True

        def hook(mod: nn.MultiheadAttention, args: tuple, kwargs: dict, output: tuple) -> None:
            if not session.wants(mod):
                return
            bound = dict(zip(_PARAMETERS, args, strict=False)) | kwargs
            query, key, value = bound["query"], bound["key"], bound["value"]
            if not (query is key and key is value):
                session.skip(mod, "it is called as cross-attention (query is not key/value)")
                return
            if query.is_nested or output[0].is_nested:
                session.skip(mod, _FAST_PATH.format(owner=session.owner))
                return
            with session.guarded(mod):
                self._feed(mod, session, bound, output[0])

        parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else None
        if not (isinstance(parent, nn.TransformerEncoderLayer) and parent.self_attn is module):
            return [
                module.register_forward_pre_hook(entered, with_kwargs=True),
                module.register_forward_hook(hook, with_kwargs=True),
            ]

        def bypassed(args: tuple, kwargs: dict, output: object) -> None:
            if session.wants(module) and not session.pending(module).entered:
                # the fused encoder path never called self_attn
                session.skip(module, _FAST_PATH.format(owner=session.owner))

        # The layer refuses its fused path when any forward hook sits on it or inside it, so there connmon reads
        # through the forwards themselves: the layer takes the path it would take unarmed.
        return [
            ForwardWrapper(module, lambda args, kwargs: entered(module, args, kwargs),
                           lambda args, kwargs, output: hook(module, args, kwargs, output)),
            ForwardWrapper(parent, None, bypassed),
        ]  # fmt: skip

    @staticmethod
    def _feed(mod: nn.MultiheadAttention, session: CaptureSession, bound: dict, out: Tensor) -> None:
        x = bound["query"] if mod.batch_first else bound["query"].transpose(0, 1)  # (B, n, d)
        out = out if mod.batch_first else out.transpose(0, 1)
        x = x[: session.num_sequences]  # the session scores only the leading max_tokens of these
        batch, n, d = x.shape
        heads, d_h = mod.num_heads, d // mod.num_heads
        if mod._qkv_same_embed_dim:
            w_q, w_k = mod.in_proj_weight[:d], mod.in_proj_weight[d : 2 * d]
        else:
            w_q, w_k = mod.q_proj_weight, mod.k_proj_weight
        b_q, b_k = (None, None) if mod.in_proj_bias is None else (mod.in_proj_bias[:d], mod.in_proj_bias[d : 2 * d])
        q = nn.functional.linear(x, w_q, b_q).view(batch, n, heads, d_h).transpose(1, 2)  # (B, H, n, d_h)
        k = nn.functional.linear(x, w_k, b_k).view(batch, n, heads, d_h).transpose(1, 2)  # (B, H, n, d_h)
        attn_mask, padding = bound.get("attn_mask"), bound.get("key_padding_mask")
        if attn_mask is None and bound.get("is_causal", False):
            attn_mask = torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1)
        masks = []
        rows = session.window(x).shape[1]  # the recorded queries: masks are cut to them before they are combined
        if attn_mask is not None:
            masks.append((attn_mask if attn_mask.dim() == 2 else attn_mask.view(-1, heads, n, n))[..., :rows, :])
        if padding is not None:
            masks.append(padding[:, None, None, :])
        additive = (
            functools.reduce(operator.add, map(_additive, masks)) if masks else None
        )  # broadcast, never (B, H, n, n)
        session.put_scores(mod, q, k, additive, dropout=mod.training and mod.dropout > 0)
        session.put(mod, x=x, output=out)


_FAST_PATH = (
    "nn.TransformerEncoderLayer took its fused fast path (eval mode without gradients), which computes attention "
    "without calling this module or on nested tensors, so there is nothing exact to record; it runs unchanged. "
    "Record a training forward, a probe ({owner}(probe=...)), or call "
    "torch.backends.mha.set_fastpath_enabled(False) in your code"
)


@contextlib.contextmanager
def python_attention_path() -> Iterator[None]:
    """Run ``nn.MultiheadAttention`` and ``nn.TransformerEncoderLayer`` on their Python path inside the block.

    For connmon's own forwards only (:func:`connmon.capture`, probes), whose outputs nobody uses: the user's
    forwards keep their fast path, and a layer it bypasses is skipped with a warning.

    Examples:
        >>> import torch
        >>> from connmon.capture.adapters.torch_mha import python_attention_path
        >>> with python_attention_path():
        ...     torch.backends.mha.get_fastpath_enabled()
        False
        >>> torch.backends.mha.get_fastpath_enabled()
        True
    """
    was = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(was)


def _additive(mask: Tensor) -> Tensor:
    """An nn.MultiheadAttention mask (bool: True = blocked; float: added) as an additive float mask."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill_(mask, float("-inf"))
    return mask.float()
