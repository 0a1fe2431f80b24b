"""Every head's max logit over the whole batch, every step: exact against float64, on the families users run."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import connmon
from connmon.alerts import AlertRunner, QKClip, TransportClip
from connmon.capture import attention_layers
from connmon.capture.max_logit import HeadMaxLogits, head_max_logit
from tests.capture.families import FAMILIES
from tests.capture.models import TinyGPT


def dense_head_max(q, k, allowed=None, scale=None):
    """The definition in float64: scale * q k^T over the allowed pairs, max over batch, queries and keys per head."""
    q, k = q.double(), k.double()
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = q @ k.mT * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, -math.inf)
    return scores.amax(dim=(0, 2, 3))


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2), (4, 1), (1, 1)])
@pytest.mark.parametrize("mask", ["none", "causal", "padded bool", "additive float"])
@pytest.mark.parametrize("block_elements", [1, 1 << 22])
def test_head_max_logit_is_the_float64_definition(heads, kv_heads, mask, block_elements):
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(3, heads, 7, 8, generator=gen) * 3, torch.randn(3, kv_heads, 7, 8, generator=gen) * 3
    causal = torch.ones(7, 7, dtype=torch.bool).tril()
    padded = torch.ones(3, 1, 1, 7, dtype=torch.bool)
    padded[2, ..., 4:] = False
    allowed, given, is_causal = None, None, False
    if mask == "causal":
        allowed, is_causal = causal, True
    elif mask == "padded bool":
        allowed = given = padded & causal
    elif mask == "additive float":
        allowed = padded & causal
        given = torch.where(allowed, torch.randn(3, 1, 7, 7, generator=gen), torch.finfo(torch.float32).min)
    got = head_max_logit(q, k, given, is_causal=is_causal, block_elements=block_elements)
    torch.testing.assert_close(got.double(), dense_head_max(q, k, allowed), rtol=1e-6, atol=1e-6)


def test_head_max_logit_scale_unbatched_float64_and_nan():
    q, k = torch.randn(2, 5, 4, dtype=torch.float64), torch.randn(2, 5, 4, dtype=torch.float64)
    got = head_max_logit(q, k, scale=0.5)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, dense_head_max(q[None], k[None], scale=0.5), rtol=0, atol=1e-12)
    q[0, 1, 2] = math.nan  # a non-finite forward reads as NaN in its head, never raises
    got = head_max_logit(q, k)
    assert math.isnan(got[0]) and math.isfinite(got[1])
    assert head_max_logit(q, k, torch.zeros(5, 5, dtype=torch.bool)).isneginf().all()  # nothing allowed


def test_tracker_reads_every_forward_of_a_step_and_no_other():
    torch.manual_seed(0)
    model = TinyGPT()
    tracker = HeadMaxLogits([block.attn for block in model.blocks], ["L0", "L1"])
    tracker.watch()
    first, second = torch.randint(0, 50, (2, 9)), torch.randint(0, 50, (2, 9))
    model(first).sum().backward()
    model(second).sum().backward()  # two micro-batches of one step
    both = tracker.read()
    model(first)
    alone = [tracker.read()]
    model(second)
    alone.append(tracker.read())
    torch.testing.assert_close(both, torch.maximum(*alone), rtol=0, atol=0)
    with torch.no_grad():
        model(first)  # an evaluation forward is not a training forward
    model.eval()
    model(first)
    assert tracker.read() is None
    tracker.unwatch()
    model.train()
    model(first)
    assert tracker.read() is None  # no hook is left


def _families():
    return [family for family in FAMILIES if family.inputs == "ids"]


NO_SDPA = {"Bloom", "Gemma2", "GPT-OSS"}  # attention computed by hand or by transformers' eager functions
NO_LAYOUT = {  # queries or keys that are not rows of one projection's output
    "OPT": "queries scaled after the projection",
    "Falcon": "FalconLinear multiplies by weight.T itself",
    "Falcon (new decoder, GQA)": "FalconLinear multiplies by weight.T itself",
    "Qwen3": "QK-norm",
    "Gemma3": "QK-norm",
    "OLMo2": "QK-norm",
    "DeepSeek-V3": "multi-head latent attention: keys through a normed latent",
}


def _tiny(family):
    model = family.build().train()
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    batch = family.batch()
    batch.pop("attention_mask")  # unpadded: the capture leaves padding queries out, the kernel reads them
    return model, batch


@pytest.mark.parametrize("family", _families(), ids=lambda f: f.name)
def test_families_max_logit_equals_the_capture_and_qk_clip_brings_it_to_the_threshold(family):
    model, batch = _tiny(family)
    layers = attention_layers(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tracker = HeadMaxLogits([layer.module for layer in layers], [layer.name for layer in layers])
        tracker.watch()
        model(**batch)
        table = tracker.read()
    said = [str(w.message) for w in caught if "connmon" in str(w.message)]
    if family.name in NO_SDPA:
        assert table is None and len(said) == len(layers) and all("calls no scaled_dot_product" in s for s in said)
        return
    with torch.no_grad():
        records = connmon.capture(model, num_sequences=3, max_tokens=None, **batch)
    reference = {r.index: float(r.max_logit.max()) for r in records}
    for index, value in reference.items():
        if family.name == "ALBERT":  # one layer run twice: the capture records its first call, the tracker both
            assert table[index].max().item() >= value
        elif family.name != "OPT":  # OPT's capture adds its additive mask's finite values to the logits
            assert table[index].max().item() == pytest.approx(value, rel=1e-6)
    layouts = [tracker.layout(index) for index in range(len(layers))]
    if family.name in NO_LAYOUT:
        assert all(layout.query is layout.key is None for layout in layouts)
        assert not said  # no clip acts: nothing to say
        clipping = HeadMaxLogits([layer.module for layer in layers], [layer.name for layer in layers])
        clipping.threshold = 1e9  # QK-clip's tau: it reads the query and key rows, so it is told why it cannot
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            clipping.watch()
            model(**batch)
            clipping.unwatch()
        said = [str(w.message) for w in caught if "connmon" in str(w.message)]
        assert len(said) == len(layers) and all("QK-clip cannot scale" in s for s in said)
        return
    assert None not in layouts and not said
    if family.name == "ALBERT":  # its second call reads what the clipped first call wrote: no exact threshold
        return
    tau = float(table[0].max()) / 2  # layer 0 only: its input is the embedding, unchanged by the clip
    only_first = torch.full_like(table, -math.inf)
    only_first[0] = table[0]
    clips = QKClip(tau).apply(tracker.modules, only_first, layouts)
    assert clips and {c[0] for c in clips} == {0}
    model(**batch)
    after = tracker.read()[0]
    assert after.max().item() == pytest.approx(tau, rel=1e-5)
    above = table[0] > tau
    if layouts[0].key.rows[:, 0].unique().numel() == table.shape[1]:  # a key head per query head: the rest untouched
        torch.testing.assert_close(after[~above], table[0][~above], rtol=1e-6, atol=0)
    tracker.unwatch()


def _train(model, monitor=None, steps=4, accumulate=2, lr=3e-2):
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(0)
    losses, last = [], []
    for step in range(steps):
        last = []
        for _ in range(accumulate):
            ids = torch.randint(0, 50, (2, 9), generator=gen)
            last.append(ids)
            context = monitor.step(step) if monitor is not None else torch.enable_grad()
            with context:
                loss = torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.roll(-1, 1).flatten())
            (loss / accumulate).backward()
            losses.append(loss.detach())
        optimizer.step()
        optimizer.zero_grad()
    return torch.stack(losses), [p.detach().clone() for p in model.parameters()], last


@pytest.mark.parametrize("threshold", [None, 1e9])
def test_training_is_bitwise_unchanged_by_the_reading_and_by_a_clip_that_never_fires(threshold):
    torch.manual_seed(0)
    plain = _train(TinyGPT())
    torch.manual_seed(0)
    model = TinyGPT()
    alerts = None if threshold is None else AlertRunner([], actions=("qk_clip",), qk_clip=QKClip(threshold))
    monitor = connmon.Monitor(model, every_n_steps=2, diagnostics=("walk",), log=lambda values, step: None,
                              alerts=alerts)  # fmt: skip
    watched = _train(model, monitor)
    monitor.close()
    assert torch.equal(plain[0], watched[0])
    assert all(torch.equal(a, b) for a, b in zip(plain[1], watched[1], strict=True))
    assert "connmon/step_max_logit/L00" in monitor.last_values
    if threshold is not None:
        assert monitor.qk_clip.clipped == 0


def test_monitor_clips_each_step_and_logs_the_window():
    torch.manual_seed(0)
    model = TinyGPT()
    logged = []
    clip = QKClip(threshold=2.0)
    monitor = connmon.Monitor(model, every_n_steps=2, diagnostics=("walk",), log=lambda v, step: logged.append(v),
                              alerts=AlertRunner([], actions=("qk_clip",), qk_clip=clip))  # fmt: skip
    with pytest.warns(UserWarning, match=r"QK-clip at step 0: L0\d head \d"):
        _train(model, monitor, steps=5)
    assert clip.clipped > 0
    before = [block.attn.c_attn.weight.detach().clone() for block in model.blocks]
    monitor.begin_step(5)  # the last step's clip: after its optimizer step, before the next forward
    assert clip.last, "the last step has heads above the threshold"
    for layer, head, logit in clip.last:  # K2's rule: query and key rows of the head times sqrt(tau / S), exactly
        weight, factor, rows = (
            model.blocks[layer].attn.c_attn.weight,
            math.sqrt(2.0 / logit),
            slice(8 * head, 8 * head + 8),
        )
        torch.testing.assert_close(weight[rows], before[layer][rows] * factor, rtol=1e-6, atol=0)
        torch.testing.assert_close(weight[32:64][rows], before[layer][32:64][rows] * factor, rtol=1e-6, atol=0)
        torch.testing.assert_close(weight[64:], before[layer][64:], rtol=0, atol=0)  # values untouched
    assert all(value > 0 for values in logged for key, value in values.items() if "step_max_logit" in key)
    assert not any(key.startswith("connmon/head_max_logit") for values in logged for key in values)
    monitor.close()


@pytest.mark.parametrize("name", ["GPT-2", "LLaMA"])
def test_an_hf_model_held_by_a_lightning_module_trains_bitwise_with_the_reading_and_logs_it(tmp_path, name):
    """ConnectionMonitor reading every step's logits (and clips that never fire) around an HF model that a
    LightningModule holds under its own attribute name: the same weights as the unwatched run, the reading logged."""
    import lightning as L
    from lightning.pytorch.loggers import CSVLogger

    from connmon.callbacks import ConnectionMonitor, DriftAlert

    family = next(f for f in FAMILIES if f.name == name)

    class Wrapped(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.backbone = family.build().train()

        def training_step(self, batch, batch_idx):
            (ids,) = batch
            return self.backbone(input_ids=ids, labels=ids).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    ids = torch.randint(1, 64, (8, 10), generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=4)
    runs, logged = [], []
    for watched in (False, True):
        callbacks = [ConnectionMonitor(every_n_steps=2, diagnostics=("walk",), figures_every_n_samples=None,
                                       logit_every_n_steps=1),
                     DriftAlert(actions=("qk_clip", "transport_clip"), qk_clip=QKClip(1e9),
                                transport_clip=TransportClip(1e9))] if watched else []  # fmt: skip
        module = Wrapped()
        trainer = L.Trainer(max_steps=4, callbacks=callbacks, logger=CSVLogger(tmp_path / str(watched), name="csv"),
                            enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                            accelerator="cpu", devices=1, log_every_n_steps=1)  # fmt: skip
        trainer.fit(module, loader)
        runs.append(module)
        logged = callbacks[0].sampler.last_values if watched else logged
    assert all(torch.equal(a, b) for a, b in zip(runs[0].parameters(), runs[1].parameters(), strict=True))
    assert logged["connmon/step_max_logit/L00"] > 0 and logged["connmon/step_max_logit/L01"] > 0


def test_a_reading_that_raises_warns_once_and_leaves_training_bitwise_unchanged(monkeypatch):
    import connmon.capture.max_logit as max_logit

    def broken(*args, **kwargs):
        raise RuntimeError("out of memory, say")

    torch.manual_seed(0)
    plain = _train(TinyGPT())
    monkeypatch.setattr(max_logit, "head_max_logit", broken)
    torch.manual_seed(0)
    model = TinyGPT()
    monitor = connmon.Monitor(model, every_n_steps=2, diagnostics=("walk",), log=lambda values, step: None,
                              logit_every_n_steps=1)  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        watched = _train(model, monitor)
    said = [str(w.message) for w in caught if "reading its max logit raised RuntimeError" in str(w.message)]
    assert len(said) == 2 and monitor.attention_sampler.logits._unread == {0, 1}  # once per layer, never read again
    assert torch.equal(plain[0], watched[0])
    assert all(torch.equal(a, b) for a, b in zip(plain[1], watched[1], strict=True))
    assert not any(key.startswith("connmon/step_max_logit") for key in monitor.last_values)
    monitor.close()


class _HandWritten(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(8, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).split(8, dim=-1)
        return torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v


def _why_unread(module: torch.nn.Module) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tracker = HeadMaxLogits([module], ["attn"])
        with tracker.watching():
            module(torch.randn(1, 4, 8))
            tracker.read()
    return [str(w.message) for w in caught if "calls no scaled_dot_product" in str(w.message)]


def test_a_new_layer_at_a_freed_layers_address_is_told_why_it_is_unread():
    import gc
    import weakref

    first = _HandWritten()
    address, freed = id(first), weakref.ref(first)
    assert len(_why_unread(first)) == 1 and _why_unread(first) == []  # once per layer
    del first
    gc.collect()
    assert freed() is None
    held = []  # CPython hands out a size class's freed blocks last freed first: take them until the layer's comes
    while len(held) < 100_000 and id(second := _HandWritten.__new__(_HandWritten)) != address:
        held.append(second)
    assert id(second) == address
    second.__init__()
    assert len(_why_unread(second)) == 1
