"""What one full sample's diagnostics cost, each in training steps of the example model.

Trains the example's tiny GPT (4 layers, width 128, 4 heads, batch 16 x 64 tokens, causal; AdamW at 3e-3) for 150
steps so that attention has structure, captures 2 sequences as ConnectionMonitor does, then times each part of a
full sample on those records (median of 5 after a warm-up) against the median time of one training step measured
in the same run:

* ``connection_spectra`` (k = 8 by modulus and the rightmost eigenvalue: the spectral radius and Laplacian gap),
* ``connection_operator_norm``, ``ov_spectral_radius``,
* ``edge_isometry_gap`` at the monitor's defaults (16 queries x 1 key, 32 Lanczos steps),
* the light groups (walk, head/OV transport, drift) through the metrics, for comparison,

and counts the causal blocks whose eigenvalues the spectrum decomposed.

Usage:
    python benchmarks/bench_sample.py                 # about 1 minute on 2 CPU cores
    python benchmarks/bench_sample.py --device cuda
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
from pathlib import Path

import torch
from bench_functional import clock  # a sibling script: benchmarks/ is on sys.path when run

import connmon
import connmon.functional as F
from connmon.functional import spectrum
from connmon.metrics import DriftMetrics, TransportMetrics, WalkMetrics

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_tiny_gpt.py"


def example_module():
    spec = importlib.util.spec_from_file_location("train_tiny_gpt", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=150)
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    example = example_module()
    model = example.TinyGPT().to(device)
    data = example.markov_corpus(256)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)

    def train_step() -> None:
        rows = torch.randint(0, len(data), (16,), generator=gen)
        idx, target = (t[rows].to(device) for t in data.tensors)
        loss = torch.nn.functional.cross_entropy(model(idx).flatten(0, 1), target.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    for _ in range(args.steps):
        train_step()
    step_times = []
    for _ in range(20):
        step_times.append(clock(train_step, device, repeats=1)[0])
    step = statistics.median(step_times)
    records = connmon.capture(model, data.tensors[0][:16].to(device), num_sequences=2)

    decomposed = []
    solve = spectrum.eigvals

    def counting(matrix: torch.Tensor) -> torch.Tensor:
        decomposed.append(matrix.shape[0] if matrix.ndim == 3 else 1)
        return solve(matrix)

    spectrum.eigvals = counting
    for r in records:
        F.connection_spectra(r.attn, r.w_v, r.w_o, k=8)
    spectrum.eigvals = solve

    def light() -> None:
        transport = TransportMetrics(len(records))
        transport.measure_edges = False
        for group in (WalkMetrics(len(records)), transport, DriftMetrics(len(records))):
            for r in records:
                group.update(r)
            group.compute()

    parts = {
        "connection_spectra (k=8 and the rightmost)": lambda: [
            F.connection_spectra(r.attn, r.w_v, r.w_o, k=8) for r in records
        ],
        "connection_operator_norm": lambda: [F.connection_operator_norm(r.attn, r.w_v, r.w_o) for r in records],
        "ov_spectral_radius": lambda: [F.ov_spectral_radius(r.w_v, r.w_o) for r in records],
        "edge_isometry_gap (16 x 1, Lanczos 32)": lambda: [
            F.edge_isometry_gap(r.attn, r.w_v, r.w_o, num_samples=1, num_queries=16, lanczos_steps=32) for r in records
        ],
        "light groups (walk, transport, drift metrics)": light,
    }
    print(f"torch {torch.__version__}, device {device}, {torch.get_num_threads()} threads")
    print(f"\none training step: {step * 1e3:.1f} ms (median of 20, after {args.steps} steps)")
    print(f"causal blocks decomposed by connection_spectra: {sum(decomposed)} over {len(records)} layers x 2 sequences")
    print("\n| part (4 layers x 2 sequences) | ms | training steps |\n|---|---|---|")
    total = 0.0
    for name, part in parts.items():
        seconds = clock(part, device, repeats=5)[0]
        total += seconds if not name.startswith("light") else 0.0
        print(f"| {name} | {seconds * 1e3:.1f} | {seconds / step:.2f} |")
    print(f"| the full sample's extra parts, together | {total * 1e3:.1f} | {total / step:.2f} |")


if __name__ == "__main__":
    main()
