"""Adam's coordinates that no gradient has given a scale (an attention key's bias: softmax ignores a shift shared by
all keys, so its gradient is analytically zero and Adam's step there is lr (1 - beta1) / eps) are left out of the
curvature reading, where they would multiply a gradient difference's round-off by 1e5: on models with key biases
(GPT-2's fused Conv1D qkv, BERT/MiniLM's key Linear, a hand-written attention with a biased k) the float32 reading
agrees with the float64 one, and leaving them out changes no float64 reading (they carry no curvature)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import transformers
from torch import nn

from connmon.curvature import sharpness_ratio, step_geometry

VOCAB = 32


class BiasedKey(nn.Module):
    """A hand-written causal attention with separate, biased q, k, v, o projections and a residual."""

    def __init__(self, d: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.emb = nn.Embedding(VOCAB, d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.head = nn.Linear(d, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        B, T, C = x.shape
        q, k, v = (m(x).view(B, T, self.heads, C // self.heads).transpose(1, 2) for m in (self.q, self.k, self.v))
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(C // self.heads)
        scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        return self.head(x + self.o((scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, C)))


def build(name: str) -> tuple[nn.Module, object, list[tuple[nn.Parameter, slice]]]:
    """The model, its loss, and where its key biases are (a parameter and the slice of it)."""
    torch.manual_seed(0)
    if name == "gpt2":
        config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                                         resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)  # fmt: skip
        model = transformers.GPT2LMHeadModel(config)
        keys = [(block.attn.c_attn.bias, slice(32, 64)) for block in model.transformer.h]
        return model, lambda m, ids: m(input_ids=ids, labels=ids).loss, keys
    if name == "bert":  # all-MiniLM-L6-v2's layout, smaller
        config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                         intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0,
                                         attention_probs_dropout_prob=0)  # fmt: skip
        model = transformers.BertForMaskedLM(config)
        keys = [(layer.attention.self.key.bias, slice(None)) for layer in model.bert.encoder.layer]
        return model, lambda m, ids: m(input_ids=ids, labels=ids).loss, keys
    model = BiasedKey()

    def next_token(m: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(m(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())

    return model, next_token, [(model.k.bias, slice(None))]


def batch(generator: torch.Generator) -> torch.Tensor:
    half = torch.randint(0, VOCAB, (16, 12), generator=generator)
    return torch.cat([half, half], 1)  # a copy task: attention that learns something


def in_float64(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[nn.Module, torch.optim.Optimizer]:
    wide = copy.deepcopy(model).double()
    wide_optimizer = torch.optim.AdamW(wide.parameters(), lr=optimizer.defaults["lr"])
    wide_optimizer.load_state_dict(optimizer.state_dict())
    for state in wide_optimizer.state.values():
        for key, value in state.items():
            if key != "step" and isinstance(value, torch.Tensor) and value.is_floating_point():
                state[key] = value.double()
    return wide, wide_optimizer


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "bert", "hand-written"])
def test_key_biases_are_left_out_and_the_float32_reading_agrees_with_float64(name):
    model, loss_fn, keys = build(name)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(0)
    for _ in range(40):
        loss = loss_fn(model, batch(generator))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    ids = batch(generator)

    geometry = step_geometry(optimizer, measured_only=True)
    sizes = {id(p): size for p, size in zip(geometry.params, geometry.step_sizes, strict=True)}
    kept = {id(p): size for p, size in zip(step_geometry(optimizer).params, step_geometry(optimizer).step_sizes,
                                            strict=True)}  # fmt: skip
    for bias, part in keys:
        assert torch.all(sizes[id(bias)][part] == 0)  # every key bias coordinate is left out
        assert float(kept[id(bias)][part].min()) > 1e3 * float(torch.cat([s.flatten() for s in kept.values()]).median())

    wide, wide_optimizer = in_float64(model, optimizer)
    exact = sharpness_ratio(lambda: loss_fn(wide, ids), wide_optimizer, model=wide, steps=60,
                            products="double_backward", eps_dominated="keep").ratio  # fmt: skip
    left_out = sharpness_ratio(lambda: loss_fn(wide, ids), wide_optimizer, model=wide, steps=60,
                               products="double_backward").ratio  # fmt: skip
    assert left_out == pytest.approx(exact, rel=1e-6)  # the key biases carry no curvature: nothing is lost
    reading = sharpness_ratio(lambda: loss_fn(model, ids), optimizer, model=model, steps=30).ratio
    assert reading == pytest.approx(exact, rel=0.05)  # the estimator: within 10% of exact on 97% of the suite
