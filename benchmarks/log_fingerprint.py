"""What a monitored run logs, as one fingerprint per entry point: to hold a refactoring to "behaviour unchanged".

Three short seeded runs on this machine's CPU, each with the attention monitor, the curvature sampler and alerts
whose actions (stop request, back-off, restore point) all fire: a plain loop (``connmon.Monitor``), Lightning
(``ConnectionMonitor`` + ``SharpnessMonitor`` + ``DriftAlert``) and the Hugging Face ``Trainer``
(``ConnectionMonitorCallback``). Every logged row (its step, keys and values as float64 bits), the alerts and the
restore points' names are hashed; cost keys (``connmon/overhead*``: wall-clock) and timestamps are left out. Run it
on two commits of one machine and compare the table: equal hashes mean bitwise-equal logs.

    python benchmarks/log_fingerprint.py            # the table
    python benchmarks/log_fingerprint.py --rows     # also every row, to see where two commits differ
    python benchmarks/log_fingerprint.py --by-step  # rows of one step merged first: the values, not how they were
                                                    # split into logger calls (W&B merges a step's calls too)
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import hashlib
import io
import json
import math
import os
import struct
import sys
import tempfile
import warnings
from pathlib import Path

import torch
from torch import nn

import connmon
from connmon.alerts import AlertRunner, RestorePoints, Rule, Threshold

EDGE = "past the edge of stability"  # the rule the back-off acts on
STEPS = 12


class TinyGPT(nn.Module):
    """A causal 2-layer transformer on 32 tokens."""

    def __init__(self, vocab: int = 32, width: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        block = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:  # noqa: D102
        mask = nn.Transformer.generate_square_subsequent_mask(idx.shape[1])
        return self.head(self.blocks(self.embed(idx), mask=mask, is_causal=True))


def data(steps: int = STEPS) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, 32, (4, 12), generator=generator) for _ in range(steps)]


def rules() -> list[Rule]:
    return [
        Rule(EDGE, "connmon/sharpness_ratio", Threshold(0.0), cooldown=4),
        Rule("any logit", "connmon/max_attention_logit/L*", Threshold(-1.0), cooldown=4, since=3),
    ]


def loss_of(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch).flatten(0, 1), batch.flatten())


def sampler() -> object:
    try:
        from connmon.curvature.sampler import SharpnessSampler
    except ImportError:  # before the curvature package
        from connmon.integrations.sharpness import SharpnessSampler
    return SharpnessSampler(every_n_steps=3)


def plain(folder: Path) -> dict:
    torch.manual_seed(0)
    model = TinyGPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rows: list[dict] = []
    runner = AlertRunner(rules(), actions=("log", "backoff", "checkpoint"), restore_points=RestorePoints(
        keep=2, dirpath=folder / "points"))  # fmt: skip
    monitor = connmon.Monitor(
        model, every_n_steps=2, alerts=runner, optimizer=optimizer, sharpness=sampler(), loss_fn=loss_of,
        log=lambda values, step: rows.append({"step": step, **values}),
    )  # fmt: skip
    for step, batch in enumerate(data()):
        with monitor.step(step, batch=batch):
            loss = loss_of(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    monitor.close()
    return {"rows": rows, "alerts": [repr(a) for a in runner.alerts], "files": sorted(os.listdir(folder / "points"))}


def lightning(folder: Path) -> dict:
    import lightning as L
    from lightning.pytorch.loggers import CSVLogger

    from connmon.callbacks import ConnectionMonitor, DriftAlert, SharpnessMonitor

    class Lit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = TinyGPT()

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            loss = loss_of(self.model, batch[0])
            self.log("loss", loss)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    torch.manual_seed(0)
    module = Lit()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.cat(data())), batch_size=4)
    alert = DriftAlert(rules(), actions=("log", "backoff", "checkpoint"),
                       restore_points=RestorePoints(keep=2, dirpath=folder / "points"))  # fmt: skip
    trainer = L.Trainer(
        max_steps=STEPS, accelerator="cpu", devices=1, logger=CSVLogger(folder), log_every_n_steps=1,
        callbacks=[ConnectionMonitor(every_n_steps=2), SharpnessMonitor(
            lambda m, batch: loss_of(m.model, batch[0]), every_n_steps=3), alert],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=folder,
    )  # fmt: skip
    trainer.fit(module, loader)
    with open(next(folder.rglob("metrics.csv"))) as file:
        rows = [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(file)]
    return {"rows": rows, "alerts": [repr(a) for a in alert.alerts], "files": sorted(os.listdir(folder / "points"))}


def hugging_face(folder: Path) -> dict:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from connmon.integrations.transformers import ConnectionMonitorCallback

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=32, n_positions=16, n_embd=32, n_layer=2, n_head=4, attn_implementation="eager")
    model = GPT2LMHeadModel(config)
    dataset = [{"input_ids": row, "labels": row} for batch in data() for row in batch]
    args = TrainingArguments(
        output_dir=str(folder), max_steps=STEPS, per_device_train_batch_size=4, learning_rate=1e-2,
        logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, seed=0, data_seed=0,
        dataloader_num_workers=0, disable_tqdm=True,
    )  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=dataset)
    runner = AlertRunner(rules(), actions=("log", "backoff", "checkpoint"))
    callback = ConnectionMonitorCallback(trainer, every_n_steps=2, alerts=runner, sharpness=sampler())
    trainer.add_callback(callback)
    trainer.train()
    rows = [{k: v for k, v in row.items() if isinstance(v, (int, float))} for row in trainer.state.log_history]
    files = sorted(p.name for p in folder.iterdir() if p.name.startswith("checkpoint-"))
    return {"rows": rows, "alerts": [repr(a) for a in runner.alerts], "files": files}


def merged_by_step(rows: list[dict]) -> list[dict]:
    """One row per step, in the order steps first appear; a key logged twice at a step keeps its last value."""
    merged: dict[float, dict] = {}
    for row in rows:
        merged.setdefault(row.get("step", math.nan), {}).update(row)
    return list(merged.values())


def fingerprint(run: dict) -> tuple[int, int, str]:
    digest = hashlib.sha256()
    keys = set()
    for row in run["rows"]:
        for key in sorted(row):
            if "overhead" in key or key in ("train_runtime", "train_samples_per_second", "train_steps_per_second",
                                            "total_flos", "epoch"):  # fmt: skip
                continue
            keys.add(key)
            value = float(row[key])
            digest.update(key.encode() + struct.pack("<d", value if not math.isnan(value) else float("nan")))
    digest.update(json.dumps(run["alerts"]).encode() + json.dumps(run["files"]).encode())
    return len(run["rows"]), len(keys), digest.hexdigest()[:16]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", action="store_true", help="print every row too")
    parser.add_argument("--by-step", action="store_true", help="merge the rows of each step before hashing")
    args = parser.parse_args()
    os.environ.setdefault("WANDB_MODE", "disabled")
    torch.use_deterministic_algorithms(True)
    print(f"connmon at {Path(connmon.__file__).parent}, torch {torch.__version__}")
    print(f"{'entry point':<14} {'rows':>5} {'keys':>5}  sha256 of rows, alerts, restore points")
    for name, run in (("plain loop", plain), ("Lightning", lightning), ("Hugging Face", hugging_face)):
        quiet = contextlib.redirect_stdout(io.StringIO())
        with tempfile.TemporaryDirectory() as folder, warnings.catch_warnings(), quiet:
            warnings.simplefilter("ignore")  # the Trainer prints its rows: its own, and left out
            result = run(Path(folder))
        if args.by_step:
            result["rows"] = merged_by_step(result["rows"])
        rows, keys, digest = fingerprint(result)
        print(f"{name:<14} {rows:>5} {keys:>5}  {digest}  alerts={len(result['alerts'])} files={result['files']}")
        if args.rows:
            for row in result["rows"]:
                print("   ", {k: v for k, v in sorted(row.items()) if "overhead" not in k})
        sys.stdout.flush()


if __name__ == "__main__":
    main()
