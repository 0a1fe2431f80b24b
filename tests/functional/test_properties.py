"""Invariances that follow from the definitions, checked on random layers drawn by hypothesis."""

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import connmon.functional as F
from tests.functional.reference import make_layer

SETTINGS = settings(max_examples=20, deadline=None, derandomize=True)  # the same examples in every run (CI)

layers = st.builds(
    make_layer,
    heads=st.integers(1, 4),
    n=st.integers(1, 6),
    d_h=st.integers(1, 3),
    d=st.integers(3, 6),
    mask=st.sampled_from(["none", "causal", "padded"]),
    sharpness=st.floats(0.1, 30.0),
    seed=st.integers(0, 10_000),
)


def random_orthogonal(d: int, seed: int) -> torch.Tensor:
    return torch.linalg.qr(torch.randn(d, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)).Q


@SETTINGS
@given(heads=st.integers(1, 4), d_h=st.integers(1, 3), scale=st.floats(1e-3, 1e3), seed=st.integers(0, 10_000))
def test_scaled_orthogonal_transport_has_gap_zero(heads, d_h, scale, seed):
    d = heads * d_h
    domain, image = random_orthogonal(d, seed), random_orthogonal(d, seed + 1)
    w_v = domain.T.reshape(heads, d_h, d)  # V_h: orthonormal rows
    w_o = scale * image.reshape(d, heads, d_h).transpose(0, 1)  # O_h: orthonormal columns, scaled
    assert F.head_isometry_gap(w_v, w_o, reduction="none").abs().max().item() < 1e-7
    assert F.ov_isometry_gap(w_v, w_o).item() < 1e-7  # T_bar = scale * image @ domain^T: scaled orthogonal
    assert (
        F.transport_scale(w_v, w_o).item() == np.float64(scale).item()
        or abs(F.transport_scale(w_v, w_o).item() / scale - 1) < 1e-12
    )


@SETTINGS
@given(layer=layers, factor=st.floats(1e-3, 1e3))
def test_gaps_and_normalized_spectrum_do_not_change_when_transport_is_scaled(layer, factor):
    args = (layer.attn, layer.w_v, layer.w_o)
    scaled = (layer.attn, layer.w_v, factor * layer.w_o)
    for fn in (F.edge_isometry_gap,):
        np.testing.assert_allclose(fn(*scaled).numpy(), fn(*args).numpy(), rtol=1e-9, atol=1e-12)
    for fn in (F.head_isometry_gap, F.ov_isometry_gap, F.transport_symmetry_gap):
        np.testing.assert_allclose(fn(*scaled[1:]).numpy(), fn(*args[1:]).numpy(), rtol=1e-9, atol=1e-12)
    for fn in (F.connection_spectral_radius, F.connection_operator_norm):  # NaN for one token (no walk part)
        np.testing.assert_allclose(fn(*scaled).numpy(), fn(*args).numpy(), rtol=1e-8, atol=1e-12)
    np.testing.assert_allclose(F.ov_spectral_radius(*scaled[1:]).numpy(), F.ov_spectral_radius(*args[1:]).numpy())


@SETTINGS
@given(layer=layers, data=st.data())
def test_permuting_heads_changes_nothing(layer, data):
    heads = layer.attn.shape[0]
    perm = torch.tensor(data.draw(st.permutations(range(heads))))
    original = (layer.attn, layer.w_v, layer.w_o)
    permuted = (layer.attn[perm], layer.w_v[perm], layer.w_o[perm])
    checks = [
        lambda a, v, o: F.walk_matrix(a),
        lambda a, v, o: F.attention_entropy(a),
        lambda a, v, o: F.head_isometry_gap(v, o),
        lambda a, v, o: F.ov_isometry_gap(v, o),
        lambda a, v, o: F.transport_scale(v, o),
        lambda a, v, o: F.edge_isometry_gap(a, v, o),
        lambda a, v, o: F.connection_operator_norm(a, v, o),
        lambda a, v, o: F.connection_spectrum(a, v, o, k=1, deflate=False).abs(),
        lambda a, v, o: F.connection_spectral_radius(a, v, o),  # the walk part (NaN for one token)
        lambda a, v, o: F.ov_spectral_radius(v, o),
    ]
    for check in checks:
        np.testing.assert_allclose(check(*permuted).numpy(), check(*original).numpy(), rtol=1e-9, atol=1e-12)


@SETTINGS
@given(n=st.integers(1, 8), seed=st.integers(0, 10_000))
def test_symmetric_doubly_stochastic_walk_is_reversible(n, seed):
    gen = torch.Generator().manual_seed(seed)
    kernel = torch.rand(n, n, generator=gen, dtype=torch.float64) + 0.01
    P = kernel + kernel.T
    for _ in range(500):  # Sinkhorn on a symmetric matrix: the symmetric scaling D P D is doubly stochastic
        P = P / P.sum(-1, keepdim=True).sqrt() / P.sum(-2, keepdim=True).sqrt()
    P = (P + P.T) / 2
    assert F.stochasticity_gap(P).item() < 1e-9
    np.testing.assert_allclose(F.stationary_distribution(P).numpy(), np.full(n, 1 / n), atol=1e-9)
    assert F.reversibility_gap(P).item() < 1e-9


@SETTINGS
@given(layer=layers)
def test_walk_is_stochastic_and_gaps_in_range(layer):
    P = F.walk_matrix(layer.attn)
    assert F.stochasticity_gap(P).item() < 1e-12
    assert 0 <= F.reversibility_gap(P).item() <= 1
    assert -1e-9 <= F.walk_spectral_gap(P).item() <= 1 + 1e-9
    d = layer.w_v.shape[-1]
    for gap, r in ((F.ov_isometry_gap(layer.w_v, layer.w_o), d), (F.head_isometry_gap(layer.w_v, layer.w_o), 1)):
        assert 0 <= gap.item() <= (1 - 1 / max(r, layer.w_v.shape[-2])) ** 0.5 + 1e-12
