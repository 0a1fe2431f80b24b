"""Standalone DDP run for test_ddp.py: Lightning's "ddp" strategy re-launches this script for rank 1.

Usage: python tests/callbacks/ddp_run.py OUT_DIR
"""

import sys
from pathlib import Path

import lightning as L
from lightning.pytorch.loggers import CSVLogger

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from connmon.callbacks import ConnectionMonitor
from tests.callbacks.lightning_models import LitGPT, loader

if __name__ == "__main__":
    out = Path(sys.argv[1])
    monitor = ConnectionMonitor(every_n_steps=2, edge_samples=None, edge_queries=None, figures_every_n_samples=None)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_steps=2, callbacks=[monitor],
        logger=CSVLogger(out, name="ddp"), enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False,
    )  # fmt: skip
    trainer.fit(LitGPT(), loader(batch_size=4))
