"""Curvature against the optimizer's edge of stability: the one warning that is about the update, not the attention.

On a quadratic with Hessian ``H``, an optimizer that steps by ``U`` times its momentum buffer (``U`` diagonal: the
learning rate times the optimizer's preconditioner) is stable exactly when ``lambda_max(U^1/2 H U^1/2) < c``, with
``c`` the momentum's constant: ``2 (1 + beta)`` for heavy-ball momentum (``2`` without), ``2 (1 + beta) / (1 + 2 beta)``
for Nesterov's. Past it, the top direction oscillates with a growing amplitude. :func:`sharpness_ratio` returns
``lambda_max(U^1/2 H U^1/2) / c`` for the loss of one batch, with ``H`` the Hessian of that loss in the parameters the
optimizer updates, so 1 is the edge of stability whatever the model, optimizer or learning rate (Cohen et al. 2021,
*Gradient descent on neural networks typically occurs at the edge of stability*; 2022, *Adaptive gradient methods at
the edge of stability*). For Adam, with one learning rate, the ratio is ``lr * lambda_max(P^-1 H) / ((2 + 2 beta1) /
(1 - beta1))``, Cohen et al.'s preconditioned sharpness against its threshold.

What ``U`` and ``c`` are, per optimizer (the state read is the optimizer's own, after its latest step; ``lr`` is the
rate the step applies, times ``lr_scale`` where something scales it inside the step, as a learning-rate back-off does):

* ``torch.optim.SGD``: ``U = lr (1 - dampening)`` with momentum (``lr`` without), ``c`` as above. ``weight_decay``
  adds ``weight_decay * I`` to ``H`` (it is part of the gradient).
* ``torch.optim.Adam`` and ``AdamW``: ``U = lr (1 - beta1) / (sqrt(v_hat) + eps)``, ``v_hat`` the bias-corrected
  second moment (its running maximum with ``amsgrad``), and ``c = 2 (1 + beta1)``. Adam's ``weight_decay`` adds
  ``weight_decay * I`` to ``H``; AdamW's decoupled decay, a contraction by ``1 - lr * weight_decay``, is left out (it
  only stabilizes). The first moment's bias correction is left out too: it is within 1% of 1 after 44 steps at
  ``beta1 = 0.9``.

``lambda_max`` is the algebraically largest eigenvalue (a negative curvature does not destabilize the step), the top
Ritz value of ``steps`` Lanczos steps with Hessian-vector products: a lower bound that converges from below. Each
product is by default a difference of two first-order gradients (one gradient of the batch's loss per step, through
the model's own kernels); the exact double-backward product is the reference (:mod:`connmon.curvature.products`).

Examples:
    >>> import torch
    >>> from connmon.curvature import sharpness_ratio
    >>> model = torch.nn.Linear(3, 1, bias=False)
    >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> x = torch.eye(3) * torch.tensor([[1.0], [2.0], [3.0]])  # loss = mean((x w)^2): H = diag(2, 8, 18) / 3
    >>> loss_fn = lambda: model(x).pow(2).mean()
    >>> result = sharpness_ratio(loss_fn, optimizer, steps=3)
    >>> round(result.ratio, 4)  # lr * 18 / 3 / 2
    0.3
"""

from __future__ import annotations

from connmon.curvature.geometry import StepGeometry, check_optimizer, step_geometry
from connmon.curvature.ratio import Sharpness, sharpness_ratio
from connmon.curvature.update import READINGS, CriticalSharpness, Reading, UpdateProbe, UpdateSharpness

__all__ = [
    "READINGS",
    "CriticalSharpness",
    "Reading",
    "Sharpness",
    "StepGeometry",
    "UpdateProbe",
    "UpdateSharpness",
    "check_optimizer",
    "sharpness_ratio",
    "step_geometry",
]
