"""The README's python blocks run, in order, and print what their comments say."""

import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_quick_start_prints_what_the_readme_says():
    block = "".join(re.findall(r"```python\n(.*?)```", README.read_text(), re.S))  # every python block, in order
    promised = [line.split("# ", 1)[1].strip() for line in block.splitlines() if line.startswith("print(")]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(block, str(README), "exec"), {})
    printed = [line.strip() for line in out.getvalue().splitlines()]
    assert printed == promised


def test_coverage_table_is_the_generated_one():
    from tests.capture.families import coverage_table

    text = README.read_text()
    table = text.split("<!-- coverage:start -->\n", 1)[1].split("\n<!-- coverage:end -->", 1)[0]
    assert table == coverage_table(), "regenerate it: python -m tests.capture.families"
