import numpy as np
import pytest
import torch

import connmon.functional as F
from tests.functional import reference as ref


def test_depth_and_time_drift_match_definition():
    a, b = ref.make_layer(seed=0), ref.make_layer(seed=1)
    P, Q = ref.walk(a.np[0]), ref.walk(b.np[0])
    for fn in (F.depth_drift, F.time_drift):
        assert fn(torch.from_numpy(P), torch.from_numpy(Q)).item() == pytest.approx(ref.relative_change(P, Q))


def test_transport_drift_matches_definition():
    a, b = ref.make_layer(seed=0), ref.make_layer(seed=1)
    T, U = ref.ov_map(*a.np[1:]), ref.ov_map(*b.np[1:])
    got = F.transport_drift(F.ov_transport(a.w_v, a.w_o), F.ov_transport(b.w_v, b.w_o))
    assert got.item() == pytest.approx(ref.relative_change(T, U))


def test_drift_is_batched_and_zero_safe():
    P = torch.rand(4, 5, 5, dtype=torch.float64)
    Q = torch.rand(4, 5, 5, dtype=torch.float64)
    batched = F.depth_drift(P, Q)
    np.testing.assert_allclose(batched.numpy(), [ref.relative_change(P[b].numpy(), Q[b].numpy()) for b in range(4)])
    assert F.time_drift(torch.zeros(3, 3), torch.zeros(3, 3)).item() == 0
    assert F.time_drift(torch.zeros(3, 3), torch.eye(3)).item() == float("inf")
