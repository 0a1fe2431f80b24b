"""Input checks and the dtype rule shared by the functional code (docs/numerics.md).

Every check here reads shapes and dtypes only: nothing inspects tensor values, so nothing synchronizes the GPU.
"""

from __future__ import annotations

import torch
from torch import Tensor

_KEPT = (torch.float32, torch.float64)
_UPCAST = (torch.float16, torch.bfloat16)


def as_float(tensor: Tensor, name: str) -> Tensor:
    """Return ``tensor`` in its compute dtype: float32/float64 kept, float16/bfloat16 upcast to float32."""
    if not isinstance(tensor, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype in _KEPT:
        return tensor
    if tensor.dtype in _UPCAST:
        return tensor.float()
    raise TypeError(f"{name} must be a floating-point tensor (float16, bfloat16, float32, float64), got {tensor.dtype}")


def promote(*tensors: Tensor) -> tuple[Tensor, ...]:
    """Cast already-floating tensors to one dtype: float64 if any is float64, else float32."""
    dtype = torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32
    return tuple(t.to(dtype) for t in tensors)


def shape(tensor: Tensor) -> str:
    """Format a shape for an error message: ``(2, 4, 8, 8)``."""
    return str(tuple(tensor.shape))


def check_square(tensor: Tensor, name: str, layout: str) -> int:
    """Check that the last two dims are equal and return that size."""
    if tensor.ndim < 2 or tensor.shape[-1] != tensor.shape[-2]:
        raise ValueError(f"{name} must have shape {layout} with equal last two dims, got {name}{shape(tensor)}")
    return tensor.shape[-1]


def check_attention(attn: Tensor, name: str = "attn") -> tuple[int, int]:
    """Check ``attn`` is ``(*, H, n, n)`` and return ``(H, n)``."""
    if attn.ndim < 3:
        raise ValueError(f"{name} must have shape (*, H, n, n), got {name}{shape(attn)}")
    n = check_square(attn, name, "(*, H, n, n)")
    return attn.shape[-3], n


def check_transport(w_v: Tensor, w_o: Tensor, num_heads: int | None = None) -> tuple[int, int, int]:
    """Check ``w_v`` is ``(*, H, d_h, d)`` and ``w_o`` is ``(*, H, d, d_h)``; return ``(H, d_h, d)``."""
    if w_v.ndim < 3 or w_o.ndim < 3:
        raise ValueError(
            f"w_v must have shape (*, H, d_h, d) and w_o (*, H, d, d_h), got w_v{shape(w_v)} and w_o{shape(w_o)}"
        )
    heads, d_h, d = w_v.shape[-3:]
    if tuple(w_o.shape[-3:]) != (heads, d, d_h):
        raise ValueError(
            f"w_o must have shape (*, H, d, d_h) = (*, {heads}, {d}, {d_h}) to match w_v{shape(w_v)}, "
            f"got w_o{shape(w_o)}"
        )
    if num_heads is not None and heads != num_heads:
        raise ValueError(
            f"w_v and w_o must hold one map per query head (H={num_heads} from attn; expand GQA key/value heads "
            f"first), got w_v{shape(w_v)} and w_o{shape(w_o)}"
        )
    if d_h > d:
        raise ValueError(f"head width d_h must not exceed model width d, got w_v{shape(w_v)} (d_h={d_h}, d={d})")
    return heads, d_h, d


def check_layer(attn: Tensor, w_v: Tensor, w_o: Tensor) -> tuple[int, int, int, int]:
    """Check one layer's attention and transports together; return ``(H, n, d_h, d)``."""
    heads, n = check_attention(attn)
    _, d_h, d = check_transport(w_v, w_o, heads)
    try:
        torch.broadcast_shapes(attn.shape[:-3], w_v.shape[:-3], w_o.shape[:-3])
    except RuntimeError:
        raise ValueError(
            f"leading (batch) dims must broadcast, got attn{shape(attn)}, w_v{shape(w_v)}, w_o{shape(w_o)}"
        ) from None
    return heads, n, d_h, d


def check_mask(mask: Tensor | None, target: Tensor, name: str = "mask") -> Tensor | None:
    """Check a boolean mask (True = allowed) broadcasts to ``target``; return it expanded."""
    if mask is None:
        return None
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
        got = mask.dtype if isinstance(mask, Tensor) else type(mask).__name__
        raise TypeError(f"{name} must be a bool tensor (True = allowed key), got {got}")
    try:
        return mask.expand(target.shape)
    except RuntimeError:
        raise ValueError(f"{name}{shape(mask)} must broadcast to {shape(target)}") from None
