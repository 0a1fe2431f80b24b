"""What the per-step signals read from the optimizer's own state cost a training step, by width.

A pre-LN GPT (``bench_instability.GPT``: 4 layers, 4 heads, SDPA, AdamW) trains on ``--sequences`` x ``--length``
tokens; after each step, timed apart, :func:`connmon.curvature.optimizer_state.optimizer_signals` reads Adam's
state (the normalized update's RMS, the share of coordinates with a stale second moment, the update-to-weight ratio)
in one ``torch._foreach`` pass. The table gives the median training step and the reading as a fraction of it.

Usage:
    python benchmarks/bench_step_signals.py                  # widths 128, 256, 512, 768; about two minutes
    python benchmarks/bench_step_signals.py --device cuda
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_clips import timed
from bench_instability import GPT

from connmon.curvature.optimizer_state import optimizer_signals


def row(width: int, args: argparse.Namespace) -> tuple[int, float, float]:
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = GPT(256, args.length, False, 4, width).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = torch.randint(0, 256, (args.sequences, args.length + 1), device=device)

    def train() -> None:
        logits = model(batch[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    steps, reads = [], []
    for i in range(args.warmup + args.steps):
        times = timed(device, train), timed(device, lambda: optimizer_signals(optimizer))
        if i >= args.warmup:
            steps.append(times[0]), reads.append(times[1])
    return sum(p.numel() for p in model.parameters()), statistics.median(steps), statistics.median(reads)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--widths", type=int, nargs="*", default=[128, 256, 512, 768])
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {args.device}, {torch.get_num_threads()} threads, 4 layers x 4 heads, "
          f"{args.sequences} x {args.length} tokens, AdamW\n")  # fmt: skip
    print("| width | parameters | training step, ms | optimizer signals, ms | share of the step |")
    print("|---|---|---|---|---|")
    for width in args.widths:
        count, step, read = row(width, args)
        print(f"| {width} | {count / 1e6:.2f}M | {1e3 * step:.1f} | {1e3 * read:.2f} | {read / step:.2%} |", flush=True)


if __name__ == "__main__":
    main()
