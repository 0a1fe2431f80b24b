"""Does curvature warn before divergence where attention geometry does not? A spike on bench_instability's runs.

Issue 12's target (a median lead of at least 50 steps with no false alarm) was not met by any attention signal
(benchmarks/README.md). At 50 steps before divergence a ramp run's LR has moved by about 3%, so whatever diverges
is already in the state: the edge of stability (Cohen et al.) says where. For Adam the quantity is the preconditioned
sharpness ``lambda_max(P^-1 H)``, ``P = diag(sqrt(v_hat) + eps)``, whose stability threshold is
``(2 + 2 beta1) / ((1 - beta1) lr) = 38 / lr`` at ``beta1 = 0.9`` (Cohen et al., 2022). This script trains some of
bench_instability's AdamW runs (same model, data, LR schedules and divergence rule) and records, every ``--every``
steps, ``lr * lambda_max(P^-1 H) / 38`` on the current batch: the top Ritz value of a few Lanczos steps on
``P^-1/2 H P^-1/2`` with Hessian-vector products. It then scores threshold rules on that
ratio and a z-score rule on its log, with bench_instability's definitions of a warning and a false alarm.

It is a measurement, not a connmon feature: curvature is not attention geometry, and each sample costs about
``2 * --iterations`` extra backward passes.

Usage:
    python benchmarks/bench_sharpness.py --save /tmp/sharpness.json    # 8 runs, about 17 minutes on 2 CPU cores
    python benchmarks/bench_sharpness.py --set phase --save /tmp/phase.json   # 4 more runs
    python benchmarks/bench_sharpness.py --load /tmp/sharpness.json /tmp/phase.json   # the tables again, merged
    python benchmarks/bench_sharpness.py --check   # the estimator against a dense Hessian (a few seconds)
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from multiprocessing import get_context
from pathlib import Path

import torch
from bench_instability import BASE, GPT, corpus, divergence, example_module, next_batch, score
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from connmon.alerts import EWMAZScore, Rule, RuleSet
from connmon.functional._lanczos import largest_eigenvalue

BETA1 = 0.9
THRESHOLD = (2 + 2 * BETA1) / (1 - BETA1)  # 38: lr * lambda_max(P^-1 H) at the edge of stability
SETS = {
    "main": [
        {"variant": "base", "arm": "ramp", "seed": 0},
        {"variant": "base", "arm": "ramp", "seed": 1},
        {"variant": "base", "arm": "ramp", "seed": 2},
        {"variant": "base", "arm": "control", "seed": 0},
        {"variant": "copy task", "arm": "ramp", "seed": 0, "corpus": "copy"},
        {"variant": "copy task", "arm": "control", "seed": 0, "corpus": "copy"},
        {"variant": "width 64", "arm": "ramp", "seed": 0, "width": 64},
        {"variant": "depth 2", "arm": "ramp", "seed": 0, "depth": 2},
    ],
    # the healthy phase change again (more seeds of the copy-task control) and a user's warmup run
    "phase": [
        {"variant": "copy task", "arm": "control", "seed": 1, "corpus": "copy"},
        {"variant": "copy task", "arm": "control", "seed": 2, "corpus": "copy"},
        {"variant": "copy task", "arm": "ramp", "seed": 1, "corpus": "copy"},
        {"variant": "base", "arm": "warmup", "seed": 0},
    ],
    # more seeds where the margin is thin (the copy-task controls) and of a base ramp and a warmup run
    "more": [
        {"variant": "copy task", "arm": "control", "seed": 3, "corpus": "copy"},
        {"variant": "copy task", "arm": "control", "seed": 4, "corpus": "copy"},
        {"variant": "base", "arm": "ramp", "seed": 3},
        {"variant": "base", "arm": "warmup", "seed": 1},
    ],
}


def preconditioned_sharpness(
    model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], optimizer: torch.optim.AdamW, steps: int, seed: int
) -> float:
    """``lambda_max(P^-1/2 H P^-1/2)`` on this batch: the top Ritz value of ``steps`` Lanczos steps.

    The algebraically largest eigenvalue (power iteration would find the largest in modulus, which near divergence is
    often a negative one). The loss is recomputed with SDPA's math kernel: the fused CPU kernel has no double
    backward.
    """
    idx, target = batch
    params = [p for p in model.parameters() if p.requires_grad]
    group = optimizer.param_groups[0]
    scale = []
    for p in params:
        state = optimizer.state.get(p, {})
        if "exp_avg_sq" not in state:  # before the first step: no preconditioner yet
            scale.append(torch.ones_like(p))
            continue
        v_hat = state["exp_avg_sq"] / (1 - group["betas"][1] ** float(state["step"]))
        scale.append((v_hat.sqrt() + group["eps"]).rsqrt())  # P^-1/2
    scale = torch.cat([s.reshape(-1) for s in scale])
    with sdpa_kernel(SDPBackend.MATH):
        loss = nn.functional.cross_entropy(model(idx).flatten(0, 1), target.flatten())
    grads = torch.autograd.grad(loss, params, create_graph=True)

    def matvec(x: torch.Tensor) -> torch.Tensor:  # (1, r) float64 -> P^-1/2 H P^-1/2 x
        w = (x[0].float() * scale).split([p.numel() for p in params])
        hw = torch.autograd.grad(
            grads, params, grad_outputs=[a.view_as(p) for a, p in zip(w, params, strict=True)], retain_graph=True
        )
        return (torch.cat([h.reshape(-1) for h in hw]) * scale).double().unsqueeze(0)

    start = torch.randn(1, scale.numel(), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    value, _ = largest_eigenvalue(matvec, start, steps, tol=1e-3)
    return float(value[0])


def check_against_dense() -> None:
    """The estimator against the dense ``P^-1/2 H P^-1/2`` of a 1-layer, width-8 GPT (1224 parameters, float64)."""
    torch.manual_seed(0)
    model = GPT(16, 8, False, n_layer=1, n_embd=8).double()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    idx, target = torch.randint(0, 16, (4, 8)), torch.randint(0, 16, (4, 8))
    for _ in range(3):  # a preconditioner to scale by
        loss = nn.functional.cross_entropy(model(idx).flatten(0, 1), target.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    names, params = zip(*model.named_parameters(), strict=True)

    def loss_of(flat: torch.Tensor) -> torch.Tensor:
        values = dict(zip(names, torch.split(flat, [p.numel() for p in params]), strict=True))
        values = {name: v.view_as(p) for (name, v), p in zip(values.items(), params, strict=True)}
        with sdpa_kernel(SDPBackend.MATH):
            logits = torch.func.functional_call(model, values, (idx,))
        return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())

    hessian = torch.autograd.functional.hessian(loss_of, torch.cat([p.detach().reshape(-1) for p in params]))
    group = optimizer.param_groups[0]
    scale = torch.cat(
        [
            ((optimizer.state[p]["exp_avg_sq"] / (1 - group["betas"][1] ** float(optimizer.state[p]["step"]))).sqrt()
             + group["eps"]).rsqrt().reshape(-1)
            for p in params
        ]
    )  # fmt: skip
    dense = torch.linalg.eigvalsh(scale[:, None] * hessian * scale[None, :])[-1].item()
    print(f"dense lambda_max(P^-1/2 H P^-1/2) = {dense:.6f}")
    for steps in (8, 200):
        found = preconditioned_sharpness(model, (idx, target), optimizer, steps, seed=0)
        print(f"Lanczos, {steps} steps: {found:.6f} (relative difference {abs(found - dense) / dense:.1e})")


def train(config: dict, steps: int, every: int, iterations: int, start: float, peak: float, ramp: int) -> dict:
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    example = example_module()
    config = {**BASE, **config, "start": start, "ramp": ramp}
    if config["arm"] == "warmup":  # bench_instability's healthy from-scratch run: linear warmup to 1e-3, then constant
        config.update(start=0.0, ramp=100, shape="warmup", peak=1e-3, qk_norm=False)
    else:
        config["peak"], config["qk_norm"] = (peak, False) if config["arm"] == "ramp" else (3e-3, True)
    data = corpus(config, example)
    torch.manual_seed(config["seed"])
    model = GPT(example.VOCAB, example.TOKENS, config["qk_norm"], n_layer=config["depth"], n_embd=config["width"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=config["peak"], betas=(BETA1, 0.999), weight_decay=0.0)
    gen = torch.Generator().manual_seed(config["seed"])
    losses, ratio = [], {}
    begin = time.perf_counter()
    for step in range(steps):
        idx, target, lr = next_batch(config, step, optimizer, data, gen)
        loss = nn.functional.cross_entropy(model(idx).flatten(0, 1), target.flatten())
        if step % every == 0 and step > 0:
            sharpness = preconditioned_sharpness(model, (idx, target), optimizer, iterations, step)
            ratio[step] = lr * sharpness / THRESHOLD
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        losses.append(loss.item())
        if not math.isfinite(losses[-1]):
            break
        optimizer.step()
    return {**config, "loss": losses, "ratio": ratio, "seconds": time.perf_counter() - begin}


def _train(job: tuple) -> dict:
    return train(*job)


COOLDOWN = 100  # steps between alerts of one rule, as connmon's Rule default
RULES = {  # name: (bound on the ratio, consecutive samples above it), or None for the z-score rule
    **{f"ratio > {t:g}": (t, 1) for t in (0.5, 0.7, 1.0, 1.2)},
    **{f"ratio > {t:g} on {k} consecutive samples": (t, k) for t in (0.7, 1.0) for k in (2, 3)},
    "log ratio z > 4 rise (floor 0.05)": None,
}


def alerts(run: dict, name: str) -> list[int]:
    """The steps at which the rule alerts on a run's ratio series (online, with the cooldown)."""
    series = {int(step): value for step, value in run["ratio"].items()}
    if RULES[name] is None:
        rules = RuleSet([Rule("sharpness", "ratio", EWMAZScore(4.0, "rise", log=True, min_std=0.05))])
        return [s for s in sorted(series) if series[s] > 0 and rules.update({"ratio": series[s]}, s)]
    bound, need = RULES[name]
    steps, streak = [], 0
    for step in sorted(series):
        streak = streak + 1 if series[step] > bound else 0
        if streak >= need and (not steps or step - steps[-1] >= COOLDOWN):
            steps.append(step)
    return steps


def report(runs: list[dict]) -> None:
    print("\n| variant | arm | seed | divergence | final loss | max ratio (step) | ratio 50 steps before divergence |")
    print("|---|---|---|---|---|---|---|")
    for run in runs:
        series = {int(s): v for s, v in run["ratio"].items() if math.isfinite(v)}
        top = max(series, key=series.get) if series else None
        before = "-"
        if run["divergence"] is not None and series:
            near = min(series, key=lambda s: abs(s - (run["divergence"] - 50)))
            before = f"{series[near]:.2f} (step {near})"
        top_text = f"{series[top]:.2f} ({top})" if top is not None else "-"
        final = f"{run['loss'][-1]:.2f}" if math.isfinite(run["loss"][-1]) else "nan"
        cells = [run["variant"], run["arm"], run["seed"], run["divergence"], final, top_text, before]
        print("| " + " | ".join(map(str, cells)) + " |")
    print("\n| rule | divergences warned | leads | alerts on healthy runs | false alarms on other runs |")
    print("|---|---|---|---|---|")
    for name in RULES:
        leads, healthy, other = [], [], []
        for run in runs:
            lead, fa = score(alerts(run, name), run["divergence"])
            leads += [lead] if lead is not None else []
            where = f"{run['variant']} {run['arm']} {run['seed']}: {fa}"
            (healthy if run["arm"] in ("control", "warmup") else other).extend([where] if fa else [])
        diverged = sum(run["divergence"] is not None for run in runs)
        median = f"median {statistics.median(leads):g}: " if leads else ""
        cells = [name, f"{len(leads)}/{diverged}", median + ", ".join(map(str, sorted(leads)))]
        cells += ["; ".join(healthy) or "0", "; ".join(other) or "0"]
        print("| " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--every", type=int, default=20)
    parser.add_argument("--iterations", type=int, default=8, help="Lanczos steps per sample")
    parser.add_argument("--start", type=float, default=1e-3)
    parser.add_argument("--peak", type=float, default=1e-1)
    parser.add_argument("--ramp", type=int, default=1500)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--set", choices=sorted(SETS), default="main", help="which runs (main: 8; phase, more: 4 each)")
    parser.add_argument("--save", type=Path)
    parser.add_argument("--load", type=Path, nargs="*", help="saved runs (several files are merged)")
    parser.add_argument("--check", action="store_true", help="only compare the estimator with a dense Hessian")
    args = parser.parse_args()
    if args.check:
        check_against_dense()
        return
    if args.load:
        runs = [run for path in args.load for run in json.loads(path.read_text())]
    else:
        jobs = [(c, args.steps, args.every, args.iterations, args.start, args.peak, args.ramp) for c in SETS[args.set]]
        with get_context("spawn").Pool(args.processes) as pool:
            runs = pool.map(_train, jobs)
        for run in runs:
            run["divergence"] = divergence(run["loss"])
        if args.save:
            args.save.write_text(json.dumps(runs))
    print(f"{len(runs)} runs; sampled every {args.every} steps, {args.iterations} Lanczos steps")
    report(runs)


if __name__ == "__main__":
    main()
