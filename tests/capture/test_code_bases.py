"""Real model code that users train, read unchanged: nanoGPT and minGPT (vendored under tests/vendored with their
MIT licenses), x-transformers and litgpt (installed from the registry), a torchtitan-style flex_attention module.

For each: every self-attention layer recorded exactly in eval mode, and arming changes neither outputs nor gradients
(train and eval, dropout on, the same seed).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import connmon
from tests.capture.code_bases import CODE_BASES, TOKENS, VOCAB, build, flex_model, logits

TOL = 1e-5


@pytest.mark.parametrize("code_base", list(CODE_BASES))
def test_every_self_attention_layer_is_recorded_exactly(code_base, monkeypatch):
    model, names = build(code_base, monkeypatch)
    ids = torch.randint(0, VOCAB, (3, TOKENS), generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not one warning: every layer is read
        records = connmon.capture(model.eval(), ids, dtype=torch.float64)
    assert [r.name for r in records] == names
    for record in records:
        assert record.attn.shape == (2, 4, TOKENS, TOKENS)
        assert record.reconstruction_error.item() <= TOL
        assert torch.equal(record.attn.triu(1), torch.zeros_like(record.attn))  # causal, as these models are


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("code_base", list(CODE_BASES))
def test_arming_changes_neither_outputs_nor_gradients(code_base, mode, monkeypatch):
    model, names = build(code_base, monkeypatch)
    model.train(mode == "train")
    ids = torch.randint(0, VOCAB, (3, TOKENS), generator=torch.Generator().manual_seed(1))

    def run(armed: bool) -> tuple[torch.Tensor, list[torch.Tensor], list]:
        model.zero_grad()
        torch.manual_seed(7)  # the same dropout masks
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # dropout in train mode: records unverifiable, said once
            if armed:
                with connmon.capture.armed(model) as session:
                    out = logits(model, ids)
            else:
                out, session = logits(model, ids), None
        out.float().square().mean().backward()
        return out.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None], session

    plain, plain_grads, _ = run(False)
    armed, armed_grads, session = run(True)
    assert torch.equal(plain, armed)
    assert len(plain_grads) == len(armed_grads) and all(map(torch.equal, plain_grads, armed_grads))
    assert [r.name for r in session.records] == names
    assert torch._C._len_torch_function_stack() == 0  # the reading mode is gone with the forward


def test_flex_attention_is_read_from_its_own_score_and_mask_functions():
    """torchtitan 0.3.0 needs spmd_types and a newer torch, so this module is written the way its FlexAttention is.

    flex_attention has no backward on CPU: the forward is checked here; benchmarks/gpu.sh trains it on CUDA.
    """
    torch.manual_seed(0)
    model, flex_class = flex_model()
    model.eval()
    compiled = vars(flex_class)["_compiled_flex_attn"]
    ids = torch.randint(0, VOCAB, (3, TOKENS), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = model(ids)
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="connmon")
            with connmon.capture.armed(model, dtype=torch.float64) as session:
                armed = model(ids)
    assert torch.equal(plain, armed)
    assert vars(flex_class)["_compiled_flex_attn"] is compiled  # unwrapped again
    assert [r.name for r in session.records] == ["layers.0", "layers.1"]
    for record in session.records:
        assert record.reconstruction_error.item() <= TOL
        assert float(record.attn[:, :, 7, :5].abs().max()) == 0.0  # the second document never reads the first
        assert float(record.attn[0, 3, 4, :5].sum()) == pytest.approx(1.0, abs=1e-6)  # its own rows sum to 1


def test_flex_attention_window_of_a_bidirectional_call_is_renormalized():
    from torch.nn.attention.flex_attention import flex_attention

    from connmon.capture.adapters.flex import flex_scores

    q, k = torch.randn(2, 2, 8, 4, dtype=torch.float64), torch.randn(2, 2, 8, 4, dtype=torch.float64)
    probs, _, cut = flex_scores(q, k, score_mod=None, block_mask=None, scale=0.3, window=8, sequences=2)
    reference = torch.softmax(q @ k.mT * 0.3, dim=-1)
    assert not cut and torch.allclose(probs, reference, atol=1e-12)
    v = torch.eye(8, dtype=torch.float64).expand(2, 2, 8, 8)
    assert torch.allclose(flex_attention(q, k, v, scale=0.3), reference, atol=1e-12)  # flex agrees
    window, _, cut = flex_scores(q, k, score_mod=None, block_mask=None, scale=0.3, window=5, sequences=1)
    assert cut and torch.allclose(window, torch.softmax(q[:1, :, :5] @ k[:1, :, :5].mT * 0.3, dim=-1), atol=1e-12)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex_attention has no backward on CPU: benchmarks/gpu.sh")
def test_flex_attention_trains_unchanged_on_cuda():
    torch.manual_seed(0)
    model, _ = flex_model()
    model = model.cuda().train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, VOCAB, (3, TOKENS), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    twin = copy.deepcopy(model)
    twin_optimizer = torch.optim.AdamW(twin.parameters(), lr=1e-3)
    for step in range(3):
        with connmon.capture.armed(model) as session:
            loss = model(ids).square().mean()
        loss.backward()
        twin_loss = twin(ids).square().mean()
        twin_loss.backward()
        assert torch.equal(loss, twin_loss), step
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), twin.parameters(), strict=True))
        assert [r.name for r in session.records] == ["layers.0", "layers.1"]
        assert all(r.reconstruction_error.item() <= 1e-3 for r in session.records)
        for opt in (optimizer, twin_optimizer):
            opt.step()
            opt.zero_grad()
