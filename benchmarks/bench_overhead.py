"""Training throughput with connmon's monitors against no monitor and against ``wandb.watch``, in the same run.

The model is the example's tiny GPT (4 layers, width 128, 4 heads, batch 16 x 64 tokens, AdamW, CPU). Each
configuration trains 201 steps; the timed window is steps 1..200 (step 0, which every monitor samples, is warm-up).
A step is timed from the first callback's batch start to the last callback's batch end, so every hook a monitor
uses (batch start, before the optimizer step, batch end) falls inside it. Configurations run alternately,
``--rounds`` times; the table gives median steps/s, the ratio of step time to the plain run, and beside it what the
monitors themselves logged as ``connmon/overhead`` (their clocks' time over the training time, in the same run).

* plain: no monitor (CSV logger).
* ConnectionMonitor(every_n_steps=100) and (every_n_steps=10): the default diagnostics on the training forward;
  "monitor_100 -logits", "monitor_100 -optimizer" (either or both): the same without the per-step max logits
  (``logit_every_n_steps=None``) or the optimizer's state (``optimizer_every_n_steps=None``).
* recipe: the alerting recipe of README and docs/monitoring.md at its defaults: SharpnessMonitor(loss_fn) (gradient
  differences, the adaptive cadence from every_n_steps=20, held to its default budget of 5% of the training's passes)
  + ConnectionMonitor(every_n_steps=25, diagnostics=("walk",)) + DriftAlert; "recipe x4" the same with 4
  micro-batches of 16 per step (accumulate_grad_batches=4), against "plain x4"; "recipe (budget none)",
  "recipe (budget 0.10)", "recipe (budget 0.25)": the same held to no budget (the default before 2026-12-08) or to
  another.
* recipe (exact_lanczos): the same with exact Lanczos (double backward) every 20 steps, the previous default.
* recipe (secant): the same with the secant along the update every 20 steps.
* recipe (two looks): the same with two looks: critical sharpness every 20 steps, gradient-difference Lanczos every
  200 steps (fixed) and at the step after a first look at 1 or more (at most once per 200 steps).
* finite_difference_lanczos_10, secant_1, difference_10, exact_lanczos_10, critical_10, critical_20: one
  SharpnessMonitor alone at that fixed cadence (tables before 2026-12-04 call the two Lanczos estimators
  gradient_difference and lanczos).
* lanczos budget 5%: SharpnessMonitor(every_n_steps=1, estimator="exact_lanczos", budget=0.05): the readings it affords.
* wandb.watch(log="all", log_freq=100): gradients and parameters histograms, W&B offline.

``--steps`` sets the run's length (201: a 200-step window; the budgeted recipe's first reading comes at step 220, so
its cost needs ``--steps 601`` or more). It also reports what one sampled step costs in the
ConnectionMonitor(every_n_steps=10) run (light and full samples,
in training steps) and the peak memory one curvature sample adds to what training holds, against what training
steps need above the model alone (the kernel's high-water mark, in a fresh process; Linux). A plain fit runs
first, untimed: the process's first fit pays for thread pools and allocator growth.

Usage:
    python benchmarks/bench_overhead.py               # about 10 minutes on 2 CPU cores
    python benchmarks/bench_overhead.py --rounds 3
    python benchmarks/bench_overhead.py --rounds 3 --configs recipe "plain x4" "recipe x4"   # the default recipe
    python benchmarks/bench_overhead.py --rounds 1 --configs recipe --lr 3e-2   # the recipe on a high-LR run
    python benchmarks/bench_overhead.py --rounds 1 --steps 1001 --skip-memory --configs recipe "recipe (budget none)"
"""

from __future__ import annotations

import argparse
import importlib.util
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
from connmon.sampling import SamplingOptions

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
        elapsed = time.perf_counter() - self.clock._start  # a step of several micro-batches: their sum
        self.clock.times[self.clock._step] = self.clock.times.get(self.clock._step, 0.0) + elapsed


def next_token_loss(module: L.LightningModule, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    idx, target = batch
    return torch.nn.functional.cross_entropy(module(idx).flatten(0, 1), target.flatten())


TWO_LOOKS_FIRST = 20  # "recipe (two looks)": the first look's cadence


def run(config: str, data: DataLoader, workdir: Path, lr: float = 3e-3) -> dict[int, float]:
    torch.manual_seed(0)
    model = example.TinyGPT(lr=lr)
    clock = StepClock()
    callbacks: list[L.Callback] = [clock]  # first, and its stop last: the clock brackets every monitor's hooks
    logger: object = CSVLogger(workdir, name=config)
    if config.startswith("monitor"):
        every = int(config.split()[0].split("_")[1])
        full = {"full_every_n_samples": 10} if every == 10 else {}  # 2 full samples in the window, to time them
        off = {"logit_every_n_steps": None} if "-logits" in config else {}  # the per-step signals, each taken out
        off |= {"optimizer_every_n_steps": None} if "-optimizer" in config else {}
        callbacks.append(ConnectionMonitor(every_n_steps=every, figures_every_n_samples=None, **full, **off))
    if config.startswith("recipe"):
        sharpness = SharpnessMonitor(next_token_loss)  # the defaults: gradient differences, adaptive from 20 steps
        if config.startswith("recipe (budget"):
            budget = config.split()[-1].rstrip(")")
            sharpness = SharpnessMonitor(next_token_loss, budget=None if budget == "none" else float(budget))
        elif config == "recipe (two looks)":  # critical sharpness every 20 steps, Lanczos every 200 or when it moves
            sharpness = SharpnessMonitor(next_token_loss, every_n_steps=200, cadence="fixed",
                                         first_look_every_n_steps=TWO_LOOKS_FIRST)  # fmt: skip
        elif "(" in config:
            estimator = config.split("(")[1].rstrip(")")
            sharpness = SharpnessMonitor(next_token_loss, every_n_steps=20, estimator=estimator, cadence="fixed")
        callbacks += [
            sharpness,
            ConnectionMonitor(every_n_steps=25, diagnostics=("walk",), figures_every_n_samples=None),
            DriftAlert(actions=("log",)),
        ]
    for estimator in ("finite_difference_lanczos", "secant", "difference", "exact_lanczos", "critical"):
        if config.startswith(f"{estimator}_"):
            every = int(config.split("_")[-1])
            callbacks.append(
                SharpnessMonitor(next_token_loss, every_n_steps=every, estimator=estimator, cadence="fixed")
            )
    if config == "lanczos budget 5%":
        callbacks.append(
            SharpnessMonitor(next_token_loss, every_n_steps=1, estimator="exact_lanczos", budget=0.05, cadence="fixed")
        )
    if config == "wandb.watch":
        logger = WandbLogger(project="connmon-bench", save_dir=str(workdir), mode="offline")
        logger.watch(model, log="all", log_freq=100)
    trainer = L.Trainer(
        max_steps=STEPS, accelerator="cpu", devices=1, callbacks=[*callbacks, clock.stop], logger=logger,
        log_every_n_steps=50, enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False,
        accumulate_grad_batches=4 if config.endswith(" x4") else 1,
    )  # fmt: skip
    trainer.fit(model, data)
    if config == "wandb.watch":
        logger.experiment.finish()
    clocks = [cb.sampler.clock for cb in callbacks if isinstance(cb, ConnectionMonitor)]
    clocks += [cb.sampler.clock for cb in callbacks if isinstance(cb, SharpnessMonitor)]
    spent = sum(c.spent for c in clocks)  # as connmon/overhead: every monitor's time over the rest of the fit's
    logged = spent / (max(c.training + c.spent for c in clocks) - spent) if clocks else 0.0
    readings = [cb.sampler.samples for cb in callbacks if isinstance(cb, SharpnessMonitor)]
    gradients = [cb.sampler.gradients / STEPS for cb in callbacks if isinstance(cb, SharpnessMonitor)]
    return clock.times, logged, (readings[0] if readings else None), (gradients[0] if gradients else None)


def peak_memory(estimator: str | None) -> tuple[int, int]:
    """Peak resident memory (bytes) of training steps above the process before them, and of a sample above that.

    In a fresh process the kernel's high-water mark is reset (``/proc/self/clear_refs``, Linux) before 4 training
    steps (their peak: activations, gradients, optimizer state) and again before the curvature sample that follows
    them (what it adds to the memory training already holds).
    """
    import subprocess
    import sys

    code = f"""
import re, sys, torch
sys.path.insert(0, {str(Path(__file__).parent)!r})
import bench_overhead as b
from connmon.curvature import UpdateProbe, sharpness_ratio

def status(key):
    return int(re.search(key + r":\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) * 1024

def reset():
    open("/proc/self/clear_refs", "w").write("5")
    return status("VmRSS")

torch.manual_seed(0)
model = b.example.TinyGPT()
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
idx, target = next(iter(torch.utils.data.DataLoader(b.example.markov_corpus(64), batch_size=16)))
loss_fn = lambda: b.next_token_loss(model, (idx, target))
before = reset()
probe = None
for step in range(4):
    optimizer.zero_grad()
    loss_fn().backward()
    if step == 3:
        step_peak = status("VmHWM") - before
        before = reset()  # the sample from here: the parameter copy, the step it spans, the reading
        if {estimator!r} in ("secant", "difference", "critical"):
            probe = UpdateProbe(optimizer)
        if {estimator!r} == "finite_difference_lanczos":  # where SharpnessMonitor reads it: .grad held, before the step
            sharpness_ratio(loss_fn, optimizer, steps=8, model=model)
    optimizer.step()
if probe is not None:
    probe.stepped()
if {estimator!r} == "difference":
    probe.difference(loss_fn, model=model)
elif {estimator!r} == "secant":
    probe.secant()  # after the next backward, which training does anyway
elif {estimator!r} == "critical":
    probe.critical([loss_fn], model=model)
elif {estimator!r} == "exact_lanczos":
    sharpness_ratio(loss_fn, optimizer, steps=8, model=model, products="double_backward")
print(step_peak, status("VmHWM") - before)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    step, sample = out.stdout.split()[-2:]
    return int(step), int(sample)


def main() -> None:
    global STEPS
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--configs", nargs="*", help="only these configurations (plain is always run)")
    parser.add_argument("--lr", type=float, default=3e-3, help="the example's peak rate (3e-2, 1e-1: high-LR runs)")
    parser.add_argument("--steps", type=int, default=STEPS, help="steps per run (the window: steps 1 to the last)")
    parser.add_argument("--skip-memory", action="store_true", help="leave out the memory table")
    args = parser.parse_args()
    STEPS = args.steps
    os.environ.setdefault("WANDB_SILENT", "true")
    warnings.filterwarnings("ignore", category=UserWarning)  # a benchmark's table, not Lightning's advice
    data = DataLoader(example.markov_corpus(4096), batch_size=16, shuffle=True)
    configs = [
        "plain", "monitor_100", "monitor_100 -logits", "monitor_100 -optimizer", "monitor_100 -logits -optimizer",
        "monitor_10", "recipe", "recipe (budget none)", "recipe (budget 0.10)", "recipe (budget 0.25)", "plain x4",
        "recipe x4", "recipe (exact_lanczos)",
        "recipe (secant)", "recipe (two looks)", "finite_difference_lanczos_10", "secant_1", "difference_10",
        "exact_lanczos_10", "critical_10", "critical_20", "lanczos budget 5%", "wandb.watch",
    ]  # fmt: skip
    if args.configs:
        configs = ["plain", *[c for c in configs if c in args.configs and c != "plain"]]
    throughput: dict[str, list[float]] = {c: [] for c in configs}
    whole: dict[str, list[float]] = {c: [] for c in configs}  # steps 0..200: the span the logged figure covers
    logged: dict[str, list[float]] = {c: [] for c in configs}
    readings: dict[str, int | None] = {}
    gradients: dict[str, list[float]] = {c: [] for c in configs}
    light_cost: list[float] = []
    full_cost: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        run("plain", data, Path(tmp) / "warm-up")  # the process's first fit pays for thread pools and allocator growth
        for round_ in range(args.rounds):
            for config in configs:
                times, fraction, readings[config], spent = run(config, data, Path(tmp) / f"{round_}", args.lr)
                if spent is not None:
                    gradients[config].append(spent)
                window = [times[s] for s in range(1, STEPS)]
                throughput[config].append(len(window) / sum(window))
                whole[config].append(sum(times[s] for s in range(STEPS)))
                logged[config].append(fraction)
                if config == "monitor_10":  # sample i at step 10 i; full when i % 10 == 0
                    step = statistics.median(times[s] for s in range(1, STEPS) if s % 10)
                    light_cost.extend((times[s] - step) / step for s in range(10, STEPS, 10) if s % 100)
                    full_cost.extend((times[s] - step) / step for s in range(100, STEPS, 100))
                print(f"round {round_ + 1}: {config} {throughput[config][-1]:.2f} steps/s", flush=True)
    base = statistics.median(throughput["plain"])
    print(f"\ntorch {torch.__version__}, CPU, {torch.get_num_threads()} threads, {args.rounds} rounds, steps "
          f"1..{STEPS - 1}, peak LR {args.lr:g}\n")  # fmt: skip
    print(f"| configuration | steps/s (median) | step time vs plain | steps 0..{STEPS - 1} vs plain | connmon/overhead "
          "logged in the run | curvature passes per step (readings) |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for config in configs:
        rate = statistics.median(throughput[config])
        reference = statistics.median(throughput["plain x4"]) if config.endswith(" x4") else base
        unmonitored = config.startswith("plain") or config == "wandb.watch"
        inside = f"{100 * statistics.median(logged[config]):.1f}%" if not unmonitored else "-"
        spent = f"{statistics.median(gradients[config]):.3f} ({readings[config]})" if gradients[config] else "-"
        plain_whole = statistics.median(whole["plain x4" if config.endswith(" x4") else "plain"])
        span = f"{statistics.median(whole[config]) / plain_whole:.3f}x"
        print(f"| {config} | {rate:.2f} | {reference / rate:.3f}x | {span} | {inside} | {spent} |")
    if light_cost:
        light, full = statistics.median(light_cost), statistics.median(full_cost)
        print(f"\none sampled step costs, in training steps (every_n_steps=10 run): light {light:.2f}, full {full:.2f}")
        cadence = SamplingOptions().full_every_n_samples  # the default
        per_sample = ((cadence - 1) * light + full) / cadence
        print(f"amortized at the default full_every_n_samples={cadence} ({per_sample:.2f} steps per sample): ", end="")
        print(f"every_n_steps=100 {1 + per_sample / 100:.4f}x, every_n_steps=10 {1 + per_sample / 10:.3f}x")
    if args.skip_memory:
        return
    print("\n| curvature sample | what it adds to training's memory, MB | training steps' own, MB | sample / step |")
    print("|---|---|---|---|")
    for estimator in ("finite_difference_lanczos", "secant", "difference", "exact_lanczos", "critical"):
        step, sample = peak_memory(estimator)
        print(f"| {estimator} | {sample / 2**20:.1f} | {step / 2**20:.1f} | {sample / step:.2f} |")


if __name__ == "__main__":
    main()
