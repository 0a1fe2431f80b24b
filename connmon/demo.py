"""A small causal transformer built from code, for ``connmon analyze demo`` and quick experiments (no download).

Examples:
    >>> import torch
    >>> from connmon.demo import DemoGPT
    >>> model = DemoGPT()
    >>> tuple(model(torch.randint(0, model.vocab_size, (2, 16))).shape)
    (2, 16, 256)
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["DemoGPT"]


class DemoGPT(nn.Module):
    """Token and position embeddings, pre-LN ``nn.TransformerEncoderLayer`` blocks with a causal mask, a linear head.

    Weights are random but seeded (every run of the demo reads the same model), independent across layers, with
    query and key maps scaled by 2 so that attention is sharper than at initialization.

    Args:
        vocab_size: number of token ids.
        max_tokens: longest sequence.
        width: model width ``d``.
        heads: attention heads.
        layers: transformer blocks.
        seed: seed of the initialization.
    """

    def __init__(
        self, vocab_size: int = 256, max_tokens: int = 512, width: int = 64, heads: int = 4, layers: int = 4,
        seed: int = 0,
    ) -> None:  # fmt: skip
        super().__init__()
        generator_state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        self.vocab_size = vocab_size
        self.tokens, self.positions = nn.Embedding(vocab_size, width), nn.Embedding(max_tokens, width)
        block = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab_size)
        for layer in self.blocks.layers:  # TransformerEncoder deep-copies one layer: give each its own weights
            for module in layer.modules():
                if isinstance(module, nn.MultiheadAttention):
                    module._reset_parameters()
                    module.in_proj_weight.data[: 2 * width] *= 2.0  # sharper attention, as after some training
                elif hasattr(module, "reset_parameters") and module is not layer:
                    module.reset_parameters()
        torch.random.set_rng_state(generator_state)
        self.eval()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``(B, n)`` token ids -> ``(B, n, vocab_size)`` logits."""
        n = ids.shape[1]
        x = self.tokens(ids) + self.positions(torch.arange(n, device=ids.device))  # (B, n, d)
        causal = nn.Transformer.generate_square_subsequent_mask(n, device=ids.device)
        return self.head(self.blocks(x, mask=causal, is_causal=True))
