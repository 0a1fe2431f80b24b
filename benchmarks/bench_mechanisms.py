"""Which mechanism makes a run diverge, and when its signals show: attention-logit growth against its QK-norm twin.

A first step of issue 47's mechanisms benchmark (its rules, leads, false alarms and cost come next): the suite's
pre-LN GPT (``bench_instability.py``: 4 layers, width 128, 4 heads, the example's Markov corpus, batch 16 x 64,
AdamW, no clipping) with a linear warmup over ``--warmup`` steps to a constant learning rate, without QK-norm
(``logit growth``) and with it (``qk-norm twin``: LayerNorm on q and k, the same rate and seed), and at an ordinary rate
(``healthy``). Every step it records the loss and the exact max attention logit over the whole batch, per layer and
head (``q k^T / sqrt(d_h)`` inside the causal mask, from a forward hook on each attention: no connmon involved), so
the table says when the logits pass 1e2 and 1e3 against the divergence step (the suite's rule,
``bench_instability.divergence``).

Usage:
    python benchmarks/bench_mechanisms.py --rates 1e-2 3e-2 --steps 600 --save /tmp/mechanisms.json
    python benchmarks/bench_mechanisms.py --load /tmp/mechanisms.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from multiprocessing import get_context
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_instability import GPT, corpus, divergence, example_module

WIDTH, DEPTH, BATCH = 128, 4, 16


def max_logits(model: torch.nn.Module) -> tuple[list, list]:
    """Forward hooks that keep each attention layer's per-head max logit of the latest forward; and their handles."""
    seen: list = [None] * len(model.blocks)
    handles = []
    for index, block in enumerate(model.blocks):
        attention = block.attn

        def hook(module, args, output, index=index):
            (x,) = args
            B, T, C = x.shape
            heads = module.n_head
            with torch.no_grad():
                q, k, _ = module.c_attn(x).split(module.n_embd, dim=2)
                q, k = (t.view(B, T, heads, C // heads).transpose(1, 2) for t in (q, k))
                q, k = module.q_norm(q), module.k_norm(k)
                scores = (q @ k.transpose(-1, -2)) / math.sqrt(C // heads)
                scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
                seen[index] = scores.amax(dim=(0, 2, 3)).tolist()  # (heads,): over the batch, queries and keys

        handles.append(attention.register_forward_hook(hook))
    return seen, handles


def run(job: tuple) -> dict:
    arm, rate, seed, steps, warmup = job
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    example = example_module()
    config = {"corpus": "markov"}
    data = corpus(config, example)
    torch.manual_seed(seed)
    model = GPT(example.VOCAB, example.TOKENS, arm == "qk-norm twin", n_layer=DEPTH, n_embd=WIDTH)
    optimizer = torch.optim.AdamW(model.parameters(), lr=rate, weight_decay=0.0)
    seen, handles = max_logits(model)
    generator = torch.Generator().manual_seed(seed)
    losses, logits = [], []
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = rate * min(1.0, (step + 1) / warmup)
        batch = data[torch.randint(0, len(data), (BATCH,), generator=generator)]
        loss = torch.nn.functional.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())
        losses.append(loss.item())
        logits.append([list(layer) for layer in seen])
        if not math.isfinite(losses[-1]):
            break
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    for handle in handles:
        handle.remove()
    return {"arm": arm, "rate": rate, "seed": seed, "warmup": warmup, "loss": losses, "max_logit": logits}


def first_above(series: list[float], bound: float) -> int | None:
    return next((step for step, value in enumerate(series) if value > bound), None)


def table(runs: list[dict]) -> None:
    print("\n| arm | rate | seed | divergence | max logit at 0, 50, 100 | > 1e2 at | > 1e3 at | best (step) | final |")
    print("|---|---|---|---|---|---|---|---|---|")
    for run_ in runs:
        peak = [max(max(head for head in layer) for layer in step) for step in run_["max_logit"]]
        at = ", ".join(f"{peak[s]:.3g}" if s < len(peak) else "-" for s in (0, 50, 100))
        div = divergence(run_["loss"])
        smooth = [sum(run_["loss"][max(0, s - 9) : s + 1]) / len(run_["loss"][max(0, s - 9) : s + 1])
                  for s in range(len(run_["loss"]))]  # fmt: skip
        best = min(range(len(smooth)), key=smooth.__getitem__)
        print(f"| {run_['arm']} | {run_['rate']:g} | {run_['seed']} | {div} | {at} | {first_above(peak, 1e2)} | "
              f"{first_above(peak, 1e3)} | {smooth[best]:.3f} ({best}) | {run_['loss'][-1]:.3f} |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", type=float, nargs="+", default=[1e-2, 3e-2])
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--healthy-rate", type=float, default=1e-3)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--save", type=Path)
    parser.add_argument("--load", type=Path, nargs="*")
    args = parser.parse_args()
    if args.load:
        runs = [r for path in args.load for r in json.loads(path.read_text())]
    else:
        jobs = [(arm, rate, seed, args.steps, args.warmup) for seed in range(args.seeds) for rate in args.rates
                for arm in ("logit growth", "qk-norm twin")]  # fmt: skip
        jobs += [("healthy", args.healthy_rate, seed, args.steps, args.warmup) for seed in range(args.seeds)]
        with get_context("spawn").Pool(args.processes) as pool:
            runs = pool.map(run, jobs)
        if args.save:
            args.save.write_text(json.dumps(runs))
    table(runs)


if __name__ == "__main__":
    main()
