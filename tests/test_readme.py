"""The python blocks of README and the guide run, in order, and print what their comments say; README stays short."""

import contextlib
import io
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
GUIDE = [ROOT / "docs" / page for page in ("monitoring.md", "integrations.md", "capture.md")]  # in reading order
COVERAGE = ROOT / "docs" / "capture.md"


def test_readme_and_guide_print_what_they_say():
    text = "".join(path.read_text() for path in [README, *GUIDE])
    block = "".join(re.findall(r"```python\n(.*?)```", text, re.S))  # every python block, in order
    promised = [line.split("# ", 1)[1].strip() for line in block.splitlines() if line.startswith("print(")]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(block, "README.md + docs", "exec"), {})
    printed = [line.strip() for line in out.getvalue().splitlines()]
    assert printed == promised


def test_coverage_table_is_the_generated_one():
    from tests.capture.families import coverage_table

    text = COVERAGE.read_text()
    table = text.split("<!-- coverage:start -->\n", 1)[1].split("\n<!-- coverage:end -->", 1)[0]
    generated = coverage_table()
    # the error column is round-off (1e-07 or so): its last digit moves with the BLAS build and thread count
    assert _without_errors(table) == _without_errors(generated), "regenerate it: python -m tests.capture.families"
    for written, measured in zip(_errors(table), _errors(generated), strict=True):
        if written != measured:  # a factor of 5 either way; "-" (nothing recorded) only matches itself
            assert "-" not in (written, measured), (written, measured)
            assert float(written) <= 5 * float(measured) + 1e-12 and float(measured) <= 5 * float(written) + 1e-12


def _rows(table: str) -> list[list[str]]:
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in table.splitlines()[2:]]


def _errors(table: str) -> list[str]:
    return [row[3] for row in _rows(table)]


def _without_errors(table: str) -> list[list[str]]:
    return [row[:3] + row[4:] for row in _rows(table)]


def test_readme_reaches_install_and_the_two_commands_on_its_first_screen():
    lines = README.read_text().splitlines()
    assert len(lines) < 200
    first_screen = "\n".join(lines[:40])
    assert "## Install" in first_screen and "python -m pytest" in first_screen
    assert "python examples/train_tiny_gpt.py" in first_screen
    assert 'name = "torch-connmon"' in (ROOT / "pyproject.toml").read_text()
