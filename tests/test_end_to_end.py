"""The way users hold their models: each HF family, custom layout and real code base inside a LightningModule,
trained a few steps with ConnectionMonitor(every_n_steps=1) and DriftAlert(), a CSV and an offline W&B logger. The
run finishes, every layer's keys are logged, no hook, kernel wrapper or reading mode is left, and losses and weights
equal a run without the callbacks."""

import contextlib
import io

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from connmon.callbacks import ConnectionMonitor, DriftAlert
from connmon.capture import attention_layers
from tests.callbacks.test_connection_monitor import read_csv
from tests.callbacks.wandb_run import finish_and_read, history, offline_logger
from tests.capture import code_bases, test_layouts
from tests.capture.families import FAMILIES

transformers = pytest.importorskip("transformers", minversion="5.0")
STEPS = 3


class Lit(L.LightningModule):
    """A LightningModule holding the model as an attribute, as users write it."""

    def __init__(self, build, batch_of):
        super().__init__()
        torch.manual_seed(0)
        self.model, self.batch_of, self.losses = build(), batch_of, []

    def training_step(self, batch, batch_idx):
        out = self.model(**batch) if isinstance(batch, dict) else self.model(*batch)
        out = out[0] if not isinstance(out, torch.Tensor) else out
        loss = out.float().square().mean()
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def family_case(family):
    def batches():
        batch = family.batch(batch=2, tokens=8)
        return [batch] * STEPS

    return family.build, batches


def layout_case(layout):
    def build():
        torch.manual_seed(0)
        return test_layouts.Block(layout())

    def batches():
        return [tuple(t[:2] for t in test_layouts.inputs(layout))] * STEPS

    return build, batches


def code_base_case(name):
    def build():
        with contextlib.redirect_stdout(io.StringIO()):  # nanoGPT and minGPT print their sizes
            return code_bases.build(name, pytest.MonkeyPatch())[0]

    def batches():
        return [(torch.randint(0, code_bases.VOCAB, (2, 8), generator=torch.Generator().manual_seed(1)),)] * STEPS

    return build, batches


CASES = (
    [pytest.param(*family_case(f), id=f.name) for f in FAMILIES]
    + [pytest.param(*layout_case(c), id=c.__name__) for c in test_layouts.LAYOUTS]
    + [pytest.param(*code_base_case(name), id=name) for name in code_bases.CODE_BASES]
)


def fit(tmp_path, build, batches, callbacks, loggers):
    L.seed_everything(0, verbose=False)
    module = Lit(build, batches)
    trainer = L.Trainer(
        max_steps=STEPS, callbacks=callbacks, logger=loggers, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, accelerator="cpu", devices=1, log_every_n_steps=1,
    )  # fmt: skip
    trainer.fit(module, DataLoader(batches(), batch_size=None))
    return module


@pytest.mark.filterwarnings("ignore::UserWarning")  # skipped layers (cross-attention) and dropout warn by design
@pytest.mark.parametrize(("build", "batches"), CASES)
def test_monitored_training_equals_plain_training_and_logs_every_layer(tmp_path, monkeypatch, build, batches):
    plain = fit(tmp_path / "plain", build, batches, [], False)
    wandb = offline_logger(tmp_path / "wandb", monkeypatch)
    sdpa, monitor = torch.nn.functional.scaled_dot_product_attention, ConnectionMonitor(every_n_steps=1)
    watched = fit(tmp_path, build, batches, [monitor, DriftAlert()], [CSVLogger(tmp_path, name="csv"), wandb])

    assert watched.losses == plain.losses
    for (name, a), b in zip(plain.named_parameters(), watched.parameters(), strict=True):
        assert torch.equal(a, b), name
    cross = ("encoder_attn", "EncDecAttention")  # decoder cross-attention: skipped at run time with a warning
    layers = [layer.index for layer in attention_layers(watched) if not layer.name.endswith(cross)]
    rows = [row for row in read_csv(tmp_path) if "connmon/attention_entropy/all" in row]
    assert [int(row["step"]) for row in rows] == list(range(STEPS))
    for index in layers:
        assert all(f"connmon/attention_entropy/L{index:02d}" in row for row in rows)
    assert any("connmon/connection_spectral_radius/L00" in row for row in rows)
    logged = history(finish_and_read(wandb))
    assert any("connmon/ov_isometry_gap/L00" in item for item in logged)
    assert torch.nn.functional.scaled_dot_product_attention is sdpa
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in watched.modules())
    assert torch._C._len_torch_function_stack() == 0  # the reading mode of hand-written attention is gone
