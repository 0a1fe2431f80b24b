"""What the curvature warning costs on a run that stays past its edge, with and without the wait after an alert.

The suite's model (``bench_sharpness.build``: the example's GPT, AdamW) at a constant learning rate too high for it
(``--lr``, 0.1: the ratio passes 1 within the first 40 steps and stays above), trained for ``--steps`` steps as a user
runs the docs' recipe: ``connmon.Monitor`` with ``SharpnessSampler()`` at its defaults (gradient differences, the
adaptive cadence from every 20 steps, the noise check) and the default ``edge_of_stability_rule()`` (WARN, two
samples above 1 in a row, cooldown 100) with the ``"log"`` action, the run never stopped. Three arms on the same
batches: no connmon (the time base), connmon as shipped (after the rule fires the sampler waits for its cooldown:
``SharpnessSampler.hold_for``), and the sampler that does not wait (every sample at the densest interval).

Printed: curvature samples, the rule's alerts (and the first one's step), gradients of the step's batch per training
step (``connmon/overhead/curvature_gradients``), and connmon's time over the run without it (one torch thread).

Usage:
    python benchmarks/bench_past_edge.py                 # 300 steps at LR 0.1, about a minute on 2 cores
    python benchmarks/bench_past_edge.py --steps 600 --lr 0.05
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch
from bench_instability import next_batch
from bench_sharpness import build, gpt_loss

import connmon
from connmon.alerts import AlertRunner, edge_of_stability_rule
from connmon.curvature.sampler import SharpnessSampler


def run(arm: str, steps: int, lr: float) -> dict:
    """One arm: ``"plain"``, ``"wait"`` (as shipped) or ``"dense"`` (no wait after an alert)."""
    config, data, model, optimizer, gen = build({"arm": "ramp", "seed": 0}, lr, lr, 1)
    sampler = monitor = None
    if arm != "plain":
        sampler = SharpnessSampler()
        if arm == "dense":
            sampler.hold_for = lambda rules: None  # the sampler before the wait
        alerts = AlertRunner([edge_of_stability_rule()], actions=("log",))
        monitor = connmon.Monitor(
            model, every_n_steps=10**9, diagnostics=("walk",), optimizer=optimizer, sharpness=sampler,
            loss_fn=gpt_loss, alerts=alerts, log=lambda values, step: None,
        )  # fmt: skip
    begin = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(steps):
            idx, target, _ = next_batch(config, step, optimizer, data, gen)
            with monitor.step(step, batch=(idx, target)) if monitor is not None else torch.enable_grad():
                loss = gpt_loss(model, (idx, target))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    seconds = time.perf_counter() - begin
    if monitor is None:
        return {"arm": arm, "seconds": seconds}
    monitor.close()
    fired = [str(w.message) for w in caught if "past the edge of stability" in str(w.message)]
    return {
        "arm": arm,
        "seconds": seconds,
        "samples": sampler.samples,
        "alerts": alerts.total,
        "first_alert": alerts.alerts[0].step if alerts.alerts else None,
        "gradients_per_step": sampler.gradients / steps,
        "connmon_seconds": sampler.clock.spent + monitor.clock.spent,
        "said": len(fired),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=0.1)
    args = parser.parse_args()
    plain = run("plain", args.steps, args.lr)
    rows = [run(arm, args.steps, args.lr) for arm in ("wait", "dense")]
    print(f"\n{args.steps} steps at LR {args.lr:g}; the run without connmon took {plain['seconds']:.1f} s\n")
    print("| sampler | samples | alerts (first at) | gradients / step | connmon's time / training time |")
    print("|---|---|---|---|---|")
    for row in rows:
        name = "waits for the rule's cooldown (shipped)" if row["arm"] == "wait" else "samples densely past the edge"
        print(
            f"| {name} | {row['samples']} | {row['alerts']} ({row['first_alert']}) | "
            f"{row['gradients_per_step']:.2f} | {100 * row['connmon_seconds'] / plain['seconds']:.0f}% |"
        )


if __name__ == "__main__":
    main()
