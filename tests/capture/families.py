"""Every transformers family connmon is tested on, built tiny from its config (random weights, no hub).

``python -m tests.capture.families`` prints docs/capture.md's coverage table from real captures; tests/test_readme.py checks
that the table there is that output, so the table is generated, never hand-written.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch

import connmon

VOCAB, TOKENS, WIDTH, HEADS = 64, 10, 32, 4


@dataclass(frozen=True)
class Family:
    """A model family: how to build it tiny, and what its forward takes."""

    name: str
    model_class: str
    config_class: str
    config: dict
    inputs: str = "ids"  # "ids", "ids+decoder" (encoder-decoder), "pixels"
    causal: bool = True

    def build(self) -> torch.nn.Module:
        import transformers

        torch.manual_seed(0)
        config = getattr(transformers, self.config_class)(**self.config)
        model = getattr(transformers, self.model_class)(config)
        sharpen(model)
        return model

    def batch(self, batch: int = 3, tokens: int = TOKENS) -> dict[str, Any]:
        gen = torch.Generator().manual_seed(1)
        if self.inputs == "pixels":
            return {"pixel_values": torch.randn(batch, 3, 16, 16, generator=gen)}
        ids = torch.randint(1, VOCAB, (batch, tokens), generator=gen)
        mask = torch.ones(batch, tokens, dtype=torch.long)
        mask[-1, -3:] = 0  # right padding in the last sequence (not recorded by default: checks the masks' batch)
        out = {"input_ids": ids, "attention_mask": mask}
        if self.inputs == "ids+decoder":
            out["decoder_input_ids"] = torch.randint(1, VOCAB, (batch, tokens - 2), generator=gen)
        return out


def sharpen(model: torch.nn.Module, factor: float = 6.0) -> None:
    """Scale query and key weights so attention is far from uniform (init std 0.02 gives nearly uniform maps)."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            leaf = name.rsplit(".", 2)[-2] if name.count(".") else name
            if name.endswith("weight") and leaf in {"q_proj", "k_proj", "query", "key", "q", "k", "q_lin", "k_lin"}:
                parameter.mul_(factor)


_DECODER = dict(
    vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=64, num_hidden_layers=2, max_position_embeddings=64
)
_GQA = dict(num_attention_heads=HEADS, num_key_value_heads=2)

FAMILIES = [
    Family("GPT-2", "GPT2LMHeadModel", "GPT2Config", dict(vocab_size=VOCAB, n_embd=WIDTH, n_layer=2, n_head=HEADS, n_positions=64)),
    Family("GPT-J", "GPTJForCausalLM", "GPTJConfig", dict(vocab_size=VOCAB, n_embd=WIDTH, n_layer=2, n_head=HEADS, n_positions=64, rotary_dim=4)),
    Family("GPT-NeoX", "GPTNeoXForCausalLM", "GPTNeoXConfig", dict(_DECODER, num_attention_heads=HEADS)),
    Family("OPT", "OPTForCausalLM", "OPTConfig", dict(vocab_size=VOCAB, hidden_size=WIDTH, ffn_dim=64, num_hidden_layers=2, num_attention_heads=HEADS, max_position_embeddings=64, word_embed_proj_dim=WIDTH)),
    Family("Bloom", "BloomForCausalLM", "BloomConfig", dict(vocab_size=VOCAB, hidden_size=WIDTH, n_layer=2, n_head=HEADS)),
    Family("Falcon", "FalconForCausalLM", "FalconConfig", dict(vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=2, num_attention_heads=HEADS)),
    Family("Falcon (new decoder, GQA)", "FalconForCausalLM", "FalconConfig", dict(vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=2, num_attention_heads=HEADS, num_kv_heads=2, new_decoder_architecture=True)),
    Family("Phi", "PhiForCausalLM", "PhiConfig", dict(_DECODER, num_attention_heads=HEADS)),
    Family("Phi3", "Phi3ForCausalLM", "Phi3Config", dict(_DECODER, **_GQA, pad_token_id=0)),
    Family("LLaMA", "LlamaForCausalLM", "LlamaConfig", dict(_DECODER, **_GQA)),
    Family("Mistral", "MistralForCausalLM", "MistralConfig", dict(_DECODER, **_GQA, sliding_window=4)),
    Family("Mixtral", "MixtralForCausalLM", "MixtralConfig", dict(_DECODER, **_GQA, num_local_experts=2, num_experts_per_tok=1)),
    Family("Qwen2", "Qwen2ForCausalLM", "Qwen2Config", dict(_DECODER, **_GQA)),
    Family("Qwen3", "Qwen3ForCausalLM", "Qwen3Config", dict(_DECODER, **_GQA, head_dim=8)),
    Family("Gemma", "GemmaForCausalLM", "GemmaConfig", dict(_DECODER, **_GQA, head_dim=8)),
    Family("Gemma2", "Gemma2ForCausalLM", "Gemma2Config", dict(_DECODER, **_GQA, head_dim=8, sliding_window=4)),
    Family("Gemma3", "Gemma3ForCausalLM", "Gemma3TextConfig", dict(_DECODER, **_GQA, head_dim=8, sliding_window=4)),
    Family("OLMo", "OlmoForCausalLM", "OlmoConfig", dict(_DECODER, **_GQA)),
    Family("OLMo2", "Olmo2ForCausalLM", "Olmo2Config", dict(_DECODER, **_GQA)),
    Family("StarCoder2", "Starcoder2ForCausalLM", "Starcoder2Config", dict(_DECODER, **_GQA)),
    Family("GPT-OSS", "GptOssForCausalLM", "GptOssConfig", dict(_DECODER, **_GQA, head_dim=8, num_local_experts=2, num_experts_per_tok=1, sliding_window=4)),
    Family("ModernBERT", "ModernBertModel", "ModernBertConfig", dict(vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=2, num_attention_heads=HEADS, intermediate_size=64, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2, local_attention=4), causal=False),
    Family("DeepSeek-V3", "DeepseekV3ForCausalLM", "DeepseekV3Config", dict(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=HEADS, num_key_value_heads=HEADS, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8)),
    Family("BERT", "BertModel", "BertConfig", dict(vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=2, num_attention_heads=HEADS, intermediate_size=64, max_position_embeddings=64), causal=False),
    Family("RoBERTa", "RobertaModel", "RobertaConfig", dict(vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=2, num_attention_heads=HEADS, intermediate_size=64, max_position_embeddings=64), causal=False),
    Family("DistilBERT", "DistilBertModel", "DistilBertConfig", dict(vocab_size=VOCAB, dim=WIDTH, n_layers=2, n_heads=HEADS, hidden_dim=64, max_position_embeddings=64), causal=False),
    Family("ALBERT", "AlbertModel", "AlbertConfig", dict(vocab_size=VOCAB, embedding_size=16, hidden_size=WIDTH, num_hidden_layers=2, num_attention_heads=HEADS, intermediate_size=64, max_position_embeddings=64), causal=False),
    Family("ViT", "ViTModel", "ViTConfig", dict(image_size=16, patch_size=4, hidden_size=WIDTH, num_hidden_layers=2, num_attention_heads=HEADS, intermediate_size=64), inputs="pixels", causal=False),
    Family("T5", "T5Model", "T5Config", dict(vocab_size=VOCAB, d_model=WIDTH, d_kv=8, d_ff=64, num_layers=2, num_heads=HEADS), inputs="ids+decoder", causal=False),
    Family("BART", "BartModel", "BartConfig", dict(vocab_size=VOCAB, d_model=WIDTH, encoder_layers=2, decoder_layers=2, encoder_attention_heads=HEADS, decoder_attention_heads=HEADS, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64), inputs="ids+decoder", causal=False),
]  # fmt: skip


@dataclass
class Coverage:
    """What a capture of one family gave: layers recorded exactly, layers skipped and why."""

    family: Family
    implementation: str
    recorded: list[str]
    worst_error: float
    skipped: dict[str, str]  # layer -> reason (the warning's text)


def capture_family(family: Family) -> Coverage:
    """Capture one eval-mode forward of the family's tiny model, keeping the warnings it gave."""
    model = family.build().eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            records = connmon.capture(model, **family.batch())
        except ValueError:  # no readable attention at all: the warnings say why, layer by layer
            records = []
    skipped = {}
    for warning in caught:
        text = str(warning.message)
        if text.startswith("connmon: "):
            layer = text.removeprefix("connmon: ").split(" ", 1)[0]
            skipped[layer] = text
    errors = [r.reconstruction_error.item() for r in records]
    implementation = model.config._attn_implementation
    return Coverage(family, implementation, [r.name for r in records], max(errors, default=float("nan")), skipped)


def _reason(text: str) -> str:
    if "looks like attention" in text:
        return "attention computed by hand (no SDPA or transformers attention function)"
    return text.split("is not recorded: ", 1)[-1].split(";")[0].split(" (")[0]


def coverage_table() -> str:
    """docs/capture.md's coverage table, from a capture of every family."""
    lines = [
        "| family | attention | layers recorded | max reconstruction error | not recorded |",
        "| --- | --- | --- | --- | --- |",
    ]
    for family in FAMILIES:
        result = capture_family(family)
        kinds = sorted({name.rsplit(".", 1)[-1] if "." in name else name for name in result.skipped})
        reasons = sorted({_reason(text) for text in result.skipped.values()})
        error = "-" if not result.recorded else f"{result.worst_error:.0e}"
        missing = "; ".join(f"{', '.join(kinds)}: {r}" for r in reasons) if reasons else ""
        lines.append(f"| {family.name} | {result.implementation} | {len(result.recorded)} | {error} | {missing} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(coverage_table())
