"""The max logit's bound from the kernel's own statistics: the logsumexp SDPA saves for its backward, every step."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import connmon
from connmon.alerts import AlertRunner, QKClip
from connmon.capture.max_logit import HeadMaxLogits
from tests.capture.models import TinyGPT


class Attend(torch.nn.Module):
    """Calls SDPA on the query, key and value it is given (so the test knows them)."""

    def forward(self, q, k, v, **call):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, **call)


def dense(q, k, allowed=None):
    """float64: each head's max logit and largest logsumexp over the batch and its query rows."""
    q, k = q.double(), k.double().repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = q @ k.mT / math.sqrt(q.shape[-1])
    if allowed is not None:
        scores = scores.masked_fill(~allowed, -math.inf)
    lse = scores.logsumexp(-1).nan_to_num(nan=-math.inf)
    return scores.amax(dim=(0, 2, 3)), lse.amax(dim=(0, 2))


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2), (1, 1)])
@pytest.mark.parametrize("mask", ["none", "causal", "padded bool"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_bound_is_the_largest_logsumexp_and_bounds_the_max_logit_within_log_n(heads, kv_heads, mask, dtype):
    gen = torch.Generator().manual_seed(0)
    n = 12
    q = (torch.randn(3, heads, n, 8, generator=gen) * 3).requires_grad_()
    k, v = torch.randn(3, kv_heads, n, 8, generator=gen) * 3, torch.randn(3, kv_heads, n, 8, generator=gen)
    call, allowed = {"enable_gqa": kv_heads != heads}, None
    if mask == "causal":
        call["is_causal"], allowed = True, torch.ones(n, n, dtype=torch.bool).tril()
    elif mask == "padded bool":
        allowed = torch.ones(3, 1, n, n, dtype=torch.bool)
        allowed[1, ..., 7:] = False
        call["attn_mask"] = allowed
    module = Attend().train()
    tracker = HeadMaxLogits([module], ["attend"])
    tracker._seen_call[0] = True  # no layout to find: the reading itself is tested
    tracker.exact = False
    with tracker.watching():
        module(q.to(dtype), k.to(dtype), v.to(dtype), **call)
    exact, bound = tracker.read_both()
    assert exact is None  # no exact reading on a bound step without a threshold
    logit, lse = dense(q.to(dtype), k.to(dtype), allowed)
    torch.testing.assert_close(bound[0].double(), lse, rtol=1e-5, atol=1e-4 if dtype == torch.float32 else 2e-2)
    assert bool((bound[0].double() >= logit - 1e-4).all()) and bool((bound[0].double() <= logit + math.log(n)).all())


@pytest.mark.parametrize("heads, kv_heads, side", [(4, 4, "query"), (4, 2, "key"), (1, 1, "query")])
def test_a_head_with_a_non_finite_query_or_key_reads_nan_whatever_the_kernel_saved(heads, kv_heads, side):
    """CPU flash attention saves a logsumexp of 0 for NaN rows on some instruction sets: the bound says NaN."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, heads, 6, 8, generator=gen).requires_grad_()
    k, v = torch.randn(2, kv_heads, 6, 8, generator=gen), torch.randn(2, kv_heads, 6, 8, generator=gen)
    with torch.no_grad():
        (q if side == "query" else k)[1, 0, 3, 2] = math.nan  # query head 0, or the keys of query heads 0..H/Hk-1
    module = Attend().train()
    tracker = HeadMaxLogits([module], ["attend"])
    tracker._seen_call[0] = True
    tracker.exact = False
    with tracker.watching():
        module(q, k, v, is_causal=True, enable_gqa=kv_heads != heads)
    _, bound = tracker.read_both()
    nan = bound[0].isnan()
    assert (
        nan.tolist() == [h < heads // kv_heads for h in range(heads)]
        if side == "key"
        else nan.tolist() == [h == 0 for h in range(heads)]
    )
    assert bool(bound[0][~nan].isfinite().all())


def test_a_call_whose_bound_passes_the_threshold_is_read_exactly_and_an_additive_mask_is_read_exactly_said_once():
    gen = torch.Generator().manual_seed(0)
    q = (torch.randn(2, 4, 10, 8, generator=gen) * torch.tensor([0.1, 0.1, 6.0, 0.1]).view(1, 4, 1, 1)).requires_grad_()
    k, v = torch.randn(2, 4, 10, 8, generator=gen), torch.randn(2, 4, 10, 8, generator=gen)
    module = Attend().train()
    tracker = HeadMaxLogits([module], ["attend"])
    tracker._seen_call[0] = True
    tracker.exact, tracker.threshold = False, 5.0
    logit, _ = dense(q, k)
    with tracker.watching():
        module(q, k, v)
    exact, bound = tracker.read_both()
    assert bool((bound[0].double() > 5.0).any())
    torch.testing.assert_close(exact[0].double(), logit, rtol=1e-5, atol=1e-5)  # the heads QK-clip acts on: exact
    additive = torch.zeros(2, 1, 10, 10).masked_fill(torch.ones(10, 10, dtype=torch.bool).triu(1), -math.inf)
    additive[..., :3] -= 0.5  # an ALiBi-like bias enters the logsumexp: no bound of the logit
    tracker.threshold = None
    with pytest.warns(UserWarning, match="additive float mask enters the kernel's logsumexp") as said:
        with tracker.watching():
            module(q, k, v, attn_mask=additive)
            module(q, k, v, attn_mask=additive)
    assert sum("logsumexp" in str(w.message) for w in said) == 1
    assert tracker.read_both() == (None, None)  # no bound and no read step: not read at all
    tracker.exact = True  # a read step
    with tracker.watching():
        module(q, k, v, attn_mask=additive)
    exact, bound = tracker.read_both()
    assert exact is not None and torch.equal(exact, bound)


class FloatMaskGPT(torch.nn.Module):
    """One attention layer whose SDPA call gets an additive float mask (causal, ALiBi-like bias): no kernel bound."""

    def __init__(self) -> None:
        super().__init__()
        self.wte, self.head = torch.nn.Embedding(50, 16), torch.nn.Linear(16, 50)
        self.attn = FloatMaskAttention()

    def forward(self, ids):
        return self.head(self.attn(self.wte(ids)))


class FloatMaskAttention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.proj = torch.nn.Linear(16, 48), torch.nn.Linear(16, 16)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (t.view(b, n, 4, 4).transpose(1, 2) for t in self.qkv(x).split(16, dim=-1))
        mask = torch.zeros(n, n).masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -math.inf)
        mask = mask - 0.25 * (torch.arange(n)[:, None] - torch.arange(n)).clamp(min=0)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(out.transpose(1, 2).reshape(b, n, 16))


def test_a_layer_without_a_kernel_bound_is_read_on_its_read_steps_only():
    """``logit_every_n_steps=2``: the window logged at step 8 is the max over steps 4 and 6, not 5 and 7 too."""
    torch.manual_seed(0)
    model = FloatMaskGPT()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    logged = {}
    monitor = connmon.Monitor(model, every_n_steps=4, diagnostics=("walk",), logit_every_n_steps=2, optimizer=optimizer,
                              log=lambda values, step: logged.update({step: values}))  # fmt: skip
    reference = HeadMaxLogits([model.attn], ["attn"])  # every step read exactly
    tables = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(9):
            ids = torch.randint(0, 50, (4, 10), generator=torch.Generator().manual_seed(step))
            with reference.watching(), monitor.step(step):
                loss = torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.roll(-1, 1).flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            with torch.no_grad():
                model.attn.qkv.weight[:32] *= 1.2  # the logits grow step by step
            tables.append(reference.read()[0].max().item())
    assert tables[7] > tables[6] > tables[5] > tables[4]  # the test can tell: step 7's max is the largest
    assert logged[8]["connmon/step_max_logit/L00"] == pytest.approx(max(tables[4], tables[6]), rel=1e-6)


def clipped_run(every):
    torch.manual_seed(0)
    model, clip = TinyGPT(), QKClip(threshold=3.0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-2)
    logged = {}
    monitor = connmon.Monitor(model, every_n_steps=3, diagnostics=("walk",), optimizer=optimizer,
                              logit_every_n_steps=every, log=lambda values, step: logged.update({step: values}),
                              alerts=AlertRunner([], actions=("qk_clip",), qk_clip=clip))  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(7):
            ids = torch.randint(0, 50, (4, 10), generator=torch.Generator().manual_seed(step))
            with monitor.step(step):
                loss = torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.roll(-1, 1).flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    return model, clip, logged


def test_qk_clip_from_the_bound_clips_exactly_as_reading_every_step_exactly():
    exactly, exact_clip, _ = clipped_run(every=1)
    bounded, bound_clip, logged = clipped_run(every=25)
    assert bound_clip.clipped == exact_clip.clipped > 0
    assert all(torch.equal(a, b) for a, b in zip(exactly.parameters(), bounded.parameters(), strict=True))
    assert sorted(logged) == [0, 3, 6]
    for step in (3, 6):  # every step's bound since the last sample (step 0's sample comes before any step's)
        values = logged[step]
        for layer in ("L00", "L01"):
            bound = values[f"connmon/max_logit_bound/{layer}"]
            assert math.isfinite(bound)
            if f"connmon/step_max_logit/{layer}" in values:
                assert bound >= values[f"connmon/step_max_logit/{layer}"]
