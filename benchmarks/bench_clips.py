"""What the two clip actions cost after each optimizer step, against the training step itself, by width.

A pre-LN GPT (``bench_instability.GPT``: 4 layers, 4 heads, SDPA, AdamW, 16 x 256 tokens) trains; after each step,
timed apart, :class:`connmon.alerts.QKClip` scales the heads of the step's max-logit table (every head above its
threshold, the worst case: tau below every head's logit) and :class:`connmon.alerts.TransportClip` checks every
head's ``O_h V_h`` (a QR and an SVD per head, in float64) and clips those outside its band (``factor`` just above 1:
every head, the worst case). The table gives the median training step and each clip as a fraction of it. Neither
clip includes reading the max logits (``bench_max_logit.py``).

``--in-run`` measures where the transport clip acts in a real run instead: a freshly initialized GPT (the example's
size, 16 x 64 tokens) trains in a plain loop with ``connmon.Monitor`` and the ``"transport_clip"`` action at
``factor`` 2, against the same loop without connmon, alternated; it prints the steps on which the clip acted, its head
clips, and the training time with it over the time without it (the whole cost: the max-logit reading that finds the
rows, and the clip).

Usage:
    python benchmarks/bench_clips.py                          # widths 128, 256, 512; about a minute
    python benchmarks/bench_clips.py --widths 768 --device cuda
    python benchmarks/bench_clips.py --in-run                 # factor 2 and 10-step cadences; about 2 minutes
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

import connmon

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_instability import GPT

from connmon.alerts import AlertRunner, QKClip, TransportClip
from connmon.capture.max_logit import HeadMaxLogits


def timed(device: torch.device, work: Callable[[], object]) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    work()
    sync()
    return time.perf_counter() - start


def row(width: int, args: argparse.Namespace) -> tuple[float, float, float]:
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = GPT(256, args.length, False, 4, width).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tracker = HeadMaxLogits([block.attn for block in model.blocks], [f"L{i}" for i in range(4)])
    batch = torch.randint(0, 256, (args.sequences, args.length + 1), device=device)
    with tracker.watching():  # the layouts, found at the first training forward
        model(batch[:, :-1]).sum().backward()
    optimizer.zero_grad(set_to_none=True)
    table = tracker.read()
    layouts = [tracker.layout(i) for i in range(4)]
    qk, transport = QKClip(threshold=1e-6), TransportClip(factor=1.0 + 1e-9)

    def train() -> None:
        logits = model(batch[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    steps, qk_times, transport_times = [], [], []
    for i in range(args.warmup + args.steps):
        times = (timed(device, train), timed(device, lambda: qk.apply(tracker.modules, table, layouts)),
                 timed(device, lambda: transport.apply(tracker.modules, layouts)))  # fmt: skip
        if i >= args.warmup:
            steps.append(times[0]), qk_times.append(times[1]), transport_times.append(times[2])
    return statistics.median(steps), statistics.median(qk_times), statistics.median(transport_times)


def in_run(clip: TransportClip | None, args: argparse.Namespace) -> tuple[float, int, int]:
    """One run of ``args.steps`` steps; its seconds, the steps the clip acted on, and its head clips."""
    torch.manual_seed(0)
    model = GPT(256, 64, False, 4, 128)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    monitor = None
    if clip is not None:
        alerts = AlertRunner([], actions=("transport_clip",), transport_clip=clip)
        monitor = connmon.Monitor(model, every_n_steps=10**9, logit_every_n_steps=None, diagnostics=("walk",),
                                  optimizer=optimizer,
                                  alerts=alerts)  # fmt: skip
    data = torch.Generator().manual_seed(1)
    acted, before = 0, 0
    start = time.perf_counter()
    for step in range(args.steps):
        batch = torch.randint(0, 256, (16, 65), generator=data)
        with monitor.step(step) if monitor is not None else torch.enable_grad():
            logits = model(batch[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if clip is not None:
            acted, before = acted + (clip.clipped > before), clip.clipped
    took = time.perf_counter() - start
    if monitor is not None:
        monitor.close()
    return took, acted, clip.clipped if clip is not None else 0


def in_run_table(args: argparse.Namespace) -> None:
    import warnings

    warnings.simplefilter("ignore")  # the clip's lines
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, a fresh GPT (4 layers x 4 heads, width "
          f"128), 16 x 64 tokens, {args.steps} steps, each run alternated with the loop without connmon\n")  # fmt: skip
    print("| transport clip | steps it acted on | head clips | training time with it / without |")
    print("|---|---|---|---|")
    for every in (1, 10):
        plain, with_clip, acted, clips = [], [], 0, 0
        for _ in range(args.repeats):
            plain.append(in_run(None, args)[0])
            took, acted, clips = in_run(TransportClip(factor=2.0, every_n_steps=every), args)
            with_clip.append(took)
        ratio = statistics.median(with_clip) / statistics.median(plain)
        print(f"| factor 2, every {every} step{'s' if every > 1 else ''} | {acted} of {args.steps} | {clips} | "
              f"{ratio:.3f}x |", flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--widths", type=int, nargs="*", default=[128, 256, 512])
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--in-run", action="store_true", help="where the transport clip acts in a fresh run")
    parser.add_argument("--repeats", type=int, default=3, help="--in-run: runs of each kind, alternated")
    args = parser.parse_args()
    if args.in_run:
        args.steps = 100 if args.steps == 10 else args.steps
        in_run_table(args)
        return
    print(f"torch {torch.__version__}, {args.device}, {torch.get_num_threads()} threads, 4 layers x 4 heads, "
          f"{args.sequences} x {args.length} tokens\n")  # fmt: skip
    print("| width | head size | training step, ms | QK-clip, every head | transport clip, every head |")
    print("|---|---|---|---|---|")
    for width in args.widths:
        step, qk, transport = row(width, args)
        print(f"| {width} | {width // 4} | {1e3 * step:.1f} | {qk / step:.2%} | {transport / step:.2%} |", flush=True)


if __name__ == "__main__":
    main()
