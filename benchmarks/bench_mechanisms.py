"""Which mechanism makes a run fail, and which rule says so first: attention-logit growth, the edge, healthy runs.

The suite's pre-LN GPT (``bench_instability.py``: 4 layers, 4 heads, batch 16 x 64, AdamW, no clipping) in arms
that each isolate one mechanism, every run recording what the README's recipe feeds the alert rules: the attention
sample every 25 steps (``connmon/<metric>/L<ll>``, two sequences), the curvature ratio every 40 steps
(``connmon/sharpness_ratio``, SharpnessMonitor's default cadence) and every step's per-head max logit over the whole
batch (:class:`connmon.capture.max_logit.HeadMaxLogits`, as a Monitor logs it), and the loss every step.

* ``logit growth``: no QK-norm, a linear warmup to a high constant learning rate (``--growth``: rate, warmup, task,
  init), several seeds and widths. Its max logit climbs by orders of magnitude.
* ``qk-norm twin``: the same run (rate, seed, width, task) with LayerNorm on q and k: it lives at Adam's adaptive
  edge at the same rate, and stays healthy.
* ``healthy``: an ordinary rate (1e-3, warmup 100) on both tasks: logits triple early as attention learns.
* ``ramp`` / ``ramp twin`` / ``control``: the suite's exponential LR ramp (1e-3 to 1e-1 over 1500 steps) without
  QK-norm, with it at the same ramp, and its healthy control (QK-norm, peak 3e-3).
* the other mechanisms (:func:`mechanism_arms`, ``--mechanism-seeds``): Adam's second moment at beta2 0.999 against
  0.95, the z-loss twin, post-LN without warmup against pre-LN, a high-rate cosine schedule with and without QK-norm,
  and healthy runs whose loss spikes and recovers (bad batches, an LR spike). Every run also records the optimizer's
  state after each step (:mod:`connmon.curvature.optimizer_state`) and its largest output logit.

The cadence table replays curvature cadences on the recorded ratios (every 40 steps): the ratio-driven ladder, and a
slow base cadence made dense where a first-tier signal moved (:func:`curvature_steps`), with the default rules'
warnings, false alarms and the recipe's estimated cost.

Failure is the suite's divergence rule (``bench_instability.divergence``: NaN, or the smoothed loss above 1.5x its
running minimum for 10 steps once the run has learned). A run that never learns while its QK-norm twin does (final
smoothed loss above the twin's by more than 25% of the twin's drop below the unigram plateau) is a failure too,
``stuck`` in the table (any alert warns of it; the table gives the step it falls behind the twin by that margin for
good), and any alert on a run that neither diverges nor sticks is a false alarm. For every rule set the table gives
the first alert (rule, step), the lead (``failure step - alert step``), and the false alarms.

Usage:
    python benchmarks/bench_mechanisms.py --save /tmp/mechanisms.json     # about 25 minutes on 2 quiet CPU cores
    python benchmarks/bench_mechanisms.py --load /tmp/mechanisms.json     # the tables again, no training
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Callable
from multiprocessing import get_context
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_instability import SHARPNESS_EVERY, _train, divergence, example_module

from connmon import keys
from connmon.alerts import (
    AllOf,
    Growth,
    NonFinite,
    Rule,
    RuleSet,
    Surge,
    Threshold,
    default_rules,
    edge_of_stability_rule,
)
from connmon.curvature.optimizer_state import OPTIMIZER_SIGNALS

ATTENTION_EVERY = 25  # the README's recipe: a light attention sample every 25 steps
SMOOTH = 20  # steps in the final smoothed loss
RAMP_STEPS = 1500  # the suite's ramp reaches its peak at step 1500
STALE_PEAK = 0.3  # the stale-second-moment arms' peak rate
CRITICAL_EVERY = 10  # critical sharpness recorded after every this many steps


def configs(args: argparse.Namespace) -> list[dict]:
    runs = []
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        for rate, warmup, task, init, width in args.growth:
            common = {"seed": seed, "start": 0.0, "peak": rate, "ramp": warmup, "shape": "warmup", "corpus": task,
                      "init": init, "width": width, "depth": 4, "optimizer": "adamw"}  # fmt: skip
            runs.append({"arm": "logit growth", **common, "qk_norm": False})
            runs.append({"arm": "qk-norm twin", **common, "qk_norm": True})
            for tau in args.qk_clip:
                runs.append({"arm": f"qk-clip {tau:g}", **common, "qk_norm": False, "qk_clip": tau})
            for factor in args.transport_clip:
                runs.append({"arm": f"transport-clip {factor:g}", **common, "qk_norm": False,
                             "transport_clip": factor})  # fmt: skip
            if args.backoff:
                runs.append({"arm": "backoff", **common, "qk_norm": False, "backoff": True})
        for task in ("markov", "copy"):
            for init in args.healthy_inits:  # torch's init: logits near 2 that triple as attention learns
                healthy = {"start": 0.0, "peak": 1e-3, "ramp": 100, "shape": "warmup", "corpus": task, "init": init}
                runs.append({"arm": "healthy", "seed": seed, **healthy, "width": 128, "qk_norm": False})
                for factor in args.transport_clip:
                    runs.append({"arm": f"healthy transport-clip {factor:g}", "seed": seed, **healthy, "width": 128,
                                 "qk_norm": False, "transport_clip": factor})  # fmt: skip
        if seed < args.first_seed + args.mechanism_seeds:
            runs += mechanism_arms(seed, args.steps, args.stale_peak)
        if args.ramp:
            ramp = {"seed": seed, "start": 1e-3, "ramp": 1500, "shape": "exp", "corpus": "markov", "width": 128}
            runs.append({"arm": "ramp", **ramp, "peak": 1e-1, "qk_norm": False})
            runs.append({"arm": "ramp twin", **ramp, "peak": 1e-1, "qk_norm": True})
            runs.append({"arm": "control", **ramp, "peak": 3e-3, "qk_norm": True})
            for tau in args.qk_clip:
                runs.append({"arm": f"ramp qk-clip {tau:g}", **ramp, "peak": 1e-1, "qk_norm": False, "qk_clip": tau})
            for factor in args.transport_clip:
                runs.append({"arm": f"ramp transport-clip {factor:g}", **ramp, "peak": 1e-1, "qk_norm": False,
                             "transport_clip": factor})  # fmt: skip
            if args.backoff:
                runs.append({"arm": "ramp backoff", **ramp, "peak": 1e-1, "qk_norm": False, "backoff": True})
    for run in runs:
        run["head_logits"] = True
        run["critical_every"] = args.critical_every
    return runs


def mechanism_arms(seed: int, steps: int, stale_peak: float = STALE_PEAK) -> list[dict]:
    """The mechanisms the field knows beyond logit growth, each beside the twin it differs from by one setting.

    * ``adam beta2 0.999`` / ``adam beta2 0.95``: QK-norm (no logit growth), a warmup to 1e-2: Adam's second moment
      out of date at beta2 = 0.999 (Wortsman et al. 2023b; Molybog et al. 2023) against its 0.95 twin.
    * ``z-loss twin``: the beta2 0.95 run with PaLM's z-loss (1e-4): the output logits' drift without it.
    * ``post-LN`` / ``pre-LN``: 3e-3 from the first step, no warmup (Xiong et al. 2020), no QK-norm.
    * ``cosine`` / ``cosine qk-norm``: a warmup to 1e-2 and a cosine decay to a tenth over the run.
    * ``stale beta2 0.999`` / ``stale beta2 0.95``: QK-norm and z-loss (1e-4) hold the attention and output logits;
      a warmup over 300 steps to ``stale_peak`` (a few tenths): where beta2 0.999's second moment lags the gradient.
    * ``bad batches`` / ``lr spike``: a healthy run (1e-3) that trains 5 steps on random tokens, or 3 steps at 30x
      its rate, at step 400: a loss spike it recovers from (no alert is right).
    """
    base = {"seed": seed, "start": 0.0, "shape": "warmup", "corpus": "markov", "init": "torch", "width": 128}
    high = {**base, "peak": 1e-2, "ramp": 100, "qk_norm": True}
    healthy = {**base, "peak": 1e-3, "ramp": 100, "qk_norm": False}
    cosine = {**base, "peak": 1e-2, "ramp": 100, "shape": "cosine", "decay": steps}
    stale = {**base, "peak": stale_peak, "ramp": 300, "qk_norm": True, "z_loss": 1e-4}
    return [
        {"arm": "adam beta2 0.999", **high, "beta2": 0.999},
        {"arm": "adam beta2 0.95", **high, "beta2": 0.95},
        {"arm": "z-loss twin", **high, "beta2": 0.95, "z_loss": 1e-4},
        {"arm": "post-LN", **base, "peak": 3e-3, "ramp": 0, "qk_norm": False, "post_ln": True},
        {"arm": "pre-LN", **base, "peak": 3e-3, "ramp": 0, "qk_norm": False},
        {"arm": "cosine", **cosine, "qk_norm": False},
        {"arm": "cosine qk-norm", **cosine, "qk_norm": True},
        {"arm": "stale beta2 0.999", **stale, "beta2": 0.999},
        {"arm": "stale beta2 0.95", **stale, "beta2": 0.95},
        {"arm": "bad batches", **healthy, "bad_batches": [400, 5]},
        {"arm": "lr spike", **healthy, "lr_spike": [400, 3, 30.0]},
    ]


def smoothed(losses: list[float], at: int | None = None) -> float:
    end = len(losses) if at is None else at + 1
    window = losses[max(0, end - SMOOTH) : end]
    return statistics.fmean(window)


def failure(run: dict, twins: dict) -> tuple[int | None, str]:
    """The step and kind of the run's failure: ``"diverged"``, ``"stuck"`` or ``""`` (healthy)."""
    div = divergence(run["loss"])
    if div is not None:
        return div, "diverged"
    twin = twin_of(run, twins)
    if twin is not None:
        margin = 0.25 * (run["loss"][0] - smoothed(twin["loss"]))
        steps = min(len(run["loss"]), len(twin["loss"]))
        behind = [smoothed(run["loss"], s) - smoothed(twin["loss"], s) > margin for s in range(steps)]
        if behind[-1]:  # behind its twin at the end: from the first step it stays behind for good
            return next(s for s in range(steps) if all(behind[s:])), "stuck"
    return None, ""


TWIN_OF = {"logit growth": "qk-norm twin", "post-LN": "pre-LN", "adam beta2 0.999": "adam beta2 0.95",
           "stale beta2 0.999": "stale beta2 0.95",
           "adam beta2 0.95": "z-loss twin", "cosine": "cosine qk-norm"}  # fmt: skip
# a run that ends behind the arm named here (its twin that differs by one setting) has failed: stuck


def twins_of(runs: list[dict]) -> dict:
    """Every twin run by ``(arm, twin key)``."""
    return {(r["arm"], _twin_key(r)): r for r in runs if r["arm"] in TWIN_OF.values()}


def twin_of(run: dict, twins: dict) -> dict | None:
    return twins.get((TWIN_OF.get(run["arm"]), _twin_key(run)))


def _twin_key(run: dict) -> tuple:
    return (run["seed"], run["peak"], run["ramp"], run["corpus"], run.get("init"), run["width"])


LOGIT_EVERY = 25  # SamplingOptions.logit_every_n_steps default: the logits of every 25th step are read


def fed(
    run: dict, curvature_every: int = SHARPNESS_EVERY, curvature_steps: set[int] | None = None
) -> dict[int, dict[str, float]]:
    """What the recipe's DriftAlert sees, step by step (the logit window since the last attention sample).

    ``curvature_every``: the ratio as a sampler every this many steps would read it (a multiple of the recorded 40);
    ``curvature_steps``: only the ratios of these steps (a cadence replayed by :func:`curvature_steps`).
    """
    series: dict[int, dict[str, float]] = {}
    window: list[list[float]] | None = None
    for step, table in enumerate(run["head_logits"]):
        if step % ATTENTION_EVERY == 0:  # as a Monitor: the window of the steps before this sample's
            values = dict(run["samples"].get(str(step), run["samples"].get(step, {})))
            for index, row in enumerate(window or []):
                values[keys.metric_key(keys.STEP_MAX_LOGIT, index)] = max(row)
                values.update({keys.head_key(index, head): value for head, value in enumerate(row)})
            series[step] = values
            window = None
        if step % LOGIT_EVERY == 0:  # the steps whose logits a Monitor reads
            window = table if window is None else [[max(a, b) for a, b in zip(w, t, strict=True)]
                                                   for w, t in zip(window, table, strict=True)]  # fmt: skip
    for step, ratio in run.get("sharpness", {}).items():
        if (
            step != "off"
            and int(step) % curvature_every == 0
            and (curvature_steps is None or int(step) in curvature_steps)
        ):
            series.setdefault(int(step), {})[keys.SHARPNESS_RATIO] = ratio
    return dict(sorted(series.items()))


def first_alerts(rules: Callable[[], RuleSet], series: dict[int, dict[str, float]]) -> list[tuple[int, str, str]]:
    ruleset = rules()  # warnings only: a notice claims no failure
    return [(step, a.rule, a.key) for step in series for a in ruleset.update(series[step], step) if a.kind == "warning"]


def previous_defaults() -> RuleSet:
    """The default rules before issue 47: non-finite logits, logits tripled by step 50, the edge on two samples."""
    logits = keys.every_layer("max_attention_logit")
    return RuleSet([
        Rule("non-finite attention", logits, NonFinite(), level="ERROR", cooldown=0),
        Rule("attention logits growing early", logits, Growth(3.0), until=50, cooldown=1000),
        edge_of_stability_rule(),
    ])  # fmt: skip


RULE_SETS: dict[str, Callable[[], RuleSet]] = {
    "previous defaults": previous_defaults,
    "defaults": lambda: RuleSet(default_rules()),
}
WINDOW = 300  # as the suite: an alert at most this many steps before the failure warns of it


def score(alerts: list[tuple[int, str, str]], fail: int | None, kind: str) -> tuple[str, int, tuple | None]:
    """The lead cell, the false alarms and the alert that warned (or the first alert) of one run.

    A divergence is warned by an alert at most ``WINDOW`` steps before it (earlier ones are false alarms); a run
    stuck from its start by any alert (the cell gives its step); every alert on a run that does not fail is false.
    """
    if fail is None:
        return "-", len(alerts), alerts[0] if alerts else None
    if kind == "stuck":
        return (f"at {alerts[0][0]}" if alerts else "-"), 0, alerts[0] if alerts else None
    warnings = [a for a in alerts if fail - WINDOW <= a[0] <= fail]
    false = sum(a[0] < fail - WINDOW for a in alerts)
    return (str(fail - warnings[0][0]) if warnings else "-"), false, warnings[0] if warnings else None


def behind(run: dict, twins: dict) -> str:
    """How far behind its QK-norm twin a run ended, as a share of the twin's drop below the first loss."""
    twin = twin_of(run, twins)
    if twin is None or twin is run:
        return "-"
    drop = run["loss"][0] - smoothed(twin["loss"])
    return f"{(smoothed(run['loss']) - smoothed(twin['loss'])) / drop:.0%}"


def table(runs: list[dict], curvature_every: int = SHARPNESS_EVERY) -> None:
    twins = twins_of(runs)
    for name, rules in RULE_SETS.items():
        print(f"\n### {name}\n")
        print("| arm | LR | warmup | task | init | width | seed | failure (step) | alert (rule, key, step) | lead "
              "| false alarms | best / final loss | behind twin | max logit: start, peak (step) |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        warned, failed, false_alarms, leads = 0, 0, 0, []
        for run in runs:
            fail, kind = failure(run, twins)
            alerts = first_alerts(rules, fed(run, curvature_every))
            lead, false, shown = score(alerts, fail, kind)
            failed += fail is not None
            warned += lead != "-"
            leads += [int(lead)] if lead.isdigit() else []
            false_alarms += false
            alert = "-" if shown is None else f"{shown[1]}, {shown[2].removeprefix('connmon/')}, {shown[0]}"
            peaks = [max(max(layer) for layer in step) for step in run["head_logits"]]
            top = max(range(len(peaks)), key=peaks.__getitem__)
            best = min(smoothed(run["loss"], s) for s in range(len(run["loss"])))
            cells = [run["arm"], f"{run['peak']:g}", str(run["ramp"]), run["corpus"], run.get("init", "torch"),
                     str(run["width"]), str(run["seed"]), f"{kind} ({fail})" if kind else "-", alert, lead,
                     str(false), f"{best:.2f} / {smoothed(run['loss']):.2f}", behind(run, twins),
                     f"{peaks[0]:.3g}, {peaks[top]:.3g} ({top})"]  # fmt: skip
            print("| " + " | ".join(cells) + " |")
        median = statistics.median(leads) if leads else "-"
        print(f"\n{name}: {warned}/{failed} failures warned (divergence leads: {sorted(leads)}, median {median}), "
              f"{false_alarms} false alarms")  # fmt: skip


def action_of(run: dict) -> str:
    """The action a run trained with ("" for none): QK-clip, the transport clip or the back-off."""
    if run.get("qk_clip"):
        return f"qk-clip {run['qk_clip']:g}"
    if run.get("transport_clip"):
        return f"transport clip {run['transport_clip']:g}"
    return "back-off" if run.get("backoff") else ""


def clip_table(runs: list[dict]) -> None:
    """Each action against the QK-norm twin and the same run without it: the final loss, divergence, time."""
    twins = {_twin_key(r): r for r in runs if r["arm"] in ("qk-norm twin", "ramp twin")}
    plain = {_twin_key(r): r for r in runs if r["arm"] in ("logit growth", "ramp", "healthy")}
    acted = [r for r in runs if action_of(r)]
    if not acted:
        return
    print("\n### The actions (after every optimizer step) against the QK-norm twin and the run without them\n")
    print(
        "| run | LR | warmup | task | init | width | seed | action | diverged at (without) | final loss: with / "
        "twin / without | vs twin | vs without | max logit with (without) | back-offs | time vs without |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    order = sorted(acted, key=lambda r: (r["arm"].startswith("ramp"), r["arm"].startswith("healthy"), action_of(r),
                                         r["peak"], r["corpus"], r.get("init", ""), r["seed"]))  # fmt: skip
    for run in order:
        twin, without = twins.get(_twin_key(run)), plain.get(_twin_key(run))
        if without is None:
            continue
        mine, other = smoothed(run["loss"]), smoothed(without["loss"])
        theirs = smoothed(twin["loss"]) if twin is not None else None
        peak = max(max(max(layer) for layer in step) for step in run["head_logits"])
        free = max(max(max(layer) for layer in step) for step in without["head_logits"])
        kind = "ramp" if run["arm"].startswith("ramp") else "healthy" if run["arm"].startswith("healthy") else "warmup"
        diverged = f"{divergence(run['loss'])} ({divergence(without['loss'])})"
        cells = [kind, f"{run['peak']:g}", str(run["ramp"]), run["corpus"], run.get("init", "torch"), str(run["width"]),
                 str(run["seed"]), action_of(run), diverged,
                 f"{mine:.2f} / {'-' if theirs is None else f'{theirs:.2f}'} / {other:.2f}",
                 "-" if theirs is None else f"{mine / theirs - 1:+.0%}", f"{mine / other - 1:+.0%}",
                 f"{peak:.3g} ({free:.3g})", str(len(run.get("backoffs", []))),
                 f"{run['seconds'] / without['seconds']:.2f}x"]  # fmt: skip
        print("| " + " | ".join(cells) + " |")


GRADIENTS_PER_SAMPLE = 11  # a finite-difference Lanczos sample: 8 products, g(theta) and the step search
ATTENTION_COST = 0.03  # the recipe's light attention sample every 25 steps (benchmarks/README.md, bench_overhead.py)


def moved(run: dict, last: int, step: int, signals: tuple[str, ...]) -> bool:
    """Whether a first-tier signal moved in steps ``(last, step]`` against the 40 steps up to ``last``.

    ``logit``: the largest head logit x1.5; ``optimizer``: the stale-second-moment share or the update-to-weight ratio
    x2; ``loss``: the 10-step mean loss 1.2x its running minimum once the run has learned.
    """
    before, after = range(max(0, last - SHARPNESS_EVERY + 1), last + 1), range(last + 1, step + 1)
    if "logit" in signals or "logit above 20" in signals:
        peak = [max(max(layer) for layer in table) for table in run["head_logits"]]
        now = max(peak[s] for s in after if s < len(peak))
        floor = 20.0 if "logit above 20" in signals else -math.inf
        if now >= 1.5 * max(peak[s] for s in before if s < len(peak)) and now > floor:
            return True
    names = [
        n for n in ("stale_second_moment", "update_to_weight", "update_rms") if "optimizer" in signals or n in signals
    ]
    if names:
        for name in names:
            series = run.get("optimizer_signals", {}).get(name) or []
            if len(series) > step and max(series[s] for s in after) >= 2 * max(series[s] for s in before):
                return True
    if "loss" in signals:
        loss = run["loss"]
        mean = [statistics.fmean(loss[max(0, s - 9) : s + 1]) for s in range(min(step + 1, len(loss)))]
        low = min(mean[: last + 1])
        if low < 0.9 * loss[0] and any(mean[s] >= 1.2 * low for s in after if s < len(mean)):
            return True
    return False


def curvature_steps(run: dict, cadence: dict) -> set[int]:
    """The recorded curvature samples a cadence would have taken (the recording's grid: every 40 steps).

    ``cadence``: ``{"ladder": ((ratio, steps), ...)}`` for the ratio-driven ladder (the next sample that many steps
    after, from the first rung the ratio reaches), ``{"base": steps, "signals": (...), "dense_ratio": r}`` for the
    gated one: the next sample ``base`` steps later, or at the first recorded step where a first-tier signal moved
    (:func:`moved`), or 40 steps later where the ratio was at least ``dense_ratio``.
    """
    ratios = {int(s): r for s, r in run.get("sharpness", {}).items() if s != "off"}
    taken, due, last = set(), SHARPNESS_EVERY, 0
    for step in sorted(ratios):
        if step < due and not ("base" in cadence and moved(run, last, step, cadence["signals"])):
            continue
        taken.add(step)
        ratio, last = ratios[step], step
        if "ladder" in cadence:
            due = step + next(gap for bound, gap in cadence["ladder"] if not ratio < bound)
        else:
            dense = not ratio < cadence.get("dense_ratio", math.inf)  # a NaN ratio is dense too
            due = step + (SHARPNESS_EVERY if dense else cadence["base"])
    return taken


CADENCES: dict[str, dict] = {
    "base 200, gated by logits above 20, update RMS, dense from ratio 2 (timed in a run)": {
        "base": 200,
        "signals": ("logit above 20", "update_rms"),
        "dense_ratio": 2.0,
    },
    "base 200, gated by logits above 20": {"base": 200, "signals": ("logit above 20",)},
    "base 200, gated by logits above 20, stale second moment": {
        "base": 200,
        "signals": ("logit above 20", "stale_second_moment"),
    },
    "base 200, gated by logits above 20, update RMS": {"base": 200, "signals": ("logit above 20", "update_rms")},
    "base 200, gated by logits above 20, dense from ratio 2": {
        "base": 200,
        "signals": ("logit above 20",),
        "dense_ratio": 2.0,
    },
    "base 200, gated by logits above 20, dense from ratio 1": {
        "base": 200,
        "signals": ("logit above 20",),
        "dense_ratio": 1.0,
    },
    "base 120, gated by logits above 20, dense from ratio 1": {
        "base": 120,
        "signals": ("logit above 20",),
        "dense_ratio": 1.0,
    },
    "adaptive ladder (the default, on the recorded 40-step grid)": {
        "ladder": ((0.5, 40), (0.25, 120), (-math.inf, 320))
    },
    "base 200, no gate": {"base": 200, "signals": ()},
    "base 200, gated by logits": {"base": 200, "signals": ("logit",)},
    "base 200, gated by logits, optimizer": {"base": 200, "signals": ("logit", "optimizer")},
    "base 200, gated by logits, optimizer, loss": {"base": 200, "signals": ("logit", "optimizer", "loss")},
    "base 200, gated by logits, dense from ratio 2": {"base": 200, "signals": ("logit",), "dense_ratio": 2.0},
    "base 160, gated by logits, optimizer, dense from ratio 2": {
        "base": 160,
        "signals": ("logit", "optimizer"),
        "dense_ratio": 2.0,
    },
}


def cadence_table(runs: list[dict]) -> None:
    """Each curvature cadence replayed on the recorded runs: the default rules' warnings, false alarms and cost."""
    twins = twins_of(runs)
    print("\n### The curvature's cadence, replayed (default rules; cost: 1 + attention 3% + 11 gradients a sample)\n")
    print("| cadence | failures warned | divergence leads | false alarms (arms) | samples a run (median, max) | "
          "estimated recipe cost (median, worst) |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for name, cadence in CADENCES.items():
        warned, failed, leads, false, where, counts, costs = 0, 0, [], 0, [], [], []
        for run in runs:
            fail, kind = failure(run, twins)
            taken = curvature_steps(run, cadence)
            alerts = first_alerts(RULE_SETS["defaults"], fed(run, SHARPNESS_EVERY, taken))
            lead, wrong, _ = score(alerts, fail, kind)
            failed += fail is not None
            warned += lead != "-"
            leads += [int(lead)] if lead.isdigit() else []
            false += wrong
            where += [run["arm"]] * wrong
            counts.append(len(taken))
            costs.append(1 + ATTENTION_COST + GRADIENTS_PER_SAMPLE * len(taken) / max(1, len(run["loss"])))
        arms = ", ".join(f"{arm} {where.count(arm)}" for arm in sorted(set(where)))
        print(f"| {name} | {warned}/{failed} | {sorted(leads)} | {false} ({arms}) | {statistics.median(counts):g}, "
              f"{max(counts)} | {statistics.median(costs):.2f}x, {max(costs):.2f}x |")  # fmt: skip


def first_move(series: list[float], after: int = 225) -> int | None:
    """The first step from ``after`` where the largest of 25 steps is twice the median of the 175 before them."""
    for step in range(after, len(series)):
        reference = statistics.median(series[step - 200 : step - 25])
        if reference > 0 and max(series[step - 24 : step + 1]) >= 2 * reference:
            return step
    return None


def signal_table(runs: list[dict]) -> None:
    """When each optimizer signal first moved on each run, beside its failure: does it move first, and only there?"""
    twins = twins_of(runs)
    print("\n### The optimizer's state: its first move (the largest of 25 steps x2 the median of the 175 before)\n")
    print("| arm | LR | seed | failure (step) | update RMS | stale second moment | update-to-weight |")
    print("|---|---|---|---|---|---|---|")
    moved = {name: 0 for name in OPTIMIZER_SIGNALS}
    for run in runs:
        fail, kind = failure(run, twins)
        firsts = {name: first_move(run.get("optimizer_signals", {}).get(name) or []) for name in OPTIMIZER_SIGNALS}
        for name, step in firsts.items():
            moved[name] += step is not None
        cells = [run["arm"], f"{run['peak']:g}", str(run["seed"]), f"{kind} ({fail})" if kind else "-",
                 *("-" if firsts[name] is None else str(firsts[name]) for name in OPTIMIZER_SIGNALS)]  # fmt: skip
        print("| " + " | ".join(cells) + " |")
    print(f"\nruns on which each moved (of {len(runs)}): " + ", ".join(f"{k} {v}" for k, v in moved.items()))


def candidates() -> dict[str, Callable[[], RuleSet]]:
    """One rule at a time: per-head logit levels and surges, and the edge rule at several bounds."""
    heads = keys.HEAD_MAX_LOGIT + "*"
    out: dict[str, Callable[[], RuleSet]] = {}
    for bound in (30.0, 50.0, 100.0, 200.0):
        out[f"head logit > {bound:g}"] = _one(Rule("c", heads, Threshold(bound), cooldown=1000))
    for factor in (2.0, 3.0, 5.0, 10.0):
        for span in (2, 4):
            for floor in (20.0, 30.0, 50.0, 100.0):
                name = f"head logit x{factor:g} in {span * ATTENTION_EVERY} steps, > {floor:g}"
                out[name] = _one(Rule("c", heads, Surge(factor, span, floor), cooldown=1000))
    for factor in (1.25, 1.5, 2.0):
        for floor in (10.0, 20.0):
            for consecutive in (1, 2):
                logits = Rule("logits", heads, Surge(factor, 4, floor))
                edge = edge_of_stability_rule(1.0, consecutive)
                name = f"ratio > 1 on {consecutive} and head logit x{factor:g} in 100 steps, > {floor:g}"
                out[name] = _one(AllOf("c", [edge, logits], within=100, cooldown=1000))
    for bound in (1.0, 2.0, 3.0, 4.0, 5.0, 8.0):
        for consecutive in (1, 2):
            rule = edge_of_stability_rule(bound, consecutive, cooldown=1000)
            out[f"ratio > {bound:g} on {consecutive} samples"] = _one(rule)
    return out


LEAD = 50  # issue 65's target: a divergence warned at least this many steps ahead


def configuration(run: dict) -> tuple:
    """What a seed ensemble shares: the arm and every setting but the seed."""
    return (run["arm"], run["peak"], run["ramp"], run["corpus"], run.get("init"), run["width"])


def two_looks_fed(run: dict, look: dict) -> dict[int, dict[str, float]]:
    """What the rules see under a two-look cadence, replayed on the recorded readings.

    ``look``: ``first`` (critical sharpness every this many steps, a multiple of the recorded 10), ``trigger`` (the
    critical ratio from which the second look is taken), ``base`` (Lanczos every this many steps regardless; None:
    only when triggered) and ``dense`` (steps the second look stays dense after a trigger). A second look is the
    recorded Lanczos ratio at the first 40-step grid point at or after the trigger (a run would read it at the next
    step: the replay's lead is short by up to 39 steps); Lanczos with ``base=None, trigger=inf`` never runs.
    """
    critical = {int(s): v[0] for s, v in run.get("critical", {}).items() if int(s) % look["first"] == 0}
    lanczos = {int(s): r for s, r in run.get("sharpness", {}).items() if s != "off"}
    taken, ordered = set(), sorted(critical)

    def moved(i: int, step: int) -> bool:  # at the trigger, or (``relative``) that many times its last 10's median
        if "relative" not in look:
            return not critical[step] < look["trigger"]
        before = [critical[s] for s in ordered[max(0, i - 10) : i]]
        return len(before) >= 5 and not critical[step] < look["relative"] * statistics.median(before)

    triggers = [step for i, step in enumerate(ordered) if moved(i, step)]
    for step in sorted(lanczos):
        on_base = look["base"] is not None and step % look["base"] == 0
        after_trigger = any(t <= step <= t + look["dense"] for t in triggers)
        if on_base or after_trigger:
            taken.add(step)
    series = fed(run, SHARPNESS_EVERY, taken)
    for step, ratio in critical.items() if look.get("critical", True) else ():
        series.setdefault(step + 1, {})[keys.CRITICAL_SHARPNESS_RATIO] = ratio  # read at the next step's start
    stale = run.get("optimizer_signals", {}).get("gradient_to_second_moment") or []
    readings = [(s, v) for s, v in enumerate(stale) if (s + 1) % 10 == 0]  # optimizer_every_n_steps=10
    for step in series:
        recent = [v for s, v in readings if step - 50 < s < step]
        if recent:
            series[step][keys.GRADIENT_TO_SECOND_MOMENT] = statistics.median(recent)
    return dict(sorted(series.items()))


LOOKS: dict[str, dict] = {
    "Lanczos every 40 (recorded; today's fixed cadence)": {"first": 10, "trigger": -math.inf, "base": 40, "dense": 0},
    "critical every 10, Lanczos after ratio 1, base 400": {"first": 10, "trigger": 1.0, "base": 400, "dense": 120},
    "critical every 20, Lanczos after ratio 1, base 400": {"first": 20, "trigger": 1.0, "base": 400, "dense": 120},
    "critical every 20, Lanczos after ratio 0.25, base 400": {"first": 20, "trigger": 0.25, "base": 400, "dense": 120},
    "critical every 20, Lanczos after ratio x2 its median, base 400": {
        "first": 20,
        "trigger": 0.0,
        "relative": 2.0,
        "base": 400,
        "dense": 120,
    },
    "critical every 20, no Lanczos": {"first": 20, "trigger": math.inf, "base": None, "dense": 0},
    "critical every 10, no Lanczos": {"first": 10, "trigger": math.inf, "base": None, "dense": 0},
}
for _budget, _every in ((0.25, 80), (0.10, 120), (0.05, 240)):  # a Lanczos sample (11 gradients) every 11 / budget
    LOOKS[f"Lanczos within a budget of {_budget:g}: every {_every}, the first at {_every}"] = {
        "first": 10, "trigger": math.inf, "base": _every, "dense": 0, "critical": False,
    }  # fmt: skip


def ensemble_rules() -> dict[str, Callable[[], RuleSet]]:
    """The rule sets scored on seed ensembles: the defaults, and each candidate on the new readings alone."""
    out: dict[str, Callable[[], RuleSet]] = {"defaults": lambda: RuleSet(default_rules())}
    for bound, consecutive in ((1.0, 1), (1.0, 2), (1.0, 3), (1.5, 2), (2.0, 1), (2.0, 2), (3.0, 1)):
        rule = Rule("c", keys.CRITICAL_SHARPNESS_RATIO, Threshold(bound, consecutive=consecutive), cooldown=1000)
        out[f"critical ratio > {bound:g} on {consecutive}"] = _one(rule)
    for bound in (0.1, 0.15, 0.2, 0.3):
        rule = Rule("c", keys.GRADIENT_TO_SECOND_MOMENT, Threshold(bound, "fall"), cooldown=1000, since=100)
        out[f"gradient / second moment < {bound:g} (50-step median, from step 100)"] = _one(rule)
    return out


def ensemble_table(runs: list[dict]) -> None:
    """Each rule set under each cadence, scored on seed ensembles (issue 65's targets).

    A configuration is at risk if one of its seeds fails, safe if none does. ``warned``: failing seeds warned at
    least ``LEAD`` steps ahead (a stuck run: at any step); ``false``: alerts on the seeds of safe configurations
    (and alerts more than ``WINDOW`` steps before a failure); the arms they fell on; the estimated cost (1 + attention
    3% + each critical reading's forwards / 3 + 11 gradients a Lanczos sample, per step).
    """
    twins = twins_of(runs)
    groups: dict[tuple, list[dict]] = {}
    for run in runs:
        groups.setdefault(configuration(run), []).append(run)
    outcome = {id(run): failure(run, twins) for run in runs}
    risky = {key for key, seeds in groups.items() if any(outcome[id(r)][0] is not None for r in seeds)}
    print("\n### Configurations and their seeds (failure step, or -)\n")
    for key, seeds in sorted(groups.items()):
        cells = [f"{r['seed']}: {outcome[id(r)][1]} {outcome[id(r)][0]}" if outcome[id(r)][0] is not None
                 else f"{r['seed']}: -" for r in sorted(seeds, key=lambda r: r["seed"])]  # fmt: skip
        print(f"* {key[0]} (LR {key[1]:g}): {'at risk' if key in risky else 'safe'}; " + ", ".join(cells))
    print(f"\n### Seed ensembles: each rule set under each cadence (a lead counts from {LEAD} steps)\n")
    print("| cadence | rules | failing seeds warned | leads | missed (arm) | false alarms (arm) | cost (median, max) |")
    print("|---|---|---|---|---|---|---|")
    for look_name, look in LOOKS.items():
        feeds = {id(run): two_looks_fed(run, look) for run in runs}
        costs = [_looks_cost(run, feeds[id(run)], look) for run in runs]
        for rules_name, rules in ensemble_rules().items():
            warned, failing, leads, missed, false = 0, 0, [], [], []
            for run in runs:
                fail, kind = outcome[id(run)]
                alerts = first_alerts(rules, feeds[id(run)])
                if fail is None:
                    false += [run["arm"]] * len(alerts) if configuration(run) not in risky else []
                    continue
                failing += 1
                ahead = [fail - a[0] for a in alerts if fail - WINDOW <= a[0] <= fail]
                early = [a for a in alerts if a[0] < fail - WINDOW]
                false += [run["arm"]] * len(early)
                if (kind == "stuck" and alerts) or (ahead and max(ahead) >= LEAD):
                    warned += 1
                    leads.append(max(ahead) if ahead else "stuck")
                else:
                    missed.append(run["arm"])
            cost = f"{statistics.median(costs):.2f}x, {max(costs):.2f}x"
            print(f"| {look_name} | {rules_name} | {warned}/{failing} | {leads} | {_counted(missed)} | "
                  f"{len(false)} ({_counted(false)}) | {cost} |")  # fmt: skip


def _counted(arms: list[str]) -> str:
    return ", ".join(f"{arm} {arms.count(arm)}" for arm in sorted(set(arms))) or "-"


def _looks_cost(run: dict, series: dict[int, dict[str, float]], look: dict) -> float:
    steps = max(1, len(run["loss"]))
    readings = [v for s, v in run.get("critical", {}).items() if int(s) % look["first"] == 0]
    forwards = sum(v[1] for v in readings) if look["trigger"] != -math.inf and look.get("critical", True) else 0
    lanczos = sum(keys.SHARPNESS_RATIO in values for values in series.values())
    return 1 + ATTENTION_COST + (forwards / 3 + GRADIENTS_PER_SAMPLE * lanczos) / steps


def _one(rule: Rule | AllOf) -> Callable[[], RuleSet]:
    return lambda: RuleSet([rule])


def search(runs: list[dict]) -> None:
    """Every candidate alone: failures warned (and how far ahead), false alarms on the runs that stay healthy."""
    twins = twins_of(runs)
    outcomes = [(run, *failure(run, twins), fed(run)) for run in runs]
    runs = [run for run in runs if not action_of(run)]
    print("\n### Candidates, one rule at a time\n")
    print("| rule | failures warned | leads | false alarms (arms) |")
    print("|---|---|---|---|")
    for name, rules in candidates().items():
        leads, false, where = [], 0, []
        for run, fail, kind, series in outcomes:
            lead, wrong, _ = score(first_alerts(rules, series), fail, kind)
            false += wrong
            where += [run["arm"]] * wrong
            if fail is not None:
                leads.append(None if lead == "-" else lead)
        got = [lead for lead in leads if lead is not None]
        arms = ", ".join(f"{arm} {where.count(arm)}" for arm in sorted(set(where)))
        print(f"| {name} | {len(got)}/{len(leads)} | {', '.join(map(str, got))} | {false} ({arms}) |")


GROWTH = [(1e-2, 100, "markov", "torch", 128), (3e-2, 400, "markov", "torch", 128), (3e-3, 100, "copy", "gpt2", 128),
          (1e-2, 100, "markov", "gpt2", 64)]  # fmt: skip


def growth_setting(text: str) -> tuple:
    rate, warmup, task, init, width = text.split(",")
    return float(rate), int(warmup), task, init, int(width)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--first-seed", type=int, default=0, help="seeds first-seed .. first-seed + seeds - 1")
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--growth", type=growth_setting, nargs="*", default=GROWTH,
                        help="logit-growth settings, each 'rate,warmup,task,init,width'")  # fmt: skip
    parser.add_argument("--no-ramp", dest="ramp", action="store_false", help="leave out the suite's LR ramp arms")
    parser.add_argument("--mechanism-seeds", type=int, default=1,
                        help="seeds of the other mechanisms' arms (mechanism_arms; 0 leaves them out)")  # fmt: skip
    parser.add_argument("--qk-clip", type=float, nargs="*", default=[], help="QK-clip arms at these thresholds")
    parser.add_argument("--transport-clip", type=float, nargs="*", default=[],
                        help="transport-clip arms (an experiment) at these factors, healthy runs included")  # fmt: skip
    parser.add_argument("--backoff", action="store_true", help="back-off arms: the default rules' 'backoff' action")
    parser.add_argument("--only", nargs="*", help="train only these arms")
    parser.add_argument("--healthy-inits", nargs="*", default=["gpt2", "torch"], help="the healthy arms' inits")
    parser.add_argument("--curvature-every", type=int, default=SHARPNESS_EVERY,
                        help="read the recorded ratio every this many steps (a multiple of 40)")  # fmt: skip
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--stale-peak", type=float, default=STALE_PEAK, help="the stale-second-moment arms' peak")
    parser.add_argument("--critical-every", type=int, default=CRITICAL_EVERY,
                        help="record critical sharpness after every this many steps")  # fmt: skip
    parser.add_argument("--search", action="store_true", help="also every candidate rule alone")
    parser.add_argument("--ensemble", action="store_true", help="only the seed-ensemble table (issue 65's targets)")
    parser.add_argument("--save", type=Path)
    parser.add_argument("--load", type=Path, nargs="*")
    args = parser.parse_args()
    if args.load:
        runs = [run for path in args.load for run in json.loads(path.read_text())]
    else:
        example_module()  # fails early if the example moved
        chosen = [config for config in configs(args) if not args.only or config["arm"] in args.only]
        jobs = [(config, RAMP_STEPS if config["arm"].startswith("ramp") or config["arm"] == "control" else args.steps,
                 ATTENTION_EVERY, False, False, SHARPNESS_EVERY) for config in chosen]  # fmt: skip
        jobs.sort(key=lambda job: (job[0]["seed"], -job[1]))  # the first seed of every arm first, long runs first
        runs = []
        with get_context("spawn").Pool(args.processes) as pool:
            for run in pool.imap_unordered(_train, jobs):
                runs.append(run)
                print(
                    f"{run['arm']} {run['peak']:g} {run['corpus']} seed {run['seed']}: {run['seconds']:.0f} s",
                    flush=True,
                )
                if args.save:
                    args.save.write_text(json.dumps(runs))
    if args.ensemble:
        ensemble_table([run for run in runs if not action_of(run)])
        return
    table([run for run in runs if not action_of(run)], args.curvature_every)
    cadence_table([run for run in runs if not action_of(run)])
    signal_table([run for run in runs if not action_of(run) and run.get("optimizer_signals")])
    clip_table(runs)
    if args.search:
        search(runs)


if __name__ == "__main__":
    main()
