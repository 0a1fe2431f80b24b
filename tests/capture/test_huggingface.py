"""Hugging Face transformers models built from config objects with random weights (no hub)."""

import pytest
import torch

import connmon
from tests.capture.models import sharpen

transformers = pytest.importorskip("transformers", minversion="5.0")

TOL = 1e-5


def check(records, names, heads, n, causal):
    assert [r.name for r in records] == names
    for record in records:
        assert record.attn.shape[1:] == (heads, n, n)
        assert record.reconstruction_error.item() <= TOL, (record.name, record.reconstruction_error)
        assert (record.attn.amax(-1) > 0.5).any()
        if causal:
            assert record.attn.triu(1).abs().max() == 0


def test_gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=32)
    model = sharpen(transformers.GPT2LMHeadModel(config).eval(), ("c_attn",), 3.0)
    before = model.config._attn_implementation
    records = connmon.capture(model, torch.randint(0, 64, (3, 10)))
    assert model.config._attn_implementation == before  # switched back
    check(records, ["transformer.h.0.attn", "transformer.h.1.attn"], 4, 10, causal=True)


def test_llama_gqa_rope_with_left_padding():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    model = sharpen(transformers.LlamaForCausalLM(config).eval(), ("q_proj", "k_proj"), 3.0)
    ids = torch.randint(0, 64, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :3] = 0  # left padding
    records = connmon.capture(model, input_ids=ids, attention_mask=mask)
    check(records, ["model.layers.0.self_attn", "model.layers.1.self_attn"], 4, 9, causal=True)
    record = records[0]
    assert record.w_v.shape == (4, 8, 32)
    torch.testing.assert_close(record.w_v[0], record.w_v[1])  # query heads 0 and 1 share kv head 0
    assert record.key_mask[1].tolist() == [False] * 3 + [True] * 6
    assert record.attn[1, :, 3:, :3].abs().max() == 0  # nobody reads the padding


def test_bert_with_padding():
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    model = sharpen(transformers.BertModel(config).eval(), ("query", "key"), 25.0)  # init std is 0.02
    ids = torch.randint(0, 64, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[0, -3:] = 0
    records = connmon.capture(model, input_ids=ids, attention_mask=mask)
    check(records, ["encoder.layer.0.attention.self", "encoder.layer.1.attention.self"], 4, 8, causal=False)
    assert records[0].key_mask[0].tolist() == [True] * 5 + [False] * 3
    assert records[0].attn[0, ..., -3:].abs().max() == 0


def test_vit():
    torch.manual_seed(0)
    config = transformers.ViTConfig(
        image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64,
    )  # fmt: skip
    model = sharpen(transformers.ViTModel(config, add_pooling_layer=False).eval(), ("q_proj", "k_proj"), 25.0)
    records = connmon.capture(model, pixel_values=torch.randn(2, 3, 16, 16))
    check(records, ["layers.0.attention", "layers.1.attention"], 4, 17, causal=False)  # 16 patches + [CLS]


def test_bert_decoder_cross_attention_is_skipped_with_a_warning():
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
        is_decoder=True, add_cross_attention=True, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    model = transformers.BertModel(config).eval()
    with pytest.warns(UserWarning, match="cross-attention"):
        records = connmon.capture(
            model, input_ids=torch.randint(0, 64, (2, 6)), encoder_hidden_states=torch.randn(2, 4, 32)
        )
    assert [r.name for r in records] == ["encoder.layer.0.attention.self"]
    assert records[0].attn.triu(1).abs().max() == 0  # decoder self-attention is causal
    assert records[0].reconstruction_error.item() <= TOL


def test_every_hf_model_inside_a_wrapper_is_captured_and_left_on_its_own_implementation():
    torch.manual_seed(0)
    gpt2 = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=32)
    llama = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attn_implementation="eager",
    )  # fmt: skip

    class Distill(torch.nn.Module):  # a teacher and a student, as a LightningModule would hold them
        def __init__(self):
            super().__init__()
            self.teacher = transformers.GPT2LMHeadModel(gpt2).eval()
            self.student = transformers.LlamaForCausalLM(llama).eval()

        def forward(self, ids):
            return self.teacher(ids).logits + self.student(ids).logits

    model = Distill()
    implementations = [model.teacher.config._attn_implementation, model.student.config._attn_implementation]
    ids = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        plain = model(ids)
    with connmon.capture.armed(model) as session, torch.no_grad():
        armed = model(ids)
    assert torch.equal(plain, armed)
    assert [r.name for r in session.records] == [
        "teacher.transformer.h.0.attn", "teacher.transformer.h.1.attn", "student.model.layers.0.self_attn"
    ]  # fmt: skip
    assert all(r.reconstruction_error.item() <= TOL for r in session.records)
    assert [model.teacher.config._attn_implementation, model.student.config._attn_implementation] == implementations
    assert implementations == ["sdpa", "eager"]  # each model ran, and was recorded, on its own implementation
