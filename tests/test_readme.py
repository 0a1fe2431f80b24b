"""The python blocks of README and the guide run, in order, and print what their comments say; README stays short."""

import contextlib
import importlib
import io
import re
from pathlib import Path

import pytest

from tests.integrations.wandb_read import read_run

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
GUIDE = [ROOT / "docs" / page for page in ("monitoring.md", "integrations.md", "capture.md")]  # in reading order
COVERAGE = ROOT / "docs" / "capture.md"


def test_readme_and_guide_print_what_they_say(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")  # README's plain-loop block opens a W&B run, as a user's would
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    text = "".join(path.read_text() for path in [README, *GUIDE])
    block = "".join(re.findall(r"```python\n(.*?)```", text, re.S))  # every python block, in order
    promised = [line.split("# ", 1)[1].strip() for line in block.splitlines() if line.startswith("print(")]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(block, "README.md + docs", "exec"), {})
    printed = [line.strip() for line in out.getvalue().splitlines()]
    assert printed == promised
    (run,) = (tmp_path / "wandb").glob("offline-run-*")  # the plain-loop block's W&B run holds what it logged
    rows = [record["history"]["item"] for record in read_run(run / "files") if record.get("type") == "history"]
    logged = [row for row in rows if "connmon/attention_entropy/all" in row]
    assert [row["_step"] for row in logged] == [0, 100]


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
    assert "## Install" in first_screen and "\nmake test\n" in first_screen and "\nmake example\n" in first_screen
    assert "python examples/train_tiny_gpt.py" in first_screen and "python -m pytest" in first_screen
    assert 'name = "torch-connmon"' in (ROOT / "pyproject.toml").read_text()


BENCHMARKS = ROOT / "benchmarks" / "README.md"
MONITORING = ROOT / "docs" / "monitoring.md"
MECHANISMS = "## `bench_mechanisms.py`"
LARGE_RUNS = ROOT / "docs" / "large_runs.md"
OVERHEAD, SHARPNESS, INSTABILITY = "## `bench_overhead.py`", "## `bench_sharpness.py`", "## `bench_instability.py`"
BACKOFF = "## `bench_backoff.py`"
PAST_EDGE = "## `bench_past_edge.py`"
# (the page, what it says (the figure as group 1), the benchmark section whose current tables must say the same)
QUOTED = [
    (README, r"the monitor's defaults cost the\s+example's small steps (\d\.\d+)% of its training time", OVERHEAD),
    (README, r"\((\d+) s on a quiet 2-core", "## The example"),
    (README, r"median (\d+) steps ahead\) \|", SHARPNESS),
    (MONITORING, r"\*\*(\d\.\d+)x, \d\.\d+x and \d\.\d+x the\s+training time", OVERHEAD),
    (MONITORING, r"\*\*\d\.\d+x, (\d\.\d+)x and \d\.\d+x the\s+training time", OVERHEAD),
    (MONITORING, r"\*\*\d\.\d+x, \d\.\d+x and (\d\.\d+)x the\s+training time", OVERHEAD),
    (MONITORING, r"the same runs cost \d\.\d+x, \d\.\d+x and\s+(\d\.\d+)x", OVERHEAD),
    (README, r"the recipe cost at most (\d\.\d+)x on 1000-step runs", OVERHEAD),
    (README, r"against up to (\d\.\d+)x without it", OVERHEAD),
    (MONITORING, r"the sample adds (\d\.\d+)x a training step's own memory", OVERHEAD),
    (MONITORING, r"\(exact Lanczos (\d\.\d+)x\)", OVERHEAD),
    (MONITORING, r"the defaults warned \*\*(\d) of the 6 failures\*\*", MECHANISMS),
    (MONITORING, r"saved (\d) of the 6 runs that logit growth ruined", MECHANISMS),
    (MONITORING, r"8 of 8 divergences a median of (\d+) steps ahead", SHARPNESS),
    (MONITORING, r"for (0\.\d+) gradients per\s+training step on the median healthy run", SHARPNESS),
    (ROOT / "docs" / "capture.md", r"agree within 10% on (\d+\.\d+)% of the", SHARPNESS),
    (LARGE_RUNS, r"a light sample costs (\d\.\d+) training steps", OVERHEAD),
    (LARGE_RUNS, r"and a full one\s+\(the spectrum group and the edge gap as well\) (\d\.\d+)", OVERHEAD),
    (LARGE_RUNS, r"a healthy run pays about (0\.\d+) gradients per training step", SHARPNESS),
    (MONITORING, r"8 finished without diverging with the back-off \((\d+)%\)", BACKOFF),
    (MONITORING, r"each within 10% of the best loss it reached\s+before the alert\*\* \((\d\.\d+)-", BACKOFF),
    (MONITORING, r"one back-off at step (\d+) and it ended", BACKOFF),
    (MONITORING, r"median (0\.\d+) gradients per training\s+step on the healthy runs", BACKOFF),
    (MONITORING, r"\*\*(0\.\d+) gradients\s+per training step instead of", PAST_EDGE),
    (MONITORING, r"per training step instead of (\d\.\d+)\*\*", PAST_EDGE),
]


@pytest.mark.parametrize(("page", "quote", "section"), QUOTED, ids=lambda v: getattr(v, "name", str(v))[:40])
def test_figures_quoted_in_readme_and_the_guide_are_the_benchmark_tables(page, quote, section):
    figure = re.search(quote, page.read_text()).group(1)
    body = BENCHMARKS.read_text().split(section, 1)[1].split("\n## ", 1)[0]
    # the figure stands in that section's text as the page quotes it (1.0096x; 38 s; 91 steps ahead), digits whole
    assert re.search(rf"(?<![\d.]){re.escape(figure)}0*(?!\d)", body), (figure, section)


def test_the_reconstruction_tolerances_pages_quote_are_the_codes():
    import torch

    from connmon.capture.session import RECONSTRUCTION_TOLERANCE

    float32, bf16, fp16 = torch.float32, torch.bfloat16, torch.float16
    quoted = {
        README: [(r"above ([\d.e-]+) in float32", float32), (r"([\d.e-]+) bf16, ", bf16), (r"([\d.e-]+) fp16\)", fp16)],
        ROOT / "docs" / "capture.md": [(r"\(([\d.e-]+) in float32, ", float32), (r"([\d.e-]+) in bf16\)", bf16)],
        ROOT / "docs" / "diagnostics.md": [(r"above\s+([\d.e-]+), or", float32), (r"or ([\d.e-]+) in bf16", bf16)],
        ROOT / "docs" / "integrations.md": [(r"at most ([\d.e-]+), the bf16 tolerance", bf16)],
        LARGE_RUNS: [(r"to ([\d.e-]+) in bf", bf16), (r"\(([\d.e-]+) in fp16", fp16), (r"16, ([\d.e-]+) in", float32)],
    }  # fmt: skip
    for page, quotes in quoted.items():
        for quote, dtype in quotes:
            assert float(re.search(quote, page.read_text()).group(1)) == RECONSTRUCTION_TOLERANCE[dtype], (page, quote)


def test_the_api_reference_turns_sphinx_roles_into_cross_references():
    import sys

    sys.path.insert(0, str(ROOT))
    try:
        from docs_griffe import _ROLE, _reference
    finally:
        sys.path.remove(str(ROOT))
    text = "See :func:`connmon.capture`, :class:`~connmon.alerts.Rule` and :class:`torch.nn.Module`."
    assert _ROLE.sub(_reference, text) == (
        'See <autoref identifier="connmon.capture" optional><code>connmon.capture</code></autoref>, '
        '<autoref identifier="connmon.alerts.Rule" optional><code>Rule</code></autoref> and `torch.nn.Module`.'
    )


def _quick_start_blocks() -> list[str]:
    """README's ```py blocks: the Lightning quick start, then the Hugging Face snippet (a user's objects missing)."""
    return re.findall(r"```py\n(.*?)```", README.read_text(), re.S)


def test_the_lightning_quick_start_runs_as_pasted_and_logs_what_it_says(tmp_path, monkeypatch):
    """The quick start with a user's model and loader (a tiny GPT): it ends, and W&B holds each layer's keys and the
    model-level ones at every 100th step, as its comment says."""
    import wandb
    from torch.utils.data import DataLoader

    from tests.callbacks.lightning_models import LitGPT, corpus

    monkeypatch.chdir(tmp_path)  # Lightning and W&B write where the user runs
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    wandb.teardown()  # W&B reads the environment once per process
    lightning_block = _quick_start_blocks()[0]
    namespace = {"model": LitGPT(), "train_loader": DataLoader(corpus(64), batch_size=8)}
    exec(compile(lightning_block, "README.md (quick start)", "exec"), namespace)
    trainer = namespace["trainer"]
    assert trainer.global_step == 1000  # max_steps: the run ends
    run_dir = wandb.run.dir
    wandb.finish()
    logged = [record["history"]["item"] for record in read_run(run_dir) if record.get("type") == "history"]
    steps = [row["trainer/global_step"] for row in logged if "connmon/attention_entropy/L00" in row]
    assert steps == list(range(0, 1000, 100))
    assert all("connmon/attention_entropy/all" in row for row in logged if "connmon/attention_entropy/L00" in row)


def test_the_hugging_face_snippet_runs_as_pasted_and_reaches_wandb_under_train(tmp_path, monkeypatch):
    """The snippet with a user's Trainer (report_to="wandb", as its comment asks): the keys it names reach W&B."""
    pytest.importorskip("transformers")
    import wandb

    from tests.integrations.test_transformers import make_trainer

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    wandb.teardown()
    hugging_face_block = _quick_start_blocks()[1]
    namespace = {"trainer": make_trainer(tmp_path, report_to=["wandb"], max_steps=200, logging_steps=50)}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(hugging_face_block, "README.md (Hugging Face)", "exec"), namespace)
        namespace["trainer"].train()
    run_dir = wandb.run.dir
    wandb.finish()
    logged = [record["history"]["item"] for record in read_run(run_dir) if record.get("type") == "history"]
    steps = [row["train/global_step"] for row in logged if "train/connmon/attention_entropy/L00" in row]
    assert steps == [1, 101]  # the forwards after 0 and 100 steps, in the rows of their losses
    assert "connmon" not in out.getvalue()  # the rows reach W&B, not the console
