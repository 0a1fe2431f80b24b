"""Training throughput with ConnectionMonitor against no monitor and against ``wandb.watch``, in the same run.

The model is the example's tiny GPT (4 layers, width 128, 4 heads, batch 16 x 64 tokens, CPU). Each configuration
trains 201 steps; the timed window is steps 1..200 (step 0, which every monitor samples, is warm-up), so
``every_n_steps=100`` samples twice in the window and ``every_n_steps=10`` twenty times. Configurations run
alternately, ``--rounds`` times; the table gives median steps/s and the ratio of step time to the plain run.

* plain: no monitor (CSV logger).
* ConnectionMonitor(every_n_steps=100) and (every_n_steps=10): the default diagnostics on the training forward.
* alerting_5: ConnectionMonitor(every_n_steps=5, diagnostics=("walk",)) with DriftAlert, the alerting setup.
* wandb.watch(log="all", log_freq=100): gradients and parameters histograms, W&B offline.
* sharpness_10: SharpnessMonitor(every_n_steps=10) alone (the opt-in curvature; its default is every 40 steps).

It also reports what one sampled step costs: the median time of the sampled steps of the ``every_n_steps=10`` run
minus the median time of its other steps, in units of one training step, separately for the light samples (walk,
head/OV transport, drift) and the full ones (also the spectrum group and the edge gap; that run uses
``full_every_n_samples=10`` so that its window holds two). From those, the amortized overhead of ``every_n_steps=N``
at the default cadence F is ``1 + ((F - 1) light + full) / (F N)``: the whole-run ratios cannot show it, because the
200-step window of ``every_n_steps=100`` holds two light samples and no full one, and because they carry about 10%
noise on a shared 2-core machine.

The same per-sample cost is reported for SharpnessMonitor (8 Lanczos steps, the default), amortized at its default
``every_n_steps=40``.

Usage:
    python benchmarks/bench_overhead.py               # about 7 minutes on 2 CPU cores
    python benchmarks/bench_overhead.py --rounds 3
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import os
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger, WandbLogger
from torch.utils.data import DataLoader

from connmon.callbacks import ConnectionMonitor, DriftAlert, SharpnessMonitor

STEPS = 201
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_tiny_gpt.py"
spec = importlib.util.spec_from_file_location("train_tiny_gpt", EXAMPLE)
example = importlib.util.module_from_spec(spec)
spec.loader.exec_module(example)


class StepClock(L.Callback):
    """Wall time of every training step, from its first callback's batch start to its last callback's batch end.

    Lightning calls the callbacks in list order at both ends, so the clock starts in the first one and stops in
    :attr:`stop`, a second callback listed last: the monitors' own batch-end work (a SharpnessMonitor's whole
    estimate, a ConnectionMonitor's sync and logging) falls inside the step.
    """

    def __init__(self) -> None:
        self.times: dict[int, float] = {}
        self._start = 0.0
        self._step = 0
        self.stop = _ClockStop(self)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: D102
        self._step = trainer.global_step
        self._start = time.perf_counter()


class _ClockStop(L.Callback):
    def __init__(self, clock: StepClock) -> None:
        self.clock = clock

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.clock.times[self.clock._step] = time.perf_counter() - self.clock._start


def next_token_loss(module: L.LightningModule, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    idx, target = batch
    return torch.nn.functional.cross_entropy(module(idx).flatten(0, 1), target.flatten())


def run(config: str, data: DataLoader, workdir: Path) -> dict[int, float]:
    torch.manual_seed(0)
    model = example.TinyGPT()
    clock = StepClock()
    callbacks: list[L.Callback] = [clock]  # first, and its stop last: the clock brackets every monitor's hooks
    logger: object = CSVLogger(workdir, name=config)
    if config.startswith("monitor"):
        every = int(config.split("_")[1])
        full = {"full_every_n_samples": 10} if every == 10 else {}  # 2 full samples in the window, to time them
        callbacks.append(ConnectionMonitor(every_n_steps=every, figures_every_n_samples=None, **full))
    if config == "alerting_5":  # the setup DriftAlert wants: dense, walk group only
        callbacks += [ConnectionMonitor(every_n_steps=5, diagnostics=("walk",)), DriftAlert(actions=("log",))]
    if config == "sharpness_10":
        callbacks.append(SharpnessMonitor(next_token_loss, every_n_steps=10))
    if config == "wandb.watch":
        logger = WandbLogger(project="connmon-bench", save_dir=str(workdir), mode="offline")
        logger.watch(model, log="all", log_freq=100)
    trainer = L.Trainer(
        max_steps=STEPS, accelerator="cpu", devices=1, callbacks=[*callbacks, clock.stop], logger=logger,
        log_every_n_steps=50, enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False,
    )  # fmt: skip
    trainer.fit(model, data)
    if config == "wandb.watch":
        logger.experiment.finish()
    return clock.times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    os.environ.setdefault("WANDB_SILENT", "true")
    warnings.filterwarnings("ignore", category=UserWarning)  # a benchmark's table, not Lightning's advice
    data = DataLoader(example.markov_corpus(4096), batch_size=16, shuffle=True)
    configs = ["plain", "monitor_100", "monitor_10", "alerting_5", "wandb.watch", "sharpness_10"]
    throughput: dict[str, list[float]] = {c: [] for c in configs}
    light_cost: list[float] = []
    full_cost: list[float] = []
    walk_cost: list[float] = []
    watch_cost: list[float] = []
    sharpness_cost: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for config in configs:
                times = run(config, data, Path(tmp) / f"{round_}")
                window = [times[s] for s in range(1, STEPS)]
                throughput[config].append(len(window) / sum(window))
                if config == "monitor_10":  # sample i at step 10 i; full when i % 10 == 0
                    step = statistics.median(times[s] for s in range(1, STEPS) if s % 10)
                    light_cost.extend((times[s] - step) / step for s in range(10, STEPS, 10) if s % 100)
                    full_cost.extend((times[s] - step) / step for s in range(100, STEPS, 100))
                if config == "wandb.watch":  # it computes and logs its histograms at steps 100 and 200
                    step = statistics.median(times[s] for s in range(1, STEPS) if s % 100)
                    watch_cost.extend((times[s] - step) / step for s in range(100, STEPS, 100))
                if config == "sharpness_10":  # it measures after the step that makes global_step a multiple of 10
                    step = statistics.median(times[s] for s in range(1, STEPS) if (s + 1) % 10)
                    sharpness_cost.extend((times[s] - step) / step for s in range(9, STEPS, 10))
                if config == "alerting_5":
                    step = statistics.median(times[s] for s in range(1, STEPS) if s % 5)
                    walk_cost.extend((times[s] - step) / step for s in range(5, STEPS, 5))
                print(f"round {round_ + 1}: {config} {throughput[config][-1]:.2f} steps/s", flush=True)
    base = statistics.median(throughput["plain"])
    print(f"\ntorch {torch.__version__}, CPU, {torch.get_num_threads()} threads, {args.rounds} rounds, steps 1..200\n")
    print("| configuration | steps/s (median) | step time vs plain |")
    print("|---|---|---|")
    for config in configs:
        rate = statistics.median(throughput[config])
        print(f"| {config} | {rate:.2f} | {base / rate:.3f}x |")
    light, full = statistics.median(light_cost), statistics.median(full_cost)
    print(f"\none sampled step costs, in training steps (every_n_steps=10 run): light {light:.2f}, full {full:.2f}")
    cadence = inspect.signature(ConnectionMonitor).parameters["full_every_n_samples"].default
    per_sample = ((cadence - 1) * light + full) / cadence
    print(f"amortized at the default full_every_n_samples={cadence} ({per_sample:.2f} steps per sample): ", end="")
    print(f"every_n_steps=100 {1 + per_sample / 100:.4f}x, every_n_steps=10 {1 + per_sample / 10:.3f}x")
    watch = statistics.median(watch_cost)
    print(
        f"wandb.watch: each logging step costs {watch:.2f} training steps, {1 + watch / 100:.4f}x at log_freq=100 ",
        end="",
    )
    print("(plus its per-step hooks, which only the whole-run ratio sees)")
    walk = statistics.median(walk_cost)
    print(f"alerting (walk group every 5 steps + DriftAlert): {walk:.2f} steps per sample, {1 + walk / 5:.3f}x")
    curvature = statistics.median(sharpness_cost)
    print(f"SharpnessMonitor (8 Lanczos steps): {curvature:.2f} steps per sample, ", end="")
    print(f"every_n_steps=40 {1 + curvature / 40:.3f}x, every_n_steps=100 {1 + curvature / 100:.3f}x")


if __name__ == "__main__":
    main()
