"""Bad input: clear errors for wrong shapes and types, NaN (never a crash or a hang) for non-finite values."""

import math

import pytest
import torch

import connmon.functional as F
from tests.functional import reference as ref

NAN = float("nan")


def test_attention_shape_errors_name_the_shape():
    with pytest.raises(ValueError, match=r"attn must have shape \(\*, H, n, n\), got attn\(4, 4\)"):
        F.walk_matrix(torch.rand(4, 4))
    with pytest.raises(ValueError, match=r"equal last two dims, got attn\(2, 4, 5\)"):
        F.attention_entropy(torch.rand(2, 4, 5))
    with pytest.raises(ValueError, match=r"got P\(3, 4\)"):
        F.stochasticity_gap(torch.rand(3, 4))
    with pytest.raises(ValueError, match=r"logits must have shape"):
        F.max_attention_logit(torch.rand(3, 3))


def test_transport_shape_errors_name_the_shapes():
    expected = r"w_o must have shape \(\*, H, d, d_h\) = \(\*, 2, 8, 3\).*got w_o\(2, 3, 8\)"
    with pytest.raises(ValueError, match=expected):
        F.transport_singular_values(torch.rand(2, 3, 8), torch.rand(2, 3, 8))
    with pytest.raises(ValueError, match=r"d_h must not exceed"):
        F.transport_singular_values(torch.rand(2, 8, 3), torch.rand(2, 3, 8))
    with pytest.raises(ValueError, match=r"H=4 from attn; expand GQA"):
        F.connection_spectrum(torch.rand(4, 5, 5), torch.rand(2, 2, 8), torch.rand(2, 8, 2))
    with pytest.raises(ValueError, match=r"leading \(batch\) dims must broadcast"):
        F.edge_isometry_gap(torch.rand(3, 2, 4, 4), torch.rand(2, 2, 1, 4), torch.rand(2, 2, 4, 1))
    expected = r"x must have shape \(\*, n, d\) = \(\*, 4, 6\) to match attn and w_v, got x\(4, 5\)"
    with pytest.raises(ValueError, match=expected):
        F.connection_matvec(torch.rand(2, 4, 4), torch.rand(2, 3, 6), torch.rand(2, 6, 3), torch.rand(4, 5))
    with pytest.raises(ValueError, match=r"walk and walk_previous must be"):
        F.depth_drift(torch.rand(3, 3), torch.rand(4, 4))


def test_option_errors_echo_the_value():
    layer = ref.make_layer()
    args = (layer.attn, layer.w_v, layer.w_o)
    with pytest.raises(ValueError, match=r"k must satisfy 1 <= k <= \(n-1\)\*d = 40, got k=0"):
        F.connection_spectrum(*args, k=0)
    with pytest.raises(ValueError, match=r"k must satisfy 1 <= k <= n\*d = 48, got k=49"):
        F.connection_spectrum(*args, k=49, deflate=False)
    with pytest.raises(ValueError, match=r"which must be 'LM'.*got which='SM'"):
        F.connection_spectrum(*args, which="SM")
    with pytest.raises(ValueError, match=r"method='kron' needs a single head"):
        F.connection_spectrum(*args, method="kron")
    with pytest.raises(ValueError, match=r"method must be one of.*got method='arpack'"):
        F.connection_spectrum(*args, method="arpack")
    with pytest.raises(ValueError, match=r"reduction must be 'mean' or 'none', got reduction='sum'"):
        F.head_isometry_gap(layer.w_v, layer.w_o, reduction="sum")
    with pytest.raises(ValueError, match=r"num_samples must be a positive int or None, got num_samples=0"):
        F.edge_isometry_gap(*args, num_samples=0)
    with pytest.raises(ValueError, match="lanczos_steps"):
        F.edge_isometry_gap(*args, lanczos_steps=0)
    with pytest.raises(ValueError, match=r"above max_dim=10"):
        F.connection_operator(*args, max_dim=10)
    with pytest.raises(ValueError, match=r"num_squarings must be >= 0"):
        F.stationary_distribution(torch.eye(2), num_squarings=-1)
    with pytest.raises(ValueError, match=r"rank >= m"):
        F.isometry_gap(torch.ones(4), rank=2)


def test_type_errors():
    with pytest.raises(TypeError, match=r"attn must be a floating-point tensor.*got torch.int64"):
        F.walk_matrix(torch.ones(1, 2, 2, dtype=torch.long))
    with pytest.raises(TypeError, match=r"mask must be a bool tensor \(True = allowed key\), got torch.float32"):
        F.max_attention_logit(torch.rand(1, 2, 2), mask=torch.ones(2, 2))
    with pytest.raises(TypeError, match=r"P must be a torch.Tensor, got list"):
        F.stochasticity_gap([[1.0]])


def test_dtype_rule():
    layer = ref.make_layer()
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        expected = torch.float32
        attn, w_v, w_o = (t.to(dtype) for t in (layer.attn, layer.w_v, layer.w_o))
        assert F.walk_matrix(attn).dtype == expected
        assert F.head_isometry_gap(w_v, w_o).dtype == expected
        assert F.connection_spectrum(attn, w_v, w_o, k=2).dtype == torch.complex64
    assert F.connection_spectrum(layer.attn, layer.w_v, layer.w_o, k=2).dtype == torch.complex128
    assert F.edge_isometry_gap(layer.attn.float(), layer.w_v, layer.w_o.float()).dtype == torch.float64  # promoted
    assert F.edge_isometry_gap(layer.attn.float(), layer.w_v.float(), layer.w_o.float(), lanczos_steps=4).dtype == (
        torch.float32
    )


def poisoned(value: float):
    layer = ref.make_layer(heads=4, n=32, d_h=6, d=24, seed=2, dtype=torch.float32)  # above the dense size
    attn, w_v, w_o = layer.attn.clone(), layer.w_v.clone(), layer.w_o.clone()
    attn[1, 3, 3] = value  # on the diagonal, so that every solver path reads it
    return attn, w_v, w_o


@pytest.mark.parametrize("value", [NAN, math.inf])
def test_non_finite_attention_gives_nan_never_a_crash(value):
    attn, w_v, w_o = poisoned(value)
    P = F.walk_matrix(attn)
    walk_values = [
        F.stochasticity_gap(P),
        F.attention_entropy(attn),
        F.stationary_distribution(P).sum(),
        F.reversibility_gap(P),
        F.walk_spectral_gap(P),
        F.edge_isometry_gap(attn, w_v, w_o),
        F.edge_isometry_gap(attn, w_v, w_o, num_samples=2),
        F.edge_isometry_gap(attn, w_v, w_o, num_samples=2, lanczos_steps=8),
        F.depth_drift(P, P),
    ]
    for method in ("krylov", "dense", "causal"):
        walk_values.append(F.connection_spectrum(attn, w_v, w_o, k=3, method=method).abs().sum())
    walk_values.append(F.connection_operator_norm(attn, w_v, w_o))
    for got in walk_values:
        assert not torch.isfinite(got).all(), got


def test_non_finite_weights_give_nan():
    attn, w_v, w_o = poisoned(0.01)
    w_o[0, 0, 0] = NAN
    for got in (
        F.transport_singular_values(w_v, w_o)[0],
        F.head_isometry_gap(w_v, w_o),
        F.ov_isometry_gap(w_v, w_o),
        F.transport_scale(w_v, w_o),
        F.transport_symmetry_gap(w_v, w_o),
        F.connection_spectrum(attn, w_v, w_o, k=2).abs(),
        F.connection_spectrum(attn[:1], w_v[:1], w_o[:1], k=2).abs(),  # kron path
        F.connection_operator_norm(attn, w_v, w_o),
        F.connection_laplacian_gap(attn, w_v, w_o),
    ):
        assert torch.isnan(got).any(), got


def test_non_finite_weights_on_the_causal_path_give_nan():
    layer = ref.make_layer(heads=4, n=40, d_h=4, d=16, mask="causal", seed=7, dtype=torch.float32)  # n d = 640
    w_o = layer.w_o.clone()
    w_o[1, 2, 3] = NAN
    both = F.connection_spectra(layer.attn, layer.w_v, w_o, k=4)
    assert torch.isnan(both.largest.abs()).all() and torch.isnan(both.rightmost.real)
    assert torch.isnan(F.connection_laplacian_gap(layer.attn, layer.w_v, w_o))


def test_single_token():
    attn = torch.ones(3, 1, 1)
    gen = torch.Generator().manual_seed(42)  # any seed: float32 eigensolvers agree to about 1e-6 relative
    w_v, w_o = torch.randn(3, 2, 6, generator=gen), torch.randn(3, 6, 2, generator=gen)
    P = F.walk_matrix(attn)
    assert F.stochasticity_gap(P).item() == 0
    assert F.attention_entropy(attn).item() == 0
    assert math.isnan(F.attention_entropy(attn, normalized=True).item())  # documented: no row has two keys
    assert F.stationary_distribution(P).tolist() == [1.0]
    assert F.reversibility_gap(P).item() == 0
    assert F.walk_spectral_gap(P).item() == 1
    assert F.edge_isometry_gap(attn, w_v, w_o).item() == pytest.approx(F.ov_isometry_gap(w_v, w_o).item(), rel=1e-5)
    T_bar = (w_o @ w_v).sum(0)
    expected = torch.linalg.eigvals(T_bar) / F.transport_scale(w_v, w_o)  # n = 1: M = T_bar
    got = F.connection_spectrum(attn, w_v, w_o, k=6, deflate=False)
    torch.testing.assert_close(got.abs(), expected.abs().sort(descending=True).values, rtol=1e-5, atol=1e-6)
    radius = F.connection_spectral_radius(attn, w_v, w_o, deflate=False)
    assert radius.item() == pytest.approx(got.abs().max().item(), rel=1e-5)
    assert radius.item() == pytest.approx(F.ov_spectral_radius(w_v, w_o).item(), rel=1e-5)  # M = T_bar
    # no walk part: only constant fields
    assert F.connection_spectral_radius(attn, w_v, w_o).isnan() and F.connection_laplacian_gap(attn, w_v, w_o).isnan()
    assert F.connection_operator_norm(attn, w_v, w_o, deflate=False).item() > 0
    assert F.connection_operator_norm(attn, w_v, w_o).isnan()  # no walk part


def test_fully_masked_input_is_finite():
    attn = torch.zeros(2, 4, 4)  # no query has an allowed key
    P = F.walk_matrix(attn)
    assert F.stochasticity_gap(P).item() == 0
    assert F.stationary_distribution(P).tolist() == [0.25] * 4
    assert F.reversibility_gap(P).item() == 0
    assert F.edge_isometry_gap(attn, torch.randn(2, 1, 3), torch.randn(2, 3, 1)).item() == 0
    assert F.max_attention_logit(torch.zeros(2, 4, 4), mask=torch.zeros(4, 4, dtype=torch.bool)).item() == -math.inf
