"""``flex_attention`` calls, read from the call's own ``score_mod`` and ``block_mask``.

While a capture is armed, every reference to ``torch.nn.attention.flex_attention.flex_attention`` that an armed
module can reach is wrapped: the module attribute, the names its code's modules bound at import (``from
torch.nn.attention.flex_attention import flex_attention``), and class attributes holding it or a
``torch.compile`` of it (torchtitan's ``FlexAttention._compiled_flex_attn``). The wrapper runs the original object
(the compiled kernel stays the compiled kernel) and then scores the recorded window the way flex defines it:
``score_mod(q . k * scale, b, h, q_idx, kv_idx)`` where the block mask's ``mask_mod`` allows a key, ``-inf``
elsewhere, softmax over keys, rows with no allowed key zero. ``score_mod`` and ``mask_mod`` are called once on
broadcast index tensors; one that cannot be (a Python branch on a tensor) leaves the layer unrecorded with a
warning, and the record's reconstruction error proves the rest.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn


def flex_function() -> Callable | None:
    """``torch.nn.attention.flex_attention.flex_attention``, or None where this torch has none."""
    try:
        from torch.nn.attention import flex_attention as module
    except ImportError:
        return None
    return getattr(module.flex_attention, "connmon_original", module.flex_attention)


def _is_flex(value: object, flex: Callable) -> bool:
    return value is flex or getattr(value, "_torchdynamo_orig_callable", None) is flex


def flex_scores(
    query: Tensor,
    key: Tensor,
    *,
    score_mod: Callable | None,
    block_mask: object,
    scale: float | None,
    window: int,
    sequences: int,
) -> tuple[Tensor, Tensor, bool]:
    """Probabilities and logits of a flex call on the first ``sequences`` and leading ``window`` tokens.

    Returns:
        ``probs (B_s, H, m, m)``, ``logits (B_s, H, m, m)`` (``-inf`` where masked) and whether a kept query may
        attend a key beyond the window (the window's rows are then the walk restricted to it).

    Examples:
        >>> import torch
        >>> from connmon.capture.adapters.flex import flex_scores
        >>> q = k = torch.randn(1, 2, 4, 8)
        >>> probs, logits, cut = flex_scores(q, k, score_mod=None, block_mask=None, scale=None, window=4, sequences=1)
        >>> tuple(probs.shape), bool(torch.allclose(probs.sum(-1), torch.ones(1, 2, 4))), cut
        ((1, 2, 4, 4), True, False)
    """
    dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    n = query.shape[-2]
    m = min(window, n)
    q, k = query[:sequences, :, :m].to(dtype), key[:sequences, :, :m].to(dtype)
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (q @ k.mT) * scale
    batch, heads = scores.shape[:2]
    index = _indices(batch, heads, m, m, device=scores.device)
    if score_mod is not None:
        scores = score_mod(scores, *index).to(dtype).expand(batch, heads, m, m)
    mask_mod = getattr(block_mask, "mask_mod", None)
    allowed = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=scores.device)
    truncated = False
    if mask_mod is not None:
        allowed = torch.as_tensor(mask_mod(*index)).to(torch.bool)
        if m < n:
            beyond = _indices(batch, heads, m, n, device=scores.device)
            truncated = bool(torch.as_tensor(mask_mod(*beyond[:3], beyond[3][..., m:])).any())
    elif m < n:
        truncated = True
    logits = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # a row with no allowed key: 0, as flex returns
    return probs, logits, truncated


def _indices(batch: int, heads: int, rows: int, keys: int, device: torch.device) -> tuple[Tensor, ...]:
    """``b, h, q_idx, kv_idx`` as long tensors broadcasting to ``(batch, heads, rows, keys)``."""
    return tuple(
        torch.arange(size, device=device).view([-1 if i == axis else 1 for i in range(4)])
        for axis, size in enumerate((batch, heads, rows, keys))
    )


@contextlib.contextmanager
def wrapped(modules: list[nn.Module], read: Callable[..., None]) -> Iterator[None]:
    """Wrap every flex_attention reference the modules' code can reach while the block runs.

    Args:
        modules: the armed attention modules.
        read: called as ``read(output, query, key, value, score_mod=..., block_mask=..., scale=..., enable_gqa=...)``
            after each call, with the call's own arguments.
    """
    flex = flex_function()
    if flex is None:
        yield
        return
    from torch.nn.attention import flex_attention as flex_module

    places: dict[tuple[int, str], Any] = {(id(vars(flex_module)), "flex_attention"): vars(flex_module)}  # by (id, name)
    namespaces = {}  # the module globals the classes' functions read, each scanned once
    for cls in {type(m) for module in modules for m in module.modules()}:
        for klass in cls.__mro__:
            if klass in (nn.Module, object):
                continue
            for name, value in vars(klass).items():
                function = getattr(value, "__func__", value)
                if _is_flex(function, flex):
                    places[(id(klass), name)] = klass
                namespace = getattr(inspect.unwrap(function), "__globals__", None) if callable(function) else None
                if namespace is not None:
                    namespaces[id(namespace)] = namespace
    for namespace in namespaces.values():
        for global_name, global_value in namespace.items():
            if _is_flex(global_value, flex):
                places[(id(namespace), global_name)] = namespace
    restore = []
    for (_, name), holder in places.items():
        raw = vars(holder)[name] if isinstance(holder, type) else holder[name]
        function = getattr(raw, "__func__", raw)
        if getattr(function, "connmon_original", None) is not None:
            continue  # wrapped already (a nested capture)
        wrapper = _reading(function, read)
        _set(holder, name, staticmethod(wrapper) if isinstance(raw, staticmethod) else wrapper)
        restore.append((holder, name, raw))
    try:
        yield
    finally:
        for holder, name, raw in reversed(restore):
            _set(holder, name, raw)


def _set(holder: dict | type, name: str, value: object) -> None:
    if isinstance(holder, type):
        setattr(holder, name, value)
    else:
        holder[name] = value


def _reading(original: Callable, read: Callable[..., None]) -> Callable:
    parameters = ("query", "key", "value", "score_mod", "block_mask", "scale", "enable_gqa")

    @functools.wraps(original)
    def flex_attention(*args: object, **kwargs: object) -> object:
        result = original(*args, **kwargs)
        bound = dict(zip(parameters, args, strict=False)) | kwargs
        output = result[0] if isinstance(result, tuple) else result
        if isinstance(output, Tensor) and all(isinstance(bound.get(p), Tensor) for p in parameters[:3]):
            read(output, bound["query"], bound["key"], bound["value"], score_mod=bound.get("score_mod"),
                 block_mask=bound.get("block_mask"), scale=bound.get("scale"))  # fmt: skip
        return result

    flex_attention.connmon_original = original  # type: ignore[attr-defined]
    return flex_attention
