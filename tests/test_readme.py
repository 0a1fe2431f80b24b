"""The python blocks of README and the guide run, in order, and print what their comments say; README stays short."""

import contextlib
import importlib
import io
import re
from pathlib import Path

import pytest

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


@pytest.mark.parametrize(
    ("marker", "generator", "column"),
    [("coverage", "tests.capture.families", 3), ("code-bases", "tests.capture.code_bases", 2)],
)
def test_coverage_tables_are_the_generated_ones(marker, generator, column):
    coverage_table = importlib.import_module(generator).coverage_table
    text = COVERAGE.read_text()
    table = text.split(f"<!-- {marker}:start -->\n", 1)[1].split(f"\n<!-- {marker}:end -->", 1)[0]
    generated = coverage_table()
    # the error column is round-off (1e-07 or so): its last digit moves with the BLAS build and thread count
    assert _without_errors(table, column) == _without_errors(generated, column), f"regenerate it: python -m {generator}"
    for written, measured in zip(_errors(table, column), _errors(generated, column), strict=True):
        if written != measured:  # both round-off, or a factor of 5 either way; "-" (none recorded) only matches itself
            assert "-" not in (written, measured), (written, measured)
            if max(float(written), float(measured)) > 1e-6:
                assert float(written) <= 5 * float(measured) and float(measured) <= 5 * float(written)


def _rows(table: str) -> list[list[str]]:
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in table.splitlines()[2:]]


def _errors(table: str, column: int) -> list[str]:
    return [row[column] for row in _rows(table)]


def _without_errors(table: str, column: int) -> list[list[str]]:
    return [row[:column] + row[column + 1 :] for row in _rows(table)]


def test_readme_reaches_install_and_the_two_commands_on_its_first_screen():
    lines = README.read_text().splitlines()
    assert len(lines) < 200
    first_screen = "\n".join(lines[:40])
    assert "## Install" in first_screen and "python -m pytest" in first_screen
    assert "python examples/train_tiny_gpt.py" in first_screen
    assert 'name = "torch-connmon"' in (ROOT / "pyproject.toml").read_text()


BENCHMARKS = ROOT / "benchmarks" / "README.md"
# (what README says, the benchmark section whose current table must say the same)
QUOTED = [
    (r"about 1% of the\s+training time on the example \((\d\.\d+x)", "## `bench_overhead.py`"),
    (r"\((\d+ s) on a 2-core CPU", "## The example"),
    (r"median (\d+ steps) ahead\) \|", "## `bench_sharpness.py`"),
]


@pytest.mark.parametrize(("quote", "section"), QUOTED)
def test_figures_quoted_in_readme_are_the_benchmark_tables(quote, section):
    figure = re.search(quote, README.read_text()).group(1)
    text = BENCHMARKS.read_text()
    body = text.split(section, 1)[1].split("\n## ", 1)[0]
    number, unit = re.match(r"([\d.]+)\s*(\S+)", figure).groups()
    # the figure stands in that section's text, as README quotes it (1.0073x; 46 s; 97 steps ahead)
    assert re.search(rf"\b{re.escape(number)}\s*{re.escape(unit.rstrip('x'))}", body), (figure, section)
