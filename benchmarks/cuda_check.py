"""Correctness on an accelerator: connmon on ``--device`` against the same computation on the CPU. Prints tables.

1. functional: every diagnostic of random layers (GQA, causal, padded; float64) on the device against the CPU.
2. capture: HF families built from configs on the device, float32 and bf16 autocast: the armed forward equals the
   plain one bitwise, and every record rebuilds its output (reconstruction error).
3. ConnectionMonitor: a tiny GPT LightningModule trained 3 steps on the device with ``every_n_steps=1``.
4. curvature: gradient-difference Lanczos (SharpnessMonitor's default) on the device's own SDPA kernels, in float32
   and under bf16 autocast (the training forward on the flash kernel; the reading in float32), against exact
   double-backward Lanczos on the math kernel; the parameters bitwise as they were; a bf16-mixed Lightning fit.

The exit status is 1 if any check fails. ``benchmarks/gpu.sh`` runs it with ``--device cuda``; on a machine
without a GPU, ``--device cpu`` runs the same checks (a smoke test of the script).

Usage:
    python benchmarks/cuda_check.py --device cuda
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import connmon
import connmon.functional as F
from tests.capture.families import FAMILIES
from tests.functional.reference import make_layer

FAILED: list[str] = []


def check(name: str, ok: bool, detail: str) -> str:
    if not ok:
        FAILED.append(name)
    return f"| {name} | {'ok' if ok else 'FAIL'} | {detail} |"


def functional_rows(device: torch.device) -> list[str]:
    rows = []
    cases = {
        "gqa": dict(heads=4, kv_heads=2, n=12, d_h=4, d=16),
        "causal": dict(heads=3, n=40, d_h=4, d=12, mask="causal"),
        "padded": dict(heads=2, n=12, d_h=3, d=6, mask="padded"),
    }
    for case, options in cases.items():
        layer = make_layer(**options, seed=1)
        cpu = (layer.attn, layer.w_v, layer.w_o)
        dev = tuple(t.to(device) for t in cpu)
        P_cpu, P_dev = F.walk_matrix(cpu[0]), F.walk_matrix(dev[0])
        quantities = {
            "stochasticity_gap": lambda a, v, o, P: F.stochasticity_gap(P),
            "attention_entropy": lambda a, v, o, P: F.attention_entropy(a),
            "reversibility_gap": lambda a, v, o, P: F.reversibility_gap(P),
            "walk_spectral_gap": lambda a, v, o, P: F.walk_spectral_gap(P),
            "head_isometry_gap": lambda a, v, o, P: F.head_isometry_gap(v, o),
            "ov_isometry_gap": lambda a, v, o, P: F.ov_isometry_gap(v, o),
            "edge_isometry_gap": lambda a, v, o, P: F.edge_isometry_gap(a, v, o),
            "connection_spectrum": lambda a, v, o, P: F.connection_spectrum(a, v, o, k=4).abs(),
            "connection_spectrum (full)": lambda a, v, o, P: F.connection_spectrum(a, v, o, k=4, deflate=False).abs(),
            "connection_operator_norm": lambda a, v, o, P: F.connection_operator_norm(a, v, o),
            "connection_laplacian_gap": lambda a, v, o, P: F.connection_laplacian_gap(a, v, o),
            "ov_spectral_radius": lambda a, v, o, P: F.ov_spectral_radius(v, o),
        }
        worst, worst_name = 0.0, ""
        for name, fn in quantities.items():
            want, got = fn(*cpu, P_cpu).double(), fn(*dev, P_dev).double().cpu()
            error = float(((got - want).abs() / want.abs().clamp_min(1e-12)).nan_to_num(0.0).max())
            if error > worst:
                worst, worst_name = error, name
        rows.append(check(f"functional {case}", worst <= 1e-6, f"max relative difference {worst:.1e} ({worst_name})"))
    return rows


def capture_rows(device: torch.device, names: list[str]) -> list[str]:
    rows = []
    for family in (f for f in FAMILIES if f.name in names):
        model = family.build().to(device).eval()
        batch = {k: v.to(device) for k, v in family.batch().items()}
        for precision in ("float32", "bf16 autocast"):
            autocast = (
                torch.autocast(device.type, dtype=torch.bfloat16)
                if precision != "float32"
                else contextlib.nullcontext()
            )
            with torch.no_grad(), autocast:
                plain = model(**batch)[0]
            with warnings.catch_warnings(), autocast:
                warnings.simplefilter("ignore")
                with connmon.capture.armed(model) as session, torch.no_grad():
                    armed = model(**batch)[0]
            errors = [r.reconstruction_error.item() for r in session.records]
            limit = 1e-5 if precision == "float32" else 6e-2
            ok = torch.equal(plain, armed) and bool(errors) and max(errors) <= limit
            detail = f"{len(errors)} records, max reconstruction {max(errors, default=float('nan')):.1e}"
            rows.append(check(f"capture {family.name}, {precision}", ok, detail + ", armed == plain"))
    return rows


def monitor_row(device: torch.device) -> str:
    import lightning as L

    from connmon.callbacks import ConnectionMonitor
    from tests.callbacks.lightning_models import LitGPT, loader

    monitor = ConnectionMonitor(every_n_steps=1, full_every_n_samples=1)
    values: list[dict] = []
    monitor.add_listener(lambda trainer, step, scalars: values.append(scalars))
    accelerator = "gpu" if device.type == "cuda" else "cpu"
    trainer = L.Trainer(
        max_steps=3, callbacks=[monitor], logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, accelerator=accelerator, devices=1,
    )  # fmt: skip
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(LitGPT(), loader())
    seconds = time.perf_counter() - start
    finite = all(v == v for sample in values for v in sample.values())
    ok = len(values) == 3 and finite and "connmon/connection_spectral_radius/L00" in values[-1]
    return check("ConnectionMonitor fit", ok, f"3 steps, {len(values)} samples, all finite: {finite}, {seconds:.1f} s")


def curvature_rows(device: torch.device) -> list[str]:
    import lightning as L
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from connmon.callbacks import SharpnessMonitor
    from connmon.curvature import sharpness_ratio
    from tests.callbacks.lightning_models import LitGPT, loader

    rows = []
    module = LitGPT().to(device)
    optimizer = torch.optim.AdamW(module.parameters(), lr=3e-3)
    batches = [(x.to(device), y.to(device)) for x, y in loader()]

    def loss(batch):
        return torch.nn.functional.cross_entropy(module(batch[0]).flatten(0, 1), batch[1].flatten())

    for batch in batches[:4]:
        optimizer.zero_grad()
        loss(batch).backward()
        optimizer.step()
    batch = batches[4]
    exact = sharpness_ratio(lambda: loss(batch), optimizer, steps=8, products="double_backward").ratio
    before = [p.detach().clone() for p in module.parameters()]
    for label, context in (
        ("float32", contextlib.nullcontext()),
        ("bf16 autocast, flash kernel", torch.autocast(device.type, dtype=torch.bfloat16)),
    ):
        kernels = sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])
        start = time.perf_counter()
        with context, kernels:
            found = sharpness_ratio(lambda: loss(batch), optimizer, steps=8)
        seconds = time.perf_counter() - start
        unchanged = all(torch.equal(a, b) for a, b in zip(before, module.parameters(), strict=True))
        ok = abs(found.ratio / exact - 1) < 0.02 and unchanged
        detail = f"{found.ratio:.4g} against exact {exact:.4g}, {found.gradient_evaluations} gradients, {seconds:.2f} s"
        rows.append(check(f"curvature by gradient differences, {label}", ok, detail))
    monitor = SharpnessMonitor(
        lambda m, b: torch.nn.functional.cross_entropy(m(b[0]).flatten(0, 1), b[1].flatten()), every_n_steps=2,
        cadence="fixed",
     budget=None,
    )  # fmt: skip
    values: list[float] = []
    monitor.add_listener(lambda trainer, step, scalars: values.append(scalars["connmon/sharpness_ratio"]))
    trainer = L.Trainer(
        max_steps=5, callbacks=[monitor], logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, accelerator="gpu" if device.type == "cuda" else "cpu", devices=1,
        precision="bf16-mixed",
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(LitGPT(), loader())
    ok = len(values) == 2 and all(v == v for v in values) and monitor.off is None
    rows.append(check("SharpnessMonitor bf16-mixed fit", ok, f"ratios {[round(v, 4) for v in values]}"))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--families", nargs="*", default=["GPT-2", "LLaMA", "Gemma2", "GPT-OSS", "BERT", "T5"])
    args = parser.parse_args()
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"torch {torch.__version__}, {name}\n")
    print("| check | result | detail |")
    print("|---|---|---|")
    rows = [*functional_rows(device), *capture_rows(device, args.families), monitor_row(device)]
    for row in [*rows, *curvature_rows(device)]:
        print(row, flush=True)
    print(f"\n{len(FAILED)} failed" + (f": {', '.join(FAILED)}" if FAILED else ""))
    sys.exit(1 if FAILED else 0)


if __name__ == "__main__":
    main()
