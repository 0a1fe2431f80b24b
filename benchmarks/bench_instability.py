"""Do attention signals warn before a training run diverges? A tiny-GPT instability suite on CPU.

Runs (4-layer, width 128, 4-head pre-LN GPT on the example's order-2 Markov corpus, batch 16 x 64, AdamW, no
gradient clipping, one torch thread per run, two runs side by side):

* ``ramp``: a slow exponential LR ramp from ``--start`` (1e-3) to ``--peak`` (1e-1) over ``--ramp`` (1500) steps; no
  qk-norm. The run learns first, at a good LR, then destabilises as the LR grows. (A linear warmup to 1e-1 over 500
  steps was tried first: it passes 1e-2 at step 50, before this model has learned anything, and every run went
  straight to the uniform-prediction plateau, so there was nothing to warn about.)
* ``control``: the same ramp to a peak of 3e-3, with qk-layernorm. It should never diverge.
* ``warmup`` (``--wide``, base and width 64): a healthy from-scratch run as users set it up, linear warmup to 1e-3
  over 100 steps then constant, no qk-norm. Any alert on it is a false alarm.
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

With ``--wide`` the ramp runs and their controls are repeated for each variant in ``VARIANTS``, one factor away
from the base setting at a time: width 64, depth 2, SGD with momentum (learning rates x100), the copy task (random
tokens then the same again: an induction head forms, a healthy phase change), and a staircase ramp (the same
exponential envelope in 15 jumps).

Usage:
    python benchmarks/bench_instability.py --save /tmp/instability.json   # about 6 minutes on 2 CPU cores
    python benchmarks/bench_instability.py --load /tmp/instability.json   # the tables again, no training
    python benchmarks/bench_instability.py --wide --variants "width 64" "copy task" --save /tmp/wide.json
    python benchmarks/bench_instability.py --load /tmp/instability.json /tmp/wide.json   # merged tables
    python benchmarks/bench_instability.py --wide --variants "copy task" --seeds 1 --first-seed 2 --save /tmp/s2.json
    python benchmarks/bench_instability.py --wide --variants base "copy task" --seeds 2 --per-head   # heads too
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import math
import statistics
import time
import warnings
from collections.abc import Callable
from multiprocessing import get_context
from pathlib import Path

import torch
from torch import nn

import connmon
from connmon import keys
from connmon.alerts import (
    CUSUM,
    AlertRunner,
    AllOf,
    EWMAZScore,
    QKClip,
    Rule,
    RuleSet,
    Threshold,
    TransportClip,
    attention_collapse_rules,
    default_rules,
    edge_of_stability_rule,
)
from connmon.callbacks.sharpness_monitor import RATIO_KEY
from connmon.capture import paused
from connmon.capture.max_logit import HeadMaxLogits
from connmon.curvature import UpdateProbe, sharpness_ratio
from connmon.curvature.optimizer_state import OPTIMIZER_SIGNALS, optimizer_signals
from connmon.metrics import DriftMetrics, SpectrumMetrics, TransportMetrics, WalkMetrics

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_tiny_gpt.py"
K, M, LEARNED, SMOOTH, WINDOW, REGIME = 1.5, 10, 0.9, 10, 300, 100
SHARPNESS_EVERY = 40  # SharpnessMonitor's default cadence, the recommendation in docs/monitoring.md
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
    """A pre-LN transformer block (post-LN with ``post_ln``: each sublayer's sum normalized, as Vaswani et al.)."""

    def __init__(self, n_embd: int, n_head: int, qk_norm: bool, post_ln: bool = False) -> None:
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(n_embd), CausalSelfAttention(n_embd, n_head, qk_norm)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))
        self.post_ln = post_ln

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, T, C) -> (B, T, C)``."""
        if self.post_ln:
            x = self.ln_1(x + self.attn(x))
            return self.ln_2(x + self.mlp(x))
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """The example's tiny GPT, with optional qk-layernorm."""

    def __init__(
        self,
        vocab: int,
        tokens: int,
        qk_norm: bool,
        n_layer: int = 4,
        n_embd: int = 128,
        init: str = "torch",
        post_ln: bool = False,
    ) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, n_embd), nn.Embedding(tokens, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, 4, qk_norm, post_ln) for _ in range(n_layer))
        self.ln_f, self.head = nn.LayerNorm(n_embd), nn.Linear(n_embd, vocab)
        if init == "gpt2":  # nanoGPT's: N(0, 0.02), residual projections 0.02 / sqrt(2 n_layer), zero biases
            for name, parameter in self.named_parameters():
                if name.endswith("bias"):
                    nn.init.zeros_(parameter)
                elif parameter.dim() == 2:
                    scale = 1 / math.sqrt(2 * n_layer) if name.endswith(("c_proj.weight", "mlp.2.weight")) else 1
                    nn.init.normal_(parameter, std=0.02 * scale)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """``(B, T)`` token ids -> ``(B, T, V)`` logits."""
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


BASE = {"width": 128, "depth": 4, "optimizer": "adamw", "corpus": "markov", "shape": "exp"}
# The wider suite (``--wide``): one factor at a time away from the base setting, each with its own controls.
VARIANTS = {
    "base": {},
    "width 64": {"width": 64},
    "depth 2": {"depth": 2},
    "SGD momentum": {"optimizer": "sgd"},
    "copy task": {"corpus": "copy"},
    "staircase ramp": {"shape": "stairs"},
}
SGD_SCALE = 100.0  # SGD with momentum 0.9 runs this many times AdamW's learning rates (its steps are not normalized)
STAIRS = 15  # the staircase ramp: the exponential ramp held constant over 15 equal stretches, then raised at once


def arms(args: argparse.Namespace) -> list[dict]:
    runs = []
    for variant, changes in VARIANTS.items() if args.wide else [("base", {})]:
        setting = {**BASE, **changes, "variant": variant}
        scale = SGD_SCALE if setting["optimizer"] == "sgd" else 1.0
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            ramp = {**setting, "seed": seed, "start": args.start * scale, "ramp": args.ramp}
            runs.append({"arm": "ramp", **ramp, "peak": args.peak * scale, "qk_norm": False})
            runs.append({"arm": "control", **ramp, "peak": 3e-3 * scale, "qk_norm": True})
            if variant in ("base", "width 64"):  # a user's healthy from-scratch run: linear warmup, then constant
                warmup = {**setting, "seed": seed, "start": 0.0, "ramp": 100, "shape": "warmup"}
                runs.append({"arm": "warmup", **warmup, "peak": 1e-3, "qk_norm": False})
            for lr in args.constant if variant == "base" else ():
                const = {**setting, "seed": seed, "start": lr, "peak": lr, "ramp": 0, "qk_norm": False}
                runs.append({"arm": f"const-{lr:g}", **const})
    return runs


def copy_corpus(sequences: int, vocab: int, tokens: int, seed: int = 0) -> torch.Tensor:
    """``(sequences, tokens)``: random tokens, then the same tokens again.

    Copying needs an induction head, whose formation is a healthy phase change (the loss drops fast, attention
    sharpens).
    """
    gen = torch.Generator().manual_seed(seed)
    half = torch.randint(0, vocab, (sequences, tokens // 2), generator=gen)
    return torch.cat([half, half], dim=1)


def corpus(config: dict, example) -> torch.Tensor:
    """The run's training sequences ``(2048, tokens + 1)``: the copy task or the example's Markov corpus."""
    if config["corpus"] == "copy":
        return copy_corpus(2048, example.VOCAB, example.TOKENS + 1)
    return example.markov_corpus(2048, seed=0).tensors[0]


def learning_rate(config: dict, step: int) -> float:
    """The learning rate of a run at ``step``.

    An exponential ramp from ``start`` to ``peak`` over ``ramp`` steps, smooth or in stairs, then constant; or a
    linear warmup from 0 to ``peak`` over ``ramp`` steps, then constant (``shape="warmup"``), or then a cosine decay
    to a tenth of ``peak`` at step ``decay`` (``shape="cosine"``). ``lr_spike = (step, steps, factor)`` multiplies the
    rate by ``factor`` for ``steps`` steps from ``step`` (a spike the run recovers from, or not).

    A linear ramp to the same peak was not used: it passes 1e-2 before this model learns anything (see above).
    """
    spike = config.get("lr_spike")
    if spike is not None and spike[0] <= step < spike[0] + spike[1]:
        return spike[2] * learning_rate({**config, "lr_spike": None}, step)
    progress = min(1.0, step / config["ramp"]) if config["ramp"] else 1.0
    if config.get("shape", "exp") == "cosine":
        warm = config["peak"] * min(1.0, (step + 1) / config["ramp"]) if config["ramp"] else config["peak"]
        after = min(1.0, max(0.0, (step - config["ramp"]) / max(1, config["decay"] - config["ramp"])))
        return warm * (0.1 + 0.45 * (1 + math.cos(math.pi * after)))
    if config.get("shape", "exp") == "warmup":
        return config["peak"] * min(1.0, (step + 1) / config["ramp"]) if config["ramp"] else config["peak"]
    if config.get("shape", "exp") == "stairs":
        progress = math.floor(progress * STAIRS) / STAIRS
    return config["start"] * (config["peak"] / config["start"]) ** progress


def next_batch(
    config: dict, step: int, optimizer: torch.optim.Optimizer, data: torch.Tensor, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Set the run's LR for ``step`` and draw its batch of 16: ``(inputs, targets, lr)``.

    ``bad_batches = (step, steps)``: those steps train on uniformly random tokens (a bad shard: the loss spikes).
    """
    lr = learning_rate(config, step)
    for group in optimizer.param_groups:
        group["lr"] = lr
    batch = data[torch.randint(0, len(data), (16,), generator=gen)]
    bad = config.get("bad_batches")
    if bad is not None and bad[0] <= step < bad[0] + bad[1]:
        batch = torch.randint(0, int(data.max()) + 1, batch.shape, generator=gen)
    return batch[:, :-1], batch[:, 1:], lr


def sample(
    model: nn.Module, idx: torch.Tensor, groups: list, names: list[str], per_head: bool = False
) -> dict[str, float]:
    """One ConnectionMonitor light sample: capture 2 sequences, the same accumulators, the same keys.

    With ``per_head``, also each head's attention entropy (nats, mean over queries and sequences) as
    ``connmon/head_entropy/L<ll>H<h>``.
    """
    for group in groups:
        group.reset()
    out = {}
    with torch.no_grad():
        for record in connmon.capture(model, idx, num_sequences=2):
            for group in groups:
                group.update(record)
            if per_head:
                entropy = -torch.special.xlogy(record.attn, record.attn).sum(-1).mean(dim=(0, 2))  # (H,)
                out.update({f"connmon/head_entropy/L{record.index:02d}H{h}": e for h, e in enumerate(entropy.tolist())})
    for group in groups:
        for name, value in group.compute().items():
            if name.endswith("/all"):
                out[f"connmon/{name}"] = float(value)
            else:
                out.update({f"connmon/{name}/L{i:02d}": float(v) for i, v in enumerate(value.tolist())})
    return {k: v for k, v in out.items() if not any(k.startswith(f"connmon/{n}") for n in names)}


def next_token_loss(
    model: nn.Module, idx: torch.Tensor, target: torch.Tensor, z_loss: float = 0.0, peak: list | None = None
) -> torch.Tensor:
    """Cross-entropy, plus ``z_loss`` times the mean squared log-partition (PaLM's z-loss).

    ``peak`` gets the largest output logit (detached).
    """
    logits = model(idx).flatten(0, 1)
    loss = nn.functional.cross_entropy(logits, target.flatten())
    if peak is not None:
        peak.append(float(logits.detach().abs().max()))
    if z_loss:
        loss = loss + z_loss * torch.logsumexp(logits, dim=-1).square().mean()
    return loss


def train(
    config: dict, steps: int, every: int, spectrum: bool = False, per_head: bool = False, sharpness_every: int = 0
) -> dict:
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)  # saturated softmax otherwise slows the run about 2x
    example = example_module()
    config = {**BASE, **config}
    data = corpus(config, example)
    torch.manual_seed(config["seed"])
    depth = config["depth"]
    model = GPT(
        example.VOCAB,
        example.TOKENS,
        config["qk_norm"],
        depth,
        config["width"],
        config.get("init", "torch"),
        config.get("post_ln", False),
    )
    logits = HeadMaxLogits([block.attn for block in model.blocks], [f"L{i}" for i in range(depth)])
    if config.get("head_logits"):  # every step's per-head max logit, connmon's own reader
        logits.watch()
    clip = QKClip(config["qk_clip"]) if config.get("qk_clip") else None
    transport_clip = TransportClip(config["transport_clip"]) if config.get("transport_clip") else None
    backoff = AlertRunner(actions=("backoff",)) if config.get("backoff") else None  # the default rules' back-off
    if config["optimizer"] == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=config["peak"], momentum=0.9)
    else:
        betas = (0.9, config.get("beta2", 0.999))
        optimizer = torch.optim.AdamW(model.parameters(), lr=config["peak"], betas=betas, weight_decay=0.0)
    transport = TransportMetrics(depth)
    transport.measure_edges = False
    groups = [WalkMetrics(depth), transport, DriftMetrics(depth), *([SpectrumMetrics(depth)] if spectrum else [])]
    if backoff is not None:
        backoff.attach([optimizer], owner="bench")
    gen = torch.Generator().manual_seed(config["seed"])
    losses, grad_norms, samples, ratios, head_logits = [], [], {}, {}, []
    critical, bracket = {}, 1.0  # (eta / eta_c, forwards) every config["critical_every"] steps; the warm start
    signals: dict[str, list[float]] = {name: [] for name in OPTIMIZER_SIGNALS}  # the optimizer's state, every step
    output_logits: list[float] = []  # the largest output logit, every step
    z_loss = config.get("z_loss", 0.0)
    window, fired = None, []  # the logit window the back-off's rules see, and the steps it fired at
    start = time.perf_counter()
    for step in range(steps):
        idx, target, _ = next_batch(config, step, optimizer, data, gen)
        if step % every == 0:
            samples[step] = sample(model, idx, groups, ["stochasticity_gap", "reconstruction_error"], per_head)
        if sharpness_every and step and step % sharpness_every == 0:  # as SharpnessMonitor: on the batch about to
            loss_fn = functools.partial(next_token_loss, model, idx, target)  # be trained on, before its step
            try:
                with paused():  # as SharpnessMonitor: its forwards are not the training's
                    ratios[step] = sharpness_ratio(loss_fn, optimizer, steps=8, model=model, seed=step).ratio
            except Exception as error:  # SharpnessMonitor turns itself off here; so does the suite
                sharpness_every, ratios["off"] = 0, repr(error)
            if backoff is not None and step in ratios:
                _back_off(backoff, {RATIO_KEY: ratios[step]}, step, fired)
        if backoff is not None and step % every == 0:  # as a Monitor's sample: its values and the logit window
            values = dict(samples[step])
            for index, row in enumerate(window or []):
                values.update({keys.head_key(index, head): value for head, value in enumerate(row)})
            _back_off(backoff, values, step, fired)
            window = None
        loss = next_token_loss(model, idx, target, z_loss, output_logits)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norms.append(float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])))
        losses.append(loss.item())
        table = logits.read() if config.get("head_logits") else None
        if table is not None:
            head_logits.append([[float(f"{v:.4g}") for v in row] for row in table.tolist()])
            if step % 25 == 0:  # as a Monitor's default logit_every_n_steps: the next sample's window
                window = table.tolist()
        if not math.isfinite(losses[-1]):
            break
        every = config.get("critical_every")
        probe = UpdateProbe(optimizer) if every and step % every == 0 else None
        optimizer.step()
        if probe is not None:  # as SharpnessSampler(estimator="critical"): along the step taken, on its batch
            probe.stepped()
            loss_fn = functools.partial(next_token_loss, model, idx, target, z_loss)
            with paused():
                read = probe.critical([loss_fn], model=model, seed=step, start=bracket)
            critical[step], bracket = (float(f"{read.ratio:.4g}"), read.forwards), read.critical_step
        for name, value in optimizer_signals(optimizer).items():
            signals[name].append(float(f"{value:.4g}"))
        if clip is not None and table is not None:  # K2's QK-clip: this step's logits, after its update
            clip.apply(logits.modules, table, [logits.layout(i) for i in range(depth)])
        if transport_clip is not None:  # after every update, on the layouts the reader found
            transport_clip.apply(logits.modules, [logits.layout(i) for i in range(depth)])
    return {
        **config,
        "loss": losses,
        "grad_norm": grad_norms,
        "samples": samples,
        "sharpness": ratios,
        "critical": critical,
        "head_logits": head_logits,
        "backoffs": fired,
        "optimizer_signals": signals,
        "output_logit": output_logits,
        "seconds": time.perf_counter() - start,
    }


def _back_off(runner: AlertRunner, values: dict, step: int, fired: list) -> None:
    """Feed the back-off's rules (no warning lines); note the steps where it scaled the rate."""
    scale = runner.backoff.scale
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        runner.run(values, step)
    if runner.backoff.scale != scale:
        fired.append(step)


def _train(job: tuple) -> dict:
    return train(*job)


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
    return [step for step in sorted(series)
            if any(a.kind == "warning" for a in ruleset.update(series[step], step))]  # fmt: skip


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
    """A run's series as DriftAlert sees it with the recommended callbacks.

    Every attention sample, and the sharpness ratio every ``SHARPNESS_EVERY`` steps (when the suite recorded it).
    """
    return fed(run, 1, SHARPNESS_EVERY, 0)


def one(rule: Rule) -> Callable[[], RuleSet]:
    return lambda: RuleSet([rule])


def default_rules_set() -> RuleSet:
    return RuleSet(default_rules())


def with_collapse_rules() -> RuleSet:
    """The defaults with the opt-in attention rules: the default rules of earlier versions, and the edge rule."""
    return RuleSet(default_rules() + attention_collapse_rules())


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
    ramp = [r for r in runs if r["arm"] in ("ramp", "control", "warmup")]
    for run in ramp:
        run["divergence"] = divergence(run["loss"])
    print("\n### Lead-time suite (ramp runs and qk-norm controls)\n")
    header = ["variant", "arm", "seed", "divergence step", "final loss", "DriftAlert default", "(every 100 steps)"]
    header += list(BASELINES)
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for run in ramp:
        div = run["divergence"]
        cells = [run.get("variant", "base"), run["arm"], str(run["seed"]), str(div), f"{run['loss'][-1]:.3g}"]
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
    by_variant(ramp)
    setups(ramp, [r for r in runs if r["arm"].startswith("const-")])
    combinations(ramp)
    diverged = [r for r in ramp if r["divergence"] is not None]
    keys = set().union(*(set(v) for r in ramp for v in r["samples"].values()))
    print(
        "### Candidate signals (every sampled metric; EWMA z > 4, z > 6, CUSUM h = 8; linear and log; log z-scores "
        f"with a floor of {', '.join(map(str, FLOORS))} on the baseline's spread)\n"
    )
    print("| signal | diverging runs warned | median lead (steps) | false alarms (all runs) |")
    print("|---|---|---|---|")
    scored = []
    series = {id(run): samples(run) for run in ramp}
    only: dict[tuple[int, str], dict] = {}  # each run's series of one metric: a rule on it reads no other key

    def of(run: dict, metric: str) -> dict[int, dict[str, float]]:
        prefix = f"connmon/{metric}/L"
        if (id(run), metric) not in only:
            steps = series[id(run)].items()
            only[id(run), metric] = {s: {k: v for k, v in row.items() if k.startswith(prefix)} for s, row in steps}
        return only[id(run), metric]

    for name, rules in candidates(keys).items():
        metric = name.split(" ")[0]
        results = [(run["divergence"], score(alert_steps(rules, of(run, metric)), run["divergence"])) for run in ramp]
        leads = [lead for div, (lead, _) in results if div is not None and lead is not None]
        false = sum(f for _, (_, f) in results)
        scored.append((len(leads), statistics.median(leads) if leads else 0, false, name))
    ranked = sorted(scored, key=lambda s: (s[2] > 0, -s[0], -s[1]))
    for warned, median, false, name in ranked[:25]:
        print(f"| {name} | {warned}/{len(diverged)} | {median:g} | {false} |")
    families(ranked, len(diverged))
    spectral = [s for s in ranked if s[3].split(" ")[0] in SpectrumMetrics.metrics]
    if spectral:
        print("\n### The spectrum group as an early warning (every candidate rule on its metrics)\n")
        print("| signal | diverging runs warned | median lead (steps) | false alarms (all runs) |")
        print("|---|---|---|---|")
        for warned, median, false, name in spectral:
            print(f"| {name} | {warned}/{len(diverged)} | {median:g} | {false} |")
    if any(k.startswith("connmon/head_entropy/") for r in ramp for k in next(iter(r["samples"].values()), {})):
        heads(ramp)
    constant = [r for r in runs if r["arm"].startswith("const-")]
    if constant:
        regime(constant)


def loss_rule() -> Rule:
    """A z-score on the logged loss, as a user would watch ``train_loss`` through ``trainer.callback_metrics``."""
    return Rule("loss rising", "loss", EWMAZScore(3.0, "rise", log=True, min_std=0.02))


def with_loss(within: int) -> RuleSet:
    """The defaults, and each opt-in attention rule required to coincide with the loss rule within ``within`` steps."""
    joint = [AllOf(f"{r.name} with the loss rising", [r, loss_rule()], within=within, cooldown=r.cooldown)
             for r in attention_collapse_rules()]  # fmt: skip
    return RuleSet(default_rules() + joint)


COMBINATIONS: dict[str, Callable[[], RuleSet]] = {
    "default rules": default_rules_set,
    "default rules + attention_collapse_rules()": with_collapse_rules,
    "loss rule alone": lambda: RuleSet([loss_rule()]),
    "default rules + attention_collapse_rules() + the loss rule, each alone": lambda: RuleSet(
        [*default_rules(), *attention_collapse_rules(), loss_rule()]
    ),
    "default rules + AllOf(attention rule, loss) within 50 steps": lambda: with_loss(50),
    "default rules + AllOf(attention rule, loss) within 100 steps": lambda: with_loss(100),
}


def combinations(ramp: list[dict]) -> None:
    """Geometric rules with and without the logged loss, the loss sampled at the monitor's samples (DriftAlert)."""
    print("\n### Geometric rules combined with the logged loss (log z > 3 rise, floor 0.02, at each sample)\n")
    print("| rules | divergences warned | median lead | leads | false alarms (copy task) |\n|---|---|---|---|---|")
    for name, rules in COMBINATIONS.items():
        leads, false, copy = [], 0, 0
        for run in ramp:
            series = {s: {**v, "loss": run["loss"][s]} for s, v in samples(run).items() if s < len(run["loss"])}
            lead, fa = score(alert_steps(rules, series), run["divergence"])
            leads += [lead] if run["divergence"] is not None and lead is not None else []
            false, copy = false + fa, copy + (fa if run.get("variant") == "copy task" else 0)
        diverged = sum(run["divergence"] is not None for run in ramp)
        median = f"{statistics.median(leads):g}" if leads else "-"
        print(
            f"| {name} | {len(leads)}/{diverged} | {median} | {', '.join(map(str, sorted(leads)))} | {false} ({copy}) |"
        )


HEAD_WINDOW = 25  # steps over which firing heads are counted together


def heads(ramp: list[dict]) -> None:
    """How many heads collapse together: the default entropy detector on every head, before divergence and elsewhere."""
    window = f"within {HEAD_WINDOW} steps"
    print(f"\n### Heads whose entropy collapses together (the default entropy detector on each head, {window})\n")
    print("| variant | arm | seed | divergence | most heads in the warning window (step) | most heads earlier (step) |")
    print("|---|---|---|---|---|---|")
    for run in ramp:
        series, div = samples(run), run["divergence"]
        keys = sorted(k for k in next(iter(series.values())) if k.startswith("connmon/head_entropy/"))
        if not keys:
            continue
        detectors = {k: EWMAZScore(4.0, "fall", log=True, min_std=0.02) for k in keys}
        fired = {s: {k for k in keys if k in v and detectors[k].update(v[k]) is not None} for s, v in series.items()}
        best = {True: (0, None), False: (0, None)}
        for step in sorted(series):
            together = len(set().union(*(fired.get(t, set()) for t in range(step - HEAD_WINDOW + 1, step + 1))))
            if div is not None and step > div:
                break
            warning = div is not None and div - WINDOW <= step  # else an alert here would be a false alarm
            if fired[step] and together > best[warning][0]:
                best[warning] = (together, step)
        cells = [f"{n} ({s})" if s is not None else "0" for n, s in (best[True], best[False])]
        print(f"| {run.get('variant', 'base')} | {run['arm']} | {run['seed']} | {div} | {' | '.join(cells)} |")


ARMS = ("ramp", "others")  # false alarms on the ramp runs, and on the runs meant to stay healthy


def by_variant(ramp: list[dict]) -> None:
    """The default rules, per variant of the suite: runs warned, median lead, false alarms on ramps and controls."""
    print("### The default rules per variant (sampling every `--every` steps)\n")
    print("| variant | ramp runs diverged | warned | median lead | false alarms: ramp runs | false alarms: others |")
    print("|---|---|---|---|---|---|")
    for variant in dict.fromkeys(r.get("variant", "base") for r in ramp):
        runs = [r for r in ramp if r.get("variant", "base") == variant]
        scored = [(r, score(alert_steps(default_rules_set, samples(r)), r["divergence"])) for r in runs]
        leads = [lead for r, (lead, _) in scored if r["divergence"] is not None and lead is not None]
        diverged = sum(r["divergence"] is not None for r in runs if r["arm"] == "ramp")
        false = {arm: sum(f for r, (_, f) in scored if (r["arm"] == "ramp") == (arm == "ramp")) for arm in ARMS}
        median = f"{statistics.median(leads):g}" if leads else "-"
        ramps = sum(r["arm"] == "ramp" for r in runs)
        print(f"| {variant} | {diverged}/{ramps} | {len(leads)} | {median} | {false['ramp']} | {false['others']} |")
    print()


FAMILIES = {
    "walk": WalkMetrics.metrics,
    "transport": TransportMetrics.metrics,
    "spectrum": SpectrumMetrics.metrics,
    "drift": DriftMetrics.metrics,
}


def families(ranked: list[tuple[int, float, int, str]], diverged: int) -> None:
    """One row per signal family: its best candidate rule (fewest false alarms, then most warned, then lead)."""
    print("\n### Best candidate per signal family\n")
    print("| family | best rule | diverging runs warned | median lead (steps) | false alarms (all runs) |")
    print("|---|---|---|---|---|")
    for family, metrics in FAMILIES.items():
        rows = [r for r in ranked if r[3].split(" ")[0] in metrics]
        if rows:
            warned, median, false, name = rows[0]
            print(f"| {family} | {name} | {warned}/{diverged} | {median:g} | {false} |")


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


def edge_rule(bound: float = 1.0, consecutive: int = 2) -> Callable[[], RuleSet]:
    return one(edge_of_stability_rule(bound, consecutive))


# (rules, attention sampled every, sharpness sampled every, its phase): what a user's callbacks would feed them.
# Attention every 1 means every recorded sample (``--every``); None: that monitor is absent.
SETUPS: dict[str, tuple[Callable[[], RuleSet], int | None, int | None, int]] = {
    "defaults, SharpnessMonitor every 40 (recommended)": (default_rules_set, 1, 40, 0),
    "defaults, SharpnessMonitor every 40, sampled at steps 20 mod 40": (default_rules_set, 1, 40, 20),
    "defaults, SharpnessMonitor every 20": (default_rules_set, 1, 20, 0),
    "defaults, SharpnessMonitor every 40, attention every 25": (default_rules_set, 25, 40, 0),
    "defaults, SharpnessMonitor every 40, attention every 100": (default_rules_set, 100, 40, 0),
    "defaults, no SharpnessMonitor": (default_rules_set, 1, None, 0),
    "defaults + attention_collapse_rules(), no SharpnessMonitor (the previous defaults)": (
        with_collapse_rules,
        1,
        None,
        0,
    ),
    "defaults + attention_collapse_rules(), SharpnessMonitor every 40": (with_collapse_rules, 1, 40, 0),
    "edge rule alone, every 40": (edge_rule(), None, 40, 0),
    "edge rule alone, every 40 at steps 20 mod 40": (edge_rule(), None, 40, 20),
    "edge rule alone, every 20": (edge_rule(), None, 20, 0),
    "edge rule, one sample, every 40": (edge_rule(consecutive=1), None, 40, 0),
    "edge rule, one sample, every 40 at steps 20 mod 40": (edge_rule(consecutive=1), None, 40, 20),
    "edge rule, one sample, every 20": (edge_rule(consecutive=1), None, 20, 0),
    "edge rule above 0.7, two samples, every 40": (edge_rule(0.7), None, 40, 0),
    "edge rule above 0.7, two samples, every 40 at steps 20 mod 40": (edge_rule(0.7), None, 40, 20),
}


def fed(run: dict, attention: int | None, sharpness: int | None, phase: int) -> dict[int, dict[str, float]]:
    """The values DriftAlert would see from a ConnectionMonitor and a SharpnessMonitor at these cadences.

    ``attention``: attention samples every this many steps; ``sharpness``: the ratio at the steps equal to ``phase``
    modulo it. None: that monitor is absent.
    """
    series: dict[int, dict[str, float]] = {}
    if attention is not None:
        series.update({int(s): dict(v) for s, v in run["samples"].items() if int(s) % attention == 0})
    if sharpness is not None:
        for s, ratio in run.get("sharpness", {}).items():
            if s != "off" and int(s) % sharpness == phase:
                series.setdefault(int(s), {})[RATIO_KEY] = ratio
    return dict(sorted(series.items()))


def bad_regime(constant: list[dict]) -> dict[int, bool]:
    """Which constant-LR runs ended on a worse plateau (learned less than 75% of the lowest LR's median drop)."""
    lowest = min(r["peak"] for r in constant)
    plateau = math.log(example_module().VOCAB)
    best = statistics.median(statistics.fmean(r["loss"][-20:]) for r in constant if r["peak"] == lowest)
    finals = {id(r): statistics.fmean(r["loss"][-20:]) for r in constant}
    return {key: not (plateau - final) >= 0.75 * (plateau - best) for key, final in finals.items()}


def setups(ramp: list[dict], constant: list[dict]) -> None:
    """Rule sets as a user's callbacks would feed them: divergences warned, false alarms, the regime alert."""
    if not any(run.get("sharpness") for run in ramp):
        return
    print("\n### Alert setups: rule sets at a ConnectionMonitor's and a SharpnessMonitor's cadence\n")
    print(
        "| setup | divergences warned | median lead | leads | false alarms: ramp runs | alerts: controls and "
        "warmups (copy task) | bad const-LR runs alerted by step 25 | alerts on good const-LR runs |"
    )
    print("|---|---|---|---|---|---|---|---|")
    bad = bad_regime(constant) if constant else {}
    for name, (rules, attention, sharpness, phase) in SETUPS.items():
        leads, ramp_false, healthy, copy = [], 0, 0, 0
        for run in ramp:
            lead, fa = score(alert_steps(rules, fed(run, attention, sharpness, phase)), run["divergence"])
            leads += [lead] if run["divergence"] is not None and lead is not None else []
            if run["arm"] == "ramp":
                ramp_false += fa
            else:
                healthy, copy = healthy + fa, copy + (fa if run.get("variant") == "copy task" else 0)
        regime_hits, good_alerts = 0, 0
        for run in constant:
            steps = alert_steps(rules, fed(run, attention, sharpness, phase))
            if bad[id(run)]:
                regime_hits += any(s <= 25 for s in steps)
            else:
                good_alerts += len(steps)
        diverged = sum(run["divergence"] is not None for run in ramp)
        median = f"{statistics.median(leads):g}" if leads else "-"
        cells = [name, f"{len(leads)}/{diverged}", median, ", ".join(map(str, sorted(leads))), str(ramp_false)]
        cells += [f"{healthy} ({copy})", f"{regime_hits}/{sum(bad.values())}", str(good_alerts)]
        print("| " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--first-seed", type=int, default=0, help="seeds first-seed .. first-seed + seeds - 1")
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
    parser.add_argument("--wide", action="store_true", help="the wider suite: every variant in VARIANTS")
    parser.add_argument("--per-head", action="store_true", help="record each head's attention entropy too")
    parser.add_argument(
        "--sharpness-every", type=int, default=0, help="SharpnessMonitor's ratio every this many steps (0: off)"
    )
    parser.add_argument("--variants", nargs="*", help="with --wide, only these variants")
    parser.add_argument("--save", type=Path)
    parser.add_argument("--load", type=Path, nargs="*", help="saved runs (several files are merged)")
    args = parser.parse_args()
    if args.load:
        runs = [run for path in args.load for run in json.loads(path.read_text())]
    else:
        configs = [c for c in arms(args) if not args.arms or c["arm"] in args.arms]
        configs = [c for c in configs if not args.variants or c["variant"] in args.variants]
        jobs = [
            (
                c,
                args.const_steps if c["arm"].startswith("const-") else args.steps,
                args.every,
                args.spectrum,
                args.per_head,
                args.sharpness_every,
            )
            for c in configs
        ]
        jobs.sort(key=lambda job: job[0]["seed"])  # every variant's first seed first: a cut-short suite still spans
        runs = []
        with get_context("spawn").Pool(args.processes) as pool:
            for run in pool.imap_unordered(_train, jobs):
                runs.append(run)
                name = f"{run.get('variant', 'base')} {run['arm']} seed {run['seed']}"
                print(f"{name}: {len(run['loss'])} steps in {run['seconds']:.0f} s", flush=True)
                if args.save:  # after every run, so a suite stopped early keeps what it finished
                    args.save.write_text(json.dumps(runs))
    evaluate(runs)


if __name__ == "__main__":
    main()
