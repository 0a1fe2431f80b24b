"""What reading every head's max logit over the whole batch costs a training step, by sequence length.

A pre-LN GPT (``bench_instability.GPT``: width ``--width``, 4 layers, 4 heads, SDPA, AdamW) trains on batches of
``--tokens`` tokens (``tokens / n`` sequences of length ``n``); each step is timed without connmon and with
:class:`connmon.capture.max_logit.HeadMaxLogits` watching every layer and read after the step (what a Monitor does
with ``logit_every_n_steps=1``), alternating, after warm-up steps; and with it reading the bound from the kernel's
own statistics instead (the logsumexp SDPA saves for its backward: what a Monitor reads on every step between its
exact reads). The table gives the median step times, each reading's overhead, and the cadence
``logit_every_n_steps`` that keeps the exact reading under 1% of training time.

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


def step_times(length: int, args: argparse.Namespace) -> tuple[float, float, float]:
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = GPT(256, length, False, 4, args.width).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tracker = HeadMaxLogits([block.attn for block in model.blocks], [f"L{i}" for i in range(4)])
    batch = torch.randint(0, 256, (max(1, args.tokens // length), length + 1), device=device)
    with tracker.watching():  # the layouts, found at a first exact forward
        model(batch[:, :-1]).sum().backward()
    optimizer.zero_grad(set_to_none=True)
    tracker.read()

    def step(read: str | None) -> float:
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        sync()
        start = time.perf_counter()
        if read:
            tracker.exact = read == "exact"
            tracker.watch()
        logits = model(batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if read:
            tracker.unwatch()
            tracker.read_both()
        sync()
        return time.perf_counter() - start

    for _ in range(args.warmup):
        step(None), step("exact"), step("bound")
    plain, exact, bound = [], [], []
    for _ in range(args.steps):
        plain.append(step(None))
        exact.append(step("exact"))
        bound.append(step("bound"))
    return statistics.median(plain), statistics.median(exact), statistics.median(bound)


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
    print("| sequence length | batch | step (ms) | exact: step (ms) | exact: overhead | cadence for <= 1% "
          "| bound: step (ms) | bound: overhead |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for length in args.lengths:
        plain, exact, bound = step_times(length, args)
        overhead = exact / plain - 1
        cadence = max(1, math.ceil(overhead / 0.01))
        print(f"| {length} | {max(1, args.tokens // length)} | {plain * 1e3:.1f} | {exact * 1e3:.1f} | "
              f"{overhead:+.1%} | {cadence} | {bound * 1e3:.1f} | {bound / plain - 1:+.1%} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
