import gc
import weakref

import pytest
import torch
from torch import nn

import connmon
from connmon.capture import attention_layers

TOL = 1e-5


def sharp_mha(d=16, heads=4, **kwargs):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(d, heads, **kwargs)
    with torch.no_grad():
        if mha._qkv_same_embed_dim:
            mha.in_proj_weight[: 2 * d] *= 4
        else:
            mha.q_proj_weight *= 4
        if mha.in_proj_bias is not None:
            nn.init.normal_(mha.in_proj_bias, std=0.2)
            nn.init.normal_(mha.out_proj.bias, std=0.2)
    return mha


def assert_exact(records, count):
    assert len(records) == count
    for record in records:
        assert record.attn.dtype == torch.float32
        assert record.reconstruction_error.item() <= TOL, (record.name, record.reconstruction_error)
        assert record.attn.sum(-1).sub(1).abs().max() < 1e-5 or record.key_mask is not None
        assert (record.attn.amax(-1) > 0.5).any()  # far from uniform


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize(
    "masks",
    ["none", "bool", "float", "float_inf", "padding", "causal", "bool+padding", "per_head"],
)
def test_multihead_attention_masks(batch_first, masks):
    mha = sharp_mha(batch_first=batch_first)
    n, batch = 7, 3
    x = torch.randn(batch, n, 16) if batch_first else torch.randn(n, batch, 16)
    kwargs = {}
    causal = torch.ones(n, n, dtype=torch.bool).triu(1)  # True = blocked in nn.MultiheadAttention
    padding = torch.zeros(batch, n, dtype=torch.bool)
    padding[:, -2:] = True
    if "bool" in masks:
        kwargs["attn_mask"] = causal
    if masks == "float":
        kwargs["attn_mask"] = torch.randn(n, n)
    if masks == "float_inf":
        kwargs["attn_mask"] = torch.randn(n, n).masked_fill(causal, float("-inf"))
    if "padding" in masks:
        kwargs["key_padding_mask"] = padding
    if masks == "causal":
        kwargs.update(attn_mask=causal, is_causal=True)
    if masks == "per_head":
        kwargs["attn_mask"] = torch.rand(batch * 4, n, n) < 0.3
        kwargs["attn_mask"][..., 0] = False
    records = connmon.capture(mha, x, x, x, **kwargs)
    assert_exact(records, 1)
    record = records[0]
    assert record.attn.shape == (2, 4, n, n)
    if "padding" in masks:
        assert record.key_mask.tolist() == [[True] * 5 + [False] * 2] * 2
        assert record.attn[..., -2:].abs().max() == 0
    if masks in ("bool", "float_inf", "causal"):
        assert record.attn.triu(1).abs().max() == 0
        assert record.max_logit.isfinite().all()


def test_separate_qkv_weights_and_no_bias():
    mha = sharp_mha(kdim=16, vdim=16, bias=False, batch_first=True)
    mha._qkv_same_embed_dim = False  # separate q/k/v projection weights
    with torch.no_grad():
        mha.q_proj_weight = nn.Parameter(torch.randn(16, 16))
        mha.k_proj_weight = nn.Parameter(torch.randn(16, 16))
        mha.v_proj_weight = nn.Parameter(torch.randn(16, 16))
        mha.in_proj_weight = None
    x = torch.randn(2, 6, 16)
    assert_exact(connmon.capture(mha, x, x, x), 1)


@pytest.mark.parametrize("train", [True, False])
def test_transformer_encoder_in_train_and_eval_fast_path(train):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, num_layers=3, enable_nested_tensor=True).train(train)
    for sub in model.layers:
        sub.self_attn.in_proj_weight.data[:32] *= 4
    x = torch.randn(3, 9, 16)
    padding = torch.zeros(3, 9, dtype=torch.bool)
    padding[1, -4:] = True
    fast_before = torch.backends.mha.get_fastpath_enabled()
    records = connmon.capture(model, x, src_key_padding_mask=padding, mask=None)
    assert torch.backends.mha.get_fastpath_enabled() == fast_before  # restored
    assert_exact(records, 3)
    assert [r.index for r in records] == [0, 1, 2]
    assert records[0].key_mask[1].tolist() == [True] * 5 + [False] * 4


def test_decoder_layer_self_attention_recorded_cross_attention_skipped():
    torch.manual_seed(0)
    layer = nn.TransformerDecoderLayer(16, 4, dim_feedforward=32, dropout=0.0, batch_first=True)
    tgt, memory = torch.randn(2, 6, 16), torch.randn(2, 8, 16)
    with pytest.warns(UserWarning, match="cross-attention"):
        records = connmon.capture(
            layer, tgt, memory, tgt_is_causal=True, tgt_mask=nn.Transformer.generate_square_subsequent_mask(6)
        )
    assert [r.name for r in records] == ["self_attn"]
    assert_exact(records, 1)


def test_unsupported_bias_kv_is_reported_not_silently_wrong():
    mha = nn.MultiheadAttention(8, 2, add_bias_kv=True, batch_first=True)
    x = torch.randn(1, 4, 8)
    with pytest.warns(UserWarning, match="bias_k/bias_v or add_zero_attn"):
        assert connmon.capture(mha, x, x, x) == []


def test_no_attention_raises_with_module_types_and_advice():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with pytest.raises(ValueError, match=r"module types seen: Linear, ReLU, Sequential.*register_adapter"):
        connmon.capture(model, torch.randn(2, 4))


class Boom(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = sharp_mha(batch_first=True)

    def forward(self, x):
        self.attn(x, x, x)
        raise ValueError("boom")


def test_hooks_removed_even_when_forward_raises():
    model = Boom()
    with pytest.raises(ValueError, match="boom"):
        connmon.capture(model, torch.randn(1, 4, 16))
    assert not model.attn._forward_hooks and not model.attn._forward_pre_hooks
    assert torch.backends.mha.get_fastpath_enabled()


def test_no_reference_to_activations_survives():
    mha = sharp_mha(batch_first=True)
    x = torch.randn(2, 5, 16)
    outputs = []
    handle = mha.register_forward_hook(lambda m, a, out: outputs.append(weakref.ref(out[0])))
    records = connmon.capture(mha, x, x, x)
    handle.remove()
    gc.collect()
    assert outputs[0]() is None  # the module output was freed; the record holds a copy
    assert records[0].output.shape == (2, 5, 16)


def test_training_gradients_identical_with_and_without_capture():
    torch.manual_seed(0)
    model = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True), 2)
    x = torch.randn(2, 6, 16)

    def grads(arm):
        model.zero_grad()
        if arm:
            with connmon.capture.armed(model) as session:
                model(x).square().sum().backward()
            assert len(session.records) == 2
        else:
            model(x).square().sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    for plain, captured in zip(grads(False), grads(True), strict=True):
        assert torch.equal(plain, captured)


def test_streaming_hands_records_over_layer_by_layer():
    model = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True), 3)
    seen = []
    records = connmon.capture(model, torch.randn(2, 5, 16), on_record=lambda r: seen.append(r.index))
    assert records == [] and seen == [0, 1, 2]


def test_autocast_bf16_records_stay_float32():
    model = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True), 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        records = connmon.capture(model, torch.randn(2, 5, 16))
    assert all(r.attn.dtype == torch.float32 and r.x.dtype == torch.float32 for r in records)
    assert all(r.reconstruction_error.item() < 5e-2 for r in records)  # bf16 module arithmetic


def test_num_sequences_and_max_tokens_policy():
    mha = sharp_mha(batch_first=True)
    x = torch.randn(4, 10, 16)
    causal = torch.ones(10, 10, dtype=torch.bool).triu(1)
    (record,) = connmon.capture(mha, x, x, x, attn_mask=causal, num_sequences=3, max_tokens=6)
    assert record.attn.shape == (3, 4, 6, 6) and record.reconstruction_error.item() <= TOL  # causal prefix: exact
    (record,) = connmon.capture(mha, x, x, x, max_tokens=6)
    assert record.attn.shape == (2, 4, 6, 6)
    assert torch.isnan(record.reconstruction_error)  # bidirectional window: not a reconstruction
    torch.testing.assert_close(record.attn.sum(-1), torch.ones(2, 4, 6))


def test_bad_options():
    mha = sharp_mha(batch_first=True)
    x = torch.randn(1, 3, 16)
    with pytest.raises(ValueError, match="num_sequences must be an integer >= 1, got num_sequences=0"):
        connmon.capture(mha, x, x, x, num_sequences=0)
    with pytest.raises(ValueError, match="max_tokens must be an integer >= 1 or None"):
        connmon.capture(mha, x, x, x, max_tokens=0)


def test_attention_layers_in_module_order():
    model = nn.Transformer(16, 2, num_encoder_layers=2, num_decoder_layers=1, dim_feedforward=16, batch_first=True)
    names = [layer.name for layer in attention_layers(model)]
    assert names == [
        "encoder.layers.0.self_attn",
        "encoder.layers.1.self_attn",
        "decoder.layers.0.self_attn",
        "decoder.layers.0.multihead_attn",
    ]


def test_streamed_records_are_not_kept_by_the_capture():
    model = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True), 4)
    alive = []

    def consume(record):
        gc.collect()
        alive.append(sum(ref() is not None for ref in refs))  # earlier layers' maps still referenced somewhere
        refs.append(weakref.ref(record.attn))

    refs = []
    connmon.capture(model, torch.randn(2, 6, 16), on_record=consume)
    assert alive == [0, 0, 0, 0]  # only the layer being handed over is alive: one layer's maps at a time


def padded_encoder():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, 2).eval()
    for sub in model.layers:
        sub.self_attn.in_proj_weight.data[:32] *= 4
    x = torch.randn(3, 7, 16)
    padding = torch.zeros(3, 7, dtype=torch.bool)
    padding[1, 4:] = True
    return model, x, padding


def test_the_fused_encoder_fast_path_is_left_alone_and_skipped_with_a_warning():
    """Eval under no_grad: the encoder's fused path (nested tensors, 0 at padded positions) runs as it would unarmed."""
    model, x, padding = padded_encoder()
    with torch.no_grad():
        plain = model(x, src_key_padding_mask=padding)
        with pytest.warns(UserWarning, match="fast path"):
            with connmon.capture.armed(model) as session:
                watched = model(x, src_key_padding_mask=padding)
    assert torch.equal(plain, watched) and session.records == []
    assert torch.backends.mha.get_fastpath_enabled()


@pytest.mark.parametrize("padded", [True, False])
def test_the_fused_layer_path_without_nested_tensors_is_left_alone_too(padded):
    """enable_nested_tensor=False: each layer still takes its fused path in eval under no_grad, which torch refuses
    when any forward hook sits on the layer or inside it, so connmon reads the layer without hooks there."""
    nested, x, padding = padded_encoder()
    layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    model.load_state_dict(nested.state_dict())
    mask = {"src_key_padding_mask": padding} if padded else {}
    with torch.no_grad():
        plain = model(x, **mask)
        with pytest.warns(UserWarning, match="fast path"):
            with connmon.capture.armed(model) as session:
                watched = model(x, **mask)
        after = model(x, **mask)
    assert torch.equal(plain, watched) and torch.equal(plain, after) and session.records == []
    assert all("forward" not in vars(m) for m in model.modules())  # nothing of connmon's is left on the modules
    with connmon.capture.armed(model) as session:  # with gradients the same layers run their Python path: recorded
        model(x, **mask)
    assert_exact(session.records, 2)


def test_the_encoder_records_where_it_runs_its_python_path():
    """With gradients (a training forward) the layers call self_attn: recorded exactly, outputs bitwise unchanged."""
    model, x, padding = padded_encoder()
    plain = model(x, src_key_padding_mask=padding)
    with connmon.capture.armed(model) as session:
        watched = model(x, src_key_padding_mask=padding)
    assert torch.equal(plain, watched)
    assert_exact(session.records, 2)


def test_the_modules_own_fast_path_is_read_on_the_side():
    """nn.MultiheadAttention alone in eval under no_grad runs its native kernel; the scores are recomputed beside it."""
    mha = sharp_mha(batch_first=True).eval()
    x = torch.randn(2, 6, 16)
    padding = torch.zeros(2, 6, dtype=torch.bool)
    padding[0, 4:] = True
    with torch.no_grad():
        plain = mha(x, x, x, key_padding_mask=padding, need_weights=False)[0]
        with connmon.capture.armed(mha) as session:
            watched = mha(x, x, x, key_padding_mask=padding, need_weights=False)[0]
    assert torch.equal(plain, watched)
    assert_exact(session.records, 1)


def test_capture_runs_its_own_forward_on_the_python_path():
    model, x, padding = padded_encoder()
    records = connmon.capture(model, x, src_key_padding_mask=padding)
    assert_exact(records, 2)
    assert torch.backends.mha.get_fastpath_enabled()
