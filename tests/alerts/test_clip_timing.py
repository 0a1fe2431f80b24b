"""When the clip actions act: right after every optimizer step (the last one of a run too), never on a step the
optimizer skipped or on a non-finite logit, and a resumed run clips as the uninterrupted one."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch

import connmon
from connmon.alerts import AlertRunner, QKClip, TransportClip
from connmon.capture.max_logit import HeadLayout, Projection
from tests.capture.models import TinyGPT


def batch(step: int) -> torch.Tensor:
    return torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(step))


def loss_of(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.roll(-1, 1).flatten())


class Spy:
    """Records the optimizer steps taken and the steps at which the clip action ran."""

    def __init__(self, action):
        self.steps, self.applied, self.taken = [], [], 0
        apply = action.apply

        def spied(*args, **kwargs):
            self.applied.append(self.taken)
            return apply(*args, **kwargs)

        action.apply = spied

    def stepped(self, *args):
        self.taken += 1


def runner(action) -> AlertRunner:
    name = "qk_clip" if isinstance(action, QKClip) else "transport_clip"
    return AlertRunner([], actions=(name,), **{name: action})


def plain_run(model, optimizer, monitor, steps, start=0, scaler=None, inf_at=()):
    for step in range(start, start + steps):
        with monitor.step(step):
            loss = loss_of(model, batch(step))
        if step in inf_at:
            loss = loss * float("inf")
        (scaler.scale(loss) if scaler is not None else loss).backward()
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad()


@pytest.mark.parametrize("make", [lambda: QKClip(threshold=2.0), lambda: TransportClip(factor=1.05)])
def test_every_optimizer_step_is_clipped_right_after_it_the_last_one_too(make):
    torch.manual_seed(0)
    model, action = TinyGPT(), make()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-2)
    spy = Spy(action)
    optimizer.register_step_post_hook(spy.stepped)
    monitor = connmon.Monitor(model, every_n_steps=100, diagnostics=("walk",), optimizer=optimizer,
                              alerts=runner(action))  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain_run(model, optimizer, monitor, steps=4)
    every = getattr(action, "every_n_steps", 1)
    assert spy.applied == [s for s in range(1, 5) if s % every == 0]  # after each step, the monitor's hook after ours
    assert action.clipped > 0 and action.last  # the last step's heads were clipped without another step or close()


def test_a_step_the_grad_scaler_skips_is_not_clipped_and_a_non_finite_logit_never_clips():
    torch.manual_seed(0)
    model, clip = TinyGPT(), QKClip(threshold=2.0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-2)
    spy = Spy(clip)
    optimizer.register_step_post_hook(spy.stepped)
    monitor = connmon.Monitor(model, every_n_steps=100, diagnostics=("walk",), optimizer=optimizer,
                              alerts=runner(clip))  # fmt: skip
    before = copy.deepcopy(model.state_dict())
    scaler = torch.amp.GradScaler("cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain_run(model, optimizer, monitor, steps=1, scaler=scaler, inf_at=(0,))
        assert spy.taken == 0 and spy.applied == [] and clip.clipped == 0  # skipped: nothing moved
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        plain_run(model, optimizer, monitor, steps=1, start=1, scaler=scaler)
    assert spy.applied == [1] and clip.clipped > 0

    attention = torch.nn.Module()
    attention.qkv = torch.nn.Linear(4, 12)
    rows = torch.arange(4).view(2, 2)
    layout = HeadLayout(*(Projection("qkv.weight", "qkv.bias", r) for r in (rows, rows + 4)))
    weight = attention.qkv.weight.detach().clone()
    for logit in (float("inf"), float("nan")):
        assert QKClip(threshold=1e12).apply([attention], torch.tensor([[logit, 5.0]]), [layout]) == []
    assert torch.equal(attention.qkv.weight, weight)


def test_a_non_finite_max_logit_is_said_once_and_left_alone():
    torch.manual_seed(0)
    model, clip = TinyGPT(), QKClip(threshold=1e12)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    monitor = connmon.Monitor(model, every_n_steps=100, diagnostics=("walk",), optimizer=optimizer,
                              alerts=runner(clip))  # fmt: skip
    model.blocks[0].attn.c_attn.weight.data[0, 0] = float("inf")  # head 0's query overflows
    before = model.blocks[0].attn.c_attn.weight.detach().clone()
    with pytest.warns(UserWarning, match=r"step 0: L00 head 0 has a non-finite max logit") as said:
        for step in range(2):
            with monitor.step(step):
                model(batch(step))
            optimizer.step()
    assert sum("non-finite max logit" in str(w.message) for w in said) == 1
    assert (
        torch.equal(
            model.blocks[0].attn.c_attn.weight,
            before,
        )
        and clip.clipped == 0
    )


@pytest.mark.parametrize("make", [lambda: QKClip(threshold=2.0), lambda: TransportClip(factor=1.05)])
@pytest.mark.parametrize("given", [True, False], ids=["optimizer given", "no optimizer"])
def test_a_resumed_plain_loop_clips_as_the_uninterrupted_one_bitwise(make, given):
    """Without ``optimizer=`` the clip of the step before the resume is due at the resumed run's first step start,
    before any forward has found the heads' layouts: the checkpoint carries them."""

    def fresh():
        torch.manual_seed(0)
        model, action = TinyGPT(), make()
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-2)
        monitor = connmon.Monitor(model, every_n_steps=100, diagnostics=("walk",), alerts=runner(action),
                                  optimizer=optimizer if given else None)  # fmt: skip
        return model, optimizer, monitor, action

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, optimizer, monitor, action = fresh()
        plain_run(model, optimizer, monitor, steps=6)
        first, optimizer_a, monitor_a, action_a = fresh()
        plain_run(first, optimizer_a, monitor_a, steps=3)
        saved = copy.deepcopy((first.state_dict(), optimizer_a.state_dict(), monitor_a.state_dict()))
        resumed, optimizer_b, monitor_b, action_b = fresh()
        resumed.load_state_dict(saved[0])
        optimizer_b.load_state_dict(saved[1])
        monitor_b.load_state_dict(saved[2])
        plain_run(resumed, optimizer_b, monitor_b, steps=3, start=3)
        for ending in (monitor, monitor_b):
            ending.close()  # without an optimizer, the last step's clip is at close()
    assert action_b.clipped == action.clipped and action.clipped > action_a.clipped > 0
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), resumed.state_dict().values(),
                                                 strict=True))  # fmt: skip


class AdamLit:
    """A LitGPT trained with AdamW at a rate whose logits pass the threshold (built lazily: Lightning is heavy)."""

    @staticmethod
    def build():
        from tests.callbacks.lightning_models import LitGPT

        class Lit(LitGPT):
            def configure_optimizers(self):
                return torch.optim.AdamW(self.parameters(), lr=3e-2)

        return Lit()


def lightning_fit(tmp_path, clip, max_steps, ckpt_path=None, checkpoint=None):
    import lightning as L

    from connmon.callbacks import ConnectionMonitor, DriftAlert
    from tests.callbacks.lightning_models import corpus

    callbacks = [ConnectionMonitor(every_n_steps=100, diagnostics=("walk",)),
                 DriftAlert(actions=("log", "qk_clip"), qk_clip=clip)]  # fmt: skip
    trainer = L.Trainer(
        max_steps=max_steps, callbacks=callbacks + ([checkpoint] if checkpoint else []), logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=checkpoint is not None,
        accelerator="cpu", devices=1,
    )  # fmt: skip
    module = AdamLit.build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        data = torch.utils.data.DataLoader(corpus(n=12), batch_size=4)  # 3 steps an epoch: the save ends one
        trainer.fit(module, data, ckpt_path=ckpt_path)
    return module


def test_lightning_clips_the_last_step_and_a_resumed_fit_clips_as_the_uninterrupted_one(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    whole = QKClip(threshold=2.0)
    spy = Spy(whole)
    uninterrupted = lightning_fit(tmp_path / "whole", whole, max_steps=6)
    assert len(spy.applied) == 6  # every optimizer step, the last one of the fit included
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
    lightning_fit(tmp_path / "first", QKClip(threshold=2.0), max_steps=3, checkpoint=checkpoint)
    resumed_clip = QKClip(threshold=2.0)
    resumed = lightning_fit(tmp_path / "resumed", resumed_clip, max_steps=6,
                            ckpt_path=str(next((tmp_path / "ckpt").glob("*.ckpt"))))  # fmt: skip
    assert resumed_clip.clipped == whole.clipped > 0
    for a, b in zip(uninterrupted.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_clip_configured_where_it_could_never_act_is_refused_naming_what_is_missing(tmp_path):
    from connmon.callbacks import DriftAlert, SharpnessMonitor

    for name, action in (("qk_clip", QKClip(5.0)), ("transport_clip", TransportClip())):
        with pytest.raises(ValueError, match=rf"{name}=.* is not in actions=\('log', 'wandb', 'stop'\).*add '{name}'"):
            AlertRunner(**{name: action})
        with pytest.raises(ValueError, match=rf"'{name}' is not in actions"):
            DriftAlert(**{name: action})
    with pytest.raises(ValueError, match=r"'qk_clip' action read each head's max logit.*attention=False"):
        connmon.Monitor(attention=False, alerts=AlertRunner([], actions=("log", "qk_clip")))

    import lightning as L

    from tests.callbacks.lightning_models import loader

    callbacks = [SharpnessMonitor(lambda module, b: module(b[0]).mean(), every_n_steps=2, budget=None),
                 DriftAlert(actions=("log", "qk_clip"))]  # fmt: skip
    trainer = L.Trainer(max_steps=2, callbacks=callbacks, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, accelerator="cpu")  # fmt: skip
    with pytest.raises(ValueError, match="no ConnectionMonitor among the Trainer's callbacks"):
        trainer.fit(AdamLit.build(), loader())


def test_what_qk_clip_did_is_logged_per_layer_at_the_next_sample_and_survives_a_checkpoint():
    """Per layer since the last sample: the head clips, the smallest row scale sqrt(tau / S) and the max logit once
    clipped, each recomputed here from the action's own record of every step's clips."""
    torch.manual_seed(0)
    model, action = TinyGPT(), QKClip(threshold=2.0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-2)
    per_step: list[list[tuple]] = []
    apply = action.apply

    def recorded(modules, table, layouts):
        clips = apply(modules, table, layouts)
        per_step.append((table.clone(), list(clips)))
        return clips

    action.apply = recorded
    logged: dict[int, dict] = {}
    monitor = connmon.Monitor(
        model, every_n_steps=3, diagnostics=("walk",), optimizer=optimizer, alerts=runner(action),
        log=lambda values, step: logged.setdefault(step, values),
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain_run(model, optimizer, monitor, steps=4)  # samples at 0 and 3: the window of steps 0, 1, 2 at 3
    window = per_step[:3]
    layers = len(monitor.attention_sampler.selected)
    for layer in range(layers):
        clips = [clip for _, step_clips in window for clip in step_clips if clip[0] == layer]
        values = logged[3]
        assert values[f"connmon/qk_clips/L{layer:02d}"] == len(clips)
        scale = min((2.0 / logit) ** 0.5 for _, _, logit in clips) if clips else 1.0
        assert values[f"connmon/qk_clip_scale/L{layer:02d}"] == pytest.approx(scale, rel=1e-12)
        after = max(min(v, 2.0) for table, _ in window for v in table[layer].tolist())
        assert values[f"connmon/logit_after_qk_clip/L{layer:02d}"] == pytest.approx(after, rel=1e-6)
    assert any(values[f"connmon/qk_clips/L{layer:02d}"] > 0 for layer in range(layers))
    # the window of step 3 is pending at the end: a checkpoint carries it into a fresh monitor
    state = copy.deepcopy(monitor.state_dict())
    resumed = connmon.Monitor(TinyGPT(), every_n_steps=3, diagnostics=("walk",), alerts=runner(QKClip(2.0)))
    resumed.load_state_dict(state)
    assert resumed.signals.clips.window is not None
    assert resumed.signals.clips.window["clips"] == monitor.signals.clips.window["clips"]
    assert torch.equal(torch.as_tensor(resumed.signals.clips.window["after"]), monitor.signals.clips.window["after"])


def test_clips_without_an_optimizer_say_once_that_a_skipped_step_is_clipped_too():
    with pytest.warns(UserWarning, match="cannot tell a step the optimizer skipped") as said:
        connmon.Monitor(TinyGPT(), every_n_steps=100, diagnostics=("walk",), alerts=runner(QKClip(threshold=2.0)))
    assert sum("optimizer skipped" in str(w.message) for w in said) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # given one: nothing said
        model = TinyGPT()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        connmon.Monitor(model, every_n_steps=100, diagnostics=("walk",), alerts=runner(QKClip(threshold=2.0)),
                        optimizer=optimizer)  # fmt: skip


def test_a_forward_gone_non_finite_alerts_at_its_own_step_in_words():
    """The per-step bound of a NaN forward fires 'non-finite attention' for that step when it is read (the next step's
    start), not at the next sample, and asks the loop to stop."""
    from connmon.alerts import AlertRunner, default_rules

    torch.manual_seed(0)
    model = TinyGPT()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    logged = {}
    monitor = connmon.Monitor(model, every_n_steps=100, diagnostics=("walk",), optimizer=optimizer,
                              alerts=AlertRunner(default_rules(), actions=("log", "stop")),
                              log=lambda values, step: logged.setdefault(step, values))  # fmt: skip
    ended = None
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for step in range(8):
            if step == 3:
                with torch.no_grad():
                    model.blocks[1].attn.c_attn.weight[0, 0] = math.nan  # step 3's forward is NaN from layer 1 on
            plain_run(model, optimizer, monitor, steps=1, start=step)
            if monitor.should_stop:
                ended = step
                break
    (alert,) = [a for a in monitor.alerts.alerts if a.rule == "non-finite attention"]
    assert alert.step == 3 and ended == 4  # the step of the forward, read at the next step's start: the loop ends
    assert "not a finite number" in alert.text and "statistic" not in alert.text
    assert math.isnan(logged[3][alert.key]) and alert.key.endswith("/L01")
    assert any("non-finite attention" in str(w.message) for w in said)
