"""A tiny GPT LightningModule on a generated corpus, for callback tests (no downloads)."""

from __future__ import annotations

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from tests.capture.models import SplitGPT, TinyGPT, tensor_parallel

VOCAB, TOKENS = 50, 12


def corpus(n: int = 64, seed: int = 0) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n, TOKENS + 1), generator=gen)
    return TensorDataset(ids[:, :-1], ids[:, 1:])


class LitGPT(L.LightningModule):
    def __init__(self, n_layer: int = 2, lr: float = 1e-2, sharded: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = TinyGPT(vocab=VOCAB, n_layer=n_layer)
        self.lr = lr
        self.sharded = sharded  # FSDP2: configure_model shards each Block with fully_shard
        self.modes: list[bool] = []  # train/eval mode seen by each training step

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def training_step(self, batch, batch_idx):
        self.modes.append(self.training)
        idx, target = batch
        logits = self(idx)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())

    def configure_model(self) -> None:
        if not self.sharded:
            return
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class LitSplitGPT(LitGPT):
    """LitGPT with separate q, k, v projections; ``tensor_parallel``: ModelParallelStrategy's ``configure_model``
    shards every block's attention heads and MLP over the "tensor_parallel" mesh dimension."""

    def __init__(self, lr: float = 1e-2, tensor_parallel: bool = False) -> None:
        super().__init__(lr=lr)
        torch.manual_seed(0)
        self.model = SplitGPT(vocab=VOCAB)
        self.tensor_parallel = tensor_parallel

    def configure_model(self) -> None:
        if self.tensor_parallel:
            tensor_parallel(self.model, self.device_mesh["tensor_parallel"])


def loader(batch_size: int = 4, seed: int = 0) -> DataLoader:
    return DataLoader(corpus(seed=seed), batch_size=batch_size, shuffle=False)
