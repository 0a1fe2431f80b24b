"""Train a tiny GPT on a generated corpus with ConnectionMonitor and a WandbLogger, on a CPU, in about a minute.

The corpus is an order-2 Markov chain over 64 tokens (generated, no download). The model is nanoGPT-like (fused qkv,
F.scaled_dot_product_attention): 4 layers, width 128, 4 heads. ConnectionMonitor samples every attention layer every
25 steps on a fixed probe batch and streams the diagnostics to W&B (offline unless you are logged in) and to a CSV
log; at the end the script prints where the run is and writes a PNG summary.

    python examples/train_tiny_gpt.py [--steps 300] [--out runs/tiny_gpt]
"""

from __future__ import annotations

import argparse
import csv
import time
from pathlib import Path

import lightning as L
import torch
import wandb
from lightning.pytorch.loggers import CSVLogger, WandbLogger
from matplotlib.figure import Figure
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from connmon.callbacks import ConnectionMonitor

VOCAB, TOKENS = 64, 64


def markov_corpus(sequences: int, seed: int = 0) -> TensorDataset:
    """Sequences from a random sparse order-2 Markov chain: learnable structure, nothing downloaded."""
    gen = torch.Generator().manual_seed(seed)
    logits = 3.0 * torch.randn(VOCAB, VOCAB, VOCAB, generator=gen)  # (previous, current) -> next
    table = logits.softmax(-1)
    ids = torch.empty(sequences, TOKENS + 1, dtype=torch.long)
    ids[:, :2] = torch.randint(0, VOCAB, (sequences, 2), generator=gen)
    for t in range(2, TOKENS + 1):
        ids[:, t] = torch.multinomial(table[ids[:, t - 2], ids[:, t - 1]], 1, generator=gen).squeeze(-1)
    return TensorDataset(ids[:, :-1], ids[:, 1:])


class CausalSelfAttention(nn.Module):
    """nanoGPT's attention: fused qkv projection, SDPA, output projection."""

    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.c_attn, self.c_proj = nn.Linear(n_embd, 3 * n_embd), nn.Linear(n_embd, n_embd)
        self.n_head, self.n_embd = n_head, n_embd

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, T, C) -> (B, T, C)``."""
        B, T, C = x.shape  # batch, sequence length, width
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(n_embd), CausalSelfAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, T, C) -> (B, T, C)``."""
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyGPT(L.LightningModule):
    """4 layers, width 128, 4 heads; AdamW with a linear warmup."""

    def __init__(self, n_layer: int = 4, n_embd: int = 128, n_head: int = 4, lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.wte, self.wpe = nn.Embedding(VOCAB, n_embd), nn.Embedding(TOKENS, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f, self.head = nn.LayerNorm(n_embd), nn.Linear(n_embd, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """``(B, T)`` token ids -> ``(B, T, VOCAB)`` logits."""
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """Next-token cross-entropy."""
        idx, target = batch
        loss = nn.functional.cross_entropy(self(idx).flatten(0, 1), target.flatten())
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> dict:
        """AdamW, linear warmup over 50 steps."""
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.1)
        warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 50))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}


def summary_png(csv_path: Path, out: Path, run: str) -> None:
    """Loss and three connmon diagnostics per layer against the step, from the CSV log, titled with the run's name."""
    rows = list(csv.DictReader(csv_path.open()))
    fig = Figure(figsize=(12, 8), layout="constrained")
    fig.suptitle(f"connmon, tiny GPT: {run}")
    axes = fig.subplots(2, 2).ravel()
    panels = [
        ("train/loss", "training loss", "cross-entropy (nats)"),
        ("connmon/attention_entropy_normalized", "normalized attention entropy", "entropy / log(#keys)"),
        ("connmon/ov_isometry_gap", "OV isometry gap", "gap (0: an isometry)"),
        ("connmon/connection_spectral_radius", "spectral radius of the walk part of M / s", "|lambda_1|"),
    ]
    for ax, (key, title, ylabel) in zip(axes, panels, strict=True):
        columns = [key] if key in rows[0] else sorted(c for c in rows[0] if c.startswith(key + "/L"))
        for column in columns:
            points = [(int(r["step"]), float(r[column])) for r in rows if r.get(column)]
            if points:
                ax.plot(*zip(*points, strict=True), marker="." if column != "train/loss" else None, label=column[-3:])
        ax.set(title=title, xlabel="step", ylabel=ylabel)
        if len(columns) > 1:
            ax.legend(fontsize="small")
    fig.savefig(out, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", type=Path, default=Path("runs/tiny_gpt"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)

    train = DataLoader(markov_corpus(4096), batch_size=16, shuffle=True)
    probe = markov_corpus(4, seed=1).tensors[0]
    online = wandb.login(prompt=False, verify=False)  # never prompts: offline unless a key is already set up
    mode = "online" if online else "offline"  # passed to wandb.init: the reliable switch across wandb versions
    wandb_logger = WandbLogger(project="connmon-tiny-gpt", save_dir=str(args.out), mode=mode)
    csv_logger = CSVLogger(args.out, name="csv")
    # every sample is a full one here, so the spectral-radius panel covers the whole run (one point every 25 steps)
    monitor = ConnectionMonitor(every_n_steps=25, probe=probe, figures_every_n_samples=4, full_every_n_samples=1)
    trainer = L.Trainer(
        max_steps=args.steps, max_epochs=-(-args.steps // len(train)),  # a finite epoch count for the progress bar
        accelerator="cpu", devices=1, callbacks=[monitor], logger=[wandb_logger, csv_logger],
        log_every_n_steps=5, enable_checkpointing=False, enable_model_summary=False,
    )  # fmt: skip
    start = time.perf_counter()
    trainer.fit(TinyGPT(), train)
    seconds = time.perf_counter() - start

    run_dir = Path(wandb_logger.experiment.dir).parent
    experiment = wandb_logger.experiment  # an offline run has an id and no name
    run = f"W&B run {experiment.name or experiment.id}, CSV {Path(csv_logger.log_dir).name}"
    wandb_logger.experiment.finish()
    png = args.out / "connmon_summary.png"
    summary_png(Path(csv_logger.log_dir) / "metrics.csv", png, run)
    print(f"\ntrained {args.steps} steps in {seconds:.0f} s; ConnectionMonitor sampled {monitor.samples} times")
    print(
        "  (every 25 steps, each a full sample, figures every 4th: far denser than the quick start's "
        "every_n_steps=100, which costs this model's small steps about 5%: benchmarks/README.md)"
    )
    print(f"W&B run ({'online' if online else 'offline'}): {run_dir}")
    print(f"  look at it in the terminal:  wandb leet {run_dir}")
    if not online:
        print(f"  upload it later:             wandb sync {run_dir}   (after wandb login, once)")
    print(f"  read it in a script:         wandb leet inspect --json {run_dir}")
    print(f"CSV log: {csv_logger.log_dir}/metrics.csv")
    print(f"  figures of this run:         connmon report {csv_logger.log_dir}")
    print(f"summary figure ({run}): {png}")


if __name__ == "__main__":
    main()
