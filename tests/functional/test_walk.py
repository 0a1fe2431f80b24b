import numpy as np
import pytest
import torch

import connmon.functional as F
from tests.functional import reference as ref


def test_walk_matrix_is_mean_of_heads(layer):
    attn, _, _ = layer.np
    np.testing.assert_allclose(F.walk_matrix(layer.attn).numpy(), ref.walk(attn), atol=1e-15)


def test_stochasticity_gap(layer):
    P = ref.walk(layer.np[0])
    assert F.stochasticity_gap(torch.from_numpy(P)).item() == pytest.approx(ref.stochasticity_gap(P), abs=1e-15)
    perturbed = P.copy()
    perturbed[-1] *= 1.25
    assert F.stochasticity_gap(torch.from_numpy(perturbed)).item() == pytest.approx(0.25, rel=1e-12)


@pytest.mark.parametrize("normalized", [False, True])
def test_attention_entropy_with_mask(layer, normalized):
    attn, _, _ = layer.np
    expected = ref.attention_entropy(attn, layer.allowed.numpy(), normalized)
    got = F.attention_entropy(layer.attn, normalized=normalized, mask=layer.allowed).item()
    assert got == pytest.approx(expected, rel=1e-12)


def test_attention_entropy_without_mask_counts_nonzero_keys():
    layer = ref.make_layer(mask="padded", n=7)
    nonzero = layer.attn.numpy() != 0
    for normalized in (False, True):
        expected = ref.attention_entropy(layer.np[0], nonzero, normalized)
        assert F.attention_entropy(layer.attn, normalized=normalized).item() == pytest.approx(expected, rel=1e-12)


def test_attention_entropy_key_padding_mask_broadcasts():
    layer = ref.make_layer(mask="none", n=6)
    keep = torch.tensor([True, True, True, True, False, False])
    logits = layer.logits.masked_fill(~keep, float("-inf"))
    attn = logits.softmax(-1)
    expected = ref.attention_entropy(attn.numpy(), np.broadcast_to(keep.numpy(), attn.shape), True)
    assert F.attention_entropy(attn, normalized=True, mask=keep).item() == pytest.approx(expected, rel=1e-12)


def test_stationary_distribution(layer):
    P = ref.walk(layer.np[0])
    got = F.stationary_distribution(torch.from_numpy(P)).numpy()
    np.testing.assert_allclose(got, ref.stationary_distribution(P), atol=1e-10)
    assert got.sum() == pytest.approx(1.0, abs=1e-12)


def test_stationary_distribution_solves_pi_P_equals_pi_when_irreducible():
    P = ref.walk(ref.make_layer(n=9).np[0])
    pi = F.stationary_distribution(torch.from_numpy(P)).numpy()
    np.testing.assert_allclose(pi @ P, pi, atol=1e-13)


def test_stationary_distribution_causal_mass_flows_to_first_token():
    P = ref.walk(ref.make_layer(mask="causal", n=6).np[0])
    pi = F.stationary_distribution(torch.from_numpy(P)).numpy()
    np.testing.assert_allclose(pi, np.eye(6)[0], atol=1e-12)


def test_stationary_distribution_reducible_depends_on_start():
    # Two closed classes {0, 1} and {2}, token 3 splits its mass 1:3 between them: pi = u^T lim Q^t exactly.
    P = torch.tensor([[0.5, 0.5, 0, 0], [0.25, 0.75, 0, 0], [0, 0, 1.0, 0], [0.25, 0, 0.75, 0]], dtype=torch.float64)
    np.testing.assert_allclose(F.stationary_distribution(P).numpy(), ref.stationary_distribution(P.numpy()), atol=1e-12)


def test_stationary_distribution_float32_matches(layer):
    P = ref.walk(layer.np[0])
    got = F.stationary_distribution(torch.from_numpy(P).float())
    assert got.dtype == torch.float32
    np.testing.assert_allclose(got.numpy(), ref.stationary_distribution(P), atol=2e-5)


def test_reversibility_gap(layer):
    P = ref.walk(layer.np[0])
    assert F.reversibility_gap(torch.from_numpy(P)).item() == pytest.approx(ref.reversibility_gap(P), abs=1e-10)


def test_walk_spectral_gap(layer):
    P = ref.walk(layer.np[0])
    assert F.walk_spectral_gap(torch.from_numpy(P)).item() == pytest.approx(ref.walk_spectral_gap(P), abs=1e-10)


def test_max_attention_logit(layer):
    expected = ref.max_attention_logit(layer.logits.numpy(), layer.allowed.numpy())
    assert F.max_attention_logit(layer.logits).item() == expected  # blocked scores are -inf
    finite = torch.nan_to_num(layer.logits, neginf=1e6)  # blocked scores huge: the mask must hide them
    assert F.max_attention_logit(finite, mask=layer.allowed).item() == expected


def test_walk_functions_are_batched(layer):
    attn = torch.stack([layer.attn, layer.attn.flip(-3), layer.attn.roll(1, dims=-3)])  # (3, H, n, n)
    P = F.walk_matrix(attn)
    for fn in (F.stochasticity_gap, F.reversibility_gap, F.walk_spectral_gap, F.stationary_distribution):
        batched = fn(P)
        for b in range(3):
            torch.testing.assert_close(batched[b], fn(P[b]), rtol=1e-10, atol=1e-12)
    batched = F.attention_entropy(attn, normalized=True, mask=layer.allowed)
    assert batched.shape == (3,)
    assert F.max_attention_logit(layer.logits.expand(2, 5, *layer.logits.shape)).shape == (2, 5)
