import numpy as np
import pytest
import torch

import connmon.functional as F
from tests.functional import reference as ref


def test_transport_singular_values(layer):
    _, w_v, w_o = layer.np
    got = F.transport_singular_values(layer.w_v, layer.w_o).numpy()
    np.testing.assert_allclose(got, ref.head_singular_values(w_v, w_o), rtol=1e-10, atol=1e-13)


def test_head_isometry_gap(layer):
    _, w_v, w_o = layer.np
    expected = ref.head_gaps(w_v, w_o)
    per_head = F.head_isometry_gap(layer.w_v, layer.w_o, reduction="none")
    np.testing.assert_allclose(per_head.numpy(), expected, atol=1e-10)
    assert F.head_isometry_gap(layer.w_v, layer.w_o).item() == pytest.approx(expected.mean(), abs=1e-10)


def test_isometry_gap_matches_closed_form_and_nearest_isometry():
    gen = torch.Generator().manual_seed(3)
    s = torch.rand(5, 7, generator=gen, dtype=torch.float64)
    closed_form = (1 - s.sum(-1) ** 2 / (7 * (s**2).sum(-1))).clamp(min=0).sqrt()
    torch.testing.assert_close(F.isometry_gap(s), closed_form, rtol=1e-12, atol=1e-12)
    T = torch.randn(6, 6, generator=gen, dtype=torch.float64)
    assert F.isometry_gap(torch.linalg.svdvals(T)).item() == pytest.approx(ref.nearest_isometry_gap(T.numpy()))
    padded = torch.cat([s, torch.zeros(5, 3, dtype=torch.float64)], dim=-1)
    torch.testing.assert_close(F.isometry_gap(s, rank=10), F.isometry_gap(padded))


def test_ov_isometry_gap_and_scale(layer):
    _, w_v, w_o = layer.np
    T_bar = ref.ov_map(w_v, w_o)
    np.testing.assert_allclose(F.ov_transport(layer.w_v, layer.w_o).numpy(), T_bar, atol=1e-14)
    s = np.linalg.svd(T_bar, compute_uv=False)
    np.testing.assert_allclose(F.ov_singular_values(layer.w_v, layer.w_o).numpy(), s, atol=1e-12)
    assert F.ov_isometry_gap(layer.w_v, layer.w_o).item() == pytest.approx(ref.nearest_isometry_gap(T_bar), abs=1e-10)
    assert F.transport_scale(layer.w_v, layer.w_o).item() == pytest.approx(s.mean(), rel=1e-12)


def test_transport_symmetry_gap(layer):
    T_bar = ref.ov_map(*layer.np[1:])
    expected = np.linalg.norm(T_bar - T_bar.T) / (2 * np.linalg.norm(T_bar))
    assert F.transport_symmetry_gap(layer.w_v, layer.w_o).item() == pytest.approx(expected, rel=1e-12)


def test_edge_isometry_gap_exact(layer):
    expected = ref.edge_isometry_gap(*layer.np)
    assert F.edge_isometry_gap(layer.attn, layer.w_v, layer.w_o).item() == pytest.approx(expected, abs=1e-10)


@pytest.mark.parametrize("mask", ["none", "padded"])
def test_edge_isometry_gap_estimator_is_unbiased_within_its_documented_error(mask):
    layer = ref.make_layer(heads=4, n=8, d_h=2, d=8, mask=mask, seed=11)
    exact = F.edge_isometry_gap(layer.attn, layer.w_v, layer.w_o).item()
    k = 4
    estimates = torch.stack(
        [F.edge_isometry_gap(layer.attn, layer.w_v, layer.w_o, num_samples=k, seed=s) for s in range(200)]
    )
    bound = 0.5 / (8 * k) ** 0.5  # documented standard-error bound of one estimate
    assert estimates.std().item() <= bound
    assert (estimates - exact).abs().max().item() <= 4 * bound
    assert estimates.mean().item() == pytest.approx(exact, abs=4 * bound / 200**0.5)  # unbiased
    again = F.edge_isometry_gap(layer.attn, layer.w_v, layer.w_o, num_samples=k, seed=7)
    assert again.item() == estimates[7].item()  # deterministic for a seed


def test_edge_isometry_gap_on_a_subset_of_queries_is_unbiased():
    layer = ref.make_layer(heads=4, n=12, d_h=2, d=8, mask="causal", seed=5)
    exact = F.edge_isometry_gap(layer.attn, layer.w_v, layer.w_o).item()
    estimates = torch.stack(
        [
            F.edge_isometry_gap(layer.attn, layer.w_v, layer.w_o, num_samples=1, num_queries=4, seed=s)
            for s in range(300)
        ]
    )
    bound = 0.5 / 4**0.5
    assert estimates.std().item() <= bound
    assert estimates.mean().item() == pytest.approx(exact, abs=4 * bound / 300**0.5)
    rows_exact = torch.stack(
        [F.edge_isometry_gap(layer.attn, layer.w_v, layer.w_o, num_queries=3, seed=s) for s in range(300)]
    )  # exact over the keys of 3 random queries
    assert rows_exact.mean().item() == pytest.approx(exact, abs=4 * 0.5 / (3 * 300) ** 0.5)
    everything = F.edge_isometry_gap(layer.attn, layer.w_v, layer.w_o, num_queries=12)
    assert everything.item() == pytest.approx(exact, rel=1e-12)  # all rows: exact again
    with pytest.raises(ValueError, match="num_queries must be a positive int or None, got num_queries=0"):
        F.edge_isometry_gap(layer.attn, layer.w_v, layer.w_o, num_queries=0)


def test_transport_functions_are_batched(layer):
    w_v = torch.stack([layer.w_v, 2 * layer.w_v.flip(-1)])
    w_o = torch.stack([layer.w_o, layer.w_o.flip(-2)])
    for fn in (F.transport_singular_values, F.head_isometry_gap, F.ov_isometry_gap, F.transport_scale):
        batched = fn(w_v, w_o)
        for b in range(2):
            torch.testing.assert_close(batched[b], fn(w_v[b], w_o[b]))
    attn = torch.stack([layer.attn, layer.attn])
    torch.testing.assert_close(F.edge_isometry_gap(attn, w_v, w_o)[1], F.edge_isometry_gap(layer.attn, w_v[1], w_o[1]))
    assert F.edge_isometry_gap(attn, layer.w_v, layer.w_o).shape == (2,)  # weights broadcast over sequences


def test_zero_transport_counts_as_isometry():
    w_v, w_o = torch.randn(2, 3, 6), torch.zeros(2, 6, 3)
    attn = torch.full((2, 4, 4), 0.25)
    for value in (
        F.head_isometry_gap(w_v, w_o),
        F.ov_isometry_gap(w_v, w_o),
        F.transport_symmetry_gap(w_v, w_o),
        F.edge_isometry_gap(attn, w_v, w_o),
        F.transport_scale(w_v, w_o),
    ):
        assert value.item() == 0.0


def test_edge_isometry_gap_in_float32_matches_the_float64_reference(layer):
    # float32 cores go through the float64 Gram eigendecomposition; rank-deficient layers (GQA, d_h H < d) included
    expected = ref.edge_isometry_gap(*layer.np)
    got = F.edge_isometry_gap(layer.attn.float(), layer.w_v.float(), layer.w_o.float()).item()
    assert got == pytest.approx(expected, abs=2e-6)


def test_gram_singular_values_match_svdvals_and_keep_nan():
    from connmon._linalg import gram_svdvals

    gen = torch.Generator().manual_seed(0)
    tall, wide = (torch.randn(6, *shape, generator=gen, dtype=torch.float64) for shape in ((32, 8), (8, 32)))
    low_rank = tall @ wide
    expected = torch.linalg.svdvals(low_rank)
    got = gram_svdvals(low_rank.float()).double()
    assert (got - expected).abs().max() <= 1e-6 * expected.max()
    bad = low_rank.float().clone()
    bad[2, 0, 0] = float("nan")
    values = gram_svdvals(bad)
    assert values[2].isnan().all() and values[[0, 1, 3, 4, 5]].isfinite().all()


@pytest.mark.parametrize(
    "heads, n, d_h, d, mask",
    [(4, 24, 16, 64, "causal"), (8, 16, 8, 64, "none"), (4, 16, 8, 64, "padded"), (1, 12, 24, 24, "none")],
)
def test_edge_isometry_gap_by_lanczos_has_a_small_bias_on_the_same_edges(heads, n, d_h, d, mask):
    """Same seed, same edges: the Lanczos estimate against each edge's exact gap, over 20 seeds (probes)."""
    layer = ref.make_layer(heads=heads, n=n, d_h=d_h, d=d, mask=mask, seed=heads + n)
    args = (layer.attn, layer.w_v, layer.w_o)
    differences = torch.stack(
        [
            F.edge_isometry_gap(*args, num_samples=1, num_queries=8, seed=s, lanczos_steps=32)
            - F.edge_isometry_gap(*args, num_samples=1, num_queries=8, seed=s)
            for s in range(20)
        ]
    )
    assert differences.abs().max().item() <= 0.05
    assert abs(differences.mean().item()) <= 0.01  # the documented bias bound


def test_edge_isometry_gap_by_lanczos_is_exact_on_isometric_edges():
    """Heads that are scaled isometries onto orthogonal subspaces, equally gated: every edge map is c Q, gap 0."""
    gen = torch.Generator().manual_seed(0)
    q = torch.linalg.qr(torch.randn(32, 32, generator=gen, dtype=torch.float64)).Q
    w_v = q.T.reshape(4, 8, 32)  # orthonormal rows, head h on its own 8-dim subspace
    w_o = 3 * w_v.mT
    attn = torch.full((4, 10, 10), 0.1, dtype=torch.float64)  # equal gates: T_ij = (3/4) Q Q^T = (3/4) I
    got = F.edge_isometry_gap(attn, w_v, w_o, num_samples=2, lanczos_steps=16)
    assert got.item() == pytest.approx(0.0, abs=1e-6)
    assert F.edge_isometry_gap(attn, w_v, w_o, num_samples=2).item() == pytest.approx(0.0, abs=1e-6)


def test_edge_isometry_gap_by_lanczos_with_a_full_krylov_space_is_hutchinson_unbiased_in_sum_s():
    """With m >= r the quadrature is exact: over many probes the mean of sum s matches the exact nuclear norm."""
    from connmon._linalg.heads import concat_heads
    from connmon.functional.transport import _edge_gaps_by_lanczos, _qr_cores

    layer = ref.make_layer(heads=2, n=4, d_h=3, d=6, mask="none", seed=1)
    r_v, r_o = _qr_cores(*concat_heads(layer.w_v, layer.w_o))
    gates = torch.rand(1, 1, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    gates = gates / gates.sum(-1, keepdim=True)
    core = (r_o * gates.repeat_interleave(3, dim=-1)[0, 0]) @ r_v.mT
    s = torch.linalg.svdvals(core)
    exact_gap = F.isometry_gap(s, rank=6).item()
    gaps = torch.stack(
        [
            _edge_gaps_by_lanczos(gates, r_v, r_o, 3, 6, 6, torch.Generator().manual_seed(seed)).squeeze()
            for seed in range(1000)
        ]
    )
    sums = (1 - gaps**2).sqrt() * (6 * (s**2).sum()).sqrt()  # back from the gap to sum s
    standard_error = sums.std().item() / 1000**0.5
    assert sums.mean().item() == pytest.approx(s.sum().item(), abs=4 * standard_error)
    assert gaps.mean().item() == pytest.approx(exact_gap, abs=0.02)  # through the square root: -0.011 at r = 6
