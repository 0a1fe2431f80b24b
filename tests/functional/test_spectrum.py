import numpy as np
import pytest
import scipy.sparse.linalg as spla
import torch
from scipy.optimize import linear_sum_assignment

import connmon.functional as F
import connmon.functional._causal
import connmon.functional.spectrum as spectrum_module
from connmon._linalg.heads import concat_heads
from connmon._linalg.krylov import KrylovResult, certified, krylov_schur
from connmon.functional.operator import head_space_matvec, rmatvec, walk_part
from tests.functional import reference as ref


def assert_same_eigenvalues(got: torch.Tensor, expected: np.ndarray, which: str = "LM", atol: float = 1e-9):
    """got: the first k by `which`; expected: all eigenvalues. Compare the keys exactly and the values as a set."""
    got = got.numpy().astype(np.complex128)
    key = np.abs if which == "LM" else np.real
    want = np.sort(key(expected))[::-1][: len(got)]
    np.testing.assert_allclose(key(got), want, atol=atol, rtol=atol)
    closed = np.concatenate([expected, expected.conj()])  # M is real: conjugates of eigenvalues are eigenvalues
    for value in got:  # each found eigenvalue is an eigenvalue (conjugate pairs make the order ambiguous)
        assert np.abs(closed - value).min() <= atol * max(1.0, abs(value)) * 10


def test_connection_operator_is_sum_of_krons(layer):
    np.testing.assert_allclose(
        F.connection_operator(layer.attn, layer.w_v, layer.w_o).numpy(), ref.connection_operator(*layer.np), atol=1e-15
    )


def test_connection_matvec_matches_dense_operator(layer):
    n, d = layer.attn.shape[-1], layer.w_v.shape[-1]
    x = torch.randn(3, n, d, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    dense = ref.connection_operator(*layer.np)
    got = F.connection_matvec(layer.attn, layer.w_v, layer.w_o, x)
    for b in range(3):
        np.testing.assert_allclose(got[b].numpy().ravel(), dense @ x[b].numpy().ravel(), atol=1e-13)
    adjoint = rmatvec(layer.attn, *concat_heads(layer.w_v, layer.w_o), x[0])
    np.testing.assert_allclose(adjoint.numpy().ravel(), dense.T @ x[0].numpy().ravel(), atol=1e-13)


@pytest.mark.parametrize("causal", [False, True])
def test_connection_matvec_reconstructs_multihead_attention(causal):
    """The paper's identity: an nn.MultiheadAttention output is M(X) + c, c from the biases."""
    torch.manual_seed(0)
    d, heads, n = 12, 3, 7
    mha = torch.nn.MultiheadAttention(d, heads, batch_first=True, dtype=torch.float64)
    torch.nn.init.normal_(mha.in_proj_bias)
    torch.nn.init.normal_(mha.out_proj.bias)
    x = torch.randn(1, n, d, dtype=torch.float64)
    mask = torch.ones(n, n, dtype=torch.bool).triu(1) if causal else None  # True blocks, in nn.MHA
    out, attn = mha(x, x, x, attn_mask=mask, need_weights=True, average_attn_weights=False)
    d_h = d // heads
    w_v = mha.in_proj_weight[2 * d :].reshape(heads, d_h, d)
    w_o = mha.out_proj.weight.reshape(d, heads, d_h).transpose(0, 1)
    c = w_o @ mha.in_proj_bias[2 * d :].reshape(heads, d_h, 1)
    c = c.sum(0).squeeze(-1) + mha.out_proj.bias
    walk = F.connection_matvec(attn[0], w_v, w_o, x[0]) + c
    assert torch.linalg.norm(out[0] - walk) / torch.linalg.norm(out[0]) < 1e-13


@pytest.mark.parametrize("deflate", [False, True])
def test_connection_spectrum_auto_and_dense(layer, deflate):
    expected = ref.spectrum(*layer.np, deflate=deflate)
    for which in ("LM", "LR"):
        found = F.connection_spectrum(
            layer.attn, layer.w_v, layer.w_o, k=5, which=which, return_info=True, deflate=deflate
        )
        assert found.method == ("kron" if layer.attn.shape[0] == 1 else "dense")
        assert_same_eigenvalues(found.eigenvalues, expected, which)
        dense = F.connection_spectrum(
            layer.attn, layer.w_v, layer.w_o, k=5, which=which, method="dense", deflate=deflate
        )
        assert_same_eigenvalues(dense, expected, which)


@pytest.mark.parametrize("deflate", [False, True])
def test_connection_spectrum_krylov_small(layer, deflate):
    expected = ref.spectrum(*layer.np, deflate=deflate)
    for which in ("LM", "LR"):
        found = F.connection_spectrum(
            layer.attn, layer.w_v, layer.w_o, k=4, which=which, method="krylov", return_info=True, deflate=deflate
        )
        assert bool(found.converged.all()), (which, deflate)  # every case, the causal ones too, is found
        assert_same_eigenvalues(found.eigenvalues, expected, which, atol=1e-7)


@pytest.mark.parametrize("deflate", [False, True])
def test_connection_spectrum_causal_path_is_exact(deflate):
    layer = ref.make_layer(heads=3, n=9, d_h=2, d=5, mask="padded", seed=4)  # H d_h > d: the d x d blocks
    narrow = ref.make_layer(heads=2, n=9, d_h=2, d=6, mask="causal", seed=5)  # H d_h < d: the small core
    for case in (layer, narrow):
        expected = ref.spectrum(*case.np, deflate=deflate)
        for which in ("LM", "LR"):
            got = F.connection_spectrum(
                case.attn, case.w_v, case.w_o, k=6, which=which, method="causal", deflate=deflate
            )
            assert_same_eigenvalues(got, expected, which)


@pytest.mark.parametrize("heads", [2, 3])  # H d_h = 4 < d (the core) and H d_h = d (the d x d blocks)
@pytest.mark.parametrize("deflate", [False, True])
def test_causal_path_skips_blocks_that_cannot_enter_the_answer(heads, monkeypatch, deflate):
    layer = ref.make_layer(heads=heads, n=100, d_h=2, d=6, mask="causal", sharpness=3.0, seed=heads)
    blockwise, dense = ref.causal_spectrum(*layer.np, deflate=deflate), ref.spectrum(*layer.np, deflate=deflate)
    solved = []
    counted = lambda m: solved.append(m.shape[0]) or torch.linalg.eigvals(m)  # noqa: E731
    monkeypatch.setattr(connmon.functional._causal, "eigvals", counted)
    for which in ("LM", "LR"):
        got = F.connection_spectrum(
            layer.attn, layer.w_v, layer.w_o, k=8, which=which, method="causal", deflate=deflate
        )
        assert_same_eigenvalues(got, blockwise, which)
        assert_same_eigenvalues(got, dense, which, atol=1e-6)  # dense eig of a non-normal 600 x 600 M: ~1e-8
    assert sum(solved) < 18  # of 2 x 100: 10-15 (13-19 without the shifted LR bound, 34-50 with norm bounds alone)


@pytest.mark.parametrize("deflate", [False, True])
def test_causal_path_finds_the_rightmost_of_a_left_half_plane_spectrum(deflate):
    # T_h = -(a positive definite map): every block's eigenvalues are negative, so the bar of the rightmost request
    # is negative and the bounds' round-off margin must widen them, not shrink them
    layer = ref.make_layer(heads=3, n=60, d_h=4, d=12, mask="causal", sharpness=3.0, seed=11)
    w_o = -layer.w_v.mT @ (torch.eye(4, dtype=layer.w_v.dtype) + 0.1)  # T_h = -V_h^T (I + 0.1) V_h
    expected = ref.causal_spectrum(layer.attn.numpy(), layer.w_v.numpy(), w_o.numpy(), deflate=deflate)
    assert expected.real.max() < 0
    got = F.connection_spectrum(layer.attn, layer.w_v, w_o, k=3, which="LR", method="causal", deflate=deflate)
    assert_same_eigenvalues(got, expected, "LR")


@pytest.mark.parametrize("deflate", [False, True])
def test_connection_spectrum_kron_path_is_exact(deflate):
    layer = ref.make_layer(heads=1, n=7, d_h=3, d=5, mask="causal", seed=2)
    expected = ref.spectrum(*layer.np, deflate=deflate)
    got = F.connection_spectrum(layer.attn, layer.w_v, layer.w_o, k=7, method="kron", deflate=deflate)
    assert_same_eigenvalues(got, expected)


def scipy_eigs(layer, k, which, tol, deflate=False):
    attn, w_v, w_o = layer.np
    dense = ref.walk_operator(attn, w_v, w_o) if deflate else ref.connection_operator(attn, w_v, w_o)
    size = dense.shape[0]
    operator = spla.LinearOperator((size, size), matvec=lambda v: dense @ v, dtype=np.float64)
    values = spla.eigs(operator, k=k, which=which, tol=tol, v0=np.random.default_rng(0).standard_normal(size))[0]
    return values / ref.transport_scale(w_v, w_o)


@pytest.mark.parametrize("which", ["LM", "LR"])
@pytest.mark.parametrize("case", ["mha", "gqa", "one_hot"])
@pytest.mark.parametrize("deflate", [False, True])
def test_krylov_matches_scipy_arpack_above_dense_size(which, case, deflate):
    options = {"mha": dict(), "gqa": dict(kv_heads=2), "one_hot": dict(sharpness=20.0)}[case]
    layer = ref.make_layer(heads=4, n=32, d_h=6, d=24, seed=9, **options)  # n d = 768 > 512
    restarts = 100 if which == "LM" else 1000  # the rightmost 8 of a non-normal operator take ARPACK ~3000 matvecs
    found = F.connection_spectrum(
        layer.attn, layer.w_v, layer.w_o, k=8, which=which, max_restarts=restarts, return_info=True, deflate=deflate
    )
    assert found.method == "krylov"
    assert bool(found.converged.all())
    assert (found.residuals <= 1e-10 * found.eigenvalues.abs()).all()
    assert 0 < found.num_matvecs.item() <= 30 + restarts * 30
    # ARPACK asked for 12: with k = 8 it may end on the far side of a conjugate pair that the 8th value splits, and
    # with 10 scipy 1.17's ARPACK (OpenBLAS, Haswell kernels) missed the 8th pair of the mha walk part, which the
    # dense spectrum below and connmon agree on
    assert_same_eigenvalues(
        found.eigenvalues, scipy_eigs(layer, 12, which, tol=1e-12, deflate=deflate), which, atol=1e-8
    )
    assert_same_eigenvalues(found.eigenvalues, ref.spectrum(*layer.np, deflate=deflate), which, atol=1e-8)


@pytest.mark.parametrize("sharpness", [1.0, 10.0, 40.0])
@pytest.mark.parametrize("deflate", [False, True])
def test_krylov_finds_the_top_eigenvalues_of_non_normal_layers(sharpness, deflate):
    """Sharp attention makes M strongly non-normal, where Krylov methods can miss eigenvalues near the k-th."""
    for seed in range(6):
        layer = ref.make_layer(heads=4, n=32, d_h=6, d=24, kv_heads=[4, 2][seed % 2], sharpness=sharpness, seed=seed)
        got = F.connection_spectrum(layer.attn, layer.w_v, layer.w_o, k=8, method="krylov", deflate=deflate)
        want = np.sort(np.abs(ref.spectrum(*layer.np, deflate=deflate)))[::-1][:8]
        np.testing.assert_allclose(np.sort(got.abs().numpy())[::-1], want, rtol=1e-7)


@pytest.mark.parametrize("deflate", [False, True])
def test_krylov_float32_and_determinism(deflate):
    layer = ref.make_layer(heads=4, n=32, d_h=6, d=24, seed=1)
    expected = ref.spectrum(*layer.np, deflate=deflate)
    attn, w_v, w_o = (t.float() for t in (layer.attn, layer.w_v, layer.w_o))
    first = F.connection_spectrum(attn, w_v, w_o, k=8, return_info=True, deflate=deflate)
    assert first.eigenvalues.dtype == torch.complex64 and bool(first.converged.all())
    np.testing.assert_allclose(np.abs(first.eigenvalues.numpy()), np.sort(np.abs(expected))[::-1][:8], rtol=5e-5)
    again = F.connection_spectrum(attn, w_v, w_o, k=8, deflate=deflate)
    assert torch.equal(first.eigenvalues, again)
    other_seed = F.connection_spectrum(attn, w_v, w_o, k=8, seed=3, deflate=deflate)
    torch.testing.assert_close(other_seed.abs(), again.abs(), rtol=5e-5, atol=1e-6)


@pytest.mark.parametrize("deflate", [False, True])
def test_krylov_reports_unconverged_residuals_when_bounded(deflate):
    layer = ref.make_layer(heads=4, n=32, d_h=6, d=24, seed=1)
    found = F.connection_spectrum(
        layer.attn,
        layer.w_v,
        layer.w_o,
        k=8,
        method="krylov",
        max_restarts=0,
        ncv=10,
        return_info=True,
        deflate=deflate,
    )
    # two solves, the second with twice the basis; neither converged, so no third start (it would run out too)
    assert found.num_matvecs.item() == 10 + 20
    assert not bool(found.converged.all())
    assert (found.residuals > 0).any() and found.eigenvalues.isfinite().all()


@pytest.mark.parametrize("deflate", [False, True])
def test_krylov_low_rank_operator_breakdown(deflate):
    layer = ref.make_layer(heads=2, n=5, d_h=1, d=8, seed=2)  # rank M <= n H d_h = 10 of n d = 40
    found = F.connection_spectrum(
        layer.attn, layer.w_v, layer.w_o, k=4, method="krylov", return_info=True, deflate=deflate
    )
    assert bool(found.converged.all())
    assert_same_eigenvalues(found.eigenvalues, ref.spectrum(*layer.np, deflate=deflate), atol=1e-8)


@pytest.mark.parametrize("deflate", [False, True])
def test_auto_picks_causal_above_dense_size(deflate):
    layer = ref.make_layer(heads=4, n=32, d_h=6, d=24, mask="padded", seed=3)  # 22 valid tokens: 528 > 512
    found = F.connection_spectrum(layer.attn, layer.w_v, layer.w_o, k=8, return_info=True, deflate=deflate)
    assert found.method == "causal"
    assert_same_eigenvalues(found.eigenvalues, ref.spectrum(*layer.np, deflate=deflate))


@pytest.mark.parametrize("deflate", [False, True])
def test_spectrum_batched_with_shared_weights(deflate):
    layers = [ref.make_layer(heads=2, n=6, d_h=2, d=4, seed=s) for s in range(3)]
    attn = torch.stack([layer.attn for layer in layers])
    w_v, w_o = layers[0].w_v, layers[0].w_o
    for method in ("dense", "krylov"):
        batched = F.connection_spectrum(attn, w_v, w_o, k=3, method=method, deflate=deflate)
        assert batched.shape == (3, 3)
        for b in range(3):
            expected = ref.spectrum(attn[b].numpy(), w_v.numpy(), w_o.numpy(), deflate=deflate)
            assert_same_eigenvalues(batched[b], expected, atol=1e-8)


@pytest.mark.parametrize("method", ["auto", "dense", "causal", "krylov"])
@pytest.mark.parametrize("deflate", [False, True])
def test_connection_spectra_equal_the_two_separate_solves(method, deflate):
    for case in (ref.make_layer(heads=3, n=9, d_h=2, d=6, mask="causal", seed=4), ref.make_layer(heads=1, n=5, d=4)):
        args = (case.attn, case.w_v, case.w_o)
        both = F.connection_spectra(*args, k=4, method=method, deflate=deflate)
        torch.testing.assert_close(both.largest, F.connection_spectrum(*args, k=4, method=method, deflate=deflate))
        rightmost = F.connection_spectrum(*args, k=1, which="LR", method=method, deflate=deflate)[..., 0]
        torch.testing.assert_close(both.rightmost, rightmost)
        assert bool(both.largest_converged.all()) and bool(both.rightmost_converged.all())
    large = ref.make_layer(heads=4, n=40, d_h=4, d=16, mask="causal", seed=7)  # auto: the causal path, pruned
    both = F.connection_spectra(large.attn, large.w_v, large.w_o, k=8, deflate=deflate)
    expected = ref.causal_spectrum(*large.np, deflate=deflate)
    assert_same_eigenvalues(both.largest, expected)
    assert both.rightmost.real.item() == pytest.approx(expected.real.max(), abs=1e-10)


def test_connection_spectra_flag_krylov_solves_out_of_restarts():
    # near-uniform attention: the walk part's eigenvalues crowd a small disk (M's top, T_bar's, would converge at once)
    layer = ref.make_layer(heads=4, n=40, d_h=4, d=16, sharpness=0.3, seed=3)
    args, deflate = (layer.attn, layer.w_v, layer.w_o), True
    cut = F.connection_spectra(*args, k=8, deflate=deflate, max_restarts=0)
    assert not bool(cut.largest_converged[..., 0].any())
    assert bool(cut.rightmost.isnan().all()) and not bool(cut.rightmost_converged.any())  # LR not attempted
    found = F.connection_spectra(*args, k=8, deflate=deflate, max_restarts=300)
    assert bool(found.largest_converged.all()) and bool(found.rightmost_converged.all())
    assert_same_eigenvalues(found.largest, ref.spectrum(*layer.np, deflate=deflate), atol=1e-8)


def test_the_rightmost_is_solved_for_only_where_the_radius_converged(monkeypatch):
    clustered = ref.make_layer(heads=4, n=40, d_h=4, d=16, sharpness=0.3, seed=3)
    sharp = ref.make_layer(heads=4, n=40, d_h=4, d=16, sharpness=3.0, seed=4)
    weights = (clustered.w_v, clustered.w_o)
    solves = []

    def counted(*args, **kwargs):
        solves.append(kwargs["which"])
        return krylov_schur(*args, **kwargs)

    monkeypatch.setattr(spectrum_module, "krylov_schur", counted)
    alone = F.connection_spectra(sharp.attn, *weights, k=8, max_restarts=2)
    alone_solves, solves[:] = solves.count("LR"), []
    both = F.connection_spectra(torch.stack([clustered.attn, sharp.attn]), *weights, k=8, max_restarts=2)
    assert both.largest_converged[:, 0].tolist() == [False, True]
    assert bool(both.rightmost[0].isnan()) and both.rightmost_converged.tolist() == [False, True]
    assert alone_solves > 0 and solves.count("LR") == alone_solves  # the clustered layer's LR solve is not run
    assert bool(both.rightmost[1] == alone.rightmost)


@pytest.mark.parametrize("deflate", [False, True])
def test_spectral_radius_and_laplacian_gap(layer, deflate):
    expected = ref.spectrum(*layer.np, deflate=deflate)
    radius = F.connection_spectral_radius(layer.attn, layer.w_v, layer.w_o, deflate=deflate)
    assert radius.item() == pytest.approx(np.abs(expected).max(), rel=1e-10)
    gap = F.connection_laplacian_gap(layer.attn, layer.w_v, layer.w_o, deflate=deflate)
    assert gap.item() == pytest.approx(1 - expected.real.max(), abs=1e-10)


@pytest.mark.parametrize("deflate", [False, True])
def test_operator_norm_all_methods(layer, deflate):
    expected = ref.operator_norm(*layer.np, deflate=deflate)
    methods = ["auto", "dense", "krylov"] + (["kron"] if layer.attn.shape[0] == 1 else [])
    for method in methods:
        got = F.connection_operator_norm(layer.attn, layer.w_v, layer.w_o, method=method, deflate=deflate)
        assert got.item() == pytest.approx(expected, rel=1e-8), method


@pytest.mark.parametrize("deflate", [False, True])
def test_operator_norm_krylov_above_dense_size(deflate):
    layer = ref.make_layer(heads=4, n=32, d_h=6, d=24, seed=5)
    got = F.connection_operator_norm(layer.attn, layer.w_v, layer.w_o, deflate=deflate)
    assert got.item() == pytest.approx(ref.operator_norm(*layer.np, deflate=deflate), rel=1e-8)


@pytest.mark.parametrize("deflate", [False, True])
@pytest.mark.parametrize("lanczos_steps", [24, 2])  # 2: no layer converges, all go to the restarted solver
def test_operator_norm_of_a_batch_by_lanczos_and_its_fallback(deflate, lanczos_steps, monkeypatch):
    monkeypatch.setattr(F.spectrum, "_NORM_LANCZOS_STEPS", lanczos_steps)
    layers = [ref.make_layer(heads=4, n=24, d_h=6, d=24, seed=seed, mask=mask) for seed, mask in
              [(1, "none"), (2, "causal"), (3, "none")]]  # fmt: skip
    attn = torch.stack([layer.attn for layer in layers])
    w_v, w_o = torch.stack([layer.w_v for layer in layers]), torch.stack([layer.w_o for layer in layers])
    got = F.connection_operator_norm(attn, w_v, w_o, deflate=deflate)
    expected = [ref.operator_norm(*layer.np, deflate=deflate) for layer in layers]
    assert got.tolist() == pytest.approx(expected, rel=1e-8)
    shared = F.connection_operator_norm(attn, w_v[0], w_o[0], deflate=deflate)  # weights broadcast over the batch
    for a, value in zip(attn, shared, strict=True):
        assert value.item() == pytest.approx(F.connection_operator_norm(a, w_v[0], w_o[0], deflate=deflate).item())


@pytest.mark.parametrize("deflate", [False, True])
def test_zero_transport_has_zero_normalized_operator(deflate):
    attn = torch.full((2, 3, 3), 1 / 3)
    w_v, w_o = torch.randn(2, 2, 4), torch.zeros(2, 4, 2)
    assert F.connection_spectral_radius(attn, w_v, w_o, deflate=deflate).item() == 0
    assert F.connection_laplacian_gap(attn, w_v, w_o, deflate=deflate).item() == 1
    assert F.connection_operator_norm(attn, w_v, w_o, deflate=deflate).item() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_power_radius_bounds_hold_and_are_tight(dtype):
    from connmon.functional._causal import POWER_MARGIN, power_radius_bounds

    gen = torch.Generator().manual_seed(0)
    for size, spread in [(6, 1.0), (32, 1.0), (128, 1.0), (32, 30.0)]:
        scales = torch.logspace(0, torch.log10(torch.tensor(spread)), size, dtype=torch.float64)
        for _ in range(10):  # random, and strongly non-normal: a random matrix conjugated by badly scaled axes
            blocks = torch.randn(8, size, size, generator=gen, dtype=torch.float64)
            blocks = scales[:, None] * blocks / scales[None, :]
            blocks[0] = torch.triu(blocks[0], diagonal=1)  # nilpotent: radius 0
            blocks[1] = 0  # the zero block
            radius = torch.linalg.eigvals(blocks).abs().amax(dim=-1)
            bound = power_radius_bounds(blocks.to(dtype)).double()
            assert (bound * (1 + POWER_MARGIN) >= radius).all()
            assert (bound[2:] <= 1.5 * radius[2:]).all()  # the norm bounds are 2-4x on such blocks
            assert bound[1] == 0


def test_power_radius_bounds_with_a_floor_stay_bounds_and_stop_early():
    from connmon.functional._causal import POWER_MARGIN, power_radius_bounds

    gen = torch.Generator().manual_seed(1)
    blocks = torch.randn(12, 16, 16, generator=gen, dtype=torch.float64) / 4
    blocks[:4] *= 8  # four large blocks among small ones
    radius = torch.linalg.eigvals(blocks).abs().amax(dim=-1)
    full = power_radius_bounds(blocks)
    floor = torch.full((12,), float(radius[4:].max()) * 2)  # the small blocks can drop after a squaring or two
    floored = power_radius_bounds(blocks, floor=floor)
    assert (floored * (1 + POWER_MARGIN) >= radius).all()
    assert torch.equal(floored[:4], full[:4])  # the blocks above their floor get every squaring
    assert (floored[4:] < floor[4:]).all() and (floored[4:] > full[4:]).any()  # the others stop once below it
    assert power_radius_bounds(blocks, floor=torch.full((12,), float("inf"))).equal(torch.linalg.matrix_norm(blocks))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_real_part_bounds_hold_and_are_tighter(dtype):
    from connmon.functional._causal import POWER_MARGIN, power_radius_bounds, real_part_bounds

    gen = torch.Generator().manual_seed(2)
    for size, spread, shift in [(8, 1.0, 0.0), (32, 1.0, 0.0), (32, 30.0, 0.0), (32, 1.0, -3.0), (64, 1.0, 0.0)]:
        scales = torch.logspace(0, torch.log10(torch.tensor(spread)), size, dtype=torch.float64)
        blocks = torch.randn(10, size, size, generator=gen, dtype=torch.float64) / size**0.5
        blocks = scales[:, None] * blocks / scales[None, :] + shift * torch.eye(size, dtype=torch.float64)
        blocks[0] = torch.triu(blocks[0], diagonal=1)  # nilpotent: every eigenvalue 0
        eig = torch.linalg.eigvals(blocks)
        rightmost = eig.real.amax(dim=-1)
        radius = power_radius_bounds(blocks.to(dtype)).double()
        bound = real_part_bounds(blocks.to(dtype), radius, radius, float(rightmost.min()) - 1).double()
        assert (bound + POWER_MARGIN * bound.abs() >= rightmost - 1e-6).all()
        assert (bound <= radius).all()
        gaps = (bound - rightmost)[1:] / eig.abs().amax(dim=-1)[1:]
        assert gaps.median() < min(0.1, ((radius - rightmost)[1:] / eig.abs().amax(dim=-1)[1:]).median())
        # a bar above every bound: the shifted squaring stops early, and the bounds still hold
        early = real_part_bounds(blocks.to(dtype), radius, radius, float(radius.max()) * 10).double()
        assert (early + POWER_MARGIN * early.abs() >= rightmost - 1e-6).all()


def test_power_radius_bounds_are_nan_for_non_finite_blocks():
    from connmon.functional._causal import power_radius_bounds

    blocks = torch.randn(3, 5, 5)
    blocks[1, 2, 3] = float("nan")
    blocks[2, 0, 0] = float("inf")
    assert power_radius_bounds(blocks).isnan().tolist() == [False, True, True]


@pytest.mark.parametrize(("heads", "d_h", "d"), [(2, 2, 6), (3, 2, 6), (4, 4, 8), (1, 3, 5)])
def test_causal_block_bounds_hold_for_every_token(heads, d_h, d):
    from connmon.functional._causal import block_norms, block_radius_bounds

    for seed in range(20):
        layer = ref.make_layer(heads=heads, n=12, d_h=d_h, d=d, mask="causal", sharpness=2.0, seed=seed)
        attn, w_v, w_o = layer.np
        self_weight = layer.attn.diagonal(dim1=-2, dim2=-1).mT  # (n, H)
        bounds = block_radius_bounds(self_weight, block_norms(layer.w_v, layer.w_o)).numpy()
        for i in range(12):  # the block D_i = sum_h A^h_ii T_h, from the weights directly
            block = sum(attn[h, i, i] * w_o[h] @ w_v[h] for h in range(heads))
            assert np.abs(np.linalg.eigvals(block)).max() <= bounds[i] * (1 + 1e-10) + 1e-12


def test_walk_part_and_constant_fields_make_up_the_whole_spectrum(layer):
    attn, w_v, w_o = layer.np
    n, d = attn.shape[-1], w_v.shape[-1]
    valid = int((attn != 0).any(axis=(0, 1)).sum())
    full = F.connection_spectrum(layer.attn, layer.w_v, layer.w_o, k=n * d, deflate=False).numpy()
    walk = F.connection_spectrum(layer.attn, layer.w_v, layer.w_o, k=(n - 1) * d).numpy()
    assert np.isnan(walk[(valid - 1) * d :]).all()  # a padded sequence's walk part has (m - 1) d eigenvalues
    union = np.concatenate([walk[: (valid - 1) * d], ref.ov_spectrum(w_v, w_o), np.zeros((n - valid) * d)])
    np.testing.assert_allclose(np.sort_complex(np.round(full, 8)), np.sort_complex(np.round(union, 8)), atol=1e-7)
    radius = F.ov_spectral_radius(layer.w_v, layer.w_o).item()
    assert radius == pytest.approx(np.abs(ref.ov_spectrum(w_v, w_o)).max(), rel=1e-10)
    assert np.abs(full).max() == pytest.approx(max(np.abs(walk[: (valid - 1) * d]).max(), radius), rel=1e-10)


def test_the_walk_part_moves_with_the_attention_and_the_constant_fields_do_not():
    first, second = (ref.make_layer(heads=4, n=8, d_h=2, d=8, seed=s) for s in (0, 1))
    w_v, w_o = first.w_v, first.w_o  # the same weights, two inputs
    walks = [F.connection_spectrum(layer.attn, w_v, w_o, k=4) for layer in (first, second)]
    fulls = [F.connection_spectrum(layer.attn, w_v, w_o, k=4, deflate=False) for layer in (first, second)]
    assert not torch.allclose(walks[0].abs(), walks[1].abs(), rtol=1e-3)
    rho = F.ov_spectral_radius(w_v, w_o)
    for full in fulls:  # these weights put the constant-field part on top: the full radius ignores the input
        assert full.abs()[0].item() == pytest.approx(rho.item(), rel=1e-10)


def test_walk_basis_is_orthonormal_mean_zero_and_off_padding():
    layer = ref.make_layer(heads=2, n=9, d_h=2, d=4, mask="padded", seed=0)
    basis = F.walk_basis(layer.attn)
    valid = (layer.attn != 0).any(0).any(0)
    m = int(valid.sum())
    used, unused = basis[:, : m - 1], basis[:, m - 1 :]
    torch.testing.assert_close(used.mT @ used, torch.eye(m - 1, dtype=used.dtype))
    assert unused.abs().max() == 0 and used[~valid].abs().max() == 0
    torch.testing.assert_close(used.sum(0), torch.zeros(m - 1, dtype=used.dtype), atol=1e-12, rtol=0)


def test_one_token_has_no_walk_part():
    attn, w_v, w_o = torch.ones(2, 1, 1), torch.randn(2, 3, 6), torch.randn(2, 6, 3)
    with pytest.raises(ValueError, match=r"k must satisfy 1 <= k <= \(n-1\)\*d = 0, got k=1"):
        F.connection_spectrum(attn, w_v, w_o, k=1)
    assert F.connection_operator_norm(attn, w_v, w_o).isnan()


@pytest.mark.parametrize("d_h, d", [(4, 16), (8, 16), (3, 5)])
def test_numerical_abscissa_of_head_maps_matches_their_symmetric_part(d_h, d):
    from connmon.functional._causal import numerical_abscissa

    gen = torch.Generator().manual_seed(d_h * d)
    w_v, w_o = torch.randn(2, 3, d_h, d, generator=gen).double(), torch.randn(2, 3, d, d_h, generator=gen).double()
    maps = w_o @ w_v
    expected = np.linalg.eigvalsh(((maps + maps.mT) / 2).numpy())[..., -1]
    np.testing.assert_allclose(numerical_abscissa(w_v, w_o).numpy(), expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("mask", ["none", "causal"])
def test_a_given_transport_scale_is_the_one_used(mask):
    layer = ref.make_layer(heads=3, n=12, d_h=2, d=8, mask=mask, seed=5)
    args = (layer.attn.unsqueeze(0), layer.w_v, layer.w_o)
    scale = F.transport_scale(layer.w_v, layer.w_o)
    spectra, given = F.connection_spectra(*args, k=4), F.connection_spectra(*args, k=4, scale=scale)
    assert torch.equal(spectra.largest, given.largest) and torch.equal(spectra.rightmost, given.rightmost)
    assert torch.equal(F.connection_operator_norm(*args), F.connection_operator_norm(*args, scale=scale))
    assert torch.equal(F.ov_spectral_radius(layer.w_v, layer.w_o), F.ov_spectral_radius(*args[1:], scale=scale))
    doubled = 2 * scale  # a cache, not a second definition: the value passed is the s that divides M
    assert torch.allclose(F.connection_spectra(*args, k=4, scale=doubled).largest, spectra.largest / 2)
    assert torch.allclose(F.connection_operator_norm(*args, scale=doubled), F.connection_operator_norm(*args) / 2)
    for method in ("dense", "krylov"):
        found = F.connection_spectrum(*args, k=2, method=method, scale=doubled)
        assert torch.allclose(found, F.connection_spectrum(*args, k=2, method=method) / 2, rtol=1e-5)


def near_uniform_layer(seed, n=32, d=32, heads=8):
    """Softmax of Gaussian scores at temperature 2: the walk part's top moduli are clustered within 1e-3."""
    g = torch.Generator().manual_seed(seed)
    attn = (torch.randn(heads, n, n, generator=g) / 2).softmax(-1)
    w_v = torch.randn(heads, d // heads, d, generator=g) / d**0.5
    w_o = torch.randn(heads, d, d // heads, generator=g) / d**0.5
    return attn, w_v, w_o


def test_values_of_clustered_layers_are_certified_in_order_a_third_start_arbitrating(monkeypatch):
    """A residual test shows a Ritz value is near some eigenvalue, not that none above it was skipped: solves from
    independent starts certify the order; on these layers two often disagree, and a third start settles it."""
    solves = []

    def counted(*args, **kwargs):
        solves.append(kwargs["seed"])
        return krylov_schur(*args, **kwargs)

    monkeypatch.setattr(spectrum_module, "krylov_schur", counted)
    arbitrated = 0
    for seed in range(8):
        attn, w_v, w_o = near_uniform_layer(seed, n=40)  # at n = 32, two starts certified all 8 values of all 8
        dense = F.connection_spectrum(attn.double(), w_v.double(), w_o.double(), k=16, method="dense")
        moduli = dense.abs().sort(descending=True).values
        solves.clear()
        found = F.connection_spectrum(attn, w_v, w_o, k=8, return_info=True)
        arbitrated += len(solves) == 3
        assert bool(found.converged.all()), seed
        torch.testing.assert_close(found.eigenvalues.abs().double(), moduli[:8], rtol=1e-4, atol=0, msg=str(seed))
    assert arbitrated > 0  # without the third start some of these orders would be reported uncertain


def test_a_value_counts_as_certified_when_two_solves_found_it_and_every_value_above_it():
    def result(values, converged=None):
        values = np.array(values, dtype=complex)
        converged = np.ones(len(values), bool) if converged is None else np.array(converged)
        return KrylovResult(values, np.full(len(values), 1e-9), converged, 10, 1)

    skipped_4, found_4 = result([5, 3, 2]), result([5, 4, 3])
    merged = certified([skipped_4, found_4], 3, "LM", tol=1e-5)
    assert merged.eigenvalues.real.tolist() == [5, 4, 3] and merged.converged.tolist() == [True, False, False]
    merged = certified([skipped_4, found_4, result([5, 4, 3.5])], 3, "LM", tol=1e-5)  # 3.5: one solve only
    assert merged.eigenvalues.real.tolist() == [5, 4, 3.5] and merged.converged.tolist() == [True, True, False]
    assert merged.num_matvecs == 30 and merged.num_restarts == 3
    merged = certified([skipped_4, found_4, result([5, 4, 9], [True, True, False])], 3, "LM", tol=1e-5)
    assert merged.eigenvalues.real.tolist() == [5, 4, 3] and merged.converged.all()  # 9 never converged
    lonely = certified([result([1, 0.5], [False, False]), result([1], [True])], 2, "LM", tol=1e-5)
    assert lonely.eigenvalues.real.tolist() == [1, 1] and not lonely.converged.any()  # the first solve fills in


def test_the_largest_eigenvalues_settle_the_rightmost_when_one_reaches_the_smallest_modulus(monkeypatch):
    """Every eigenvalue outside the certified largest has ``Re <= |lambda_k|``: no LR solve when one of them reaches
    it (T_h = O_h O_h^T: a real positive eigenvalue leads), the LR solve when none does (T_h = O_h J_h O_h^T, J_h
    antisymmetric: the largest eigenvalues are nearly imaginary)."""
    whiches = []

    def counted(*args, **kwargs):
        whiches.append(kwargs["which"])
        return krylov_schur(*args, **kwargs)

    def layer(seed, rotation):
        g = torch.Generator().manual_seed(seed)
        attn = (3 * torch.randn(4, 24, 24, generator=g)).softmax(-1)
        w_o = torch.randn(4, 32, 8, generator=g) / 32**0.5
        core = torch.randn(4, 8, 8, generator=g)
        core = core - core.mT if rotation else torch.eye(8)
        return attn, core @ w_o.mT, w_o  # n d = 768: the Krylov path

    def rightmost(attn, w_v, w_o):
        return F.connection_spectrum(attn.double(), w_v.double(), w_o.double(), k=1, which="LR", method="dense")[0]

    monkeypatch.setattr(spectrum_module, "krylov_schur", counted)
    lr_solves = {False: 0, True: 0}
    for seed in range(4):
        for rotation in (False, True):
            whiches.clear()
            found = F.connection_spectra(*layer(seed, rotation), k=8)
            lr_solves[rotation] += whiches.count("LR")
            assert bool(found.rightmost_converged), (seed, rotation)
            expected = rightmost(*layer(seed, rotation))
            torch.testing.assert_close(found.rightmost.to(expected.dtype), expected, rtol=1e-4, atol=1e-6)
    assert lr_solves[False] == 0 and lr_solves[True] > 0
    both = [torch.stack(pair) for pair in zip(layer(0, False), layer(0, True), strict=True)]
    whiches.clear()
    found = F.connection_spectra(*both, k=8)
    assert whiches.count("LR") == 2  # one certified LR solve, on the layer that needs it
    for index in range(2):
        expected = rightmost(*(t[index] for t in both))
        torch.testing.assert_close(found.rightmost[index].to(expected.dtype), expected, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("mask", ["none", "causal"])
def test_the_head_space_operator_has_the_walk_parts_eigenvalues(kv_heads, mask):
    """G F (what the Krylov solver applies where H d_h = d) against M = F G, both dense, float64."""
    layer = ref.make_layer(heads=4, kv_heads=kv_heads, n=7, d_h=3, d=12, mask=mask, seed=3)
    part = walk_part(layer.attn)
    v_cat, o_cat = concat_heads(layer.w_v, layer.w_o)
    size = part.shape[-1] * 12
    basis = torch.eye(size, dtype=torch.float64).view(size, part.shape[-1], 12)
    head_space = head_space_matvec(part, v_cat @ o_cat, basis).flatten(-2).T  # column j: G F of basis vector j
    expected = np.linalg.eigvals(ref.walk_operator(*layer.np))
    got = np.linalg.eigvals(head_space.numpy())
    rows, columns = linear_sum_assignment(np.abs(got[:, None] - expected[None, :]))  # the closest one-to-one match
    assert len(got) == len(expected)
    assert np.abs(got[rows] - expected[columns]).max() <= 1e-9 * np.abs(expected).max()
