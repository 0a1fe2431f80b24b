import json
import math

import pytest
import torch

import connmon
import connmon.functional as F
from connmon.analysis import LAYER_METRICS
from tests.capture.models import TinyGPT


def test_analyze_reports_every_metric_per_layer_and_model_means():
    torch.manual_seed(0)
    model = TinyGPT(n_layer=3).eval()
    idx = torch.randint(0, 50, (3, 10))
    report = connmon.analyze(model, idx, spectrum_k=4, edge_samples=None, edge_queries=None, edge_lanczos_steps=None)
    records = connmon.capture(model, idx)
    layers = report.to_dict()["layers"]
    assert [layer["name"] for layer in layers] == ["blocks.0.attn", "blocks.1.attn", "blocks.2.attn"]
    for i, (layer, record) in enumerate(zip(layers, records, strict=True)):
        expected = set(LAYER_METRICS) - ({"depth_drift"} if i == 0 else set()) - {"reversibility_gap"}
        assert expected <= set(layer)
        assert "reversibility_gap" not in layer  # causal: 0 by the mask alone, not reported
        P = F.walk_matrix(record.attn)
        assert layer["ov_spectral_radius"] == pytest.approx(F.ov_spectral_radius(record.w_v, record.w_o).item())
        assert layer["edge_isometry_gap"] == pytest.approx(
            F.edge_isometry_gap(record.attn, record.w_v, record.w_o).mean().item()
        )
        spectrum = F.connection_spectrum(record.attn, record.w_v, record.w_o, k=4)
        assert layer["connection_spectral_radius"] == pytest.approx(spectrum.abs()[:, 0].mean().item())
        assert len(layer["connection_spectrum"]) == 2 and len(layer["connection_spectrum"][0]) == 4
        assert layer["reconstruction_error"] < 1e-5
        if i:
            previous = F.walk_matrix(records[i - 1].attn)
            assert layer["depth_drift"] == pytest.approx(F.depth_drift(P, previous).mean().item())
    model_means = report.to_dict()["model"]
    assert model_means["transport_scale"] == pytest.approx(sum(x["transport_scale"] for x in layers) / 3)
    assert model_means["depth_drift"] == pytest.approx((layers[1]["depth_drift"] + layers[2]["depth_drift"]) / 2)
    decoded = json.loads(report.to_json())
    assert decoded["layers"][1]["name"] == "blocks.1.attn"
    assert not any(isinstance(v, float) and math.isnan(v) for v in decoded["model"].values())


def test_a_report_reads_what_the_training_metrics_average():
    """One definition for training and post-hoc: each value of a report is the training accumulators' mean."""
    from connmon.metrics import DriftMetrics, SpectrumMetrics, TransportMetrics, WalkMetrics

    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    x = torch.randn(2, 20, 32)  # bidirectional, (20 - 1) * 32 > 512: the Krylov spectrum
    report = connmon.analyze(model, x)
    groups = [WalkMetrics(2), TransportMetrics(2, edge_samples=4, edge_queries=32), SpectrumMetrics(2), DriftMetrics(2)]
    for record in connmon.capture(model, x):
        for group in groups:
            group.update(record)
    compared = 0
    for group in groups:
        values = group.compute()
        for name in group.metrics:
            for index, reported in enumerate(report.layers):
                if name in LAYER_METRICS and math.isfinite(values[name][index]):
                    assert reported[name] == pytest.approx(values[name][index].item(), rel=1e-12), (name, index)
                    compared += 1
    assert compared >= 2 * (len(LAYER_METRICS) - 1)  # every metric of both layers (depth drift: the second only)
