"""Does acting on the curvature warning save the run? The learning-rate back-off on the instability suite.

Each run of ``bench_sharpness.py``'s suite (the 16 AdamW and 4 SGD runs: ramps that diverge, their qk-norm controls,
warmup runs) is trained with connmon as a user would run it: ``connmon.Monitor`` with a
``SharpnessSampler(budget=None)`` (gradient differences, the adaptive cadence from every 20 steps, no budget), the
default ``edge_of_stability_rule()`` and the ``"backoff"`` action at its defaults (factor 0.5, cooldown 100). Ramp runs
go on for ``--steps`` (2000): the ramp's 1500 steps, then 500 more at its peak, a rate at which every one of them
diverged without the back-off. At the first back-off the run *without* it is continued from that very state (the model,
its gradients, the optimizer and the batch generator copied before the step), so the two arms share everything before
the action; the monitor does not change the training (its readings restore every parameter bitwise), so the run without
is the suite's run.

Also the case users meet, a constant learning rate too high for the run (``TOO_HIGH``): SGD with momentum warmed up
over 100 steps to 2.5, then constant, learns (to a 10-step mean of 2.81) and diverges at step 1052; at 2.0 it learns
and never diverges, at 3.0 it diverges at step 684 having barely learned. On this model no constant AdamW rate both
learned and diverged within 2000 steps (the base model after a 100-step warmup: 1e-2, 1.5e-2 and 1.75e-2 learn and
stay stable; 2e-2 and 3e-2 stay near the unigram plateau; the copy task: 5e-3 to 1e-2 learn, 2e-2 spikes 1.33x and
recovers, 2.5e-2 to 5e-2 barely learn). Adam's normalized step keeps a too-high constant rate from learning at all
here rather than letting it learn and then blow up.

Reported per run: where it diverges without the back-off and with it (bench_instability's rule: the 10-step mean
loss above 1.5x its running minimum for 10 steps, once learned), the back-offs (step and scale), the best 10-step
mean loss before the first alert, the final loss (mean of the last 50 steps) and the healthy control's final loss.

Usage:
    python benchmarks/bench_backoff.py --save /tmp/backoff.jsonl     # 20 suite runs + the too-high run, ~1 h on 2 cores
    python benchmarks/bench_backoff.py --load /tmp/backoff.jsonl     # the tables again
    python benchmarks/bench_backoff.py --runs diverging --save /tmp/diverging.jsonl   # the 10 ramp runs only
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import time
import warnings
from multiprocessing import get_context
from pathlib import Path

import torch
from bench_instability import SMOOTH, divergence, next_batch
from bench_sharpness import SETS, build, gpt_loss, train_step

import connmon
from connmon.alerts import AlertRunner, edge_of_stability_rule
from connmon.callbacks.sharpness_monitor import RATIO_KEY
from connmon.curvature.sampler import SharpnessSampler

SUITE = [run for name in ("main", "phase", "more", "sgd") for run in SETS[name]]
# SGD with momentum 0.9, warmed up over 100 steps to 2.5 (build() scales SGD rates x100), then constant: it learns
# (best 10-step mean 2.81) and diverges at step 1052. No constant AdamW rate did that on this model (see the docstring).
TOO_HIGH = {"variant": "SGD momentum", "arm": "warmup", "seed": 0, "optimizer": "sgd", "peak": 0.025, "too_high": True}
FINAL = 50  # the final loss: the mean of the last 50 steps


def backoff_run(job: tuple[dict, int]) -> dict:
    """One run with connmon's alerting and the back-off, and the same run without it from its first back-off on."""
    config, steps = job
    warnings.simplefilter("ignore")  # the back-off's one line per action; the values are recorded below
    config, data, model, optimizer, gen = build(config, 1e-3, 1e-1, 1500)
    steps = steps if config["arm"] == "ramp" or config.get("too_high") else 1500
    losses, ratios, alerts, backoffs, snapshot = [], {}, [], [], {}

    def on_alert(alert) -> None:  # inside optimizer.step(), before the parameters move and before the back-off
        alerts.append(alert.step)
        if not snapshot:
            snapshot.update(
                step=alert.step,
                model=copy.deepcopy(model),
                grads=[p.grad.clone() for p in model.parameters()],
                optimizer=copy.deepcopy(optimizer.state_dict()),
                generator=gen.get_state(),
                losses=list(losses),
            )

    def log(values: dict, step: int) -> None:
        if RATIO_KEY in values:
            ratios[step] = values[RATIO_KEY]

    runner = AlertRunner([edge_of_stability_rule()], actions=("backoff",), on_alert=on_alert)
    sampler = SharpnessSampler(budget=None)
    monitor = connmon.Monitor(
        model, every_n_steps=steps + 1, diagnostics=("walk",), alerts=runner, optimizer=optimizer,
        sharpness=sampler, loss_fn=gpt_loss, log=log, log_histograms=False, figures_every_n_samples=None,
    )  # fmt: skip
    begin = time.perf_counter()
    for step in range(steps):
        idx, target, _ = next_batch(config, step, optimizer, data, gen)
        with monitor.step(step, batch=(idx, target)):
            loss = gpt_loss(model, (idx, target))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        losses.append(loss.item())
        if not math.isfinite(losses[-1]):
            break
        scale = runner.backoff.scale
        optimizer.step()
        if runner.backoff.scale != scale:
            backoffs.append((step, runner.backoff.scale))
    monitor.close()
    seconds = time.perf_counter() - begin
    without = continue_without(config, data, snapshot, steps) if snapshot else None
    return {
        **config,
        "steps": steps,
        "loss": losses,
        "ratio": ratios,
        "alerts": alerts,
        "backoffs": backoffs,
        "gradients_per_step": sampler.gradients / max(len(losses), 1),
        "seconds": seconds,
        "without": without,
    }


def continue_without(config: dict, data: torch.Tensor, snapshot: dict, steps: int) -> dict:
    """The run from the first back-off's step on, with no back-off, until it diverges (and 30 steps more) or ends."""
    model = snapshot["model"]
    for p, grad in zip(model.parameters(), snapshot["grads"], strict=True):
        p.grad = grad
    if config["optimizer"] == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=config["peak"], momentum=0.9)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=config["peak"])
    optimizer.load_state_dict(snapshot["optimizer"])  # hyperparameters (betas, the step's lr) and moments
    optimizer.step()  # the step the back-off first scaled, at the scheduled rate
    optimizer.zero_grad(set_to_none=True)
    gen = torch.Generator()
    gen.set_state(snapshot["generator"])
    losses = list(snapshot["losses"])
    for step in range(snapshot["step"] + 1, steps):
        if not train_step(model, optimizer, next_batch(config, step, optimizer, data, gen)[:2], losses):
            break
        diverged = divergence(losses)
        if diverged is not None and step > diverged + 30:
            break
    return {"from": snapshot["step"], "loss": losses[snapshot["step"] + 1 :], "divergence": divergence(losses)}


def smoothed_best(losses: list[float], until: int) -> float:
    """The best 10-step mean loss before step ``until``."""
    means = [sum(losses[s - SMOOTH + 1 : s + 1]) / SMOOTH for s in range(SMOOTH - 1, min(until, len(losses)))]
    return min(means) if means else math.nan


def final_loss(losses: list[float], end: int | None = None) -> float:
    """The mean loss of the last 50 steps before ``end`` (the run's end), NaN if the run diverged before it."""
    end = len(losses) if end is None else end
    tail = losses[max(0, end - FINAL) : end]
    return sum(tail) / len(tail) if len(losses) >= end and all(map(math.isfinite, tail)) else math.nan


def name_of(run: dict) -> str:
    if run.get("too_high"):
        return f"{run['variant']} warmup to {run['peak']:g}, then constant (too high)"
    return f"{run['variant']} {run['arm']} {run['seed']}"


def report(runs: list[dict]) -> None:
    """The runs the back-off acted on (at the suite's end, step 1500, and at the run's end), then the healthy runs."""
    controls = {run["variant"]: final_loss(run["loss"]) for run in runs if run["arm"] == "control" and run["seed"] == 0}
    print("\n| run | diverges without | final without / best | back-offs (step: scale) | diverges with | best before "
          "the alert | final at 1500 / best | final at the end / best | healthy control's final | sampler gradients "
          "per step |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    counts = {f"{what} {end}": 0 for end in ("by 1500", "by the end") for what in ("diverging", "saved", "within 10%")}
    for run in runs:
        if run["arm"] != "ramp" and not run.get("too_high"):
            continue
        without = run["without"]["divergence"] if run["without"] else divergence(run["loss"])
        without_losses = run["loss"][: run["without"]["from"] + 1] + run["without"]["loss"] if run["without"] else []
        with_ = divergence(run["loss"])
        first = run["alerts"][0] if run["alerts"] else None
        best = smoothed_best(run["loss"], first) if first is not None else math.nan
        at_1500, at_end = final_loss(run["loss"], 1500) / best, final_loss(run["loss"]) / best
        for label, end, quotient in (("by 1500", 1500, at_1500), ("by the end", run["steps"], at_end)):
            if without is not None and without < end:
                counts[f"diverging {label}"] += 1
                if with_ is None or with_ >= end:
                    counts[f"saved {label}"] += 1
                    counts[f"within 10% {label}"] += quotient <= 1.1
        backoffs = ", ".join(f"{s}: {x:g}" for s, x in run["backoffs"]) or "none"
        without_final = final_loss(without_losses, run["steps"]) / best
        cells = [
            name_of(run), "no" if without is None else without, f"{without_final:.3f}",
            backoffs, "no" if with_ is None else with_, f"{best:.3f}", f"{at_1500:.3f}", f"{at_end:.3f}",
            f"{controls.get(run['variant'], math.nan):.3f}", f"{run['gradients_per_step']:.3f}",
        ]  # fmt: skip
        print("| " + " | ".join(map(str, cells)).replace("nan", "-") + " |")
    healthy = [run for run in runs if run["arm"] in ("control", "warmup") and not run.get("too_high")]
    print("\n| healthy runs | runs | alerts | back-offs | sampler gradients per step (median, max) |")
    print("|---|---|---|---|---|")
    if healthy:
        cost = sorted(run["gradients_per_step"] for run in healthy)
        alerts, backoffs = sum(len(r["alerts"]) for r in healthy), sum(len(r["backoffs"]) for r in healthy)
        print(f"| controls and warmups | {len(healthy)} | {alerts} | {backoffs} | {statistics.median(cost):.3f}, "
              f"{cost[-1]:.3f} |")  # fmt: skip
    print("\n" + "; ".join(f"{label}: {count}" for label, count in counts.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2000, help="steps of the ramp and too-high runs")
    parser.add_argument("--runs", choices=("diverging", "too-high", "healthy"), nargs="+",
                        default=["diverging", "too-high", "healthy"])  # fmt: skip
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--save", type=Path, help="JSON lines, one run each, written as the runs end")
    parser.add_argument("--load", type=Path, nargs="*")
    args = parser.parse_args()
    if args.load:
        runs = [json.loads(line) for path in args.load for line in path.read_text().splitlines() if line]
    else:
        diverging = [run for run in SUITE if run["arm"] == "ramp"]
        too_high = [TOO_HIGH]
        healthy = [run for run in SUITE if run["arm"] != "ramp"]
        sets = {"diverging": diverging, "too-high": too_high, "healthy": healthy}
        chosen = [config for name in args.runs for config in sets[name]]
        runs = []
        with get_context("spawn").Pool(args.processes) as pool:
            for run in pool.imap_unordered(backoff_run, [(config, args.steps) for config in chosen]):
                runs.append(run)
                print(f"{name_of(run)}: {len(run['backoffs'])} back-offs, {run['seconds']:.0f} s", flush=True)
                if args.save:
                    with args.save.open("a") as file:
                        file.write(json.dumps(run) + "\n")
    report(runs)


if __name__ == "__main__":
    main()
