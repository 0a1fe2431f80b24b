import math
import random

import pytest

from connmon.alerts import CUSUM, EWMAZScore, Growth, NonFinite, Threshold


def weighted_baseline(values, alpha):
    """The EWMA mean and variance from explicit weights: x_i weighs a_i prod_{j>i} (1 - a_j), a_t = max(a, 1/t)."""
    rates = [max(alpha, 1.0 / t) for t in range(1, len(values) + 1)]
    weights = []
    for i, rate in enumerate(rates):
        w = rate
        for later in rates[i + 1 :]:
            w *= 1 - later
        weights.append(w)
    mean = sum(w * x for w, x in zip(weights, values, strict=True))
    var = sum(w * (x - mean) ** 2 for w, x in zip(weights, values, strict=True))
    return mean, var


@pytest.mark.parametrize("alpha", [0.1, 0.3, 1.0])
def test_ewma_baseline_equals_the_explicitly_weighted_mean_and_variance(alpha):
    rng = random.Random(0)
    values = [rng.gauss(3.0, 2.0) for _ in range(40)]
    detector = EWMAZScore(alpha=alpha, warmup=5, threshold=1e9)
    for v in values:
        detector.update(v)
    mean, var = weighted_baseline(values, alpha)
    assert detector.mean == pytest.approx(mean, rel=1e-12)
    assert detector.var == pytest.approx(var, rel=1e-9, abs=1e-12)


def test_ewma_z_score_fires_on_an_outlier_with_its_evidence_and_respects_direction():
    calm = [1.0, 1.1, 0.9, 1.0, 1.1, 0.9, 1.0, 1.05, 0.95, 1.0]
    rise, fall = EWMAZScore(warmup=10), EWMAZScore(direction="fall", warmup=10)
    both = EWMAZScore(4.0, "both", warmup=10)
    for d in (rise, fall, both):
        assert [d.update(v) for v in calm] == [None] * 10
    mean, var = weighted_baseline(calm, 0.1)
    hit = rise.update(2.0)
    assert hit.statistic == pytest.approx((2.0 - mean) / math.sqrt(var)) and hit.baseline == pytest.approx(mean)
    assert both.update(2.0) is not None
    assert fall.update(0.0) is not None


def test_detectors_ignore_non_finite_values_and_do_not_fire_in_warmup():
    detector = EWMAZScore(warmup=3)
    assert [detector.update(v) for v in (1.0, float("nan"), 100.0, float("inf"))] == [None] * 4
    assert detector.seen == 2  # NaN and inf were not absorbed
    cusum = CUSUM(warmup=3)
    assert cusum.update(float("nan")) is None and cusum.seen == 0


def test_cusum_catches_a_sustained_small_shift_that_no_single_z_score_shows():
    rng = random.Random(1)
    baseline = [rng.gauss(0.0, 1.0) for _ in range(200)]
    shifted = [rng.gauss(1.0, 1.0) for _ in range(100)]  # a 1-sigma shift
    cusum, zscore = CUSUM(threshold=8.0, warmup=50), EWMAZScore(threshold=4.0, warmup=50, alpha=0.02)
    quiet = [cusum.update(v) for v in baseline]
    assert all(hit is None for hit in quiet)  # no false alarm in 200 in-control values at h = 8
    hits = [i for i, v in enumerate(shifted) if cusum.update(v) is not None]
    assert hits and hits[0] < 40  # ARL at a 1-sigma shift with k = 0.5, h = 8 is about 17
    assert not any(zscore.update(v) for v in baseline + shifted[:40])
    fall = CUSUM(threshold=8.0, warmup=50, direction="fall")
    for v in baseline + shifted:
        assert fall.update(v) is None


def test_threshold_and_non_finite():
    assert Threshold(5.0).update(6.0).statistic == 6.0
    assert Threshold(5.0).update(float("nan")) is None
    assert Threshold(0.2, "fall").update(0.1) is not None and Threshold(0.2, "fall").update(0.3) is None
    assert Threshold(1.0, "both").update(-2.0) is not None
    assert NonFinite().update(float("-inf")) is not None and NonFinite().update(1e30) is None


def test_threshold_on_consecutive_values_counts_a_streak_that_nan_neither_extends_nor_breaks():
    detector = Threshold(1.0, consecutive=3)
    values = [2.0, 2.0, 0.5, 2.0, float("nan"), 2.0, 2.0, 3.0, 0.0, 2.0]
    fired = [detector.update(v) is not None for v in values]
    assert fired == [False, False, False, False, False, False, True, True, False, False]
    falling = Threshold(0.0, "fall", consecutive=2)
    assert [falling.update(v) is not None for v in (-1.0, -1.0)] == [False, True]


def test_threshold_streak_survives_a_resume():
    first = Threshold(1.0, consecutive=2)
    assert first.update(1.5) is None
    resumed = Threshold(1.0, consecutive=2)
    resumed.load_state_dict(first.state_dict())
    assert resumed.update(1.5) is not None


def test_state_round_trip_continues_identically():
    rng = random.Random(2)
    values = [rng.gauss(0, 1) + (3 if i > 60 else 0) for i in range(100)]
    straight = CUSUM(warmup=10)
    expected = [straight.update(v) for v in values]
    first = CUSUM(warmup=10)
    got = [first.update(v) for v in values[:50]]
    resumed = CUSUM(warmup=10)
    resumed.load_state_dict(first.state_dict())
    got += [resumed.update(v) for v in values[50:]]
    assert got == expected and any(expected)


@pytest.mark.parametrize(
    ("factory", "match"),
    [
        (lambda: EWMAZScore(direction="up"), "direction"),
        (lambda: EWMAZScore(alpha=0.0), "alpha"),
        (lambda: CUSUM(warmup=1), "warmup"),
        (lambda: CUSUM(threshold=-1.0), "threshold"),
        (lambda: Threshold(1.0, "sideways"), "direction"),
        (lambda: Threshold(1.0, consecutive=0), "consecutive"),
        (lambda: Threshold(1.0, consecutive=1.5), "consecutive"),
        (lambda: Threshold("1.0"), r"bound must be a number, got bound='1.0'"),
        (lambda: Threshold(float("nan")), r"bound must be a number, got bound=nan"),
        (lambda: Growth(1.0), r"factor must be a number > 1, got factor=1.0"),
        (lambda: EWMAZScore(warmup=2.5), r"warmup must be an integer >= 2, got warmup=2.5"),
        (lambda: EWMAZScore(min_std=-1), r"min_std must be a number >= 0, got min_std=-1"),
        (lambda: EWMAZScore(log="yes"), r"log must be True or False, got log='yes'"),
        (lambda: CUSUM(drift=-0.1), r"drift must be a number >= 0, got drift=-0.1"),
    ],
)
def test_bad_configuration_is_rejected_with_the_value(factory, match):
    with pytest.raises(ValueError, match=match):
        factory()


def test_growth_compares_with_the_first_finite_value_in_either_direction():
    rise, fall, both = Growth(3.0), Growth(3.0, "fall"), Growth(3.0, "both")
    for d in (rise, fall, both):
        assert d.update(float("nan")) is None and d.update(2.0) is None and d.first == 2.0
    assert rise.update(5.9) is None and rise.update(6.1).statistic == pytest.approx(3.05)
    assert fall.update(6.1) is None and fall.update(0.6).baseline == 2.0
    assert both.update(0.6) is not None and both.update(6.1) is not None
    with pytest.raises(ValueError, match="factor"):
        Growth(1.0)


def test_log_scale_tests_multiplicative_changes_and_reports_the_baseline_in_units():
    rng = random.Random(3)
    calm = [10.0 * 1.02**i * math.exp(rng.gauss(0, 0.05)) for i in range(20)]  # 2% growth a sample, 5% noise
    detector = EWMAZScore(threshold=4.0, warmup=10, log=True)
    assert not any(detector.update(v) for v in calm)
    hit = detector.update(calm[-1] * 3)  # a sudden tripling
    assert hit is not None and calm[0] < hit.baseline < calm[-1]  # the geometric baseline, in the series' units
    assert detector.update(-1.0) is None and detector.update(0.0) is None  # not data on a log scale
    cusum = CUSUM(warmup=5, log=True)  # a sustained trend is what CUSUM exists to catch
    assert any([cusum.update(v) for v in calm]) and cusum.seen == 20
