import pytest

from tests.functional.reference import make_layer

# Each case is a random layer: GQA, causal, key padding with a fully masked query row, a single head, near one-hot.
LAYER_CASES = {
    "dense": dict(heads=4, n=6, d_h=2, d=8),
    "gqa": dict(heads=4, kv_heads=2, n=6, d_h=2, d=8),
    "causal": dict(heads=3, n=7, d_h=2, d=6, mask="causal"),
    "padded": dict(heads=2, kv_heads=1, n=6, d_h=3, d=6, mask="padded"),
    "single_head": dict(heads=1, n=5, d_h=4, d=4),
    "one_hot": dict(heads=4, n=6, d_h=2, d=8, sharpness=40.0),
    "wide_heads": dict(heads=4, n=5, d_h=3, d=6),  # H d_h > d
    "narrow_heads": dict(heads=2, n=6, d_h=2, d=8),  # H d_h < d
}


@pytest.fixture(params=list(LAYER_CASES), ids=list(LAYER_CASES))
def layer(request):
    return make_layer(**LAYER_CASES[request.param], seed=list(LAYER_CASES).index(request.param))
