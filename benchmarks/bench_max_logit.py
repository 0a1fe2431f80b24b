"""What reading every head's max logit over the whole batch costs a training step, by sequence length.

A pre-LN GPT (``bench_instability.GPT``: width ``--width``, 4 layers, 4 heads, SDPA, AdamW) trains on batches of
``--tokens`` tokens (``tokens / n`` sequences of length ``n``); each step is timed without connmon and with
:class:`connmon.capture.max_logit.HeadMaxLogits` watching every layer and read after the step (what a Monitor does
with ``logit_every_n_steps=1``), alternating, after warm-up steps. The table gives the median step times, the
overhead, and the cadence ``logit_every_n_steps`` that keeps the reading under 1% of training time.

Usage:
    python benchmarks/bench_max_logit.py                       # 256 to 4096 tokens per sequence, about 3 minutes
    python benchmarks/bench_max_logit.py --lengths 256 1024 --tokens 4096 --device cuda
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_instability import GPT

from connmon.capture.max_logit import HeadMaxLogits


def step_times(length: int, args: argparse.Namespace) -> tuple[float, float]:
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = GPT(256, length, False, 4, args.width).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tracker = HeadMaxLogits([block.attn for block in model.blocks], [f"L{i}" for i in range(4)])
    batch = torch.randint(0, 256, (max(1, args.tokens // length), length + 1), device=device)

    def step(read: bool) -> float:
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        sync()
        start = time.perf_counter()
        if read:
            tracker.watch()
        logits = model(batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if read:
            tracker.unwatch()
            tracker.read()
        sync()
        return time.perf_counter() - start

    for _ in range(args.warmup):
        step(False), step(True)
    plain, read = [], []
    for _ in range(args.steps):
        plain.append(step(False))
        read.append(step(True))
    return statistics.median(plain), statistics.median(read)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096])
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per batch")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    print(f"\n{args.device}, torch {torch.__version__}, {torch.get_num_threads()} threads, width {args.width}, "
          f"{args.tokens} tokens per batch, median of {args.steps} steps\n")  # fmt: skip
    print("| sequence length | batch | step (ms) | step with max logits (ms) | overhead | cadence for <= 1% |")
    print("|---|---|---|---|---|---|")
    for length in args.lengths:
        plain, read = step_times(length, args)
        overhead = read / plain - 1
        cadence = max(1, math.ceil(overhead / 0.01))
        print(f"| {length} | {max(1, args.tokens // length)} | {plain * 1e3:.1f} | {read * 1e3:.1f} | "
              f"{overhead:+.1%} | {cadence} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
