"""How many top-8 walk-part eigenvalues of clustered layers the certified Krylov spectrum certifies, and how fast.

Two starts only, and with the third start that arbitrates when they disagree (the default), compared.

Layers are near-uniform and bidirectional, like a randomly initialized model's (8 heads; scores ``N(0, 1/4)``, so
the walk part's eigenvalues fill a disk and the top moduli differ by about 1e-3 relative). The reference is dense
float64 ``eigvals`` where it fits (``n d <= 4096``), else a float64 Krylov solve with a 150-vector basis, k = 24,
certified by its own two starts. Each layer is solved from 3 start seeds, at the monitor's ``max_restarts`` (30) and
at the function's default (100). One run of ``connection_spectrum`` yields both policies: the merge of its first two
solves is what two starts certify (and their matvecs and time what they cost), the final merge what the default
does. "wrong" counts certified values whose modulus is more than 1e-4 (relative) from the reference's of that rank.

The solver works on the head-space operator ``G F`` (same eigenvalues as ``M = F G``, half the flops a product);
``--operator full`` solves on ``M`` itself, as before, to compare the two.

Usage:
    python benchmarks/bench_certified.py            # about 6 minutes on 2 CPU cores
    python benchmarks/bench_certified.py --quick    # n d up to 4096, about 2 minutes
    python benchmarks/bench_certified.py --sizes 128x128 --restarts 30 --seeds 10 --operator full  # about 4 minutes
"""

from __future__ import annotations

import argparse
import time

import torch

import connmon._linalg.krylov as krylov
import connmon.functional as F
import connmon.functional.spectrum as spectrum
from connmon.functional.operator import walk_part

K = 8


def near_uniform_layer(n: int, d: int, seed: int, heads: int = 8) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    attn = (torch.randn(heads, n, n, generator=g) / 2).softmax(-1)
    w_v = torch.randn(heads, d // heads, d, generator=g) / d**0.5
    w_o = torch.randn(heads, d, d // heads, generator=g) / d**0.5
    return attn, w_v, w_o


def reference_moduli(attn: torch.Tensor, w_v: torch.Tensor, w_o: torch.Tensor) -> torch.Tensor:
    """The top-K moduli of the walk part of ``M / s`` in float64."""
    attn, w_v, w_o = attn.double(), w_v.double(), w_o.double()
    n, d = attn.shape[-1], w_v.shape[-1]
    if n * d <= 4096:
        operator = F.connection_operator(walk_part(attn), w_v, w_o, max_dim=n * d)
        values = torch.linalg.eigvals(operator) / F.transport_scale(w_v, w_o)
    else:
        found = F.connection_spectrum(
            attn, w_v, w_o, k=24, method="krylov", ncv=150, max_restarts=300, return_info=True
        )
        assert bool(found.converged[:K].all()), "the reference solve did not certify its top values"
        values = found.eigenvalues
    return values.abs().sort(descending=True).values[:K]


class Policies:
    """Records, inside one ``connection_spectrum`` call, the merge of the first two solves and their cost."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self.pair: krylov.KrylovResult | None = None

    def solve(self, *args, **kwargs) -> krylov.KrylovResult:
        """``krylov_schur``, timed."""
        start = time.perf_counter()
        result = krylov.krylov_schur(*args, **kwargs)
        self.seconds.append(time.perf_counter() - start)
        return result

    def certified(self, solves, k, which, tol) -> krylov.KrylovResult:
        """``certified``, keeping the merge of the first two solves."""
        merged = krylov.certified(solves, k, which, tol)
        if len(solves) == 2:
            self.pair = merged
        return merged


def row(n: int, d: int, seeds: int, restarts: int, references: dict) -> str:
    totals = {"pair": [0, 0, 0, 0.0], "default": [0, 0, 0, 0.0]}  # certified, wrong, matvecs, seconds
    arbitrated = 0
    for seed in range(seeds):
        attn, w_v, w_o = near_uniform_layer(n, d, seed)
        if (n, d, seed) not in references:
            references[n, d, seed] = reference_moduli(attn, w_v, w_o)
        truth = references[n, d, seed]
        for start in range(3):
            policies = Policies()
            spectrum.krylov_schur, spectrum.certified = policies.solve, policies.certified
            try:
                found = F.connection_spectrum(
                    attn, w_v, w_o, k=K, method="krylov", seed=101 * start, max_restarts=restarts, return_info=True
                )
            finally:
                spectrum.krylov_schur, spectrum.certified = krylov.krylov_schur, krylov.certified
            scale = float(F.transport_scale(w_v, w_o))
            pair = policies.pair
            assert pair is not None
            arbitrated += len(policies.seconds) == 3
            for name, converged, moduli, matvecs, seconds in (
                ("pair", torch.from_numpy(pair.converged), torch.from_numpy(abs(pair.eigenvalues)) / scale,
                 pair.num_matvecs, sum(policies.seconds[:2])),
                ("default", found.converged, found.eigenvalues.abs().double(), int(found.num_matvecs),
                 sum(policies.seconds)),
            ):  # fmt: skip
                wrong = converged & ((moduli.double() - truth).abs() / truth > 1e-4)
                total = totals[name]
                total[0] += int(converged.sum())
                total[1] += int(wrong.sum())
                total[2] += matvecs
                total[3] += seconds
    solves = 3 * seeds
    cells = []
    for name in ("pair", "default"):
        certified, wrong, matvecs, seconds = totals[name]
        cells.append(f"{certified}/{K * solves} | {wrong} | {matvecs // solves} | {seconds / solves:.2f}")
    return f"| {n} | {d} | {(n - 1) * d} | {restarts} | {cells[0]} | {cells[1]} | {arbitrated}/{solves} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="n d up to 4096 only")
    parser.add_argument("--sizes", nargs="+", help="layer sizes as NxD (default 48x64 64x64 128x128)")
    parser.add_argument("--restarts", type=int, nargs="+", default=[30, 100], help="max_restarts (default 30 100)")
    parser.add_argument("--seeds", type=int, default=4, help="layers per size")
    parser.add_argument(
        "--operator", choices=("head-space", "full"), default="head-space", help="solve on G F (default) or on M"
    )
    args = parser.parse_args()
    torch.set_num_threads(2)
    spectrum._HEAD_SPACE = args.operator == "head-space"
    if args.sizes:
        sizes = [tuple(int(part) for part in size.split("x")) for size in args.sizes]
    else:
        sizes = [(48, 64), (64, 64)] + ([] if args.quick else [(128, 128)])
    print(
        f"\n### Certified top-{K} of clustered walk parts, float32, tol 1e-5, {args.seeds} layers x 3 starts, "
        f"operator: {args.operator}\n"
    )
    print(
        "| n | d | walk part dim | max_restarts | two starts: certified | wrong | matvecs | s "
        "| with arbitration: certified | wrong | matvecs | s | third start ran |"
    )
    print("|" + "---|" * 13)
    references: dict = {}
    for n, d in sizes:
        for restarts in args.restarts:
            print(row(n, d, args.seeds, restarts, references), flush=True)


if __name__ == "__main__":
    main()
