"""Real model code that users train, built tiny: nanoGPT and minGPT (vendored under tests/vendored with their MIT
licenses, unchanged), x-transformers and litgpt (installed from the registry), a torchtitan-style flex module.

``python -m tests.capture.code_bases`` prints docs/capture.md's code-base table from real captures; tests/test_readme.py
checks that the table there is that output.
"""

from __future__ import annotations

import contextlib
import io
import sys
import warnings
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from torch import nn

import connmon

sys.path.insert(0, str(Path(__file__).parents[1] / "vendored"))  # nanoGPT's and minGPT's own files, unchanged

VOCAB, TOKENS = 64, 12


def nanogpt(flash: bool, monkeypatch: pytest.MonkeyPatch) -> nn.Module:
    from nanogpt.model import GPT, GPTConfig

    if not flash:  # nanoGPT takes its hand-written path where torch has no SDPA
        monkeypatch.delattr(torch.nn.functional, "scaled_dot_product_attention")
    model = GPT(GPTConfig(block_size=32, vocab_size=VOCAB, n_layer=2, n_head=4, n_embd=32, dropout=0.1))
    monkeypatch.undo()
    assert all(block.attn.flash is flash for block in model.transformer.h)
    return model


def mingpt(monkeypatch: pytest.MonkeyPatch) -> nn.Module:
    from mingpt.model import GPT

    config = GPT.get_default_config()
    config.merge_from_dict(dict(model_type=None, n_layer=2, n_head=4, n_embd=32, vocab_size=VOCAB, block_size=32))
    return GPT(config)


def x_transformers(flash: bool, monkeypatch: pytest.MonkeyPatch, kv_heads: int | None = None) -> nn.Module:
    from x_transformers import Decoder, TransformerWrapper

    layers = Decoder(dim=32, depth=2, heads=4, attn_dim_head=8, attn_kv_heads=kv_heads, attn_flash=flash,
                     attn_dropout=0.1)  # fmt: skip
    return TransformerWrapper(num_tokens=VOCAB, max_seq_len=32, attn_layers=layers)


def litgpt(softcap: float | None, monkeypatch: pytest.MonkeyPatch) -> nn.Module:
    from litgpt.config import Config
    from litgpt.model import GPT

    config = Config(n_layer=2, n_embd=32, n_head=4, n_query_groups=2, block_size=32, vocab_size=VOCAB,
                    padded_vocab_size=VOCAB, attention_logit_softcapping=softcap, norm_qk=True, bias=False)  # fmt: skip
    return GPT(config)


CODE_BASES = {
    "nanoGPT flash": (lambda mp: nanogpt(True, mp), "transformer.h.{}.attn"),
    "nanoGPT by hand": (lambda mp: nanogpt(False, mp), "transformer.h.{}.attn"),
    "minGPT": (mingpt, "transformer.h.{}.attn"),
    "x-transformers einsum": (lambda mp: x_transformers(False, mp), "attn_layers.layers.{}.1"),
    "x-transformers flash": (lambda mp: x_transformers(True, mp), "attn_layers.layers.{}.1"),
    "x-transformers GQA": (lambda mp: x_transformers(False, mp, kv_heads=2), "attn_layers.layers.{}.1"),
    "litgpt": (lambda mp: litgpt(None, mp), "transformer.h.{}.attn"),
    "litgpt soft-capping": (lambda mp: litgpt(20.0, mp), "transformer.h.{}.attn"),
}
_LAYER_INDEX = {"attn_layers.layers.{}.1": (0, 2)}  # x-transformers interleaves attention (0, 2) and feedforward


def build(code_base: str, monkeypatch: pytest.MonkeyPatch) -> tuple[nn.Module, list[str]]:
    if code_base.startswith("x-transformers"):
        pytest.importorskip("x_transformers")
    if code_base.startswith("litgpt"):
        pytest.importorskip("litgpt")
    make, pattern = CODE_BASES[code_base]
    torch.manual_seed(0)
    model = make(monkeypatch)
    return model, [pattern.format(i) for i in _LAYER_INDEX.get(pattern, (0, 1))]


def logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    out = model(ids)
    return out[0] if isinstance(out, tuple) else out


def flex_model():
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    class FlexAttention(nn.Module):
        """As torchtitan's: a compiled flex_attention held by the class, called through the class."""

        _compiled_flex_attn: ClassVar = torch.compile(flex_attention, backend="eager")

        def forward(self, q, k, v, block_mask, score_mod=None):
            return FlexAttention._compiled_flex_attn(q, k, v, block_mask=block_mask, score_mod=score_mod)

    class Attention(nn.Module):
        def __init__(self, dim=32, heads=4, kv_heads=2):
            super().__init__()
            self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
            self.wq = nn.Linear(dim, dim, bias=False)
            self.wk = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
            self.wv = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
            self.wo = nn.Linear(dim, dim, bias=False)
            self.inner_attention = FlexAttention()
            self.register_buffer("slopes", 2.0 ** -torch.arange(1, heads + 1.0))

        def forward(self, x, block_mask):
            b, n, _ = x.shape
            q = self.wq(x).view(b, n, self.heads, self.head_dim).transpose(1, 2)
            k, v = (w(x).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2) for w in (self.wk, self.wv))
            k, v = (t.repeat_interleave(self.heads // self.kv_heads, dim=1) for t in (k, v))

            def alibi(score, batch, head, q_idx, kv_idx):
                return score - self.slopes[head] * (q_idx - kv_idx)

            y = self.inner_attention(q, k, v, block_mask, score_mod=alibi)
            return self.wo(y.transpose(1, 2).reshape(b, n, -1))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.layers = nn.Embedding(VOCAB, 32), nn.ModuleList([Attention(), Attention()])

        def forward(self, ids):
            def document_causal(batch, head, q_idx, kv_idx):
                return (q_idx >= kv_idx) & ((q_idx < 5) == (kv_idx < 5))  # two documents packed in one row

            mask = create_block_mask(document_causal, None, None, ids.shape[1], ids.shape[1], device=ids.device)
            x = self.embed(ids)
            for layer in self.layers:
                x = x + layer(x, mask)
            return x

    return Model(), FlexAttention


def coverage_table() -> str:
    """docs/capture.md's code-base table: an eval-mode capture of each code base, with the warnings it gave."""
    lines = ["| code base | layers recorded | max reconstruction error | not recorded |", "| --- | --- | --- | --- |"]
    ids = torch.randint(0, VOCAB, (3, TOKENS), generator=torch.Generator().manual_seed(1))
    models = {name: lambda name=name: build(name, pytest.MonkeyPatch())[0] for name in CODE_BASES}
    models["torchtitan-style flex_attention"] = lambda: flex_model()[0]
    for name, make in models.items():
        torch.manual_seed(0)
        with contextlib.redirect_stdout(io.StringIO()):  # nanoGPT and minGPT print their sizes
            model = make().eval()
        with warnings.catch_warnings(record=True) as caught, torch.no_grad():
            warnings.simplefilter("always")
            records = connmon.capture(model, ids)
        skipped = sorted({str(w.message).split(" is not recorded: ")[-1].split(";")[0] for w in caught
                          if str(w.message).startswith("connmon: ")})  # fmt: skip
        error = f"{max(r.reconstruction_error.item() for r in records):.0e}" if records else "-"
        lines.append(f"| {name} | {len(records)} | {error} | {'; '.join(skipped)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(coverage_table())
