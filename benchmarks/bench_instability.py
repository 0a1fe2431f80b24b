"""Do attention signals warn before a training run diverges? A tiny-GPT instability suite on CPU.

Runs (4-layer, width 128, 4-head pre-LN GPT on the example's order-2 Markov corpus, batch 16 x 64, AdamW, no
gradient clipping, one torch thread per run, two runs side by side):

* ``ramp``: a slow exponential LR ramp from ``--start`` (1e-3) to ``--peak`` (1e-1) over ``--ramp`` (1500) steps; no
  qk-norm. The run learns first, at a good LR, then destabilises as the LR grows. (A linear warmup to 1e-1 over 500
  steps was tried first: it passes 1e-2 at step 50, before this model has learned anything, and every run went
  straight to the uniform-prediction plateau, so there was nothing to warn about.)
* ``control``: the same ramp to a peak of 3e-3, with qk-layernorm. It should never diverge.
* ``const-<lr>``: constant LR from step 0 (no warmup), for the *regime* question: does an early alert separate runs
  headed for a bad plateau from good ones?

Every ``--every`` steps the attention of the first 2 sequences is captured and reduced exactly as ConnectionMonitor
does it (walk, head/OV transport, drift groups, and with ``--spectrum`` the spectrum group too: the connection
spectrum's walk part, operator norm, Laplacian gap and ``ov_spectral_radius``), giving ``connmon/<metric>/L<ll>``
series; loss and gradient norm are kept every step. Detectors are causal, so they are evaluated on the recorded series
afterwards, exactly as they would have run online; ``--load`` re-analyses a saved ``--save`` file without training.
An alert counts as a *warning* if it comes at most ``WINDOW = 300`` steps before divergence; any earlier alert, and
any alert on a run that never diverges, is a *false alarm* (an alert during healthy learning warns of nothing).

Divergence: the first step at which the loss is NaN, or at which the smoothed loss (mean of the last 10 steps; one
batch of 16 is noisy) is above ``K = 1.5`` times its running minimum for ``M = 10`` consecutive steps, once the run
has learned (running minimum below 90% of the initial loss, i.e. clearly below the unigram plateau near
``ln 64 = 4.16``, which the untrained model reaches in a few steps).

Usage:
    python benchmarks/bench_instability.py --save /tmp/instability.json   # about 6 minutes on 2 CPU cores
    python benchmarks/bench_instability.py --load /tmp/instability.json   # the tables again, no training
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import statistics
import time
from collections.abc import Callable
from multiprocessing import get_context
from pathlib import Path

import torch
from torch import nn

import connmon
from connmon.alerts import CUSUM, EWMAZScore, Rule, RuleSet, Threshold, default_rules
from connmon.metrics import DriftMetrics, SpectrumMetrics, TransportMetrics, WalkMetrics

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_tiny_gpt.py"
K, M, LEARNED, SMOOTH, WINDOW, REGIME = 1.5, 10, 0.9, 10, 300, 100
FLOORS = (0.02, 0.05, 0.1, 0.2)  # min_std of the floored log z-score candidates


def example_module():
    spec = importlib.util.spec_from_file_location("train_tiny_gpt", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class CausalSelfAttention(nn.Module):
    """nanoGPT's attention with optional qk-layernorm (Dehghani et al. 2023; Wortsman et al. 2023)."""

    def __init__(self, n_embd: int, n_head: int, qk_norm: bool) -> None:
        super().__init__()
        self.n_embd, self.n_head = n_embd, n_head
        self.c_attn, self.c_proj = nn.Linear(n_embd, 3 * n_embd), nn.Linear(n_embd, n_embd)
        d_h = n_embd // n_head
        self.q_norm = nn.LayerNorm(d_h) if qk_norm else nn.Identity()
        self.k_norm = nn.LayerNorm(d_h) if qk_norm else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, T, C) -> (B, T, C)``."""
        B, T, C = x.shape  # batch, sequence length, width
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        y = nn.functional.scaled_dot_product_attention(self.q_norm(q), self.k_norm(k), v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    """A pre-LN transformer block."""

    def __init__(self, n_embd: int, n_head: int, qk_norm: bool) -> None:
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(n_embd), CausalSelfAttention(n_embd, n_head, qk_norm)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, T, C) -> (B, T, C)``."""
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """The example's tiny GPT, with optional qk-layernorm."""

    def __init__(self, vocab: int, tokens: int, qk_norm: bool, n_layer: int = 4, n_embd: int = 128) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, n_embd), nn.Embedding(tokens, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, 4, qk_norm) for _ in range(n_layer))
        self.ln_f, self.head = nn.LayerNorm(n_embd), nn.Linear(n_embd, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """``(B, T)`` token ids -> ``(B, T, V)`` logits."""
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def arms(args: argparse.Namespace) -> list[dict]:
    runs = []
    for seed in range(args.seeds):
        ramp = {"seed": seed, "start": args.start, "ramp": args.ramp}
        runs.append({"arm": "ramp", **ramp, "peak": args.peak, "qk_norm": False})
        runs.append({"arm": "control", **ramp, "peak": 3e-3, "qk_norm": True})
        for lr in args.constant:
            runs.append({"arm": f"const-{lr:g}", "seed": seed, "start": lr, "peak": lr, "ramp": 0, "qk_norm": False})
    return runs


def sample(model: nn.Module, idx: torch.Tensor, groups: list, names: list[str]) -> dict[str, float]:
    """One ConnectionMonitor light sample: capture 2 sequences, the same accumulators, the same keys."""
    for group in groups:
        group.reset()
    with torch.no_grad():
        for record in connmon.capture(model, idx, num_sequences=2):
            for group in groups:
                group.update(record)
    out = {}
    for group in groups:
        for name, value in group.compute().items():
            if name.endswith("/all"):
                out[f"connmon/{name}"] = float(value)
            else:
                out.update({f"connmon/{name}/L{i:02d}": float(v) for i, v in enumerate(value.tolist())})
    return {k: v for k, v in out.items() if not any(k.startswith(f"connmon/{n}") for n in names)}


def train(config: dict, steps: int, every: int, spectrum: bool = False) -> dict:
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)  # saturated softmax otherwise slows the run about 2x
    example = example_module()
    data = example.markov_corpus(2048, seed=0).tensors[0]
    torch.manual_seed(config["seed"])
    model = GPT(example.VOCAB, example.TOKENS, config["qk_norm"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=config["peak"], weight_decay=0.0)
    transport = TransportMetrics(4)
    transport.measure_edges = False
    groups = [WalkMetrics(4), transport, DriftMetrics(4), *([SpectrumMetrics(4)] if spectrum else [])]
    gen = torch.Generator().manual_seed(config["seed"])
    losses, grad_norms, samples = [], [], {}
    start = time.perf_counter()
    for step in range(steps):
        progress = min(1.0, step / config["ramp"]) if config["ramp"] else 1.0
        lr = config["start"] * (config["peak"] / config["start"]) ** progress
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = data[torch.randint(0, len(data), (16,), generator=gen)]
        idx, target = batch[:, :-1], batch[:, 1:]
        if step % every == 0:
            samples[step] = sample(model, idx, groups, ["stochasticity_gap", "reconstruction_error"])
        loss = nn.functional.cross_entropy(model(idx).flatten(0, 1), target.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norms.append(float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])))
        losses.append(loss.item())
        if not math.isfinite(losses[-1]):
            break
        optimizer.step()
    return {
        **config,
        "loss": losses,
        "grad_norm": grad_norms,
        "samples": samples,
        "seconds": time.perf_counter() - start,
    }


def divergence(losses: list[float]) -> int | None:
    """The first step of divergence (see the module docstring), or None."""
    best, above = math.inf, 0
    for step in range(len(losses)):
        if not math.isfinite(losses[step]):
            return step
        window = losses[max(0, step - SMOOTH + 1) : step + 1]
        loss = sum(window) / len(window)
        learned = best < LEARNED * losses[0]
        above = above + 1 if learned and loss > K * best else 0
        if above == M:
            return step - M + 1
        best = min(best, loss)
    return None


def alert_steps(rules: Callable[[], RuleSet], series: dict[int, dict[str, float]]) -> list[int]:
    """Every step at which a fresh rule set alerts on the series (online, cooldowns included)."""
    ruleset = rules()
    return [step for step in sorted(series) if ruleset.update(series[step], step)]


def score(alerts: list[int], div: int | None) -> tuple[int | None, int]:
    """The lead of the first warning (an alert in ``[div - WINDOW, div]``) and the number of false alarms.

    Every other alert before divergence, or on a run that never diverges, is a false alarm.
    """
    if div is None:
        return None, len(alerts)
    warnings = [s for s in alerts if div - WINDOW <= s <= div]
    return (div - warnings[0] if warnings else None), sum(s < div - WINDOW for s in alerts)


def per_step(run: dict, key: str) -> dict[int, dict[str, float]]:
    return {step: {key: value} for step, value in enumerate(run[key])}


def samples(run: dict) -> dict[int, dict[str, float]]:
    return {int(step): values for step, values in run["samples"].items()}


def one(rule: Rule) -> Callable[[], RuleSet]:
    return lambda: RuleSet([rule])


BASELINES: dict[str, tuple[str, Callable[[], RuleSet]]] = {
    "max-logit > 30": ("samples", one(Rule("b", "connmon/max_attention_logit/L*", Threshold(30.0)))),
    "entropy < 0.1": (
        "samples",
        one(Rule("b", "connmon/attention_entropy_normalized/L*", Threshold(0.1, "fall"))),
    ),
    "grad-norm z > 6": ("grad_norm", one(Rule("b", "grad_norm", EWMAZScore(6.0)))),
    "loss z > 6": ("loss", one(Rule("b", "loss", EWMAZScore(6.0)))),
}


def candidates(run_keys: set[str]) -> dict[str, Callable[[], RuleSet]]:
    """Every sampled metric under EWMA z-score and CUSUM rules, linear and log scale, each direction."""
    metrics = sorted({key.split("/")[1] for key in run_keys if key.endswith("/L00")})
    out = {}
    for metric in metrics:
        for direction in ("rise", "fall"):
            glob = f"connmon/{metric}/L*"
            for log in (False, True):
                scale = " log" if log else ""
                for z in (4.0, 6.0):
                    out[f"{metric}{scale} z>{z:g} {direction}"] = one(
                        Rule("c", glob, EWMAZScore(z, direction, log=log))
                    )
                out[f"{metric}{scale} cusum {direction}"] = one(
                    Rule("c", glob, CUSUM(8.0, direction=direction, log=log))
                )
            for floor in FLOORS:  # a floor on the baseline's spread (log scale: a relative change)
                for z in (4.0, 6.0):
                    out[f"{metric} log z>{z:g} {direction} floor {floor:g}"] = one(
                        Rule("c", glob, EWMAZScore(z, direction, log=True, min_std=floor))
                    )
    return out


def cell(lead: int | None, false: int) -> str:
    return ("-" if lead is None else f"lead {lead}") + (f", {false} FA" if false else "")


def evaluate(runs: list[dict]) -> None:
    ramp = [r for r in runs if r["arm"] in ("ramp", "control")]
    for run in ramp:
        run["divergence"] = divergence(run["loss"])
    print("\n### Lead-time suite (ramp runs and qk-norm controls)\n")
    header = ["arm", "seed", "divergence step", "final loss", "DriftAlert default", "(every 100 steps)", *BASELINES]
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for run in ramp:
        div = run["divergence"]
        cells = [run["arm"], str(run["seed"]), str(div), f"{run['loss'][-1]:.3g}"]
        for source, rules in [("samples", default_rules_set), ("every 100", default_rules_set), *BASELINES.values()]:
            if source == "every 100":  # what ConnectionMonitor's default cadence would have seen
                series = {s: v for s, v in samples(run).items() if s % 100 == 0}
            else:
                series = samples(run) if source == "samples" else per_step(run, source)
            cells.append(cell(*score(alert_steps(rules, series), div)))
        print("| " + " | ".join(cells) + " |")
    print(
        f"\nlead: divergence step minus the first alert within {WINDOW} steps before it; FA: false alarms (alerts "
        f"earlier than that, or on a run that never diverged); -: no warning\n"
    )
    diverged = [r for r in ramp if r["divergence"] is not None]
    keys = set().union(*(set(v) for r in ramp for v in r["samples"].values()))
    print(
        "### Candidate signals (every sampled metric; EWMA z > 4, z > 6, CUSUM h = 8; linear and log; log z-scores "
        f"with a floor of {', '.join(map(str, FLOORS))} on the baseline's spread)\n"
    )
    print("| signal | diverging runs warned | median lead (steps) | false alarms (all runs) |")
    print("|---|---|---|---|")
    scored = []
    for name, rules in candidates(keys).items():
        results = [(run["divergence"], score(alert_steps(rules, samples(run)), run["divergence"])) for run in ramp]
        leads = [lead for div, (lead, _) in results if div is not None and lead is not None]
        false = sum(f for _, (_, f) in results)
        scored.append((len(leads), statistics.median(leads) if leads else 0, false, name))
    ranked = sorted(scored, key=lambda s: (s[2] > 0, -s[0], -s[1]))
    for warned, median, false, name in ranked[:25]:
        print(f"| {name} | {warned}/{len(diverged)} | {median:g} | {false} |")
    spectral = [s for s in ranked if s[3].split(" ")[0] in SpectrumMetrics.metrics]
    if spectral:
        print("\n### The spectrum group as an early warning (every candidate rule on its metrics)\n")
        print("| signal | diverging runs warned | median lead (steps) | false alarms (all runs) |")
        print("|---|---|---|---|")
        for warned, median, false, name in spectral:
            print(f"| {name} | {warned}/{len(diverged)} | {median:g} | {false} |")
    constant = [r for r in runs if r["arm"].startswith("const-")]
    if constant:
        regime(constant)


def regime(constant: list[dict]) -> None:
    lowest = min(r["peak"] for r in constant)
    plateau = math.log(example_module().VOCAB)  # the loss of a uniform prediction, where unlearned runs sit
    best = statistics.median(statistics.fmean(r["loss"][-20:]) for r in constant if r["peak"] == lowest)
    print(
        f"\n### Regime: constant-LR runs (bad: learned less than 75% of the lowest LR's median drop below ln 64, "
        f"final {best:.3f}; regime alert: DriftAlert's default rules by step {REGIME})\n"
    )
    print("| arm | seed | final loss (last 20) | bad | max logit by step 25 | entropy (norm.) by step 25 | alert |")
    print("|---|---|---|---|---|---|---|")
    for run in constant:
        final = statistics.fmean(run["loss"][-20:]) if all(map(math.isfinite, run["loss"][-20:])) else float("nan")
        early = [v for s, v in samples(run).items() if s <= 25]
        logit = max(v.get("connmon/max_attention_logit/all", float("nan")) for v in early)
        entropy = min(v.get("connmon/attention_entropy_normalized/all", float("nan")) for v in early)
        bad = not (plateau - final) >= 0.75 * (plateau - best)
        alerts = [s for s in alert_steps(default_rules_set, samples(run)) if s <= REGIME]
        alert = f"step {alerts[0]}" if alerts else "-"
        print(f"| {run['arm']} | {run['seed']} | {final:.3f} | {bad} | {logit:.3g} | {entropy:.3g} | {alert} |")


def default_rules_set() -> RuleSet:
    return RuleSet(default_rules())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--const-steps", type=int, default=400)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--peak", type=float, default=1e-1)
    parser.add_argument("--start", type=float, default=1e-3)
    parser.add_argument("--ramp", type=int, default=1500)
    parser.add_argument("--constant", type=float, nargs="*", default=[1e-3, 1e-2, 3e-2])
    parser.add_argument("--arms", nargs="*", help="only these arms (ramp, control, const-<lr>)")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--spectrum", action="store_true", help="sample the spectrum group too (slower)")
    parser.add_argument("--save", type=Path)
    parser.add_argument("--load", type=Path)
    args = parser.parse_args()
    if args.load:
        runs = json.loads(args.load.read_text())
    else:
        configs = [c for c in arms(args) if not args.arms or c["arm"] in args.arms]
        jobs = [
            (c, args.const_steps if c["arm"].startswith("const-") else args.steps, args.every, args.spectrum)
            for c in configs
        ]
        with get_context("spawn").Pool(args.processes) as pool:
            runs = pool.starmap(train, jobs)
        for run in runs:
            print(f"{run['arm']} seed {run['seed']}: {len(run['loss'])} steps in {run['seconds']:.0f} s", flush=True)
        if args.save:
            args.save.write_text(json.dumps(runs))
    evaluate(runs)


if __name__ == "__main__":
    main()
