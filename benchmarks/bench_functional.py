"""Speed of connmon.functional's solvers against their baselines, measured in the same run. Prints markdown tables.

1. ``connection_spectrum(k=8, deflate=False)`` (the solvers on the whole operator) against scipy's ARPACK
   (``scipy.sparse.linalg.eigs``) driving the same ``connection_matvec`` with the same tolerance, basis size and
   restart bound, and against dense ``torch.linalg.eigvals`` of the ``n d x n d`` operator where it fits
   (``n d <= --dense-max``). The matvec
   bound is (matvecs connmon used) x (median time of one matvec): no matvec-based solver can beat it.
2. ``transport_singular_values`` against a naive SVD of each ``d x d`` head map ``T_h`` (d = 768, H = 12).
3. With ``--full-sample`` (instead of 1 and 2): a full sample of one layer and one sequence at GPT-2-small shape
   (n = 256, d = 768, H = 12, causal and bidirectional), per diagnostic: the spectrum group
   (``connection_spectra``, ``connection_operator_norm``, ``ov_spectral_radius``; the transport scale ``s``
   computed once, as ``SpectrumMetrics`` does, and timed with the norms), the edge gap at the monitor's
   defaults by Lanczos quadrature against one decomposition per edge (the previous default), the weight-only
   transport gaps and the walk group.

Usage:
    python benchmarks/bench_functional.py            # the full grid (about 7 minutes on 2 CPU cores)
    python benchmarks/bench_functional.py --quick    # n, d in {64, 128}
    python benchmarks/bench_functional.py --full-sample  # the GPT-2-small table (about 4 minutes)
    python benchmarks/bench_functional.py --device cuda
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable

import numpy as np
import scipy.sparse.linalg as spla
import torch

import connmon.functional as F

TOL = 1e-5  # connmon's float32 default, given to ARPACK too
K = 8
NCV = 30  # connmon's default basis size for k = 8, given to ARPACK too (its own default is 20)
MAX_RESTARTS = 100


def clock(fn: Callable[[], object], device: torch.device, repeats: int) -> tuple[float, object]:
    """Median wall time of ``fn`` over ``repeats`` runs (after one warm-up), and its last result."""
    result = fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        result = fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def make_layer(n: int, d: int, heads: int, causal: bool, device: torch.device, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    d_h = d // heads
    logits = 2.0 * torch.randn(heads, n, n, generator=gen)
    if causal:
        logits = logits.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    attn = logits.softmax(-1)
    w_v = torch.randn(heads, d_h, d, generator=gen) / d**0.5
    w_o = torch.randn(heads, d, d_h, generator=gen) / d**0.5
    return attn.to(device), w_v.to(device), w_o.to(device)


def arpack(attn, w_v, w_o) -> tuple[np.ndarray | None, int, str]:
    """ARPACK on the same matvec; returns (eigenvalues of M / s or None, matvecs, status)."""
    n, d = attn.shape[-1], w_v.shape[-1]
    count = [0]

    def matvec(x: np.ndarray) -> np.ndarray:
        count[0] += 1
        field = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to(attn.device).view(n, d)
        return F.connection_matvec(attn, w_v, w_o, field).reshape(-1).cpu().numpy()

    operator = spla.LinearOperator((n * d, n * d), matvec=matvec, dtype=np.float32)
    v0 = np.random.default_rng(0).standard_normal(n * d).astype(np.float32)
    scale = F.transport_scale(w_v, w_o).item()
    try:
        values = spla.eigs(
            operator, k=K, which="LM", tol=TOL, ncv=NCV, maxiter=MAX_RESTARTS, v0=v0, return_eigenvectors=False
        )
        return values / scale, count[0], "ok"
    except spla.ArpackNoConvergence as error:
        return None, count[0], f"{len(error.eigenvalues)}/{K} converged"


HEADER = (
    "| n | d | H | mask | n*d | connmon path | connmon s | matvecs | matvec ms | bound s | connmon/bound "
    "| ARPACK s | ARPACK matvecs | ARPACK/connmon | dense eigvals s | max rel diff |"
)


def spectrum_row(n: int, d: int, heads: int, causal: bool, device: torch.device, repeats: int, dense_max: int) -> str:
    attn, w_v, w_o = make_layer(n, d, heads, causal, device)
    ours_s, found = clock(
        lambda: F.connection_spectrum(attn, w_v, w_o, k=K, ncv=NCV, deflate=False, return_info=True), device, repeats
    )
    matvecs = int(found.num_matvecs)
    x = torch.randn(n, d, device=device)
    matvec_s, _ = clock(lambda: F.connection_matvec(attn, w_v, w_o, x), device, 50)
    bound = matvecs * matvec_s
    arpack_s, (values, arpack_matvecs, status) = clock(lambda: arpack(attn, w_v, w_o), device, 1)
    ours = np.sort(found.eigenvalues.abs().cpu().numpy())[::-1]
    if values is not None:
        theirs = np.sort(np.abs(values))[::-1]
        diff = f"{np.max(np.abs(ours - theirs) / theirs):.1e} vs ARPACK"
    else:
        diff = f"ARPACK: {status}"
    dense_s = "-"
    if n * d <= dense_max:
        dense_time, everything = clock(
            lambda: torch.linalg.eigvals(F.connection_operator(attn, w_v, w_o, max_dim=n * d)), device, 1
        )
        dense_s = f"{dense_time:.2f}"
        top = np.sort(everything.abs().cpu().numpy())[::-1][:K] / F.transport_scale(w_v, w_o).item()
        diff += f"; {np.max(np.abs(ours - top) / top):.1e} vs dense"
    versus_bound = f"{bound:.3f} | {ours_s / bound:.2f}x" if matvecs else "- | -"
    arpack_cell = f"{arpack_s:.3f}" + ("" if status == "ok" else f" ({status})")
    return (
        f"| {n} | {d} | {heads} | {'causal' if causal else 'full'} | {n * d} | {found.method} | {ours_s:.3f} "
        f"| {matvecs} | {matvec_s * 1e3:.2f} | {versus_bound} | {arpack_cell} | {arpack_matvecs} "
        f"| {arpack_s / ours_s:.1f}x | {dense_s} | {diff} |"
    )


def spectrum_table(sizes: list[int], heads_list: list[int], device: torch.device, repeats: int, dense_max: int) -> None:
    print(f"\n### connection_spectrum(k={K}), float32, tol={TOL}, ncv={NCV}, max_restarts={MAX_RESTARTS}\n")
    print(HEADER)
    print("|" + "---|" * 16)
    for causal in (False, True):
        for n in sizes:
            for d in sizes:
                for heads in heads_list:
                    print(spectrum_row(n, d, heads, causal, device, repeats, dense_max), flush=True)


def singular_values_table(device: torch.device, repeats: int) -> None:
    d, heads = 768, 12
    d_h = d // heads
    gen = torch.Generator().manual_seed(0)
    w_v = (torch.randn(heads, d_h, d, generator=gen) / d**0.5).to(device)
    w_o = (torch.randn(heads, d, d_h, generator=gen) / d**0.5).to(device)
    fast_s, fast = clock(lambda: F.transport_singular_values(w_v, w_o), device, repeats)
    naive_s, naive = clock(lambda: torch.linalg.svdvals(w_o @ w_v)[..., :d_h], device, repeats)
    diff = ((fast - naive).abs().max() / naive.max()).item()
    print(f"\n### transport_singular_values, d={d}, H={heads}, d_h={d_h}, float32\n")
    print("| method | ms | speed-up | max rel diff |")
    print("|---|---|---|---|")
    print(f"| naive: svdvals of each d x d T_h | {naive_s * 1e3:.1f} | 1.0x | - |")
    print(f"| connmon: thin QR + d_h x d_h SVD | {fast_s * 1e3:.2f} | {naive_s / fast_s:.0f}x | {diff:.1e} |")


def full_sample_row(causal: bool, device: torch.device, repeats: int) -> str:
    n, d, heads = 256, 768, 12
    attn, w_v, w_o = make_layer(n, d, heads, causal, device)
    attn = attn.unsqueeze(0)
    edges = dict(num_samples=1, num_queries=16)
    scale = F.transport_scale(w_v, w_o)  # weight-only, once per layer as SpectrumMetrics does: timed with "norm"

    def norms() -> tuple:
        s = F.transport_scale(w_v, w_o)
        return F.connection_operator_norm(attn, w_v, w_o, scale=s), F.ov_spectral_radius(w_v, w_o, scale=s)

    parts = {
        "spectra": lambda: F.connection_spectra(attn, w_v, w_o, k=K, scale=scale),
        "norm": norms,
        "lanczos": lambda: F.edge_isometry_gap(attn, w_v, w_o, **edges, lanczos_steps=32),
        "eigh": lambda: F.edge_isometry_gap(attn, w_v, w_o, **edges),
        "transport": lambda: (
            F.head_isometry_gap(w_v, w_o),
            F.ov_singular_values(w_v, w_o),
            F.transport_symmetry_gap(w_v, w_o),
        ),
        "walk": lambda: (F.attention_entropy(attn), F.walk_spectral_gap(F.walk_matrix(attn))),
    }
    times = {name: clock(part, device, repeats)[0] for name, part in parts.items()}
    total = sum(seconds for name, seconds in times.items() if name != "eigh")
    cells = " | ".join(f"{times[name]:.3f}" for name in parts)
    return f"| {'causal' if causal else 'full'} | {cells} | {total:.3f} |"


def full_sample_table(device: torch.device, repeats: int) -> None:
    print("\n### One full sample of one layer and sequence, n=256, d=768, H=12 (GPT-2 small), float32, seconds\n")
    print("| mask | spectra (k=8) | operator norm + ov radius + s | edge gap, Lanczos | edge gap, per-edge eigh | "
          "transport | walk | full sample (Lanczos edges) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for causal in (True, False):
        print(full_sample_row(causal, device, repeats), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quick", action="store_true", help="n, d in {64, 128} only")
    parser.add_argument("--full-sample", action="store_true", help="the GPT-2-small full-sample table instead")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dense-max", type=int, default=4096, help="largest n*d for the dense eigvals baseline")
    args = parser.parse_args()
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine()
    print(f"torch {torch.__version__}, device {device} ({name}), {torch.get_num_threads()} CPU threads")
    if args.full_sample:
        full_sample_table(device, args.repeats)
        return
    singular_values_table(device, args.repeats)
    sizes = [64, 128] if args.quick else [64, 128, 256]
    spectrum_table(sizes, [4, 8], device, args.repeats, args.dense_max)


if __name__ == "__main__":
    main()
