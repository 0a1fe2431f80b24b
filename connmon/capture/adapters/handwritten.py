"""Attention an armed module computes by hand, read from the torch calls that run inside its forward.

While an armed attention module's forward runs (at any depth: its own methods, helper modules, functions it
calls), every torch call passes through a ``TorchFunctionMode`` that runs it first, unchanged, and then looks at
it (see :func:`observe`). The calls read:

* a **softmax** over the last dimension of a square ``(B, H, n, n)`` (or ``(B H, n, n)``) tensor: the attention
  probabilities exactly as the module's own code computed them, and the logits they came from;
* the **product** of those probabilities (or of a cast, a view or a dropout of them) with a values tensor through
  ``matmul``, ``@``, ``bmm`` or a two-operand ``einsum``: the values and the attention output;
* **F.linear** with one of the module's own parameters as the weight: a projection, with the bias it was really
  given (EVA-02 builds its qkv bias by concatenation);
* **F.scaled_dot_product_attention** however it was imported (a name bound before the capture was armed too).

The value and output projections are then found from the data, as for a kernel call, and the record's
reconstruction error proves the reading: a module whose code does something else between the softmax and the
output projection (talking heads, a gate, a mask applied after the softmax) fails it and is skipped with one
warning. Nothing is switched: the module runs its own code on its own path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from torch import Tensor, nn

from connmon.capture.session import CaptureSession

if TYPE_CHECKING:  # the kernel adapter routes hand-written attention here, and imports this module
    from connmon.capture.adapters.kernel import KernelAttention

_SOFTMAX = frozenset({"softmax"})
_PRODUCT = frozenset({"matmul", "__matmul__", "bmm", "einsum"})
_DROPOUT = frozenset({"dropout", "dropout_", "feature_dropout"})


def observe(
    session: CaptureSession, module: nn.Module, func: object, args: tuple, kwargs: dict, result: object
) -> None:
    """Read one torch call that ran inside armed ``module``'s forward (see the module docstring).

    Args:
        session: the armed session that wants ``module``.
        module: the innermost running attention module.
        func: the torch function or method that ran.
        args: its positional arguments.
        kwargs: its keyword arguments.
        result: what it returned (already returned to the model unchanged).
    """
    name = getattr(func, "__name__", "")
    state = session.pending(module).adapter_state
    adapter = _reader(session, module)
    if name == "scaled_dot_product_attention" and isinstance(result, Tensor):
        adapter.read_sdpa_call(session, module, args, kwargs, output=result)
    elif name == "linear":
        weight = args[1] if len(args) > 1 else kwargs.get("weight")
        bias = args[2] if len(args) > 2 else kwargs.get("bias")
        if "parameters" not in state:  # the module's own weights, once per forward
            state["parameters"] = {id(p) for p in module.parameters()}
        if isinstance(weight, nn.Parameter) and id(weight) in state["parameters"] and isinstance(result, Tensor):
            adapter.read_projection(session, module, weight, bias, inp=args[0], out=result)
    elif name in _SOFTMAX and isinstance(result, Tensor):
        _softmax(session, state, args, kwargs, probs=result)
    elif "softmax" in state and isinstance(result, Tensor):
        if name in _PRODUCT:
            _product(session, module, state, name, args=args, out=result)
        else:
            _derived(state, name, args, kwargs, result=result)


def _softmax(session: CaptureSession, state: dict, args: tuple, kwargs: dict, probs: Tensor) -> None:
    """A softmax over the last dim of a square map of 3 or 4 dims: the candidate attention probabilities.

    The probabilities are the model's own tensor (it holds them until its product with the values); of the logits,
    which the model may free, only the recorded window is copied.
    """
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    if probs.dim() not in (3, 4) or dim not in (-1, probs.dim() - 1) or probs.shape[-1] != probs.shape[-2]:
        return
    if not probs.is_floating_point() or probs.is_nested:
        return
    logits = args[0].detach()
    if logits.dim() == 4:
        window = min(logits.shape[-1], session.max_tokens or logits.shape[-1])
        logits = session.window(logits, dim=-2)[..., :window].clone()
    state["softmax_ran"] = True
    state["softmax"] = {"logits": logits, "probs": probs, "derived": [probs], "dropout": False}


def _is_derived(softmax: dict, tensor: object) -> bool:
    return isinstance(tensor, Tensor) and any(tensor is t for t in softmax["derived"])


def _derived(state: dict, name: str, args: tuple, kwargs: dict, result: Tensor) -> None:
    """A cast, view, copy or dropout of the probabilities: the same entries, still headed for the values."""
    softmax = state["softmax"]
    source = next((a for a in (*args, *kwargs.values()) if _is_derived(softmax, a)), None)
    if source is None:
        return
    probs = softmax["probs"]
    if result.numel() == probs.numel() and result.shape[-2:] == probs.shape[-2:]:
        softmax["derived"].append(result)
        if name in _DROPOUT and not (result is source or result.equal(source)):
            softmax["dropout"] = True


def _product(session: CaptureSession, module: nn.Module, state: dict, name: str, args: tuple, out: Tensor) -> None:
    """``probs @ values``: hand the probabilities, the values and the output to the session."""
    softmax = state["softmax"]
    probs = softmax["probs"]
    if name == "einsum":
        canonical = _einsum(softmax, args, out)
    elif len(args) >= 2 and _is_derived(softmax, args[0]) and isinstance(args[1], Tensor):
        canonical = _matmul(probs, args[1], out, _batch(state, probs))
    else:
        return
    if canonical is None:
        return
    del state["softmax"]
    values, output = canonical
    batch = values.shape[0]
    probs4, logits4 = (t if t.dim() == 4 else t.reshape(batch, -1, *t.shape[-2:]) for t in (probs, softmax["logits"]))
    session.put_probabilities(module, probs4, logits4, dropout=softmax["dropout"])
    if session.wants(module):
        _reader(session, module).read_values(session, module, values, output.transpose(1, 2))


def _batch(state: dict, probs: Tensor) -> int | None:
    """The batch: the probabilities' first dim, or for ``(B H, n, n)`` the batch of the module's first projection."""
    if probs.dim() == 4:
        return probs.shape[0]
    calls = state.get("calls") or []
    return calls[0][2].shape[0] if calls and calls[0][2].dim() >= 2 else None


def _matmul(probs: Tensor, values: Tensor, out: Tensor, batch: int | None) -> tuple[Tensor, Tensor] | None:
    """``(B, H_v, n, E)`` values and ``(B, H, n, E)`` output of ``probs @ values`` (3- or 4-dim operands)."""
    n = probs.shape[-1]
    if batch is None or values.dim() not in (3, 4) or values.shape[-2] != n or out.shape[-2] != n:
        return None
    if values.shape[0] % batch or out.shape[0] % batch:
        return None
    heads = probs.numel() // (batch * n * n)
    values4 = values.reshape(batch, -1, n, values.shape[-1])
    output4 = out.reshape(batch, heads, n, out.shape[-1])
    return (values4, output4) if heads % values4.shape[1] == 0 else None


def _einsum(softmax: dict, args: tuple, out: Tensor) -> tuple[Tensor, Tensor] | None:
    """Values and output of a two-operand ``einsum`` that contracts the probabilities' key axis with the values."""
    if not args or not isinstance(args[0], str):
        return None
    operands = list(args[1][0] if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:])
    equation = args[0].replace(" ", "")
    if len(operands) != 2 or "->" not in equation or "." in equation:
        return None
    inputs, output = equation.split("->")
    subscripts = inputs.split(",")
    which = next((i for i, t in enumerate(operands) if _is_derived(softmax, t)), None)
    if which is None or len(subscripts) != 2 or len(subscripts[which]) != 4:
        return None
    b, h, i, j = tuple(subscripts[which])
    value_subscripts, values = subscripts[1 - which], operands[1 - which]
    extra = [c for c in value_subscripts if c not in (b, h, j)]
    if len(extra) != 1 or j in output or b not in value_subscripts or j not in value_subscripts:
        return None
    d = extra[0]
    if sorted(output) != sorted((b, h, i, d)) or sorted(value_subscripts) not in (
        sorted((b, h, j, d)),
        sorted((b, j, d)),
    ):
        return None
    values = values.permute(*(value_subscripts.index(c) for c in (b, h, j, d) if c in value_subscripts))
    if h not in value_subscripts:  # one values head shared by every query head
        values = values.unsqueeze(1)
    return values, out.permute(*(output.index(c) for c in (b, h, i, d)))


def _reader(session: CaptureSession, module: nn.Module) -> KernelAttention:
    """The module's adapter: the kernel adapter, the one that reads hand-written attention through this module."""
    return cast("KernelAttention", session.layers[id(module)].adapter)
