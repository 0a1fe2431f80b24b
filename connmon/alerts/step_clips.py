"""StepClips: the step-by-step actions, QK-clip and the transport clip, on each step's max logits.

Not answers to an alert: after every optimizer step (or, with no optimizer known, at the next step's start) the
coordinator hands them that step's per-head max logits (:class:`connmon.capture.max_logit.HeadMaxLogits`) and they
act on the attention modules. What QK-clip did is kept until the next sample logs it
(``connmon/qk_clips/L<ll>``, ``connmon/qk_clip_scale/L<ll>``, ``connmon/logit_after_qk_clip/L<ll>``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from connmon import keys
from connmon._collectives import gathered_objects, is_distributed
from connmon._ranks import is_rank_zero, warn_rank_zero
from connmon.alerts._head_rows import HeadClipCount
from connmon.alerts.qk_clip import QKClip
from connmon.alerts.transport_clip import TransportClip
from connmon.capture.max_logit import HeadMaxLogits

__all__ = ["StepClips"]


class StepClips:
    """QK-clip and the transport clip, driven on each step's max-logit table; one that raises is turned off.

    Args:
        qk_clip: the ``"qk_clip"`` action (None: off).
        transport_clip: the ``"transport_clip"`` action (None: off).
        owner: the entry point named in their lines.

    Examples:
        >>> from connmon.alerts import QKClip
        >>> from connmon.alerts.step_clips import StepClips
        >>> clips = StepClips(QKClip(threshold=50.0), None, owner="example")
        >>> clips.qk_clip.threshold, clips.values(None, [])
        (50.0, {})
    """

    def __init__(self, qk_clip: QKClip | None, transport_clip: TransportClip | None, owner: str) -> None:
        self.qk_clip = qk_clip
        self.transport_clip = transport_clip
        self.owner = owner
        self.window: dict[str, Any] | None = None  # what QK-clip did since the last sample
        self._said_nonfinite_logit = False  # a head QK-clip left alone for a non-finite max logit was named
        self._transport_said_where = False  # the layers it cannot act on were named
        self._said_at: dict[str, int] = {}  # the step of each clip action's last line
        self._places: list[int] = []  # the model's layer index of each layer read

    @property
    def active(self) -> bool:
        """Whether any clip acts."""
        return self.qk_clip is not None or self.transport_clip is not None

    def act(
        self, steps_taken: int | None, read: tuple[int, Tensor] | None, logits: HeadMaxLogits, places: Sequence[int]
    ) -> None:
        """QK-clip on a step's ``read`` ``(step, table)``; the transport clip when ``steps_taken`` reaches its cadence.

        ``steps_taken``: the optimizer steps taken (None: the run is over, no transport clip). ``places``: the
        model's layer index of each row of the table. Under tensor parallelism a collective.
        """
        self._places = list(places)
        if read is not None and self.qk_clip is not None:
            self._clip(*read, logits)
        transport = self.transport_clip
        if transport is not None and steps_taken is not None and steps_taken % transport.every_n_steps == 0:
            self._clip_transport(steps_taken, logits)

    def values(self, logits: HeadMaxLogits | None, places: Sequence[int]) -> dict[str, float]:
        """What QK-clip did since the last sample, per layer (the window is then empty)."""
        clipped, self.window = self.window, None
        if clipped is None or logits is None:
            return {}
        out: dict[str, float] = {}
        after = logits.whole(torch.as_tensor(clipped["after"])).tolist()
        for position, index in enumerate(places):
            out[keys.metric_key(keys.QK_CLIPS, index)] = float(clipped["clips"][position])
            out[keys.metric_key(keys.QK_CLIP_SCALE, index)] = clipped["scale"][position]
            kept = [value for value in after[position] if math.isfinite(value)]
            if kept:
                out[keys.metric_key(keys.LOGIT_AFTER_QK_CLIP, index)] = max(kept)
        return out

    def window_state(self) -> dict[str, Any] | None:
        """The window, as plain lists (for a checkpoint)."""
        clips = self.window
        if clips is None:
            return None
        after = clips["after"]
        return {**clips, "after": after.tolist() if isinstance(after, Tensor) else after}

    def load_window(self, state: dict[str, Any] | None) -> None:
        """Restore what :meth:`window_state` saved (its table becomes a tensor where the next step's table lives)."""
        if state is not None:
            self.window = dict(state)

    def _clip(self, step: int, table: Tensor, logits: HeadMaxLogits) -> None:
        """The ``"qk_clip"`` action on a step's table; one that raises is turned off, the run goes on."""
        assert self.qk_clip is not None
        layouts = [logits.layout(index) for index in range(len(logits.modules))]
        broken = torch.isnan(table) | torch.isposinf(table)
        if bool(broken.any()) and not self._said_nonfinite_logit:
            self._said_nonfinite_logit = True
            layer, head = (int(i) for i in torch.nonzero(broken)[0])
            warn_rank_zero(
                f"{self.owner}: step {step}: {self._head_place(layer, head)} has a non-finite max logit (an "
                "overflowed query or key); QK-clip leaves such a head alone (said once)"
            )
        try:
            clips, failure = self.qk_clip.apply(logits.modules, table, layouts), None
        except Exception as error:  # an action must not end the training run
            clips, failure = [], f"{type(error).__name__}: {error}"
        clips, failure = self._model_clips(
            self.qk_clip, clips, [table.shape[1]] * len(layouts), logits, failure=failure
        )
        if failure is not None:
            warn_rank_zero(f"{self.owner}: QK-clip raised {failure}; it is off for this run")
            self.qk_clip = None
            return
        try:
            self._note_clips(table, clips, [layout is not None and layout.query is not None and layout.key is not None
                                            for layout in layouts])  # fmt: skip
            if clips and is_rank_zero():
                self._say_clips(step, clips)
        except Exception as error:  # what is logged of a clip must not end the run either
            warn_rank_zero(f"{self.owner}: noting QK-clip's clips raised {type(error).__name__}: {error}")

    def _note_clips(self, table: Tensor, clips: list[tuple], acted: list[bool]) -> None:
        """Fold a step's clips into the window logged at the next sample (per layer).

        The head clips, the smallest row scale ``sqrt(tau / S)``, and the max logit the step's batch has once clipped
        (``tau`` where a head was).
        """
        assert self.qk_clip is not None
        tau = self.qk_clip.threshold
        window = self.window or {"clips": [0] * len(acted), "scale": [1.0] * len(acted), "after": None}
        for layer, _, logit in clips:
            window["clips"][layer] += 1
            window["scale"][layer] = min(window["scale"][layer], math.sqrt(tau / logit))
        over = torch.isfinite(table) & (table > tau) & torch.tensor(acted, device=table.device).unsqueeze(1)
        after = torch.where(over, torch.full_like(table, tau), table)
        kept = None if window["after"] is None else torch.as_tensor(window["after"], device=table.device)
        window["after"] = after if kept is None or kept.shape != after.shape else kept.maximum(after)
        self.window = window

    def _clip_transport(self, step: int, logits: HeadMaxLogits) -> None:
        """The ``"transport_clip"`` action; one that raises is turned off, the run goes on."""
        assert self.transport_clip is not None
        layouts = [logits.layout(index) for index in range(len(logits.modules))]
        if not self._transport_said_where and not logits.layouts_pending():
            self._transport_said_where = True
            missing = [name for name, layout in zip(logits.names, layouts, strict=True)
                       if layout is None or layout.value is None or layout.output is None]  # fmt: skip
            if missing:
                warn_rank_zero(
                    f"{self.owner}: the transport clip does not act on {', '.join(missing[:4])}"
                    f"{f' and {len(missing) - 4} more' if len(missing) > 4 else ''}: their values or output are not "
                    "one projection's rows inside the attention module, or they call no scaled_dot_product_attention"
                )
        try:
            clips, failure = self.transport_clip.apply(logits.modules, layouts), None
        except Exception as error:  # an action must not end the training run
            clips, failure = [], f"{type(error).__name__}: {error}"
        counts = [0 if layout is None or layout.output is None else layout.output.rows.shape[0] for layout in layouts]
        clips, failure = self._model_clips(self.transport_clip, clips, counts, logits, failure=failure)
        if failure is not None:
            warn_rank_zero(f"{self.owner}: the transport clip raised {failure}; it is off now")
            self.transport_clip = None
            return
        if not clips or not is_rank_zero() or not self._may_say("transport_clip", step):
            return
        heads = ", ".join(
            f"{self._head_place(layer, head)} ({high:.3g}x / {low:.3g}x)" for layer, head, high, low in clips[:4]
        )
        more = f" and {len(clips) - 4} more" if len(clips) > 4 else ""
        warn_rank_zero(
            f"{self.owner}: transport clip at step {step}: {heads}{more} (largest / smallest singular value of O_h V_h "
            f"against their mean) clamped to within {self.transport_clip.factor:g}x of the mean "
            f"({self.transport_clip.clipped} head clips so far)"
        )

    def _model_clips(
        self, action: HeadClipCount, clips: list[tuple], heads: list[int], logits: HeadMaxLogits, failure: str | None
    ) -> tuple[list[tuple], str | None]:
        """A clip action's clips as the model's, and a failure on any process (under tensor parallelism a collective).

        Under tensor parallelism every process's clips, its heads numbered as the model's (process ``r``'s head ``h``
        of a layer is ``h`` plus the layer's heads on processes ``0..r-1``), and the action's count and latest clips
        set to them; the first process's failure is every process's, so all turn the action off together. Every
        process calls it on the same steps, whatever happened to it. Elsewhere ``clips`` and ``failure``.
        ``heads``: this process's head count of each layer.
        """
        if not logits.tensor_parallel or not is_distributed():
            return clips, failure
        parts = gathered_objects((clips, heads, failure))
        failed = [(rank, why) for rank, (_, _, why) in enumerate(parts) if why is not None]
        if failed:
            return [], f"{failed[0][1]} (on process {failed[0][0]})"
        whole: list[tuple] = []
        offset = [0] * len(heads)
        for part, counts, _ in parts:
            whole += [(layer, head + offset[layer], *rest) for layer, head, *rest in part]
            offset = [a + b for a, b in zip(offset, counts, strict=True)]
        whole.sort(key=lambda clip: clip[:2])
        action.clipped += len(whole) - len(clips)
        action.last = whole
        return whole, None

    def _head_place(self, layer: int, head: int) -> str:
        """``L<ll> head <h>`` of head ``head`` of the ``layer``-th layer read, as the alerts and the keys name it."""
        return keys.head_place(self._places[layer], head)

    def _may_say(self, action: str, step: int) -> bool:
        """At most one line per 100 steps for each clip action; True (and noted) when this step may say one."""
        said = self._said_at.get(action)
        if said is not None and step - said < 100:
            return False
        self._said_at[action] = step
        return True

    def _say_clips(self, step: int, clips: list[tuple[int, int, float]]) -> None:
        if self.qk_clip is None or not self._may_say("qk_clip", step):
            return
        heads = ", ".join(f"{self._head_place(layer, head)} ({logit:.4g})" for layer, head, logit in clips[:4])
        more = f" and {len(clips) - 4} more" if len(clips) > 4 else ""
        warn_rank_zero(
            f"{self.owner}: QK-clip at step {step}: {heads}{more} above {self.qk_clip.threshold:g}, their query and "
            f"key rows scaled by sqrt(threshold / max logit) ({self.qk_clip.clipped} head clips so far)"
        )
