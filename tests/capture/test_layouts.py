"""Attention layouts of popular codebases, rewritten under other class names: captured with no registration."""

import contextlib
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import connmon

D, HEADS, KV_HEADS, TOKENS = 32, 4, 2, 9
HS = D // HEADS  # head size


def sharp(linear: nn.Linear, rows: int) -> nn.Linear:
    with torch.no_grad():
        linear.weight[:rows] *= 4
    return linear


class NanoStyle(nn.Module):
    """nanoGPT: fused c_attn, c_proj, n_head, SDPA with is_causal."""

    def __init__(self):
        super().__init__()
        self.c_attn, self.c_proj, self.n_head = sharp(nn.Linear(D, 3 * D), 2 * D), nn.Linear(D, D), HEADS

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class LitStyle(nn.Module):
    """litgpt (grouped layout): qkv rows per query group [q (q_per_kv), k, v], k/v expanded to every head."""

    def __init__(self):
        super().__init__()
        self.attn, self.proj = sharp(nn.Linear(D, (HEADS + 2 * KV_HEADS) * HS), HEADS * HS), nn.Linear(D, D)

    def forward(self, x, mask):
        B, T, _ = x.shape
        q_per_kv = HEADS // KV_HEADS
        qkv = self.attn(x).view(B, T, KV_HEADS, q_per_kv + 2, HS).permute(0, 2, 3, 1, 4)  # (B, groups, total, T, hs)
        q, k, v = qkv.split((q_per_kv, 1, 1), dim=2)
        k, v = (t.expand(B, KV_HEADS, q_per_kv, T, HS) for t in (k, v))
        q, k, v = (t.reshape(B, -1, T, HS) for t in (q, k, v))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0 / math.sqrt(HS))
        return self.proj(y.transpose(1, 2).reshape(B, T, D))


class Attend(nn.Module):
    """x-transformers: the kernel call lives in a submodule without projections."""

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class XStyle(nn.Module):
    """x-transformers: to_q, to_k, to_v, to_out (a Sequential), Attend child."""

    def __init__(self):
        super().__init__()
        self.to_q, self.to_k = sharp(nn.Linear(D, D, bias=False), D), sharp(nn.Linear(D, D, bias=False), D)
        self.to_v, self.attend = nn.Linear(D, D, bias=False), Attend()
        self.to_out = nn.Sequential(nn.Linear(D, D), nn.Dropout(0.0))

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = (f(x).view(B, T, HEADS, HS).transpose(1, 2) for f in (self.to_q, self.to_k, self.to_v))
        return self.to_out(self.attend(q, k, v).transpose(1, 2).reshape(B, T, D))


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    bs, slen, n_kv_heads, head_dim = x.shape
    return (
        x[:, :, :, None, :]
        .expand(bs, slen, n_kv_heads, n_rep, head_dim)
        .reshape(bs, slen, n_kv_heads * n_rep, head_dim)
    )


class TitanStyle(nn.Module):
    """torchtitan LLaMA: wq, wk, wv, wo without bias, GQA repeated before SDPA, RoPE-like rotation on q and k."""

    def __init__(self):
        super().__init__()
        self.wq, self.wk = (
            sharp(nn.Linear(D, D, bias=False), D),
            sharp(nn.Linear(D, KV_HEADS * HS, bias=False), KV_HEADS * HS),
        )
        self.wv, self.wo = nn.Linear(D, KV_HEADS * HS, bias=False), nn.Linear(D, D, bias=False)

    def forward(self, x):
        bs, seqlen, _ = x.shape
        xq = self.wq(x).view(bs, seqlen, HEADS, HS)
        xk, xv = self.wk(x).view(bs, seqlen, KV_HEADS, HS), self.wv(x).view(bs, seqlen, KV_HEADS, HS)
        angle = torch.arange(seqlen, dtype=x.dtype)[None, :, None, None] * 0.3
        xq, xk = xq * angle.cos() + xq.flip(-1) * angle.sin(), xk * angle.cos() + xk.flip(-1) * angle.sin()
        keys, values = repeat_kv(xk, HEADS // KV_HEADS), repeat_kv(xv, HEADS // KV_HEADS)
        output = F.scaled_dot_product_attention(
            xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), is_causal=True
        )
        return self.wo(output.transpose(1, 2).contiguous().view(bs, seqlen, -1))


class TimmStyle(nn.Module):
    """timm: fused qkv (bias), qk LayerNorm, proj, a bidirectional layer with a bool padding mask."""

    def __init__(self):
        super().__init__()
        self.num_heads, self.qkv, self.proj = HEADS, sharp(nn.Linear(D, 3 * D), 2 * D), nn.Linear(D, D)
        self.q_norm, self.k_norm = nn.LayerNorm(HS), nn.LayerNorm(HS)

    def forward(self, x, keep):
        B, N, C = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, self.num_heads, HS).permute(2, 0, 3, 1, 4).unbind(0)
        q, k = self.q_norm(q) * 3, self.k_norm(k)
        x = F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :])
        return self.proj(x.transpose(1, 2).reshape(B, N, C))


class MinGPTSelfAttention(nn.Module):
    """minGPT: a hand-written softmax (no kernel call), read from the calls that run."""

    def __init__(self):
        super().__init__()
        self.c_attn, self.c_proj, self.n_head = nn.Linear(D, 3 * D), nn.Linear(D, D), HEADS

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_head, HS).transpose(1, 2) for t in self.c_attn(x).split(C, dim=2))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(torch.ones(T, T).tril() == 0, float("-inf")).softmax(dim=-1)
        return self.c_proj((att @ v).transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self, attention: nn.Module):
        super().__init__()
        self.ln, self.mixer, self.mlp = (
            nn.LayerNorm(D),
            attention,
            nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D)),
        )

    def forward(self, x, *extra):
        x = x + self.mixer(self.ln(x), *extra)
        return x + self.mlp(x)


def inputs(layout):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, TOKENS, D, generator=gen)
    if layout is LitStyle:
        return x, torch.randn(3, 1, TOKENS, TOKENS, generator=gen)
    if layout is TimmStyle:
        keep = torch.ones(3, TOKENS, dtype=torch.bool)
        keep[1, -2:] = False
        return x, keep
    return (x,)


LAYOUTS = [NanoStyle, LitStyle, XStyle, TitanStyle, TimmStyle]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda c: c.__name__)
def test_layout_is_captured_exactly_without_registration(layout):
    torch.manual_seed(0)
    model = nn.Sequential(Block(layout()), Block(layout())) if len(inputs(layout)) == 1 else Block(layout())
    args = inputs(layout)
    records = connmon.capture(model, *args)
    assert records, layout
    for record in records:
        assert record.name.endswith("mixer")
        assert record.reconstruction_error.item() <= 1e-5
        assert record.w_v.shape == (HEADS, HS, D) and record.w_o.shape == (HEADS, D, HS)
        assert (record.attn.amax(-1) > 0.5).any()
    if layout in (TitanStyle, LitStyle):  # GQA: query heads of one group read the same values
        torch.testing.assert_close(records[0].w_v[0], records[0].w_v[1])
    if layout is TimmStyle:
        assert records[0].key_mask[1].tolist() == [True] * (TOKENS - 2) + [False] * 2


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda c: c.__name__)
def test_arming_a_layout_changes_neither_outputs_nor_gradients(layout):
    torch.manual_seed(0)
    model = Block(layout()).train()
    args = inputs(layout)

    def run(arm):
        model.zero_grad()
        with connmon.capture.armed(model) if arm else contextlib.nullcontext():
            out = model(*args)
            out.square().mean().backward()
        return [out.detach(), *(p.grad.clone() for p in model.parameters())]

    for a, b in zip(run(False), run(True), strict=True):
        assert torch.equal(a, b)


def test_hand_written_attention_is_read_from_the_calls_that_run():
    model = nn.Sequential(Block(MinGPTSelfAttention()), Block(NanoStyle()))
    records = connmon.capture(model, torch.randn(2, TOKENS, D))
    assert [r.name for r in records] == ["0.mixer", "1.mixer"]
    assert all(r.reconstruction_error.item() <= 1e-6 for r in records)


class SelfAttentionGate(nn.Module):
    """Named like attention, holds Linear layers, computes no attention: reported with a true cause."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x)))


def test_a_named_module_that_computes_no_attention_warns_once_at_the_end_of_the_capture():
    with pytest.warns(UserWarning, match="ran no attention connmon reads"):
        assert connmon.capture(SelfAttentionGate(), torch.randn(2, TOKENS, D)) == []


_attend = F.scaled_dot_product_attention  # bound at import, before any capture is armed: read all the same


class BoundKernelMixer(nn.Module):
    def __init__(self):
        super().__init__()
        self.to_qkv, self.to_out = sharp(nn.Linear(D, 3 * D), 2 * D), nn.Linear(D, D)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.to_qkv(x).view(B, T, 3, HEADS, HS).permute(2, 0, 3, 1, 4)
        return self.to_out(_attend(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C))


class SharedValueAttention(nn.Module):
    """Multi-query by hand: one values head read by every query head through einsum('bhij,bjd->bhid')."""

    def __init__(self):
        super().__init__()
        self.q, self.kv, self.out = sharp(nn.Linear(D, D), D), nn.Linear(D, 2 * HS), nn.Linear(D, D)

    def forward(self, x):
        B, T, C = x.shape
        q = self.q(x).view(B, T, HEADS, HS).transpose(1, 2)
        k, v = self.kv(x).split(HS, dim=-1)
        scores = torch.einsum("bhid,bjd->bhij", q, k) / math.sqrt(HS)
        probs = scores.softmax(dim=-1, dtype=torch.float32).to(x.dtype)
        return self.out(torch.einsum("bhij,bjd->bhid", probs, v).transpose(1, 2).reshape(B, T, C))


class TalkingHeadsAttention(nn.Module):
    """Mixes heads after the softmax: not a walk of those probabilities, so the reconstruction rejects it."""

    def __init__(self):
        super().__init__()
        self.qkv, self.out, self.mix = (
            sharp(nn.Linear(D, 3 * D), 2 * D),
            nn.Linear(D, D),
            nn.Parameter(torch.randn(4, 4)),
        )

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, HEADS, HS).permute(2, 0, 3, 1, 4)
        probs = (q @ k.transpose(-2, -1) / math.sqrt(HS)).softmax(dim=-1)
        probs = torch.einsum("bhij,hg->bgij", probs, self.mix)
        return self.out((probs @ v).transpose(1, 2).reshape(B, T, C))


@pytest.mark.parametrize("module", [BoundKernelMixer, SharedValueAttention], ids=lambda m: m.__name__)
def test_kernels_bound_before_arming_and_shared_values_by_hand_are_read(module):
    torch.manual_seed(0)
    model = module()
    (record,) = connmon.capture(model, torch.randn(2, TOKENS, D), dtype=torch.float64)
    assert record.attn.shape == (2, HEADS, TOKENS, TOKENS) and record.reconstruction_error.item() <= 1e-6


def test_hand_written_attention_that_is_not_a_walk_is_skipped_with_a_warning_and_runs_unchanged():
    torch.manual_seed(0)
    model, x = TalkingHeadsAttention(), torch.randn(2, TOKENS, D)
    plain = model(x)
    with pytest.warns(UserWarning, match="TalkingHeadsAttention is not recorded"):
        with connmon.capture.armed(model) as session:
            armed = model(x)
    assert torch.equal(plain, armed) and session.records == []


def test_a_compiled_hand_written_model_trains_unchanged_to_round_off():
    """Under torch.compile the reading mode only runs each call: the compiled graph is the model's own."""
    torch.manual_seed(0)
    model = nn.Sequential(Block(MinGPTSelfAttention()), Block(MinGPTSelfAttention()))
    compiled, x = torch.compile(model, backend="aot_eager"), torch.randn(2, TOKENS, D)
    plain = compiled(x)
    with connmon.capture.armed(model) as session:
        armed = compiled(x)
    assert torch.allclose(plain, armed, atol=1e-6)
    assert len(session.records) <= 2  # read where the hooks broke the graph, else said in a warning
