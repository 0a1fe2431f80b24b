"""The W&B workspace spec: its panels cover exactly the keys a monitored run logs (read back from a real run)."""

from __future__ import annotations

import json
import re

import pytest
import torch

import connmon
from connmon.cli import main
from connmon.curvature.sampler import SharpnessSampler
from connmon.sinks.workspace import build_workspace, workspace_spec
from tests.capture.models import TinyGPT
from tests.integrations.wandb_read import read_run

pytest.importorskip("wandb_workspaces")


@pytest.fixture(scope="module")
def logged_keys(tmp_path_factory) -> set[str]:
    """Every key an offline W&B run of connmon.Monitor holds: 3 layers, every group, figures, histograms, alerts."""
    import wandb

    run = wandb.init(project="connmon-test", mode="offline", dir=str(tmp_path_factory.mktemp("wandb")))
    torch.manual_seed(0)
    model = TinyGPT(n_layer=3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)  # its state's keys are logged too
    monitor = connmon.Monitor(
        model,
        every_n_steps=1,
        optimizer_every_n_steps=1,
        full_every_n_samples=1,
        figures_every_n_samples=1,
        wandb=run,
        alerts=connmon.alerts.AlertRunner(  # QK-clip at a threshold it passes: its keys are logged too
            actions=(*connmon.alerts.DEFAULT_ACTIONS, "qk_clip"), qk_clip=connmon.alerts.QKClip(threshold=0.05)
        ),
        optimizer=optimizer,
        sharpness=SharpnessSampler(every_n_steps=2, lanczos_steps=2, budget=None),
        loss_fn=lambda net, ids: torch.nn.functional.cross_entropy(net(ids).flatten(0, 1), ids.flatten()),
    )
    for step in range(4):
        ids = torch.randint(0, 50, (2, 12))
        with monitor.step(step, batch=ids):
            loss = torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    monitor.close()
    files = run.dir
    run.finish()
    rows = [r["history"]["item"] for r in read_run(files) if r.get("type") == "history"]
    keys = {key.removesuffix("._type") for row in rows for key in row if key.startswith("connmon/")}
    return {key for key in keys if "." not in key}


def panels(spec: dict) -> dict[str, list[dict]]:
    sections = spec["spec"]["section"]["panelBankConfig"]["sections"]
    return {section["name"]: section["panels"] for section in sections}


@pytest.mark.parametrize("trainer, prefix", [("lightning", ""), ("transformers", "train/"), ("plain", "")])
def test_every_logged_key_has_exactly_one_panel_and_every_panel_a_key(logged_keys, trainer, prefix):
    spec = workspace_spec(build_workspace("team", "proj", num_layers=3, name="watch", trainer=trainer))
    assert (spec["entity"], spec["project"], spec["displayName"]) == ("team", "proj", "watch")
    sections = panels(spec)
    assert list(sections) == [
        "connmon: walk", "connmon: transport", "connmon: spectrum", "connmon: drift",
        "connmon: histograms", "connmon: figures", "connmon: curvature and cost", "connmon: alerts",
    ]  # fmt: skip
    keys = {prefix + key for key in logged_keys}
    shown: dict[str, int] = {}
    for name, section in sections.items():
        for panel in section:
            config = panel["config"]
            if config.get("useMetricRegex"):
                matched = {key for key in keys if re.fullmatch(config["metricRegex"], key)}
                if config["chartTitle"] == "reversibility_gap":  # not logged on causal layers (TinyGPT's)
                    assert not matched
                    continue
                assert matched, config["metricRegex"]  # a panel of nothing
                if config["metricRegex"].endswith("(L\\d+|all)$"):  # a per-layer metric: the /all mean is drawn too
                    assert f"{config['metricRegex'][1:].split('(')[0]}all" in matched
                assert set(config["overrideLineWidths"]) <= matched
            else:
                matched = set(config.get("metrics") or config.get("mediaKeys") or [])
                assert matched <= keys, (name, matched - keys)
            assert config.get("xAxis", "") in ("", "trainer/global_step", "train/global_step", "_step")
            for key in matched:
                shown[key] = shown.get(key, 0) + 1
    assert set(shown) == keys  # nothing logged without a panel
    assert all(count == 1 for count in shown.values())  # and nothing drawn twice


def test_histogram_panels_follow_the_layer_count(logged_keys):
    spec = workspace_spec(build_workspace("team", "proj", num_layers=5))
    histogram_keys = [key for panel in panels(spec)["connmon: histograms"] for key in panel["config"]["metrics"]]
    assert len(histogram_keys) == 2 * 5
    assert {key for key in histogram_keys if key.endswith(("L00", "L01", "L02"))} == {
        key for key in logged_keys if "_hist/" in key
    }


def test_cli_prints_the_spec_offline_and_reports_a_missing_login(capsys, monkeypatch):
    assert main(["workspace", "--entity", "team", "--project", "proj", "--layers", "2", "--print"]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert spec["project"] == "proj" and len(panels(spec)) == 8
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert main(["workspace", "--entity", "team", "--project", "proj", "--layers", "2"]) == 2
    assert "could not save the workspace to W&B" in capsys.readouterr().err
    assert main(["workspace", "--entity", "team", "--project", "proj", "--layers", "0", "--print"]) == 2
    assert "num_layers must be an integer >= 1" in capsys.readouterr().err
