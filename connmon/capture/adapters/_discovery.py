"""Which modules call an attention kernel: their ``forward`` read as code, never run.

SDPA, ``flex_attention`` and transformers' attention dispatch are found by name or by identity in the forward, the
class's own methods it calls, its base classes' (a subclass handing on through ``super()``), the helpers beside it in
its module, and the functions it closes over or the instance holds.
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable

import torch
from torch import nn

from connmon.capture.adapters import flex

_SDPA: list[Callable] = [torch.nn.functional.scaled_dot_product_attention]  # what connmon's SDPA wrapper calls
KERNEL_NAMES = frozenset(
    {"scaled_dot_product_attention", "ALL_ATTENTION_FUNCTIONS", "AttentionInterface", "flex_attention"}
)


def calls_attention_kernel(module: nn.Module) -> bool:
    """Whether the module's ``forward`` reaches SDPA, flex_attention or transformers' attention dispatch.

    The scan follows the forward into the class's own methods it calls (x-transformers' ``Attend.flash_attn``); it
    only says which modules are candidates: what a capture records is decided by the calls that run.

    Examples:
        >>> import torch
        >>> from connmon.capture.adapters.kernel import calls_attention_kernel
        >>> class Attend(torch.nn.Module):
        ...     def forward(self, q, k, v):
        ...         return torch.nn.functional.scaled_dot_product_attention(q, k, v)
        >>> calls_attention_kernel(Attend()), calls_attention_kernel(torch.nn.Linear(2, 2))
        (True, False)
    """
    if forward_calls_kernel(type(module)):  # type: ignore[arg-type]  # a class is hashable; torch's stub says not
        return True
    # helpers held by the instance (self.attend = lambda q, k, v: F.sdpa(...)), read where forward names them
    forward = getattr(function_of(inspect.getattr_static(type(module), "forward", None)), "__code__", None)
    named = _names(forward) if forward is not None else set()
    helpers = [
        getattr(value, "func", value)
        for name, value in vars(module).items()
        if name in named and isinstance(value, (types.FunctionType, functools.partial))
    ]
    return bool(helpers) and reaches_kernel(type(module), helpers)


@functools.cache
def forward_calls_kernel(cls: type) -> bool:
    return reaches_kernel(cls, [function_of(inspect.getattr_static(cls, "forward", None))])


def reaches_kernel(cls: type, todo: list[object]) -> bool:
    """Whether a function in ``todo``, or what it calls of ``cls``, its module or its closure, is a kernel."""
    seen = set()
    while todo:
        function = todo.pop()
        code = getattr(function, "__code__", None)
        if code is None or code in seen:
            continue
        seen.add(code)
        names = _names(code)
        namespace = getattr(function, "__globals__", {})
        # variables a nested function or lambda closes over (a helper defined inside a function, not at top level)
        cells = getattr(function, "__closure__", None) or ()
        closed = dict(zip(code.co_freevars, (_contents(cell) for cell in cells), strict=True))
        if KERNEL_NAMES & names or any(is_kernel(v) for v in (*map(namespace.get, names), *closed.values())):
            return True
        todo.extend(function_of(inspect.getattr_static(cls, n, None)) for n in names)  # the class's own methods
        if "super" in names:  # a subclass's forward that hands on to its base's (class Mine(LlamaAttention))
            todo.extend(function_of(vars(base).get(n)) for base in cls.__mro__[1:] for n in {*names, code.co_name})
        todo.extend(  # helpers defined beside the code that calls them (def attend(q, k, v): return F.sdpa(...))
            value
            for value in map(namespace.get, names)
            if isinstance(value, types.FunctionType) and value.__module__ == function.__module__
        )
        todo.extend(value for value in closed.values() if isinstance(value, types.FunctionType))
    return False


def _contents(cell: types.CellType) -> object:
    """What a closure cell holds (None while its variable is unassigned)."""
    try:
        return cell.cell_contents
    except ValueError:
        return None


def function_of(value: object) -> object:
    """The plain function behind a method, staticmethod, classmethod or decorated function (None if none)."""
    value = getattr(value, "__func__", value)
    return inspect.unwrap(value) if callable(value) else None


def remember_sdpa(function: Callable) -> None:
    """Torch's SDPA as connmon's wrapper finds it when it is installed (the function the wrapper calls)."""
    _SDPA[0] = function


def sdpa_original() -> Callable:
    """Torch's SDPA as the wrapper found it (what a module naming it under another name holds)."""
    return _SDPA[0]


def is_kernel(value: object) -> bool:
    """Whether a global is SDPA or flex_attention under another name (``attend = F.scaled_dot_product_attention``)."""
    flex_attention = flex.flex_function()
    return value is not None and (value is sdpa_original() or (flex_attention is not None and value is flex_attention))


def _names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names
