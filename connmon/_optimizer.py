"""The torch optimizer inside a trainer's wrapper: the one place connmon unwraps an optimizer it reads or hooks."""

from __future__ import annotations

from typing import Any

import torch


def unwrap_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The ``torch.optim.Optimizer`` that ``optimizer`` wraps (itself if it wraps none).

    Accelerate's ``AcceleratedOptimizer`` and Lightning's ``LightningOptimizer`` hold the optimizer that steps as
    ``.optimizer`` (and the first has none of its hooks' state): its parameter groups, state and step hooks are what
    connmon reads and hooks.

    Examples:
        >>> import torch
        >>> from connmon._optimizer import unwrap_optimizer
        >>> sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        >>> class Wrapper:  # what accelerate.prepare returns, in short
        ...     def __init__(self, optimizer):
        ...         self.optimizer = optimizer
        >>> unwrap_optimizer(Wrapper(Wrapper(sgd))) is sgd, unwrap_optimizer(sgd) is sgd
        (True, True)
    """
    seen = set()
    while id(optimizer) not in seen:
        seen.add(id(optimizer))
        inner = getattr(optimizer, "optimizer", None)
        if inner is None:
            break
        optimizer = inner
    return optimizer
