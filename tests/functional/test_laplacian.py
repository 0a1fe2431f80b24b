"""The connection Laplacian form: edge compatibility and the distance of M / s from the form, against float64."""

import math

import numpy as np
import pytest
import torch

import connmon.functional as F
from tests.functional import reference as ref
from tests.functional.reference import make_layer


def test_edge_compatibility_gap_matches_reference(layer):
    expected = ref.edge_compatibility_gap(*layer.np)
    got = F.edge_compatibility_gap(layer.attn, layer.w_v, layer.w_o).item()
    if math.isnan(expected):  # causal and padded-causal: no edge is used both ways
        assert math.isnan(got)
    else:
        assert got == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("fit_scale", [False, True])
def test_connection_laplacian_distance_matches_reference(layer, fit_scale):
    expected = ref.connection_laplacian_distance(*layer.np, fit_scale=fit_scale)
    got = F.connection_laplacian_distance(layer.attn, layer.w_v, layer.w_o, fit_scale=fit_scale).item()
    assert got == pytest.approx(expected, abs=1e-10)


def test_distance_is_the_minimum_over_compatible_orthogonal_fields():
    layer = make_layer(heads=3, n=5, d_h=2, d=4, seed=7)
    attn, w_v, w_o = layer.np
    n, d = 5, 4
    M = ref.connection_operator(attn, w_v, w_o) / ref.transport_scale(w_v, w_o)
    N = ref.laplacian_form(attn, w_v, w_o).reshape(n, d, n, d)
    best = F.connection_laplacian_distance(layer.attn, layer.w_v, layer.w_o).item()
    gen = np.random.default_rng(0)
    for _ in range(20):  # rotate one edge pair's R (keeping R_ji = R_ij^T): never closer
        i, j = gen.choice(n, 2, replace=False)
        skew = gen.standard_normal((d, d))
        rotation = torch.linalg.matrix_exp(torch.as_tensor(0.1 * (skew - skew.T))).numpy()
        moved = N.copy()
        moved[i, :, j, :] = N[i, :, j, :] @ rotation
        moved[j, :, i, :] = rotation.T @ N[j, :, i, :]
        assert np.linalg.norm(M - moved.reshape(n * d, n * d)) / np.linalg.norm(M) >= best - 1e-12


def test_an_operator_of_the_form_has_distance_zero_and_a_scaled_one_its_scale():
    gen = torch.Generator().manual_seed(1)
    kernel = torch.randn(6, 6, generator=gen, dtype=torch.float64).exp()
    kernel = kernel + kernel.mT
    attn = (kernel / kernel.sum(-1, keepdim=True))[None]  # one head, reversible walk
    u = torch.nn.functional.normalize(torch.randn(5, 1, generator=gen, dtype=torch.float64), dim=0)
    reflection = torch.eye(5, dtype=torch.float64) - 2 * u @ u.T  # symmetric orthogonal: R_ji = R_ij^T
    eye = torch.eye(5, dtype=torch.float64)[None]
    assert F.connection_laplacian_distance(attn, reflection[None], eye).item() == pytest.approx(0, abs=1e-7)
    assert F.edge_compatibility_gap(attn, reflection[None], eye).item() == pytest.approx(0, abs=1e-12)
    # two symmetric orthogonal maps, each edge read by one head (head 1 where i + j is even): every block is
    # P_ij R_h scaled by c = 2 / s, s = mean singular value of R_1 + R_2: distance |1 - 1/c|, 0 once c is fitted
    parity = (torch.arange(6)[:, None] + torch.arange(6)) % 2 == 0
    heads = torch.stack([kernel * parity, kernel * ~parity])
    heads = heads / heads.sum(-1, keepdim=True)
    v = torch.nn.functional.normalize(torch.randn(5, 1, generator=gen, dtype=torch.float64), dim=0)
    maps = torch.stack([reflection, torch.eye(5, dtype=torch.float64) - 2 * v @ v.T])
    s = torch.linalg.svdvals(maps.sum(0)).mean().item()
    eyes = torch.stack([eye[0], eye[0]])
    assert F.connection_laplacian_distance(heads, maps, eyes).item() == pytest.approx(abs(1 - s / 2), abs=1e-7)
    assert F.connection_laplacian_distance(heads, maps, eyes, fit_scale=True).item() == pytest.approx(0, abs=1e-6)
    # two heads with orthogonal maps in different directions: T_ij = a Q1 + (1 - a) Q2 is no longer orthogonal
    two = torch.cat([attn, attn.flip(-1) / attn.flip(-1).sum(-1, keepdim=True)])
    w_v = torch.stack([reflection, eye[0]])
    assert F.connection_laplacian_distance(two, w_v, torch.stack([eye[0], eye[0]])).item() > 0.05


def test_batched_gqa_float32_and_leading_dims():
    layers = [make_layer(heads=4, kv_heads=2, n=6, d_h=2, d=8, seed=s) for s in range(3)]
    attn = torch.stack([layer.attn for layer in layers])  # (3, H, n, n), one set of weights
    w_v, w_o = layers[0].w_v, layers[0].w_o
    got = F.connection_laplacian_distance(attn, w_v, w_o, chunk=5)
    expected = [ref.connection_laplacian_distance(a.numpy(), w_v.numpy(), w_o.numpy()) for a in attn]
    np.testing.assert_allclose(got.numpy(), expected, atol=1e-10)
    single = F.connection_laplacian_distance(attn.float(), w_v.float(), w_o.float())
    assert single.dtype == torch.float32
    np.testing.assert_allclose(single.numpy(), expected, atol=1e-4)
    compat = F.edge_compatibility_gap(attn.float(), w_v.float(), w_o.float())
    np.testing.assert_allclose(
        compat.numpy(), [ref.edge_compatibility_gap(a.numpy(), *layers[0].np[1:]) for a in attn], atol=1e-5
    )


def test_bad_input():
    layer = make_layer()
    with pytest.raises(ValueError, match="w_o must have shape"):
        F.connection_laplacian_distance(layer.attn, layer.w_v, layer.w_o[:, :, :1])
    with pytest.raises(ValueError, match="chunk"):
        F.connection_laplacian_distance(layer.attn, layer.w_v, layer.w_o, chunk=0)
    with pytest.raises(ValueError, match="one map per query head"):
        F.edge_compatibility_gap(layer.attn[:2], layer.w_v, layer.w_o)
    broken = layer.attn.clone()
    broken[0, 1, 2] = float("nan")
    assert math.isnan(F.connection_laplacian_distance(broken, layer.w_v, layer.w_o).item())
    assert math.isnan(F.edge_compatibility_gap(broken, layer.w_v, layer.w_o).item())
    zero = torch.zeros_like(layer.w_v)
    assert math.isnan(F.connection_laplacian_distance(layer.attn, zero, layer.w_o).item())
