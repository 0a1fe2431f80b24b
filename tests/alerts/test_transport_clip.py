"""The transport clip (an experiment): each head's O_h V_h held within a factor of a scaled isometry, exactly."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import connmon
from connmon.alerts import AlertRunner, TransportClip
from connmon.alerts.transport_clip import NULL, isometry_clip
from connmon.capture import attention_layers
from connmon.capture.max_logit import HeadMaxLogits
from tests.capture.models import TinyGPT
from tests.capture.test_max_logit import NO_SDPA, _families, _tiny, _train


def dense_clip(w_v: np.ndarray, w_o: np.ndarray, factor: float, clipped: np.ndarray, rtol: float = 1e-9) -> np.ndarray:
    """The definition in float64, given the result's own mean m: T = U S W^T, s clamped to [m / f, f m] unless ~0.

    Also checks that m is the mean of the clamped non-null values (the band is centred on the result).
    """
    u, s, wt = np.linalg.svd(w_o @ w_v, full_matrices=False)
    r = w_v.shape[0]
    s, u, wt = s[:r], u[:, :r], wt[:r]
    keep = s > NULL * s.mean()
    after = np.linalg.svd(clipped @ w_v, compute_uv=False)[:r]
    m = after[keep].mean() if keep.any() else 0.0
    target = np.where(keep, np.clip(s, m / factor, m * factor), s)
    np.testing.assert_allclose(target[keep].mean() if keep.any() else 0.0, m, rtol=rtol)
    return (u * target) @ wt


@pytest.mark.parametrize("d_h, d", [(3, 8), (1, 5), (4, 4)])
def test_isometry_clip_is_the_float64_definition(d_h, d):
    gen = torch.Generator().manual_seed(0)
    heads = 6
    w_v = torch.randn(heads, d_h, d, generator=gen, dtype=torch.float64)
    w_o = torch.randn(heads, d, d_h, generator=gen, dtype=torch.float64)
    w_o[0, :, 0] *= 30  # one direction far above the others
    w_v[1, 0] *= 1e-3  # one far below
    w_v[2, -1] = 0.0  # a null direction: not raised
    q = torch.linalg.qr(torch.randn(d, d_h, generator=gen, dtype=torch.float64)).Q
    w_v[3], w_o[3] = q.mT * 2, q * 3  # a scaled isometry: untouched
    w_o[4, 0, 0] = float("nan")  # not finite: untouched
    w_v[5] = w_v[4]  # GQA: a value head shared by heads 4 and 5, each clipped on its own
    clipped, changed = isometry_clip(w_v, w_o, factor=2.0)
    for h in range(heads):
        if not torch.isfinite(w_o[h]).all():
            assert not changed[h]
            assert torch.equal(clipped[h].isnan(), w_o[h].isnan())
            continue
        want = dense_clip(w_v[h].numpy(), w_o[h].numpy(), 2.0, clipped[h].numpy())
        np.testing.assert_allclose((clipped[h] @ w_v[h]).numpy(), want, rtol=1e-9, atol=1e-9 * np.abs(want).max())
        if not changed[h]:
            assert torch.equal(clipped[h], w_o[h])  # bitwise, not recomputed
    assert not changed[3] and not changed[4]
    assert bool(changed[0] and changed[1]) == (d_h > 1)  # a head of one direction is its own scaled isometry
    s = torch.linalg.svdvals(clipped[2] @ w_v[2])[:d_h]
    assert s[-1] <= 1e-12 * s[0]  # the null direction stays null


def test_layouts_are_found_on_the_families_and_the_clip_holds_the_capture_s_transports_in_the_band():
    factor = 1.2
    acted = 0
    for family in _families():
        if family.name in NO_SDPA:
            continue
        model, batch = _tiny(family)
        layers = attention_layers(model)
        tracker = HeadMaxLogits([layer.module for layer in layers], [layer.name for layer in layers])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with tracker.watching():
                model(**batch)
        layouts = [tracker.layout(index) for index in range(len(layers))]
        if layouts[0].value is None or layouts[0].output is None:
            assert family.name in {"Falcon", "Falcon (new decoder, GQA)", "DeepSeek-V3", "BERT", "RoBERTa"}
            continue
        with torch.no_grad():
            before = {
                r.index: (r.w_v.double(), r.w_o.double()) for r in connmon.capture(model, max_tokens=None, **batch)
            }
        params = {name: p.detach().clone() for name, p in model.named_parameters()}
        only_first = [layouts[0]] + [None] * (len(layers) - 1)
        clips = TransportClip(factor=factor).apply(tracker.modules, only_first)
        assert clips and {c[0] for c in clips} == {0}, family.name
        with torch.no_grad():
            after = {r.index: r for r in connmon.capture(model, max_tokens=None, **batch)}
        record = after[0]
        assert float(record.reconstruction_error) < 1e-4, family.name  # the capture is still exact
        w_v, w_o = before[0]
        for h in range(w_v.shape[0]):
            want = dense_clip(w_v[h].numpy(), w_o[h].numpy(), factor, record.w_o[h].double().numpy(), 1e-5)
            got = (record.w_o[h].double() @ record.w_v[h].double()).numpy()
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max(), err_msg=family.name)
        output = f"{layers[0].name}.{layouts[0].output.weight}"
        for name, p in model.named_parameters():  # only the output projection of layer 0 changed
            if name != output:
                assert torch.equal(p, params[name]), (family.name, name)
        acted += 1
    assert acted >= 15


def test_multihead_attention_layout_and_clip():
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 4, dropout=0.0, batch_first=True)
    tracker = HeadMaxLogits([layer.self_attn], ["self_attn"])
    with tracker.watching():
        layer(torch.randn(2, 5, 16)).sum().backward()
    layout = tracker.layout(0)
    assert layout.value.weight == "in_proj_weight" and layout.value.rows[0].tolist() == [32, 33, 34, 35]
    assert layout.output.weight == "out_proj.weight" and layout.output.transposed
    with torch.no_grad():
        layer.self_attn.out_proj.weight[:, 0] *= 20
    w = layer.self_attn.in_proj_weight.detach()[32:].view(4, 4, 16).double()
    o = layer.self_attn.out_proj.weight.detach().view(16, 4, 4).transpose(0, 1).double()
    before = o[0].numpy().copy()
    clips = TransportClip(factor=2.0).apply([layer.self_attn], [layout])
    assert clips[0][:2] == (0, 0)
    o = layer.self_attn.out_proj.weight.detach().view(16, 4, 4).transpose(0, 1).double()
    want = dense_clip(w[0].numpy(), before, 2.0, o[0].numpy(), 1e-5)
    np.testing.assert_allclose((o[0] @ w[0]).numpy(), want, rtol=1e-5, atol=1e-6)


def test_training_is_bitwise_unchanged_by_a_transport_clip_that_never_acts():
    torch.manual_seed(0)
    plain = _train(TinyGPT())
    torch.manual_seed(0)
    model = TinyGPT()
    clip = TransportClip(factor=1e9)
    monitor = connmon.Monitor(model, every_n_steps=2, diagnostics=("walk",), log=lambda values, step: None,
                              alerts=AlertRunner([], actions=("transport_clip",), transport_clip=clip))  # fmt: skip
    watched = _train(model, monitor)
    monitor.close()
    assert torch.equal(plain[0], watched[0])
    assert all(torch.equal(a, b) for a, b in zip(plain[1], watched[1], strict=True))
    assert clip.clipped == 0


def test_monitor_clips_after_each_optimizer_step_says_so_and_resumes_its_count():
    torch.manual_seed(0)
    model = TinyGPT()
    clip = TransportClip(factor=1.5, every_n_steps=2)
    runner = AlertRunner([], actions=("transport_clip",), transport_clip=clip)
    monitor = connmon.Monitor(model, every_n_steps=2, diagnostics=("walk",), log=lambda v, step: None, alerts=runner)
    with pytest.warns(UserWarning, match=r"transport clip at step 2: L0\d head \d"):
        _train(model, monitor, steps=5)
    assert clip.clipped > 0
    monitor.begin_step(6)
    for block in model.blocks:  # every head inside the band after the clip: nothing left to do
        w_v = block.attn.c_attn.weight.detach()[64:].view(4, 8, 32).double()
        w_o = block.attn.c_proj.weight.detach().view(32, 4, 8).transpose(0, 1).double()
        s = torch.linalg.svdvals(w_o @ w_v)[:, :8]
        assert bool((s.max(-1).values <= 1.5 * s.mean(-1) * (1 + 1e-4)).all())
    state = runner.state_dict()
    fresh = AlertRunner([], actions=("transport_clip",))
    fresh.load_state_dict(state)
    assert fresh.transport_clip.clipped == clip.clipped
    monitor.close()


def test_a_layer_it_cannot_act_on_is_named_once():
    from transformers import BertConfig, BertModel

    config = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=32, attention_probs_dropout_prob=0.0, attn_implementation="sdpa")  # fmt: skip
    model = BertModel(config).train()
    monitor = connmon.Monitor(model, every_n_steps=2, diagnostics=("walk",), log=lambda v, step: None,
                              alerts=AlertRunner([], actions=("transport_clip",)))  # fmt: skip
    ids = torch.randint(0, 50, (2, 6))
    with pytest.warns(UserWarning, match="transport clip does not act on encoder.layer.0.attention.self"):
        for step in range(3):
            with monitor.step(step):
                model(input_ids=ids).last_hidden_state.sum().backward()
    monitor.close()


@pytest.mark.parametrize("factor", [0.5, 1.0, "2"])
def test_bad_factor_is_a_clear_error(factor):
    with pytest.raises(ValueError, match="factor"):
        TransportClip(factor=factor)


def test_lightning_drift_alert_hands_the_clip_to_the_connection_monitor(tmp_path):
    import lightning as L

    from connmon.callbacks import ConnectionMonitor, DriftAlert

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.gpt = TinyGPT()

        def training_step(self, batch, batch_idx):
            (ids,) = batch
            return torch.nn.functional.cross_entropy(self.gpt(ids).flatten(0, 1), ids.roll(-1, 1).flatten())

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    torch.manual_seed(0)
    ids = torch.randint(0, 50, (8, 9), generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=4)
    alert = DriftAlert(actions=("transport_clip",), transport_clip=TransportClip(factor=1.5))
    callbacks = [ConnectionMonitor(every_n_steps=2, diagnostics=("walk",), figures_every_n_samples=None), alert]
    trainer = L.Trainer(max_steps=4, callbacks=callbacks, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, accelerator="cpu")  # fmt: skip
    module = Module()
    with pytest.warns(UserWarning, match="transport clip at step 1"):
        trainer.fit(module, loader)
    assert alert.runner.transport_clip.clipped > 0
