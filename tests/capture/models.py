"""Small models for capture tests, built from code or config objects with random weights (no hub)."""

from __future__ import annotations

import math

import torch
from torch import nn


class CausalSelfAttention(nn.Module):
    """nanoGPT's attention: fused qkv Linear, output Linear, F.scaled_dot_product_attention."""

    def __init__(self, n_embd: int = 32, n_head: int = 4, dropout: float = 0.0) -> None:
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.resid_dropout = nn.Dropout(dropout)
        self.n_head, self.n_embd, self.dropout = n_head, n_embd, dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()  # batch, sequence length, embedding width
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        y = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class Block(nn.Module):
    def __init__(self, n_embd: int = 32, n_head: int = 4) -> None:
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(n_embd), CausalSelfAttention(n_embd, n_head)
        self.ln_2, self.mlp = (
            nn.LayerNorm(n_embd),
            nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd)),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 50, n_embd: int = 32, n_head: int = 4, n_layer: int = 2, checkpoint: bool = False):
        super().__init__()
        self.wte = nn.Embedding(vocab, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.head = nn.Linear(n_embd, vocab)
        self.checkpoint = checkpoint
        for block in self.blocks:  # sharper attention than the default init
            block.attn.c_attn.weight.data[: 2 * n_embd] *= 4 / math.sqrt(n_embd) * 4

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False) if self.checkpoint else block(x)
        return self.head(x)


class SplitAttention(nn.Module):
    """torchtitan's layout: separate q, k, v and output projections, heads inferred from the (local) width."""

    def __init__(self, d: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.head_dim = d // heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = (w(x).view(b, n, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H / tp, n, head_dim)
        return self.wo(y.transpose(1, 2).reshape(b, n, -1))


class SplitBlock(nn.Module):
    def __init__(self, d: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.ln_1, self.attn, self.ln_2 = nn.LayerNorm(d), SplitAttention(d, heads), nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class SplitGPT(nn.Module):
    """A GPT whose attention and MLPs tensor parallelism can shard (:func:`tensor_parallel`)."""

    def __init__(self, vocab: int = 50, d: int = 32, heads: int = 4, n_layer: int = 2) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(SplitBlock(d, heads) for _ in range(n_layer))
        self.head = nn.Linear(d, vocab)
        for block in self.blocks:  # sharper attention than the default init
            block.attn.wq.weight.data *= 4
            block.attn.wk.weight.data *= 4

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def tensor_parallel(model: SplitGPT, mesh: object) -> SplitGPT:
    """Shard every block's attention heads and MLP over ``mesh`` (ColwiseParallel in, RowwiseParallel out)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    for block in model.blocks:
        plan = {"wq": ColwiseParallel(), "wk": ColwiseParallel(), "wv": ColwiseParallel(), "wo": RowwiseParallel()}
        parallelize_module(block.attn, mesh, plan)
        parallelize_module(block.mlp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return model


def sharpen(model: nn.Module, names: tuple[str, ...], factor: float = 4.0) -> nn.Module:
    """Scale query/key projection weights so attention is far from uniform."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("weight") and any(f".{n}." in f".{name}" for n in names):
                parameter.mul_(factor)
    return model
