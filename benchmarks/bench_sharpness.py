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

The estimate is connmon's own, :func:`connmon.curvature.sharpness_ratio` (what
:class:`connmon.callbacks.SharpnessMonitor` logs); each sample costs about ``--iterations`` double backward passes.

Usage:
    python benchmarks/bench_sharpness.py --save /tmp/sharpness.json    # 8 runs, about 17 minutes on 2 CPU cores
    python benchmarks/bench_sharpness.py --set phase --save /tmp/phase.json   # 4 more runs
    python benchmarks/bench_sharpness.py --set sgd --save /tmp/sgd.json       # SGD with momentum: 2 ramps, 2 controls
    python benchmarks/bench_sharpness.py --load /tmp/sharpness.json /tmp/phase.json   # the tables again, merged
    python benchmarks/bench_sharpness.py --check   # the estimator against a dense Hessian (a few seconds)
    python benchmarks/bench_sharpness.py --batch-choice   # the next batch or the one just trained on (3 runs, ~12 min)
    python benchmarks/bench_sharpness.py --step-size --save /tmp/steps.jsonl   # gradient-difference step rules
    python benchmarks/bench_sharpness.py --probe-batch --save /tmp/probe.jsonl   # a fixed probe batch, warm started
    python benchmarks/bench_sharpness.py --lanczos-depth --save /tmp/depth.jsonl   # 8 Lanczos steps against converged
    python benchmarks/bench_sharpness.py --update-every 5 --save /tmp/readings.json   # + the update readings (~20 min)
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import time
from multiprocessing import get_context
from pathlib import Path

import torch
from bench_instability import BASE, GPT, SGD_SCALE, corpus, divergence, example_module, next_batch, score
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from connmon.alerts import EWMAZScore, Rule, RuleSet, Threshold
from connmon.callbacks.sharpness_monitor import RATIO_KEY
from connmon.curvature import UpdateProbe, sharpness_ratio
from connmon.curvature.ratio import NOISE_CHECK_FROM
from connmon.curvature.sampler import LADDER, adaptive_interval

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
    # the second optimizer: SGD with momentum 0.9 (its edge is 2 (1 + 0.9) / lr), bench_instability's SGD runs
    "sgd": [
        {"variant": "SGD momentum", "arm": "ramp", "seed": 0, "optimizer": "sgd"},
        {"variant": "SGD momentum", "arm": "ramp", "seed": 1, "optimizer": "sgd"},
        {"variant": "SGD momentum", "arm": "control", "seed": 0, "optimizer": "sgd"},
        {"variant": "SGD momentum", "arm": "control", "seed": 1, "optimizer": "sgd"},
    ],
}


def gpt_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    idx, target = batch
    return nn.functional.cross_entropy(model(idx).flatten(0, 1), target.flatten())


def ratio_of(
    model: nn.Module,
    batch: tuple,
    optimizer: torch.optim.Optimizer,
    steps: int,
    seed: int,
    products: str = "double_backward",
    relative_length: float | None = None,
) -> float:
    """``connmon.curvature.sharpness_ratio``: ``lr lambda_max(P^-1 H) / 38`` for AdamW (exact products by default)."""
    return sharpness_ratio(
        lambda: gpt_loss(model, batch),
        optimizer,
        steps=steps,
        model=model,
        seed=seed,
        products=products,
        relative_length=relative_length,
    ).ratio


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: tuple, losses: list[float]) -> bool:
    """One step on ``batch``, its loss appended to ``losses``; False (and no step) once the loss is not finite."""
    loss = gpt_loss(model, batch)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    losses.append(loss.item())
    if not math.isfinite(losses[-1]):
        return False
    optimizer.step()
    return True


def check_against_dense() -> None:
    """The shipped estimate against a dense ``P^-1/2 H P^-1/2``: a 1-layer, width-8 GPT (1224 parameters, float64)."""
    torch.manual_seed(0)
    model = GPT(16, 8, False, n_layer=1, n_embd=8).double()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    batch = torch.randint(0, 16, (4, 8)), torch.randint(0, 16, (4, 8))
    for _ in range(3):  # a preconditioner to scale by
        optimizer.zero_grad()
        gpt_loss(model, batch).backward()
        optimizer.step()
    names, params = zip(*model.named_parameters(), strict=True)

    def loss_of(flat: torch.Tensor) -> torch.Tensor:
        values = dict(zip(names, torch.split(flat, [p.numel() for p in params]), strict=True))
        values = {name: v.view_as(p) for (name, v), p in zip(values.items(), params, strict=True)}
        with sdpa_kernel(SDPBackend.MATH):
            logits = torch.func.functional_call(model, values, (batch[0],))
        return nn.functional.cross_entropy(logits.flatten(0, 1), batch[1].flatten())

    hessian = torch.autograd.functional.hessian(loss_of, torch.cat([p.detach().reshape(-1) for p in params]))
    group = optimizer.param_groups[0]
    scale = torch.cat(
        [
            ((optimizer.state[p]["exp_avg_sq"] / (1 - group["betas"][1] ** float(optimizer.state[p]["step"]))).sqrt()
             + group["eps"]).rsqrt().reshape(-1)
            for p in params
        ]
    )  # fmt: skip
    dense = group["lr"] * torch.linalg.eigvalsh(scale[:, None] * hessian * scale[None, :])[-1].item() / THRESHOLD
    print(f"dense lr * lambda_max(P^-1/2 H P^-1/2) / 38 = {dense:.6f}")
    for steps in (8, 200):
        found = ratio_of(model, batch, optimizer, steps, seed=0)
        error = abs(found - dense) / dense
        print(f"sharpness_ratio, {steps} Lanczos steps: {found:.6f} (relative difference {error:.1e})")


def build(
    config: dict, start: float, peak: float, ramp: int
) -> tuple[dict, torch.Tensor, nn.Module, torch.optim.Optimizer, torch.Generator]:
    """A suite run, untrained: its full config, corpus, model, optimizer and batch generator (one torch thread).

    ``ramp`` runs ramp from ``start`` to ``peak``; ``control`` runs to 3e-3 with qk-norm; ``warmup`` runs warm up
    linearly over 100 steps to ``config["peak"]`` (1e-3: bench_instability's healthy from-scratch run), then hold it.
    """
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    example = example_module()
    config = {**BASE, **config, "start": start, "ramp": ramp}
    if config["arm"] == "warmup":
        config.update(start=0.0, ramp=100, shape="warmup", peak=config.get("peak", 1e-3), qk_norm=False)
    else:
        config["peak"], config["qk_norm"] = (peak, False) if config["arm"] == "ramp" else (3e-3, True)
    if config["optimizer"] == "sgd":  # bench_instability's SGD with momentum 0.9 at 100x AdamW's learning rates
        config["start"], config["peak"] = config["start"] * SGD_SCALE, config["peak"] * SGD_SCALE
    data = corpus(config, example)
    torch.manual_seed(config["seed"])
    model = GPT(example.VOCAB, example.TOKENS, config["qk_norm"], n_layer=config["depth"], n_embd=config["width"])
    if config["optimizer"] == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=config["peak"], momentum=0.9)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=config["peak"], betas=(BETA1, 0.999), weight_decay=0.0)
    return config, data, model, optimizer, torch.Generator().manual_seed(config["seed"])


def train(
    config: dict, steps: int, every: int, iterations: int, start: float, peak: float, ramp: int, update_every: int = 0
) -> dict:
    """One run; Lanczos every ``every`` steps and, with ``update_every``, both readings along the update as often.

    At a sampled step ``s`` every estimate is taken at the same parameters (after ``s`` optimizer steps): Lanczos and
    the difference reading on batch ``s`` (before training on it), the secant reading after its backward, before
    the optimizer step; both update readings along the update of step ``s - 1``.
    """
    config, data, model, optimizer, gen = build(config, start, peak, ramp)
    losses, ratio, gradient, gradients, readings, probes = [], {}, {}, {}, {"difference": {}, "secant": {}}, None
    initial = None
    seconds = {"lanczos": 0.0, "gradient_difference": 0.0, "difference": 0.0, "secant": 0.0}
    begin = time.perf_counter()
    for step in range(steps):
        idx, target, _ = next_batch(config, step, optimizer, data, gen)
        clock = time.perf_counter()
        if step % every == 0 and step > 0:
            ratio[step] = ratio_of(model, (idx, target), optimizer, iterations, step)
        seconds["lanczos"] += time.perf_counter() - clock
        clock = time.perf_counter()
        if step % every == 0 and step > 0:  # connmon's default: gradient differences, the step carried over
            result = sharpness_ratio(lambda batch=(idx, target): gpt_loss(model, batch), optimizer, steps=iterations,
                                     model=model, seed=step, initial_length=initial)  # fmt: skip
            gradient[step], gradients[step], initial = (
                result.ratio,
                result.gradient_evaluations,
                result.difference_length,
            )
            initial = initial if 0 < initial < 0.1 else None
        seconds["gradient_difference"] += time.perf_counter() - clock
        clock = time.perf_counter()
        if probes is not None:
            loss_fn = lambda batch=(idx, target): gpt_loss(model, batch)  # noqa: E731
            readings["difference"][step] = probes[0].difference(loss_fn, model=model, seed=step).ratio
        seconds["difference"] += time.perf_counter() - clock
        loss = gpt_loss(model, (idx, target))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        losses.append(loss.item())
        if not math.isfinite(losses[-1]):
            break
        clock = time.perf_counter()
        if probes is not None:
            readings["secant"][step] = probes[1].secant().ratio
            probes = None
        if update_every and (step + 1) % update_every == 0:
            probes = (UpdateProbe(optimizer), UpdateProbe(optimizer))
        seconds["secant"] += time.perf_counter() - clock
        optimizer.step()
        if probes is not None:
            for probe in probes:
                probe.stepped()
            with torch.no_grad():  # the step's loss change on its own batch against the first-order prediction
                change = gpt_loss(model, (idx, target)).item() - losses[-1]
            readings.setdefault("loss_rise", {})[step + 1] = 1 + change / -probes[1]._slope
    return {
        **config,
        "loss": losses,
        "ratio": ratio,
        "gradient_ratio": gradient,
        "gradient_evaluations": gradients,
        "noise_check": True,  # the default reading's check from ratio 0.5 on (its cost is in gradient_evaluations)
        "readings": readings,
        "cost_seconds": seconds,
        "seconds": time.perf_counter() - begin,
    }


def base_ramp(seed: int) -> tuple[dict, torch.Tensor, nn.Module, torch.optim.Optimizer, torch.Generator]:
    """bench_instability's base ramp run, untrained: its config, corpus, model, AdamW and batch generator."""
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    example = example_module()
    config = {**BASE, "variant": "base", "arm": "ramp", "seed": seed, "start": 1e-3, "peak": 1e-1, "ramp": 1500}
    data = corpus(config, example)
    torch.manual_seed(seed)
    model = GPT(example.VOCAB, example.TOKENS, False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-1, betas=(BETA1, 0.999), weight_decay=0.0)
    return config, data, model, optimizer, torch.Generator().manual_seed(seed)


STEP_POINTS = (200, 600, 1000, 1150, 1250, 1300)  # base ramp seed 0: learning, healthy, then up to its divergence
RELATIVE_STEPS = (1e-3, 1e-4, 1e-5, 1e-6)  # ||h w|| / ||theta||, the rule the first measurements used
GRADIENT_CHANGES = {"float32": (1e-4, 1e-3, 1e-2), "bf16 autocast": (1e-3, 1e-2, 1e-1, 3e-1)}


DEPTHS = (4, 8, 12, 20)  # Lanczos steps of the default reading, against a converged exact one


def lanczos_depth_study(seed: int = 0, points: tuple[int, ...] = STEP_POINTS) -> list[dict]:
    """The default reading after 4, 8, 12 and 20 Lanczos steps against exact Lanczos run to convergence.

    Gradient differences in float32 against 40 steps of double backward, at the same points of a base ramp run as the
    step-size study: how far the default 8-step top Ritz value (a lower bound) stands below the top eigenvalue.
    """
    config, data, model, optimizer, gen = base_ramp(seed)
    rows = []
    for step in range(max(points) + 1):
        idx, target, _ = next_batch(config, step, optimizer, data, gen)
        if step in points:
            batch = (idx, target)
            row = {"step": step, "converged": ratio_of(model, batch, optimizer, 40, step), "depths": {}}
            for depth in DEPTHS:
                row["depths"][str(depth)] = sharpness_ratio(lambda batch=batch: gpt_loss(model, batch), optimizer,
                                                            steps=depth, model=model, seed=step).ratio  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
        model.train()
        loss = gpt_loss(model, (idx, target))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return rows


def lanczos_depth_table(rows: list[dict]) -> None:
    print(
        "\n| step | converged ratio (exact, 40 steps) | " + " | ".join(f"{d} steps / converged" for d in DEPTHS) + " |"
    )
    print("|---|---|" + "---|" * len(DEPTHS))
    for row in rows:
        cells = " | ".join(f"{row['depths'][str(d)] / row['converged']:.3f}" for d in DEPTHS)
        print(f"| {row['step']} | {row['converged']:.4f} | {cells} |")
    for d in DEPTHS:
        worst = min(row["depths"][str(d)] / row["converged"] for row in rows)
        print(f"{d} steps: at worst {100 * (1 - worst):.1f}% below the converged ratio")


def step_size_study(seed: int = 0, points: tuple[int, ...] = STEP_POINTS) -> list[dict]:
    """Gradient-difference Lanczos (8 steps) against exact Lanczos (8 steps, the same start) on a base ramp run.

    At each point, before the step trains on its batch: the exact ratio (double backward, float32), then
    ``sharpness_ratio`` with gradient differences under each step rule, in float32 and under bf16 autocast (the
    reading's forwards in bf16, the parameters float32).
    """
    config, data, model, optimizer, gen = base_ramp(seed)
    losses, rows = [], []
    for step in range(max(points) + 1):
        idx, target, _ = next_batch(config, step, optimizer, data, gen)
        if step in points:
            batch = (idx, target)
            row = {"step": step, "exact": ratio_of(model, batch, optimizer, 8, step), "rules": {}}
            for eps in RELATIVE_STEPS:
                row["rules"][f"float32, relative step {eps:g}"] = ratio_of(
                    model, batch, optimizer, 8, step, "gradient_difference", relative_length=eps
                )
            for precision, changes in GRADIENT_CHANGES.items():
                for change in changes:
                    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision != "float32")
                    with autocast:
                        result = sharpness_ratio(lambda batch=batch: gpt_loss(model, batch), optimizer, steps=8,
                                                 model=model, seed=step, gradient_change=change)  # fmt: skip
                    row["rules"][f"{precision}, gradient change {change:g}"] = result.ratio
                    row["rules"][f"{precision}, gradient change {change:g}, gradients"] = result.gradient_evaluations
            rows.append(row)
            print(json.dumps(row), flush=True)
        if not train_step(model, optimizer, (idx, target), losses):
            break
    return rows


PROBE_WINDOW = (1000, 1320, 20)  # base ramp seed 0: healthy, the ratio passing 0.5, up to its divergence near 1324


def _top_ritz(matvec, start: torch.Tensor, steps: int) -> tuple[list[float], torch.Tensor]:
    """Lanczos with full reorthogonalization (the study's operators are small).

    Returns the top Ritz value after each step (steps 1..``steps``, one product each, from the same start) and the
    last top Ritz vector.
    """
    basis, alpha, beta = [start / start.norm()], [], []
    values = []
    for j in range(steps):
        w = matvec(basis[j])
        alpha.append(float(w @ basis[j]))
        for q in basis:  # twice is enough (Kahan)
            w = w - (w @ q) * q
        for q in basis:
            w = w - (w @ q) * q
        t = torch.diag(torch.tensor(alpha, dtype=torch.float64))
        for i, b in enumerate(beta):
            t[i, i + 1] = t[i + 1, i] = b
        nodes, vectors = torch.linalg.eigh(t)
        values.append(float(nodes[-1]))
        beta.append(float(w.norm()))
        if j + 1 < steps:
            basis.append(w / w.norm())
    ritz = sum(float(c) * q for c, q in zip(vectors[:, -1], basis, strict=False))
    return values, ritz / ritz.norm()


def probe_study(seed: int = 0, window: tuple[int, int, int] = PROBE_WINDOW, warm_steps: int = 4) -> list[dict]:
    """Issue 32 item 3: can a fixed probe batch be read warm in 1-2 products (its Hessian moves with the weights only)?

    At each sample of the base ramp run, before the step: the exact ratio of the batch the step trains
    on (8 Lanczos steps, what the default rule reads), and on one fixed batch (drawn once): 20 cold Lanczos steps
    (its converged value, and its 8-step reading) and ``warm_steps`` steps from the previous sample's top Ritz
    vector. Exact products (double backward, float64 vectors).
    """
    from connmon.curvature import step_geometry
    from connmon.curvature.geometry import root_step
    from connmon.curvature.products import DoubleBackwardProducts

    config, data, model, optimizer, gen = base_ramp(seed)
    probe_rows = data[torch.randint(0, len(data), (16,), generator=torch.Generator().manual_seed(10_000 + seed))]
    probe = (probe_rows[:, :-1], probe_rows[:, 1:])
    start, until, every = window
    losses, rows, previous = [], [], None
    for step in range(until + 1):
        idx, target, _ = next_batch(config, step, optimizer, data, gen)
        if step >= start and step % every == 0:
            geometry = step_geometry(optimizer)
            sizes = zip(geometry.step_sizes, geometry.params, strict=True)
            scale = torch.cat([root_step(size, p, torch.float64) for size, p in sizes])
            row = {"step": step, "train": ratio_of(model, (idx, target), optimizer, 8, step)}
            with sdpa_kernel(SDPBackend.MATH), torch.enable_grad():
                hessian = DoubleBackwardProducts([lambda: gpt_loss(model, probe)], geometry.params, torch.float64, step)

                def matvec(v, hessian=hessian, scale=scale):
                    return hessian(v.clone(), scale).mul_(scale)

                first = torch.randn(scale.numel(), generator=torch.Generator().manual_seed(step), dtype=torch.float64)
                cold, ritz = _top_ritz(matvec, first, 20)
                row["probe"], row["probe 8 cold"] = cold[-1] / geometry.constant, cold[7] / geometry.constant
                if previous is not None:
                    warm, _ = _top_ritz(matvec, previous, warm_steps)
                    row["warm"] = [value / geometry.constant for value in warm]
                    row["overlap"] = abs(float(previous @ ritz))
            previous = ritz
            rows.append(row)
            print(json.dumps(row), flush=True)
        if not train_step(model, optimizer, (idx, target), losses):
            break
    return rows


def probe_table(rows: list[dict]) -> None:
    """A fixed probe's reading against the training batches', and warm starts against its converged value."""
    steps = max(len(row.get("warm", [])) for row in rows)
    print("\n| step | train batch, 8 cold | probe, 20 cold | probe / train | probe 8 cold / 20 | overlap | "
          + " | ".join(f"warm {k} / 20" for k in range(1, steps + 1)) + " |")  # fmt: skip
    print("|---|" + "---|" * (5 + steps))
    for row in rows:  # the first sample has no previous direction: no overlap, no warm start
        warm = [f"{w / row['probe']:.3f}" for w in row.get("warm", [])] or ["-"] * steps
        overlap = f"{row['overlap']:.2f}" if "overlap" in row else "-"
        print(
            f"| {row['step']} | {row['train']:.3f} | {row['probe']:.3f} | {row['probe'] / row['train']:.2f} | "
            f"{row['probe 8 cold'] / row['probe']:.3f} | {overlap} | {' | '.join(warm)} |"
        )


def step_size_table(rows: list[dict]) -> None:
    """Each rule's ratio over the exact one, per point, and the gradients it took."""
    rules = [r for r in rows[0]["rules"] if not r.endswith("gradients")]
    print("\n| rule | " + " | ".join(f"step {row['step']}" for row in rows) + " | worst | gradients per sample |")
    print("|---|" + "---|" * (len(rows) + 2))
    print("| exact ratio | " + " | ".join(f"{row['exact']:.3g}" for row in rows) + " | - | - |")
    for rule in rules:
        quotients = [row["rules"][rule] / row["exact"] for row in rows]
        worst = max(quotients, key=lambda q: abs(math.log(q)) if q > 0 else math.inf)
        counts = [row["rules"].get(f"{rule}, gradients") for row in rows]
        count = f"{min(counts)}-{max(counts)}" if counts[0] is not None else "9"
        cells = [f"{q:.3f}" for q in quotients]
        print(f"| {rule} | " + " | ".join(cells) + f" | {worst:.3f} | {count} |")


def batch_choice(seed: int, start: int, until: int, every: int = 10) -> dict:
    """The ratio at the same parameters on two batches: the one the next step trains on, and the one just trained on.

    A base ramp run (bench_instability's; seed ``seed``) is trained to ``until``; from ``start`` on, every ``every``
    steps, both are measured before the step (8 Lanczos steps, the same seed). What SharpnessMonitor measures is the
    first (the stability of the step about to be taken).
    """
    config, data, model, optimizer, gen = base_ramp(seed)
    losses, pairs, previous = [], {}, None
    for step in range(until):
        idx, target, _ = next_batch(config, step, optimizer, data, gen)
        if step >= start and step % every == 0 and previous is not None:
            pairs[step] = (
                ratio_of(model, (idx, target), optimizer, 8, step),
                ratio_of(model, previous, optimizer, 8, step),
            )
        if not train_step(model, optimizer, (idx, target), losses):
            break
        previous = (idx, target)
    return {"seed": seed, "pairs": pairs, "divergence": divergence(losses)}


def batch_choice_table(results: list[dict]) -> None:
    """When each choice of batch first reads above 1 twice in a row, and how the two compare before that."""
    print(
        "\n| seed | divergence | next batch: above 1 twice from step | batch just trained on: from step | "
        "median ratio (just trained / next) before the first |"
    )
    print("|---|---|---|---|---|")
    for result in results:
        pairs = {int(s): v for s, v in result["pairs"].items()}
        steps = sorted(pairs)

        crossings = [
            next((b for a, b in itertools.pairwise(steps) if pairs[a][i] > 1 and pairs[b][i] > 1), None) for i in (0, 1)
        ]
        before = min((c for c in crossings if c is not None), default=steps[-1] + 1)
        quotients = [pairs[s][1] / pairs[s][0] for s in steps if s < before]
        median = f"{statistics.median(quotients):.2f}" if quotients else "-"
        print(f"| {result['seed']} | {result['divergence']} | {crossings[0]} | {crossings[1]} | {median} |")


def _batch_choice(job: tuple) -> dict:
    return batch_choice(*job)


def _train(job: tuple) -> dict:
    return train(*job)


COOLDOWN = 100  # steps between alerts of one rule, as connmon's Rule default
RULES = {  # name: (bound on the ratio, consecutive samples above it), or None for the z-score rule
    **{f"ratio > {t:g}": (t, 1) for t in (0.5, 0.7, 1.0, 1.2)},
    **{f"ratio > {t:g} on {k} consecutive samples": (t, k) for t in (0.7, 1.0) for k in (2, 3)},
    "log ratio z > 4 rise (floor 0.05)": None,
}


def alerts(run: dict, name: str, cadence: int | None = None) -> list[int]:
    """The steps at which the rule alerts on a run's ratio series (online, cooldown included), by connmon's own rules.

    ``cadence`` keeps only the samples at multiples of it (a sparser SharpnessMonitor).
    """
    series = {int(step): value for step, value in run["ratio"].items()}
    if cadence is not None:
        series = {step: value for step, value in series.items() if step % cadence == 0}
    if RULES[name] is None:
        detector = EWMAZScore(4.0, "rise", log=True, min_std=0.05)
    else:
        bound, need = RULES[name]
        detector = Threshold(bound, consecutive=need)
    rules = RuleSet([Rule(name, RATIO_KEY, detector, cooldown=COOLDOWN)])
    return [step for step in sorted(series) if rules.update({RATIO_KEY: series[step]}, step)]


def cadence_table(runs: list[dict]) -> None:
    """The shipped default rule (above 1 on 2 samples in a row) and a single sample above 1, sampled more sparsely."""
    print("\n| rule | sampled every | divergences warned | median lead | alerts on healthy runs | on other runs |")
    print("|---|---|---|---|---|---|")
    every = min(int(s) for run in runs for s in run["ratio"])
    for name in ("ratio > 1 on 2 consecutive samples", "ratio > 1"):
        for cadence in sorted({every, 40, 60, 100}):
            leads, healthy, other = [], 0, 0
            for run in runs:
                lead, fa = score(alerts(run, name, cadence), run["divergence"])
                leads += [lead] if lead is not None else []
                if run["arm"] in ("control", "warmup"):
                    healthy += fa
                else:
                    other += fa
            diverged = sum(run["divergence"] is not None for run in runs)
            median = f"{statistics.median(leads):g}" if leads else "-"
            print(f"| {name} | {cadence} | {len(leads)}/{diverged} | {median} | {healthy} | {other} |")


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
    cadence_table(runs)


READINGS = ("difference", "secant", "loss_rise")


def readings_report(runs: list[dict]) -> None:
    """The update readings against Lanczos: their level, and the default rule (and lower bounds) fed with them.

    ``difference`` and ``secant`` are ``connmon.curvature.UpdateProbe``'s ratios along the previous update (a lower
    bound of the Lanczos ratio); ``loss_rise`` is ``1 + (L(theta + u) - L(theta)) / -(g . u)`` on the batch the step
    trained on, ``u^T H u / (-2 g . u)`` on a quadratic: above 1 the step raised that batch's loss (Kalra et al.'s
    step size over the critical one, read at the optimizer's own step).
    """
    runs = [run for run in runs if run.get("readings")]
    print("\n| reading | median reading / Lanczos, same step | healthy runs: max | diverged: max, 300 steps before |")
    print("|---|---|---|---|")
    for reading in READINGS:
        quotients, healthy, diverged = [], [], []
        for run in runs:
            series = {int(s): v for s, v in run["readings"].get(reading, {}).items()}
            if not series:
                continue
            lanczos = {int(s): v for s, v in run["ratio"].items()}
            quotients += [series[s] / lanczos[s] for s in series if s in lanczos and lanczos[s] > 0]
            div = run["divergence"]
            if div is None and run["arm"] in ("control", "warmup"):
                healthy.append(max(v for s, v in series.items() if s >= 100))
            elif div is not None:
                diverged.append(max(v for s, v in series.items() if div - 300 <= s < div))
        if not quotients:
            continue
        cells = [
            reading,
            f"{statistics.median(quotients):.3g}",
            ", ".join(f"{v:.3g}" for v in healthy),
            ", ".join(f"{v:.3g}" for v in diverged),
        ]
        print("| " + " | ".join(cells) + " |")
    print("\n| reading | bound | samples | every | divergences warned | median lead | alerts on healthy | on others |")
    print("|---|---|---|---|---|---|---|---|")
    for reading in READINGS:
        for bound, need in ((1.0, 2), (1.0, 1), (0.5, 2)):
            for cadence in (5, 20, 40):
                leads, healthy, other, counted = [], 0, 0, 0
                for run in runs:
                    series = {int(s): v for s, v in run["readings"].get(reading, {}).items() if int(s) % cadence == 0}
                    if not series:
                        continue
                    counted += 1
                    rules = RuleSet([Rule("edge", RATIO_KEY, Threshold(bound, consecutive=need), cooldown=COOLDOWN)])
                    fired = [s for s in sorted(series) if s >= 20 and rules.update({RATIO_KEY: series[s]}, s)]
                    lead, fa = score(fired, run["divergence"])
                    leads += [lead] if lead is not None else []
                    if run["arm"] in ("control", "warmup"):
                        healthy += fa
                    else:
                        other += fa
                if not counted:
                    continue
                diverged = sum(run["divergence"] is not None for run in runs if reading in run["readings"])
                median = f"{statistics.median(leads):g}" if leads else "-"
                cells = [reading, f"{bound:g}", str(need), str(cadence), f"{len(leads)}/{diverged}", median]
                print("| " + " | ".join([*cells, str(healthy), str(other)]) + " |")


def edge_alerts(series: dict[int, float]) -> list[int]:
    """The default rule's alerts (above 1 on two samples in a row, from step 20, cooldown 100) on a ratio series."""
    rules = RuleSet([Rule("edge", RATIO_KEY, Threshold(1.0, consecutive=2), cooldown=COOLDOWN)])
    return [s for s in sorted(series) if s >= 20 and rules.update({RATIO_KEY: series[s]}, s)]


CANDIDATE_LADDERS = (  # adaptive cadences: (ratio from which, times every_n_steps), densest first
    ((0.5, 1), (0.0, 4)),
    ((0.5, 1), (0.0, 6)),
    ((0.5, 1), (0.0, 8)),
    ((0.5, 1), (0.25, 3), (0.0, 8)),
    ((0.3, 1), (0.0, 6)),
)
LADDERS = {
    ", ".join(f"from {bound:g}: {factor}x" for bound, factor in ladder) + (" (default)" if ladder == LADDER else ""): (
        ladder
    )
    for ladder in CANDIDATE_LADDERS
}


def adaptive_samples(series: dict[int, float], every: int, ladder: tuple = LADDER) -> list[int]:
    """The steps an adaptive cadence samples, replayed on a series recorded every 20 steps."""
    steps, step = [], every
    while step in series:
        steps.append(step)
        step += adaptive_interval(series[step], every, ladder)
    return steps


def sample_cost(run: dict, step: int) -> float:
    """Gradients the default reading took at ``step``; runs recorded before the noise check get its cost added."""
    evaluations = float(run.get("gradient_evaluations", {}).get(str(step), 9))
    checked = run.get("noise_check") or run["gradient_ratio"].get(str(step), 0.0) < NOISE_CHECK_FROM
    return evaluations if checked else 2 * evaluations


def gradient_report(runs: list[dict]) -> None:
    """The default estimator (gradient differences) against exact Lanczos, and the adaptive cadence, on the suite."""
    runs = [run for run in runs if run.get("gradient_ratio")]
    if not runs:
        return
    quotients, before, below, missed, evaluations = [], [], [], [], []
    for run in runs:
        exact = {int(s): v for s, v in run["ratio"].items()}
        gradient = {int(s): v for s, v in run["gradient_ratio"].items()}
        evaluations += list(run.get("gradient_evaluations", {}).values())
        div = run["divergence"]
        for s in sorted(set(exact) & set(gradient)):
            if math.isfinite(exact[s]) and exact[s] > 0 and math.isfinite(gradient[s]):
                quotients.append(gradient[s] / exact[s])
                if exact[s] < 1:
                    below.append(gradient[s] / exact[s])
                if div is None or s < div:
                    before.append(gradient[s] / exact[s])
        first = [next(iter(edge_alerts(series)), None) for series in (exact, gradient)]
        if first[0] is not None and (first[1] is None or first[1] > first[0] + 20):
            missed.append(f"{run['variant']} {run['arm']} {run['seed']}: exact {first[0]}, gradients {first[1]}")
    within = sum(abs(q - 1) <= 0.1 for q in before) / len(before)
    print(f"\n{len(runs)} runs, {len(quotients)} samples where both ran ({len(before)} before a divergence)")
    print("\n| gradient differences / exact Lanczos | value |\n|---|---|")
    print(f"| samples within 10%, before divergence | {100 * within:.1f}% |")
    print(f"| samples within 10% where exact Lanczos reads below 1 (the healthy side) | "
          f"{100 * sum(abs(q - 1) <= 0.1 for q in below) / len(below):.1f}% of {len(below)} |")  # fmt: skip
    print(f"| median quotient (all samples) | {statistics.median(quotients):.4f} |")
    print(f"| 5th and 95th percentiles | {_percentile(quotients, 5):.3f}, {_percentile(quotients, 95):.3f} |")
    costs = [sample_cost(run, int(s)) for run in runs for s in run["gradient_ratio"]]
    print(f"| gradients per sample (8 Lanczos steps; noise check included) | median {statistics.median(costs):g}, "
          f"mean {statistics.mean(costs):.1f}, max {max(costs):g} |")  # fmt: skip
    print(f"| default-rule crossings exact Lanczos makes and gradients miss (or make later) | {len(missed)} |")
    for line in missed:
        print(f"|   {line} | |")
    print("\n| cadence (every_n_steps=20) | series | divergences warned | median lead | alerts on healthy runs | "
          "on other runs | gradients per training step on healthy runs (median, max) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    cadences = [("fixed every 20", None), *LADDERS.items()]
    for label, ladder in cadences:
        for key in ("ratio", "gradient_ratio"):
            leads, healthy, other, costs = [], 0, 0, []
            for run in runs:
                series = {int(s): v for s, v in run[key].items()}
                steps = sorted(series) if ladder is None else adaptive_samples(series, 20, ladder)
                kept = {s: series[s] for s in steps}
                lead, fa = score(edge_alerts(kept), run["divergence"])
                leads += [lead] if lead is not None else []
                if run["arm"] in ("control", "warmup"):
                    healthy += fa
                    costs.append(sum(sample_cost(run, s) for s in steps) / len(run["loss"]))
                else:
                    other += fa
            diverged = sum(run["divergence"] is not None for run in runs)
            median = f"{statistics.median(leads):g}" if leads else "-"
            name = "exact" if key == "ratio" else "gradients"
            cost = f"{statistics.median(costs):.3f}, {max(costs):.3f}" if costs and key != "ratio" else "-"
            print(f"| {label} | {name} | {len(leads)}/{diverged} | {median} | {healthy} | {other} | {cost} |")


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def _study_rows(args: argparse.Namespace, study, table) -> None:
    """A one-run study: its rows from ``--load`` (JSON lines) or measured now, saved with ``--save``, then tabled."""
    if args.load:
        rows = [json.loads(line) for path in args.load for line in path.read_text().splitlines()]
    else:
        rows = study()
    if args.save:
        args.save.write_text("\n".join(json.dumps(row) for row in rows))
    table(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--every", type=int, default=20)
    parser.add_argument("--iterations", type=int, default=8, help="Lanczos steps per sample")
    parser.add_argument(
        "--update-every", type=int, default=0, help="also read the curvature along the update this often (0: never)"
    )
    parser.add_argument("--start", type=float, default=1e-3)
    parser.add_argument("--peak", type=float, default=1e-1)
    parser.add_argument("--ramp", type=int, default=1500)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--set", choices=sorted(SETS), default="main", help="which runs (main: 8; phase, more: 4 each)")
    parser.add_argument("--save", type=Path)
    parser.add_argument("--load", type=Path, nargs="*", help="saved runs (several files are merged)")
    parser.add_argument("--check", action="store_true", help="only compare the estimator with a dense Hessian")
    parser.add_argument(
        "--batch-choice", action="store_true", help="only compare the next batch with the one just trained on"
    )
    parser.add_argument(
        "--step-size", action="store_true", help="only measure the gradient-difference step rules against exact"
    )
    parser.add_argument("--probe-batch", action="store_true", help="only measure a fixed probe batch, warm started")
    parser.add_argument(
        "--lanczos-depth", action="store_true", help="only measure 4-20 Lanczos steps against a converged exact reading"
    )
    args = parser.parse_args()
    if args.lanczos_depth:
        _study_rows(args, lanczos_depth_study, lanczos_depth_table)
        return
    if args.probe_batch:
        _study_rows(args, probe_study, probe_table)
        return
    if args.check:
        check_against_dense()
        return
    if args.step_size:
        _study_rows(args, step_size_study, step_size_table)
        return
    if args.batch_choice:
        if args.load:
            results = [r for path in args.load for r in json.loads(path.read_text())]
        else:
            jobs = [(0, 1000, 1330), (1, 1150, 1410), (2, 1100, 1350)]  # to just past each base ramp's divergence
            with get_context("spawn").Pool(args.processes) as pool:
                results = pool.map(_batch_choice, jobs)
            if args.save:
                args.save.write_text(json.dumps(results))
        batch_choice_table(results)
        return
    if args.load:
        runs = [run for path in args.load for run in json.loads(path.read_text())]
    else:
        jobs = [
            (c, args.steps, args.every, args.iterations, args.start, args.peak, args.ramp, args.update_every)
            for c in SETS[args.set]
        ]
        with get_context("spawn").Pool(args.processes) as pool:
            runs = pool.map(_train, jobs)
        for run in runs:
            run["divergence"] = divergence(run["loss"])
        if args.save:
            args.save.write_text(json.dumps(runs))
    print(f"{len(runs)} runs; sampled every {args.every} steps, {args.iterations} Lanczos steps")
    report(runs)
    readings_report(runs)
    gradient_report(runs)


if __name__ == "__main__":
    main()
