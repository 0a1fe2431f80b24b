"""Every key connmon logs and every name that one module hands another, defined once.

Per-layer diagnostics are logged as ``connmon/<metric>/L<ll>`` (the layer's index, two digits, in module order) and
their mean over layers as ``connmon/<metric>/all`` (:func:`metric_key`); model-wide values as ``connmon/<name>``.

Examples:
    >>> from connmon import keys
    >>> keys.metric_key("attention_entropy", 3), keys.metric_key("attention_entropy")
    ('connmon/attention_entropy/L03', 'connmon/attention_entropy/all')
    >>> keys.overhead_key("curvature")
    'connmon/overhead/curvature'
"""

from __future__ import annotations

PREFIX = "connmon/"

# the curvature (the sampler logs them; the edge rule and the workspace read them)
SHARPNESS_RATIO = "connmon/sharpness_ratio"
SHARPNESS_EIGENVALUE = "connmon/sharpness_eigenvalue"
UPDATE_SHARPNESS_RATIO = "connmon/update_sharpness_ratio"
UPDATE_SHARPNESS_EIGENVALUE = "connmon/update_sharpness_eigenvalue"
CRITICAL_SHARPNESS_RATIO = "connmon/critical_sharpness_ratio"  # eta / eta_c along the update
CRITICAL_SHARPNESS = "connmon/critical_sharpness_eigenvalue"  # 2 / eta_c, in the learning rate's units
CURVATURE_INTERVAL = "connmon/curvature_interval"
CURVATURE_GRADIENTS = "connmon/overhead/curvature_gradients"

# every head's max attention logit over the whole batch of every step (connmon.capture.max_logit)
STEP_MAX_LOGIT = "step_max_logit"  # a metric name: connmon/step_max_logit/L<ll>, the max over the layer's heads
# connmon/max_logit_bound/L<ll>: the largest logsumexp an SDPA kernel saved, every step since the last sample
MAX_LOGIT_BOUND = "max_logit_bound"
HEAD_MAX_LOGIT = "connmon/head_max_logit/"  # connmon/head_max_logit/L<ll>H<hh>: shown to the rules, not logged
# what QK-clip did since the last sample, per layer (metric names: connmon/<name>/L<ll>)
QK_CLIPS = "qk_clips"  # head clips
QK_CLIP_SCALE = "qk_clip_scale"  # the smallest factor a query or key row was scaled by, sqrt(tau / S) (1: none)
LOGIT_AFTER_QK_CLIP = "logit_after_qk_clip"  # the layer's max logit on the clipped steps' batches once clipped

# the optimizer's own state after each step, the largest since the last sample (connmon.curvature.optimizer_state)
UPDATE_RMS = "connmon/update_rms"
STALE_SECOND_MOMENT = "connmon/stale_second_moment"
UPDATE_TO_WEIGHT = "connmon/update_to_weight"
GRADIENT_TO_SECOND_MOMENT = "connmon/gradient_to_second_moment"  # sum g^2 / sum v_hat, its median over 50 steps

# what the monitors cost
OVERHEAD = "connmon/overhead"

# the alerts and their actions
ALERT_COUNT = "connmon/alerts/count"
ALERT_TOTAL = "connmon/alerts/total"
LR_SCALE = "connmon/lr_scale"
EDGE_RULE = "crossing the edge of stability"  # the curvature far past the edge; the back-off acts on the edge rules
LOGIT_EDGE_RULE = "attention logits pushing past the edge"  # the curvature past the edge while logits grow
PAST_EDGE_RULE = "past the edge of stability"  # the curvature just past the edge (opt-in)
LOGIT_RULE = "attention logits exploding"
CRITICAL_EDGE_NOTICE = "at the edge along the update"  # a notice: critical sharpness at its edge
STALE_MOMENT_NOTICE = "second moment out of date"  # a notice: Adam's v behind the gradient

# W&B histograms and figures
HEAD_ISOMETRY_GAP_HIST = "connmon/head_isometry_gap_hist"
SPECTRUM_MODULUS_HIST = "connmon/spectrum_modulus_hist"
FIGURES = "connmon/figures"


def metric_key(metric: str, index: int | None = None) -> str:
    """``connmon/<metric>/L<ll>`` for layer ``index``, or ``connmon/<metric>/all`` for the mean over layers."""
    return f"{PREFIX}{metric}/{'all' if index is None else f'L{index:02d}'}"


def head_key(index: int, head: int) -> str:
    """``connmon/head_max_logit/L<ll>H<hh>``: one head's max logit (what the per-head rules watch).

    Examples:
        >>> from connmon import keys
        >>> keys.head_key(2, 3)
        'connmon/head_max_logit/L02H03'
    """
    return f"{HEAD_MAX_LOGIT}L{index:02d}H{head:02d}"


def head_place(index: int, head: int) -> str:
    """``L<ll> head <h>``: where a head is, in every line connmon writes (alerts, clips), as its keys name layers.

    Examples:
        >>> from connmon import keys
        >>> keys.head_place(2, 3)
        'L02 head 3'
    """
    return f"L{index:02d} head {head}"


def describe(key: str, value: float) -> str:
    """A logged key and its value in words, for an alert: which head or layer, which quantity.

    Examples:
        >>> from connmon import keys
        >>> keys.describe("connmon/head_max_logit/L02H03", 640.0), keys.describe(SHARPNESS_RATIO, 1.58)
        ('L02 head 3: max logit 640', "curvature along the step 1.58x the optimizer's edge of stability")
        >>> keys.describe("connmon/max_attention_logit/L01", float("nan"))
        'connmon/max_attention_logit/L01 = nan'
    """
    if key.startswith(HEAD_MAX_LOGIT):
        layer, head = key.removeprefix(HEAD_MAX_LOGIT).removeprefix("L").split("H")
        return f"{head_place(int(layer), int(head))}: max logit {value:.4g}"
    if key in (SHARPNESS_RATIO, UPDATE_SHARPNESS_RATIO):
        return f"curvature along the step {value:.3g}x the optimizer's edge of stability"
    if key == CRITICAL_SHARPNESS_RATIO:
        return f"the step {value:.3g}x the smallest step along it that raises its batch's loss"
    return f"{key} = {value:.4g}"


def every_layer(metric: str) -> str:
    """``connmon/<metric>/L*``: the glob over every layer's key of a metric (what a per-layer rule watches)."""
    return f"{PREFIX}{metric}/L*"


def overhead_key(part: str) -> str:
    """``connmon/overhead/<part>``: one monitor's share of the training time (``attention``, ``curvature``)."""
    return f"{OVERHEAD}/{part}"
