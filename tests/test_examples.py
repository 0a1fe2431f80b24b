"""The README's example runs and shows exact records."""

import contextlib
import io
import re
import runpy
from pathlib import Path

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
