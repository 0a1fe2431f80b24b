"""A torchmetrics accumulator of per-layer means over sampled sequences (the base of every connmon metric).

State: ``total (L, M)``, ``count (L, M)`` and ``nonfinite (L,)``, all summed across processes
(``dist_reduce_fx="sum"``), so the synced value is the mean over every sequence any rank recorded. A metric that is
NaN for a sequence by definition (for example the normalized entropy of a one-token sequence) is left out of that
layer's mean rather than poisoning it; but a layer whose record itself is non-finite (NaN or inf input, output or
attention: a forward gone bad) is NaN in every metric, and so is the model-level mean, never a silent subset.
"""

from __future__ import annotations

import abc
from typing import ClassVar

import torch
from torch import Tensor
from torchmetrics import Metric

from connmon.capture import AttentionRecord


class LayerwiseMean(Metric):
    """Mean of per-sequence diagnostics, per layer. Subclasses name ``metrics`` and implement :meth:`measure`.

    Args:
        num_layers: number of captured attention layers (record indices ``0 .. num_layers - 1``).
        **kwargs: passed to ``torchmetrics.Metric``.

    Raises:
        ValueError: if ``num_layers < 1``, or a record's index is out of range.
    """

    metrics: ClassVar[tuple[str, ...]] = ()
    total: Tensor  # (L, M) sums, count: values seen, nonfinite: (L,) non-finite records (torchmetrics states)
    count: Tensor
    nonfinite: Tensor
    full_state_update: bool = False
    higher_is_better = None
    is_differentiable = False

    def __init__(self, num_layers: int, **kwargs: object) -> None:
        super().__init__(**kwargs)
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got num_layers={num_layers}")
        self.num_layers = num_layers
        shape = (num_layers, len(self.metrics))
        self.add_state("total", torch.zeros(shape, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", torch.zeros(shape, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("nonfinite", torch.zeros(num_layers, dtype=torch.float64), dist_reduce_fx="sum")

    @abc.abstractmethod
    def measure(self, record: AttentionRecord) -> Tensor:
        """``(B_s, len(metrics))`` values of one record, one row per sequence."""

    def update(self, record: AttentionRecord) -> None:
        """Add one record's per-sequence values to its layer."""
        if not 0 <= record.index < self.num_layers:
            raise ValueError(
                f"record {record.name!r} has layer index {record.index}, outside 0..{self.num_layers - 1}; "
                "construct the metric with the number of captured layers"
            )
        values = self.measure(record).to(torch.float64)  # (B_s, M)
        finite = torch.isfinite(values)
        self.total[record.index] += torch.where(finite, values, torch.zeros_like(values)).sum(dim=0)
        self.count[record.index] += finite.sum(dim=0)
        # a forward gone non-finite: its input, its output, its attention or its logits (a kernel may return finite
        # zero or value rows for scores that are NaN, as SDPA's CPU flash kernel does). No host sync.
        broken = ~(
            torch.isfinite(record.x).all()
            & torch.isfinite(record.output).all()
            & torch.isfinite(record.attn).all()
            & torch.isfinite(record.max_logit).all()
        )
        self.nonfinite[record.index] += broken

    def compute(self) -> dict[str, Tensor]:
        """``{metric: (L,) per-layer mean}`` and ``"<metric>/all"``, the mean over layers with a value.

        A layer is NaN when it has no finite value (not measured) or when a record of it was non-finite; the key
        ``"nonfinite_layers"`` ``(L,)`` counts the latter, and any of them makes every ``/all`` NaN.
        """
        broken = self.nonfinite > 0
        mean = (self.total / self.count).masked_fill(broken[:, None], float("nan"))  # 0/0 = NaN: never seen
        out = {name: mean[:, i] for i, name in enumerate(self.metrics)}
        for i, name in enumerate(self.metrics):
            seen = self.count[:, i] > 0
            out[f"{name}/all"] = mean[seen, i].mean() if bool(seen.any()) else mean.new_tensor(float("nan"))
            if bool(broken.any()):
                out[f"{name}/all"] = mean.new_tensor(float("nan"))
        out["nonfinite_layers"] = self.nonfinite.clone()
        return out
