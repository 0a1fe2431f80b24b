"""Standalone DDP run for test_ddp.py: Lightning's "ddp" strategy re-launches this script for rank 1.

Usage: python tests/callbacks/ddp_run.py OUT_DIR [alert | sharpness | spawn MODE | secant MODE | fsdp | fsdp2]

``fsdp2`` runs the same monitored fit under ModelParallelStrategy with FSDP2 ``fully_shard`` per Block (parameters
sharded across the 2 CPU processes; each rank writes whether its Block parameters are sharded DTensors to
OUT_DIR/sharded<r>.txt); ``fsdp`` under Lightning's FSDPStrategy (FSDP1, each Block a unit), which needs CUDA: on
min(2, GPUs) devices.

With ``alert``, a DriftAlert rule fires on rank 1 only, at its third sample, with level ERROR; each rank writes the
step it stopped at to OUT_DIR/rank<r>.txt (both must stop together, or the run hangs).

With ``backoff``, a DriftAlert with the ``"backoff"`` and ``"checkpoint"`` actions whose edge rule fires at step 2 (a
synced key); each rank writes its scale, the step of the back-off, a checksum of its weights and the restore points
it saved (to OUT_DIR/points) to OUT_DIR/backoff<r>.json.

With ``sharpness``, a SharpnessMonitor samples at steps 2 and 4; each rank writes the ratio of the global batch at
step 2 (computed directly from both ranks' batches) and the synced values to OUT_DIR/sharpness<r>.json. Its loss
function raises on rank 1 at step 4: both
ranks must turn the monitor off together and train on to step 6.

With ``parallel tp`` or ``parallel single``, ConnectionMonitor and SharpnessMonitor on a GPT with separate q, k, v
projections log to OUT_DIR/<mode>: under ModelParallelStrategy with its heads and MLPs sharded over 2 processes, or
on one device.

With ``spawn ddp`` or ``spawn ddp_spawn``, ConnectionMonitor, SharpnessMonitor and DriftAlert log to
OUT_DIR/<mode> through a CSVLogger (``ddp_spawn`` pickles the callbacks into its processes).

With ``secant ddp`` or ``secant fsdp2`` (and an estimator after it, default ``secant``), a SharpnessMonitor samples
at steps 2, 4 and 6; each rank writes the synced values to OUT_DIR/<estimator>-<mode><r>.json.
"""

import os
import sys
from pathlib import Path

import lightning as L
from lightning.pytorch.loggers import CSVLogger

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from connmon.alerts import Detection, Detector, Rule
from connmon.callbacks import ConnectionMonitor, DriftAlert
from tests.callbacks.lightning_models import LitGPT, loader
from tests.gloo import leave


class OnRankOne(Detector):
    """Fires on its third value, on rank 1 only."""

    def __init__(self) -> None:
        self.seen = 0

    def update(self, value: float) -> Detection | None:
        self.seen += 1
        rank = int(os.environ.get("LOCAL_RANK", "0"))
        return Detection(value, 0.0) if rank == 1 and self.seen == 3 else None


def alert_run(out: Path) -> None:
    monitor = ConnectionMonitor(every_n_steps=1, diagnostics=("walk",), figures_every_n_samples=None)
    alert = DriftAlert(rules=[Rule("rank one", "connmon/attention_entropy/all", OnRankOne(), level="ERROR")])
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_steps=6, callbacks=[monitor, alert], logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
    )  # fmt: skip
    trainer.fit(LitGPT(), loader(batch_size=4))
    (out / f"rank{trainer.global_rank}.txt").write_text(str(trainer.global_step))


def backoff_run(out: Path) -> None:
    """The edge rule (on a synced key) fires at step 2's sample on both ranks; each writes its back-off and weights."""
    import json

    from connmon.alerts import LearningRateBackoff, RestorePoints, Threshold

    monitor = ConnectionMonitor(every_n_steps=2, diagnostics=("walk",), figures_every_n_samples=None)
    edge = Rule("past the edge of stability", "connmon/attention_entropy/all", Threshold(-1.0), cooldown=0, since=1)
    alert = DriftAlert(
        rules=[edge], actions=("backoff", "checkpoint"), backoff=LearningRateBackoff(factor=0.5, cooldown=10),
        restore_points=RestorePoints(keep=1, dirpath=out / "points"),
    )  # fmt: skip
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_steps=5, callbacks=[monitor, alert], logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
    )  # fmt: skip
    module = LitGPT()
    trainer.fit(module, loader(batch_size=4))
    weights = sum(float(p.double().sum()) for p in module.parameters())
    backoff = alert.runner.backoff
    record = {"scale": backoff.scale, "last_step": backoff.last_step, "weights": weights}
    record["restore_points"] = alert.runner.restore_points.paths
    (out / f"backoff{trainer.global_rank}.json").write_text(json.dumps(record))


def sharpness_run(out: Path) -> None:
    import json

    import torch

    from connmon.callbacks import SharpnessMonitor
    from connmon.curvature import sharpness_ratio

    def loss_fn(module, batch):
        if module.trainer.global_rank == 1 and module.trainer.global_step == 4:
            raise RuntimeError("out of luck on rank 1")
        idx, target = batch
        return torch.nn.functional.cross_entropy(module(idx).flatten(0, 1), target.flatten())

    local = {}

    class Direct(L.Callback):  # as the monitor: step 3's batch, after its backward, before the optimizer step
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 2:
                self.batch = batch

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            if trainer.global_step == 2 and 2 not in local:  # the global batch: both ranks' batches, on each rank
                both = [None, None]
                torch.distributed.all_gather_object(both, self.batch)
                losses = [lambda batch=batch: loss_fn(pl_module, batch) for batch in both]
                local[2] = sharpness_ratio(losses, trainer.optimizers[0], steps=8, seed=2).ratio

    synced = {}
    monitor = SharpnessMonitor(loss_fn, every_n_steps=2, cadence="fixed", budget=None)  # gradient differences
    monitor.add_listener(lambda trainer, step, values: synced.update({step: values["connmon/sharpness_ratio"]}))
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_steps=6, callbacks=[monitor, Direct()], logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
    )  # fmt: skip
    trainer.fit(LitGPT(), loader(batch_size=4))
    result = {"local": local[2], "synced": synced, "off": monitor.off, "step": trainer.global_step}
    (out / f"sharpness{trainer.global_rank}.json").write_text(json.dumps(result))


def secant_run(out: Path, mode: str, estimator: str = "secant") -> None:
    """SharpnessMonitor's reading under DDP or FSDP2: the synced ratios of steps 2, 4, 6 per rank."""
    import json

    from connmon.callbacks import SharpnessMonitor
    from connmon.curvature.sampler import keys_of

    synced = {}
    loss_fn = next_token_loss if estimator != "secant" else None
    monitor = SharpnessMonitor(loss_fn, every_n_steps=2, estimator=estimator, cadence="fixed", budget=None)
    key = keys_of(estimator)[0]
    monitor.add_listener(lambda trainer, step, values: synced.update({step: values[key]}))
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy(mode), max_steps=7, callbacks=[monitor], logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
    )  # fmt: skip
    trainer.fit(LitGPT(sharded=mode == "fsdp2"), loader(batch_size=4))
    result = {"synced": synced, "off": monitor.off}
    (out / f"{estimator}-{mode}{trainer.global_rank}.json").write_text(json.dumps(result))


def next_token_loss(module, batch):
    """A module-level loss: ``ddp_spawn`` pickles the callbacks, and a lambda does not pickle."""
    import torch

    idx, target = batch
    return torch.nn.functional.cross_entropy(module(idx).flatten(0, 1), target.flatten())


def spawn_run(out: Path, mode: str) -> None:
    """ConnectionMonitor, SharpnessMonitor and DriftAlert under ``ddp`` or ``ddp_spawn``, logged to CSV."""
    from connmon.callbacks import SharpnessMonitor

    callbacks = [
        ConnectionMonitor(every_n_steps=2, diagnostics=("walk",), figures_every_n_samples=None),
        SharpnessMonitor(next_token_loss, every_n_steps=2, cadence="fixed", budget=None),
        DriftAlert(actions=("log",)),
    ]
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=mode, max_steps=5, callbacks=callbacks, logger=CSVLogger(out, name=mode),
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, log_every_n_steps=1,
    )  # fmt: skip
    trainer.fit(LitGPT(), loader(batch_size=4))


def tensor_parallel_run(out: Path, mode: str) -> None:
    """ConnectionMonitor and SharpnessMonitor on LitSplitGPT, logged to CSV: ``tp`` under ModelParallelStrategy with
    its heads and MLPs sharded over 2 processes (both read the same batches), ``single`` on one device."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    from connmon.callbacks import SharpnessMonitor
    from tests.callbacks.lightning_models import LitSplitGPT

    callbacks = [
        ConnectionMonitor(every_n_steps=2, edge_samples=None, edge_queries=None, figures_every_n_samples=None),
        SharpnessMonitor(next_token_loss, every_n_steps=2, cadence="fixed", budget=None),
    ]
    sharded = mode == "tp"
    trainer = L.Trainer(
        accelerator="cpu", devices=2 if sharded else 1, max_steps=3, callbacks=callbacks, log_every_n_steps=1,
        strategy=ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2) if sharded else "auto",
        logger=CSVLogger(out, name=mode), enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False,
    )  # fmt: skip
    data = loader(batch_size=4)
    if not sharded:  # the order the strategy's sampler gives a data-parallel size of 1 (a training loader: shuffled)
        from torch.utils.data import DataLoader, DistributedSampler

        data = DataLoader(data.dataset, batch_size=4, sampler=DistributedSampler(data.dataset, num_replicas=1, rank=0))
    trainer.fit(LitSplitGPT(tensor_parallel=sharded), data)


def strategy(name: str):
    """The strategy of a mode: DDP, FSDP (FSDPStrategy) or FSDP2 (ModelParallelStrategy, fully_shard per Block)."""
    from tests.capture.models import Block

    if name == "fsdp":
        from lightning.pytorch.strategies import FSDPStrategy

        return FSDPStrategy(auto_wrap_policy={Block}, process_group_backend="gloo")
    if name == "fsdp2":
        from lightning.pytorch.strategies import ModelParallelStrategy

        return ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    return "ddp"


if __name__ == "__main__":
    out = Path(sys.argv[1])
    if sys.argv[2:] == ["alert"]:
        alert_run(out)
        leave()
    if sys.argv[2:] == ["backoff"]:
        backoff_run(out)
        leave()
    if sys.argv[2:] == ["sharpness"]:
        sharpness_run(out)
        leave()
    if sys.argv[2:3] == ["parallel"]:
        tensor_parallel_run(out, sys.argv[3])
        leave()
    if sys.argv[2:3] == ["spawn"]:
        spawn_run(out, sys.argv[3])
        leave()
    if sys.argv[2:3] == ["secant"]:
        secant_run(out, sys.argv[3], *sys.argv[4:5])
        leave()
    mode = sys.argv[2] if len(sys.argv) > 2 else "ddp"
    monitor = ConnectionMonitor(every_n_steps=2, edge_samples=None, edge_queries=None, figures_every_n_samples=None)
    import torch

    accelerator, devices = ("cuda", min(2, torch.cuda.device_count())) if mode == "fsdp" else ("cpu", 2)
    trainer = L.Trainer(
        accelerator=accelerator, devices=devices, strategy=strategy(mode), max_steps=2, callbacks=[monitor],
        logger=CSVLogger(out, name=mode), enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False,
    )  # fmt: skip
    module = LitGPT(sharded=mode == "fsdp2")
    trainer.fit(module, loader(batch_size=4))
    if mode == "fsdp2":
        from torch.distributed.tensor import DTensor

        params = list(module.model.blocks[0].parameters())
        sharded = all(isinstance(p, DTensor) and p.to_local().numel() < p.numel() for p in params)
        (out / f"sharded{trainer.global_rank}.txt").write_text(str(sharded))
    leave()
