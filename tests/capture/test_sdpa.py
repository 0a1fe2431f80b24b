import warnings

import pytest
import torch
from torch import nn

import connmon
from connmon.capture import FusedQKVAttention, register_adapter
from tests.capture.models import TinyGPT

TOL = 1e-5


def test_nanogpt_is_captured_exactly_through_sdpa():
    torch.manual_seed(0)
    model = TinyGPT(n_layer=3).eval()
    idx = torch.randint(0, 50, (3, 12))
    original = torch.nn.functional.scaled_dot_product_attention
    records = connmon.capture(model, idx)
    assert torch.nn.functional.scaled_dot_product_attention is original  # interceptor removed
    assert [r.name for r in records] == ["blocks.0.attn", "blocks.1.attn", "blocks.2.attn"]
    for record in records:
        assert record.attn.shape == (2, 4, 12, 12)
        assert record.reconstruction_error.item() <= TOL
        assert record.attn.triu(1).abs().max() == 0  # causal
        assert (record.attn.amax(-1) > 0.5).any()
        assert torch.isfinite(record.max_logit).all()


def test_nanogpt_train_mode_gradients_identical():
    torch.manual_seed(0)
    model = TinyGPT().train()
    idx = torch.randint(0, 50, (2, 8))

    def grads(arm):
        model.zero_grad()
        if arm:
            with connmon.capture.armed(model) as session:
                model(idx).logsumexp(-1).sum().backward()
            assert len(session.records) == 2
            assert all(r.reconstruction_error.item() <= TOL for r in session.records)  # dropout is 0
        else:
            model(idx).logsumexp(-1).sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    for plain, captured in zip(grads(False), grads(True), strict=True):
        assert torch.equal(plain, captured)


def test_activation_checkpointing_captured_once_per_forward():
    torch.manual_seed(0)
    model = TinyGPT(checkpoint=True).train()
    idx = torch.randint(0, 50, (2, 8))
    with connmon.capture.armed(model) as session:
        model(idx).sum().backward()  # the backward re-runs each block's forward
    assert [r.index for r in session.records] == [0, 1]
    assert all(r.reconstruction_error.item() <= TOL for r in session.records)


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_compiled_model_is_captured_through_its_original_module():
    torch.manual_seed(0)
    model = TinyGPT().eval()
    compiled = torch.compile(model)
    records = connmon.capture(compiled, torch.randint(0, 50, (2, 8)))
    assert len(records) == 2 and all(r.reconstruction_error.item() <= TOL for r in records)


class MyAttention(nn.Module):
    """A user's own attention: fused projection named differently, GQA-free, with SDPA and a float mask."""

    def __init__(self, d=24, heads=3):
        super().__init__()
        self.to_qkv, self.to_out, self.heads = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d), heads
        self.to_qkv.weight.data[: 2 * d] *= 3

    def forward(self, x, bias):
        b, n, d = x.shape
        q, k, v = self.to_qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)  # 3 x (B, H, n, e)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return self.to_out(y.transpose(1, 2).reshape(b, n, d))


@pytest.mark.parametrize("registered", [False, True])
def test_custom_module_with_a_float_mask_needs_no_registration(registered):
    model = MyAttention()
    x, bias = torch.randn(2, 7, 24), torch.randn(2, 1, 7, 7)
    adapter = FusedQKVAttention("MyAttention", qkv="to_qkv", proj="to_out", heads="heads")
    if registered:  # a registered adapter for the class still works, first in line
        register_adapter(adapter)
    try:
        (record,) = connmon.capture(model, x, bias)
    finally:
        if registered:
            connmon.capture.ADAPTERS.remove(adapter)
    assert record.reconstruction_error.item() <= TOL
    logits = (x[:2] @ model.to_qkv.weight[:24].T).view(2, 7, 3, 8).transpose(1, 2) @ (
        x[:2] @ model.to_qkv.weight[24:48].T
    ).view(2, 7, 3, 8).permute(0, 2, 3, 1) / 8**0.5 + bias
    torch.testing.assert_close(record.max_logit, logits.flatten(1).amax(-1), rtol=1e-5, atol=1e-5)


class GatedAttention(MyAttention):
    """Attention whose output is gated before the projection: not a connection walk."""

    def forward(self, x, bias):
        b, n, d = x.shape
        q, k, v = self.to_qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        y = y.transpose(1, 2).reshape(b, n, d)
        return self.to_out(y * torch.sigmoid(x))


def test_a_module_the_walk_does_not_model_is_reported_not_silently_wrong():
    with pytest.warns(UserWarning, match="no Linear layer took its attention output unchanged"):
        assert connmon.capture(GatedAttention(), torch.randn(2, 7, 24), None) == []


class BrokenAdapter(FusedQKVAttention):
    def read_kernel_call(self, *args, **kwargs):
        raise RuntimeError("weights unreadable")


def test_an_error_while_recording_never_breaks_the_forward():
    model = MyAttention()
    x = torch.randn(2, 7, 24)
    expected = model(x, None)
    adapter = BrokenAdapter("MyAttention", qkv="to_qkv", proj="to_out", heads="heads")
    register_adapter(adapter)
    outputs = []
    try:
        with pytest.warns(UserWarning, match="recording failed.*weights unreadable"):
            with connmon.capture.armed(model) as session:
                outputs.append(model(x, None))
    finally:
        connmon.capture.ADAPTERS.remove(adapter)
    assert session.records == [] and torch.equal(outputs[0], expected)


class SelfAttention(nn.Module):
    def __init__(self, d=16, heads=4, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.heads, self.qkv, self.out = heads, nn.Linear(d, 3 * d), nn.Linear(d, d)
        with torch.no_grad():
            self.qkv.weight[: 2 * d] *= 4

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, n, d))


class RefinedAttention(SelfAttention):
    """Runs an inner attention module on its input before its own SDPA call (nested attention modules)."""

    def __init__(self):
        super().__init__(seed=1)
        self.inner = SelfAttention(seed=2)

    def forward(self, x):
        x = x + self.inner(x)
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, n, d))


def test_nested_attention_modules_each_record_their_own_call():
    model = nn.Sequential(RefinedAttention())
    x = torch.randn(2, 7, 16)
    records = {r.name: r for r in connmon.capture(model, x)}
    assert set(records) == {"0", "0.inner"}
    for record in records.values():
        assert record.reconstruction_error.item() <= 1e-5
    torch.testing.assert_close(records["0.inner"].x, x)  # the inner module's own walk, under its name
    with torch.no_grad():
        torch.testing.assert_close(records["0"].x, x + model[0].inner(x))
    assert not torch.allclose(records["0"].attn, records["0.inner"].attn)


def attend(q, k, v):
    """A module-level helper around the kernel, as code bases write them."""
    return nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


class RefinedThroughHelper(RefinedAttention):
    """Nested attention whose outer forward reaches SDPA only through ``attend``."""

    def forward(self, x):
        x = x + self.inner(x)
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        return self.out(attend(q, k, v).transpose(1, 2).reshape(b, n, d))


class Mixer(SelfAttention):
    """A subclass under another name whose forward hands on to its base's."""

    def forward(self, x):
        return super().forward(x) * 1.0


@pytest.mark.parametrize("outer", [RefinedThroughHelper, Mixer])
def test_a_layer_reaching_its_kernel_through_a_helper_or_its_base_is_recorded(outer):
    model = nn.Sequential(outer())
    x = torch.randn(2, 7, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        records = {r.name: r for r in connmon.capture(model, x)}
    assert set(records) == ({"0", "0.inner"} if outer is RefinedThroughHelper else {"0"})
    for record in records.values():
        assert record.reconstruction_error.item() <= 1e-5
    with torch.no_grad():
        outputs = [model(x)]
        with connmon.capture.armed(model):
            outputs.append(model(x))
    assert torch.equal(*outputs)


def test_an_outer_layer_chosen_alone_is_not_given_its_inner_modules_walk():
    model = nn.Sequential(RefinedAttention())
    x = torch.randn(2, 7, 16)
    everything = {r.name: r for r in connmon.capture(model, x)}
    layers = [layer for layer in connmon.capture.attention_layers(model) if layer.name == "0"]
    with torch.no_grad(), connmon.capture.armed(model, layers=layers) as session:
        model(x)
    (record,) = session.records
    assert record.name == "0" and torch.equal(record.attn, everything["0"].attn)


def test_a_session_armed_after_another_in_one_thread_still_records_when_the_first_ends():
    """Two armed sessions overlap in one thread (two monitors, two models): the first ending leaves the wrapped
    kernels in place (a transformers model's attention is read through its wrapped attention dispatch)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=50, n_positions=16)
    first, second = TinyGPT().eval(), transformers.GPT2Model(config).eval()
    idx = torch.randint(0, 50, (2, 9))
    original = torch.nn.functional.scaled_dot_product_attention
    one = connmon.capture.armed(first)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")  # no layer of the second goes unread
        one.__enter__()
        with connmon.capture.armed(second) as session:
            one.__exit__(None, None, None)  # the first session ends while the second is armed
            assert torch.nn.functional.scaled_dot_product_attention is not original  # still wrapped for the second
            second(idx, attention_mask=torch.tensor([[1] * 9, [1] * 6 + [0] * 3]))
    assert [r.name for r in session.records] == ["h.0.attn", "h.1.attn"]
    assert all(r.reconstruction_error.item() <= TOL for r in session.records)
    assert torch.nn.functional.scaled_dot_product_attention is original  # restored when the last one ended


def refined_through_a_closure() -> type:
    """Nested attention whose outer forward reaches SDPA through a helper defined inside a function."""

    def attend(q, k, v):
        return nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    class Closed(RefinedAttention):
        def forward(self, x):
            x = x + self.inner(x)
            b, n, d = x.shape
            q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
            return self.out(attend(q, k, v).transpose(1, 2).reshape(b, n, d))

    return Closed


class RefinedThroughALambda(RefinedAttention):
    """Nested attention whose outer forward reaches SDPA through a lambda the instance holds."""

    def __init__(self):
        super().__init__()
        self.mix = lambda q, k, v: nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    def forward(self, x):
        x = x + self.inner(x)
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        return self.out(self.mix(q, k, v).transpose(1, 2).reshape(b, n, d))


@pytest.mark.parametrize("outer", [refined_through_a_closure(), RefinedThroughALambda], ids=["closure", "lambda"])
def test_a_layer_reaching_its_kernel_through_a_closure_or_a_lambda_is_recorded(outer):
    model = nn.Sequential(outer())
    x = torch.randn(2, 7, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        records = {r.name: r for r in connmon.capture(model, x)}
    assert set(records) == {"0", "0.inner"}
    assert all(record.reconstruction_error.item() <= 1e-5 for record in records.values())
