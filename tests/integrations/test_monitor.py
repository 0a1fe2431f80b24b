"""connmon.Monitor in a plain PyTorch loop: exact values, unchanged training, hooks removed, never a crash."""

from __future__ import annotations

import contextlib
import math
import os
import warnings

import pytest
import torch

import connmon
from connmon.alerts import AlertRunner, Growth, RestorePoints, Rule, Threshold
from connmon.metrics import TransportMetrics, WalkMetrics
from tests.capture.models import TinyGPT
from tests.integrations.wandb_read import read_run


def batches(n: int = 6, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 50, (4, 10), generator=generator) for _ in range(n)]


def train(model, data, monitor=None, accumulate: int = 1) -> list[float]:
    """A plain loop: the monitor wraps each forward with the optimizer step it belongs to."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for i, ids in enumerate(data):
        step = i // accumulate
        with monitor.step(step) if monitor is not None else torch.enable_grad():
            loss = torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
        loss.backward()
        losses.append(loss.item())
        if (i + 1) % accumulate == 0:
            optimizer.step()
            optimizer.zero_grad()
    return losses


def no_hooks(model) -> bool:
    return not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_plain_loop_trains_exactly_as_without_it_and_logs_the_metrics_values():
    torch.manual_seed(0)
    plain = TinyGPT()
    watched = TinyGPT()
    watched.load_state_dict(plain.state_dict())
    logged = {}
    monitor = connmon.Monitor(watched, every_n_steps=2, log=lambda values, step: logged.update({step: values}))
    data = batches()
    assert train(watched, data, monitor) == train(plain, data)
    for a, b in zip(plain.parameters(), watched.parameters(), strict=True):
        assert torch.equal(a, b)
    assert sorted(logged) == [0, 2, 4] and monitor.samples == 3 and no_hooks(watched)
    assert "connmon/connection_spectral_radius/L01" in logged[0]  # the first sample is a full one
    assert "connmon/time_drift/L00" in logged[2] and "connmon/time_drift/L00" not in logged[0]


def test_values_equal_the_metrics_on_a_direct_capture_of_the_same_forward():
    torch.manual_seed(1)
    model = TinyGPT().eval()
    ids = batches(1)[0]
    monitor = connmon.Monitor(model, every_n_steps=1, diagnostics=("walk", "transport"), num_sequences=3)
    with monitor.step(0), torch.no_grad():
        model(ids)
    walk = WalkMetrics(2)
    for record in connmon.capture(model, ids, num_sequences=3):
        walk.update(record)
    expected = walk.compute()
    for name in WalkMetrics.metrics:
        for layer in (0, 1):
            key, want = f"connmon/{name}/L{layer:02d}", expected[name][layer].item()
            if not math.isfinite(want):  # not defined here (reversibility on a causal layer): not logged
                assert key not in monitor.last_values
                continue
            assert monitor.last_values[key] == pytest.approx(want, rel=1e-6, abs=1e-9), (name, layer)
    assert {f"connmon/{name}/all" for name in TransportMetrics.metrics} <= set(monitor.last_values)


def test_gradient_accumulation_samples_the_first_micro_batch_once():
    model = TinyGPT()
    logged = []
    monitor = connmon.Monitor(model, every_n_steps=1, diagnostics=("walk",), log=lambda v, step: logged.append(step))
    train(model, batches(6), monitor, accumulate=3)
    assert logged == [0, 1]


def test_an_exception_in_the_block_removes_every_hook_and_logs_nothing():
    model = TinyGPT()
    logged = []
    monitor = connmon.Monitor(model, every_n_steps=1, log=lambda v, step: logged.append(step))
    with pytest.raises(RuntimeError, match="boom"), monitor.step(0):
        assert not no_hooks(model)
        raise RuntimeError("boom")
    assert no_hooks(model) and logged == [] and not monitor.is_armed


def test_a_model_without_attention_warns_once_and_the_loop_goes_on():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.warns(UserWarning, match="connmon.Monitor is off for this run"):
        monitor = connmon.Monitor(model, every_n_steps=1)
    with monitor.step(0) as sampled:
        model(torch.randn(2, 4))
    assert sampled is False and monitor.samples == 0


def test_a_failing_log_function_is_reported_and_training_goes_on():
    model = TinyGPT()

    def log(values, step):
        raise ConnectionError("tracker down")

    monitor = connmon.Monitor(model, every_n_steps=1, diagnostics=("walk",), log=log)
    with pytest.warns(UserWarning, match="raised ConnectionError: tracker down"):
        train(model, batches(2), monitor)
    assert monitor.samples == 2


def test_alerts_run_on_every_sample_and_request_a_stop():
    model = TinyGPT()
    rule = Rule("entropy seen", "connmon/attention_entropy/L00", Threshold(-1.0), level="ERROR")
    logged = {}
    monitor = connmon.Monitor(
        model,
        every_n_steps=1,
        diagnostics=("walk",),
        alerts=AlertRunner([rule], actions=("stop",)),
        log=lambda values, step: logged.update({step: values}),
    )
    train(model, batches(1), monitor)
    assert monitor.should_stop and logged[0]["connmon/alerts/count"] == 1.0


def test_state_dict_resumes_cadence_and_time_drift():
    torch.manual_seed(0)
    model = TinyGPT()
    options = {"every_n_steps": 1, "diagnostics": ("walk", "drift")}
    first = connmon.Monitor(model, **options)
    train(model, batches(1), first)
    resumed = connmon.Monitor(model, **options)
    resumed.load_state_dict(first.state_dict())
    with resumed.step(0):
        model(batches(1)[0])
    assert resumed.samples == 1  # step 0 was sampled before: not again
    with resumed.step(1):
        model(batches(1)[0])
    assert resumed.samples == 2 and math.isfinite(resumed.last_values["connmon/time_drift/L00"])


def test_a_wandb_run_gets_scalars_histograms_and_figures(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    import wandb

    run = wandb.init(project="connmon-test", mode="offline", dir=str(tmp_path))
    model = TinyGPT()
    monitor = connmon.Monitor(model, every_n_steps=2, full_every_n_samples=1, figures_every_n_samples=1, wandb=run)
    train(model, batches(4), monitor)
    files = run.dir
    run.finish()
    rows = [r["history"]["item"] for r in read_run(files) if r.get("type") == "history"]
    scalar_steps = [row["_step"] for row in rows if "connmon/attention_entropy/L01" in row]
    assert scalar_steps == [0, 2]
    keys = set().union(*rows)
    assert {"connmon/head_isometry_gap_hist/L00._type", "connmon/figures/spectra._type"} <= keys


def test_accelerate_prepared_model_and_invalid_options():
    accelerate = pytest.importorskip("accelerate")
    accelerator = accelerate.Accelerator(cpu=True)
    model = accelerator.prepare(TinyGPT())
    monitor = connmon.Monitor(model, every_n_steps=1, diagnostics=("walk",))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train(model, batches(2), monitor)
    assert monitor.samples == 2
    with pytest.raises(ValueError, match="log must be callable"):
        connmon.Monitor(log="wandb")
    with pytest.raises(ValueError, match=r"alerts must be a connmon\.alerts\.AlertRunner"):
        connmon.Monitor(alerts=[rule for rule in ()])


def test_accelerates_prepared_optimizer_is_read_and_hooked_and_training_is_unchanged(tmp_path):
    """``accelerator.prepare(model, AdamW(...))``: the curvature, the back-off and a restore point see the AdamW inside.

    Its ``AcceleratedOptimizer`` wrapper has none of an optimizer's hook state; the constructor raised on it.
    """
    accelerate = pytest.importorskip("accelerate")
    from connmon.alerts import RestorePoints, edge_of_stability_rule
    from connmon.curvature.sampler import SharpnessSampler

    def run(watched: bool, tmp: str) -> tuple[list[float], dict]:
        accelerator = accelerate.Accelerator(cpu=True)
        torch.manual_seed(0)
        model = TinyGPT()
        model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        loss_fn = lambda m, ids: torch.nn.functional.cross_entropy(m(ids).flatten(0, 1), ids.flatten())  # noqa: E731
        logged: dict = {}
        monitor = None
        if watched:
            alerts = AlertRunner(
                [edge_of_stability_rule(bound=1e-9, consecutive=1, since=0)], actions=("log", "backoff", "checkpoint"),
                restore_points=RestorePoints(dirpath=tmp),
            )  # fmt: skip
            monitor = connmon.Monitor(
                model, every_n_steps=1000, diagnostics=("walk",), optimizer=optimizer, loss_fn=loss_fn, alerts=alerts,
                sharpness=SharpnessSampler(every_n_steps=2, cadence="fixed", budget=None),
                log=lambda values, step: logged.update({(step, k): v for k, v in values.items()}),
            )  # fmt: skip
        losses = []
        for step, ids in enumerate(batches(5)):
            with monitor.step(step, batch=ids) if monitor is not None else contextlib.nullcontext():
                loss = loss_fn(model, ids)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        if monitor is not None:
            monitor.close()
        return losses, logged

    plain, _ = run(False, "")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        watched, logged = run(True, str(tmp_path))
    said = " ".join(str(w.message) for w in caught)
    assert "not supported" not in said and "is off" not in said, said
    assert math.isfinite(logged[(2, "connmon/sharpness_ratio")])
    assert logged[(2, "connmon/lr_scale")] == 0.5  # the back-off scaled AdamW's rate inside its step
    assert "saved a restore point after step 3" in said
    assert watched[:3] == plain[:3] and watched[3] != plain[3]  # bitwise until the back-off's step, then backed off


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_a_compiled_model_gives_the_same_loss_and_gradients_to_float32_round_off():
    """Known limit: the capture's hooks break the compiled graph on the armed step, so its backward is fused
    differently and gradients differ in the last bits (about 1e-8 here; AdamW then amplifies such differences on
    near-zero gradients). Eager models are bitwise identical (the tests above); docs/integrations.md says so."""
    torch.manual_seed(0)
    plain, watched = TinyGPT(), TinyGPT()
    watched.load_state_dict(plain.state_dict())
    ids = batches(1)[0]
    monitor = connmon.Monitor(watched, every_n_steps=1, diagnostics=("walk",))
    compiled_plain, compiled_watched = torch.compile(plain), torch.compile(watched)
    loss = torch.nn.functional.cross_entropy(compiled_plain(ids).flatten(0, 1), ids.flatten())
    loss.backward()
    with monitor.step(0):
        watched_loss = torch.nn.functional.cross_entropy(compiled_watched(ids).flatten(0, 1), ids.flatten())
    watched_loss.backward()
    assert torch.equal(loss, watched_loss)
    for a, b in zip(plain.parameters(), watched.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-7)
    assert monitor.samples == 1 and no_hooks(watched)
    assert monitor.last_values["connmon/reconstruction_error/all"] < 1e-5


def test_a_compiled_model_handed_to_the_monitor_trains_bitwise_as_without_it():
    """``Monitor(torch.compile(model))``: no hook enters the compiled graph; each sampled batch is read beside it by
    an eager forward of the original module, so losses and weights equal the compiled loop's without connmon.
    One thread: with several, MKL and OpenMP may split a reduction differently from run to run (on a busy machine
    two compiled runs without connmon then differ too)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        models = [TinyGPT() for _ in range(3)]
        for model in models[1:]:
            model.load_state_dict(models[0].state_dict())
        data = batches(4)
        plain = [train(torch.compile(model), data) for model in models[:2]]
        compiled = torch.compile(models[2])
        monitor = connmon.Monitor(compiled, every_n_steps=2, diagnostics=("walk",))
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            watched = train(compiled, data, monitor)
    finally:
        torch.set_num_threads(threads)
    assert plain[0] == plain[1] and watched == plain[0]
    for a, b, c in zip(*(model.parameters() for model in models), strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert monitor.samples == 2 and no_hooks(models[2]) and no_hooks(compiled)
    assert monitor.last_values["connmon/reconstruction_error/all"] < 1e-5


def test_rules_see_the_loops_own_values():
    model = TinyGPT()
    seen = []
    rule = Rule("loss seen", "loss", Threshold(-1.0), cooldown=1)
    monitor = connmon.Monitor(
        model, every_n_steps=1, diagnostics=("walk",), alerts=AlertRunner([rule], actions=(), on_alert=seen.append)
    )
    with monitor.step(0, rule_values={"loss": 2.5}):
        model(batches(1)[0])
    assert [(a.key, a.value) for a in seen] == [("loss", 2.5)]
    assert "loss" not in monitor.last_values  # shown to the rules, not logged


def test_a_curvature_sample_shows_the_rules_the_trainers_values_too():
    """The trainer's values are a step signal: every sample's rules see them, the curvature's as the attention's."""
    from connmon.curvature.sampler import SharpnessSampler

    model, seen = TinyGPT(), []
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    rule = Rule("loss seen", "loss", Threshold(-1.0), cooldown=1)
    sharpness = SharpnessSampler(every_n_steps=1, estimator="secant", cadence="fixed", budget=None)
    monitor = connmon.Monitor(
        model, attention=False, optimizer=optimizer, sharpness=sharpness,
        alerts=AlertRunner([rule], actions=(), on_alert=seen.append),
    )  # fmt: skip
    for step, batch in enumerate(batches(3)):
        with monitor.step(step, rule_values={"loss": torch.tensor(2.0 + step)}):
            loss = model(batch).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert [(a.step, a.value) for a in seen] == [(step, 2.0 + step) for step in range(3)][-sharpness.samples :]
    assert sharpness.samples >= 1


def test_a_trainers_values_that_raise_are_said_once_and_the_rules_go_on():
    model, seen = TinyGPT(), []
    rule = Rule("gap seen", "connmon/stochasticity_gap/all", Threshold(-1.0), cooldown=1)

    def trainer_values():
        raise KeyError("loss")

    monitor = connmon.Monitor(
        model, every_n_steps=1, diagnostics=("walk",), trainer_values=trainer_values,
        alerts=AlertRunner([rule], actions=(), on_alert=seen.append),
    )  # fmt: skip
    with pytest.warns(UserWarning, match="reading the trainer's latest values for the rules raised KeyError") as said:
        for step, batch in enumerate(batches(2)):
            with monitor.step(step):
                model(batch)
    assert len([w for w in said if "trainer's latest values" in str(w.message)]) == 1 and len(seen) == 2


def test_each_entry_point_builds_its_options_by_keyword_checked_once():
    """Defaults and checks live in SamplingOptions (SharpnessSampler); tests/test_keywords.py holds the types."""
    from connmon.callbacks import ConnectionMonitor, SharpnessMonitor
    from connmon.sampling import SamplingOptions

    assert (
        SharpnessMonitor(lambda module, batch: 0, every_n_steps=3, cadence="fixed", budget=None).sampler.every_n_steps
        == 3
    )
    with pytest.raises(TypeError, match="ConnectionMonitor got an unexpected keyword argument 'every_n_step'; the"):
        ConnectionMonitor(every_n_step=5)
    with pytest.raises(ValueError, match="spectrum_k must be"):
        ConnectionMonitor(spectrum_k=0)  # checked by SamplingOptions, whichever entry point builds it
    callback = ConnectionMonitor(every_n_steps=7, edge_queries=None, layers=[1])
    options = callback.options  # the sampler reads its options there, never from copies of its own
    assert (options.every_n_steps, options.edge_queries, options.layers) == (7, None, (1,))
    assert options.spectrum_k == SamplingOptions().spectrum_k  # the one default
    given = SamplingOptions(every_n_steps=9, diagnostics=("walk",))
    assert ConnectionMonitor(options=given).options is given
    assert connmon.Monitor(options=given, spectrum_k=4).options.every_n_steps == 9  # keywords replace its values
    with pytest.raises(AttributeError):  # an option is read from .options, in one place
        connmon.Monitor(every_n_steps=7).every_n_steps  # noqa: B018
    with pytest.raises(AttributeError):
        callback.every_n_steps  # noqa: B018


def test_every_sample_logs_what_the_monitor_costs_and_close_says_it():
    torch.manual_seed(0)
    model = TinyGPT()
    logged = []
    monitor = connmon.Monitor(model, every_n_steps=2, diagnostics=("walk",), log=lambda v, step: logged.append(v))
    train(model, batches(6), monitor)
    assert len(logged) == 3 and not any("overhead" in key for key in logged[0])  # step 0: no training time yet
    logged = logged[1:]
    fractions = [values["connmon/overhead/attention"] for values in logged]
    assert all(0 < f < 10 for f in fractions) and all(values["connmon/overhead"] >= f for values, f in
                                                      zip(logged, fractions, strict=True))  # fmt: skip
    assert monitor.clock.sections > 0 and monitor.clock.spent > 0
    monitor.close()
    assert "connmon.Monitor cost" in monitor.cost_summary() and "% of training time" in monitor.cost_summary()


def test_a_budget_sets_the_full_sample_cadence_from_measured_costs_and_is_saved():
    torch.manual_seed(0)
    model = TinyGPT()
    monitor = connmon.Monitor(model, every_n_steps=1, full_every_n_samples=1, budget=0.02)
    with pytest.warns(UserWarning, match=r"connmon.Monitor: budget 2%: a full sample costs .* a light one .* so "):
        train(model, batches(8), monitor)
    chosen = monitor.attention_sampler.full_every_n_samples
    assert chosen > 1  # full samples (the spectrum group) cost more than 2% of these tiny steps
    assert monitor.state_dict()["full_every_n_samples"] == chosen
    fresh = connmon.Monitor(TinyGPT(), every_n_steps=1, budget=0.02)
    fresh.load_state_dict(monitor.state_dict())
    assert fresh.attention_sampler.full_every_n_samples == chosen
    with pytest.raises(ValueError, match=r"budget must be None or a fraction of training time in \(0, 1\)"):
        connmon.Monitor(budget=0.0)


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_a_monitor_given_the_compiled_model_reads_its_layers():
    """connmon.Monitor(torch.compile(model)): layers found and armed on the original module, none under _orig_mod."""
    torch.manual_seed(0)
    model = TinyGPT()
    compiled = torch.compile(model)
    monitor = connmon.Monitor(compiled, every_n_steps=1, diagnostics=("walk",))
    assert [layer.name for layer in monitor.attention_sampler.selected] == ["blocks.0.attn", "blocks.1.attn"]
    for step in range(2):
        with monitor.step(step):
            compiled(batches(1)[0]).sum().backward()
    assert monitor.samples == 2 and no_hooks(model)
    assert monitor.last_values["connmon/reconstruction_error/all"] < 1e-5


def test_a_sample_under_inference_mode_leaves_the_next_training_sample_intact():
    """An inference-mode probe between training samples: the accumulators stay normal tensors, nothing is lost."""
    torch.manual_seed(0)
    model = TinyGPT()
    monitor = connmon.Monitor(model, every_n_steps=1, diagnostics=("walk", "drift"))
    ids = batches(1)[0]
    for step in range(4):
        if step % 2:
            with torch.inference_mode(), monitor.step(step):
                model(ids)
        else:
            with monitor.step(step):
                model(ids).sum().backward()
        assert math.isfinite(monitor.last_values["connmon/attention_entropy/L01"]), step
    assert monitor.samples == 4 and math.isfinite(monitor.last_values["connmon/time_drift/L01"])


def test_a_forward_that_raised_leaves_nothing_of_its_partial_sample():
    """Layer 1 raises after layer 0 was recorded: the retried step logs the retry alone, drift from before."""
    torch.manual_seed(0)
    model, reference = TinyGPT(), TinyGPT()
    reference.load_state_dict(model.state_dict())
    first, retry = torch.randint(0, 50, (2, 8)), batches(1)[0]
    options = dict(every_n_steps=1, diagnostics=("walk", "drift"))
    monitor, expected = connmon.Monitor(model, **options), connmon.Monitor(reference, **options)
    for m, net in ((monitor, model), (expected, reference)):
        with m.step(0):
            net(retry)
    handle = model.blocks[1].register_forward_pre_hook(lambda *_: (_ for _ in ()).throw(RuntimeError("oom")))
    with pytest.raises(RuntimeError, match="oom"), monitor.step(1):
        model(first)  # layer 0 recorded, then layer 1 raises
    handle.remove()
    with monitor.step(1):
        model(retry)
    with expected.step(1):
        reference(retry)

    def measured(values):
        return {k: v for k, v in values.items() if "overhead" not in k}

    assert measured(monitor.last_values) == measured(expected.last_values)


def test_a_forward_that_raised_inside_an_attention_layer_warns_nothing_false():
    """The raise comes between layer 1's kernel and its output projection: no 'not recorded' reason is invented for
    a layer the raise cut short (it would also silence the real warning later, since each cause warns once)."""
    torch.manual_seed(0)
    model = TinyGPT()
    monitor = connmon.Monitor(model, every_n_steps=1, diagnostics=("walk",))
    handle = model.blocks[1].attn.c_proj.register_forward_pre_hook(
        lambda *_: (_ for _ in ()).throw(RuntimeError("oom"))
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(RuntimeError, match="oom"), monitor.step(0):
            model(batches(1)[0])
        handle.remove()
        with monitor.step(1):
            model(batches(1)[0])
    assert monitor.samples == 1 and monitor.last_values["connmon/reconstruction_error/L01"] < 1e-5


def test_an_error_in_a_metrics_update_is_warned_not_swallowed():
    """A drift reference of the wrong shape (a hand-edited checkpoint) is named once; the other keys still come."""
    torch.manual_seed(0)
    model = TinyGPT()
    monitor = connmon.Monitor(model, every_n_steps=1, diagnostics=("walk", "drift"))
    monitor.attention_sampler.metrics["drift"].previous_transports = {0: torch.zeros(3, 3)}
    with pytest.warns(UserWarning, match="transport_drift reference of layer 0"):
        with monitor.step(0):
            model(batches(1)[0])
    assert math.isfinite(monitor.last_values["connmon/attention_entropy/L00"])

    def broken(record):
        raise RuntimeError("metric state on another device")

    monitor.attention_sampler.metrics["walk"].measure = broken
    with pytest.warns(UserWarning, match="recording failed .*another device"):
        with monitor.step(1):
            model(batches(1)[0])


def test_a_nan_query_weight_is_logged_as_nan_with_a_warning():
    """A NaN in the last layer's query weight: that layer's attention is NaN (whatever SDPA's kernel makes of NaN
    score rows, which differs by kernel and sequence length), the layer before it is untouched."""
    torch.manual_seed(0)
    model = TinyGPT()
    with torch.no_grad():
        model.blocks[1].attn.c_attn.weight[0, 0] = float("nan")
    monitor = connmon.Monitor(model, every_n_steps=1, diagnostics=("walk",))
    with pytest.warns(UserWarning, match="non-finite attention, input or output in blocks.1.attn;"):
        with monitor.step(0):
            model(batches(1)[0])
    values = monitor.last_values
    assert math.isnan(values["connmon/attention_entropy/L01"]) and math.isnan(values["connmon/attention_entropy/all"])
    assert math.isfinite(values["connmon/attention_entropy/L00"])


def test_a_probe_restores_every_modules_own_mode_and_leaves_training_unchanged():
    torch.manual_seed(0)
    model, plain = TinyGPT(), TinyGPT()
    plain.load_state_dict(model.state_dict())
    for net in (model, plain):
        net.train()
        net.blocks[0].eval()  # a submodule the user keeps in eval mode
    probe = batches(1)[0][:1]
    monitor = connmon.Monitor(model, every_n_steps=2, diagnostics=("walk",), probe=probe)
    for step, ids in enumerate(batches(4)):
        for net, watched in ((plain, False), (model, True)):
            with monitor.step(step) if watched else contextlib.nullcontext():
                net(ids).square().mean().backward()
    assert monitor.samples == 2 and monitor.last_values["connmon/reconstruction_error/all"] < 1e-5
    assert not model.blocks[0].training and model.blocks[1].training and model.training
    for a, b in zip(plain.parameters(), model.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)


def test_a_probe_that_raises_is_reported_and_training_goes_on():
    model = TinyGPT()
    monitor = connmon.Monitor(model, every_n_steps=1, diagnostics=("walk",), probe="not a batch")
    with pytest.warns(UserWarning, match="probe forward raised"):
        with monitor.step(0):
            model(batches(1)[0]).sum().backward()
    assert monitor.samples == 0 and no_hooks(model) and model.training


@pytest.mark.parametrize(
    "make",
    [
        lambda: connmon.Monitor("str"),
        lambda: connmon.capture(TinyGPT(), batches(1)[0], max_tokens=2.5),
        lambda: connmon.capture(TinyGPT(), batches(1)[0], num_sequences="2"),
        lambda: connmon.capture("model", batches(1)[0]),
        lambda: __import__("connmon.callbacks").callbacks.DriftAlert(rules="x"),
        lambda: __import__("connmon.callbacks").callbacks.DriftAlert(wait_duration=-1),
        lambda: __import__("connmon.alerts").alerts.EWMAZScore(-3),
    ],
)
def test_bad_options_are_named(make):
    with pytest.raises(ValueError, match="must be"):
        make()


@pytest.mark.parametrize("step", [None, "4", -1, 2.0, True])
def test_a_bad_step_is_named(step):
    monitor = connmon.Monitor(TinyGPT(), every_n_steps=1)
    with pytest.raises(ValueError, match="step must be"), monitor.step(step):
        pass


def test_a_meta_device_model_turns_the_monitor_off_with_a_warning():
    with torch.device("meta"):
        model = TinyGPT()
    with pytest.warns(UserWarning, match="meta device"):
        monitor = connmon.Monitor(model, every_n_steps=1)
    assert monitor.attention_sampler.selected == []
    with pytest.raises(ValueError, match="meta device"):
        connmon.capture(model, batches(1)[0])


@pytest.mark.parametrize(
    "edit, named",
    [
        ({"samples": None}, "samples=None"),
        ({"samples": "3"}, "samples='3'"),
        ({"drift": "garbage"}, "malformed"),
        ({"config": {"num_sequences": 1, "max_tokens": 256}}, "num_sequences 1 -> 2"),
    ],
)
def test_a_hand_edited_or_foreign_checkpoint_is_checked_and_said(edit, named):
    torch.manual_seed(0)
    model = TinyGPT()
    options = dict(every_n_steps=1, diagnostics=("walk", "drift"))
    first = connmon.Monitor(model, **options)
    with first.step(0):
        model(batches(1)[0])
    state = first.state_dict() | edit
    resumed = connmon.Monitor(model, **options)
    with pytest.warns(UserWarning, match=f"not restored from the checkpoint: .*{named}"):
        resumed.load_state_dict(state)
    with resumed.step(1):
        model(batches(1)[0])  # the run goes on
    assert math.isfinite(resumed.last_values["connmon/attention_entropy/L00"])


def test_another_threads_forward_is_ignored_and_this_ones_recorded():
    import threading

    torch.manual_seed(0)
    model, other = TinyGPT(), TinyGPT()
    ids = batches(1)[0]
    started, release = threading.Event(), threading.Event()

    def run_other():
        started.set()
        release.wait(10)
        with torch.no_grad():
            other(ids)

    thread = threading.Thread(target=run_other)
    thread.start()
    started.wait(10)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning about the other thread's calls
        with connmon.capture.armed(model) as session:
            release.set()
            thread.join(10)
            with torch.no_grad():
                model(ids)
    assert [r.name for r in session.records] == ["blocks.0.attn", "blocks.1.attn"]


def test_a_thread_inside_an_armed_layer_when_another_ends_the_step_keeps_no_connmon_mode():
    """Thread B is inside an armed attention module when thread A's ``monitor.step`` ends (its hooks go): B must
    leave with no torch-function mode of connmon's on its stack, so its later encoder forwards keep torch's fused
    path and compute what an unwatched thread computes."""
    import threading

    from tests.capture.models import CausalSelfAttention

    inside, proceed = threading.Event(), threading.Event()

    class Waiting(CausalSelfAttention):
        def forward(self, x):
            y = super().forward(x)
            if threading.current_thread().name == "B":
                inside.set()
                proceed.wait(10)
            return y

    torch.manual_seed(0)
    model = TinyGPT()
    for block in model.blocks:
        waiting = Waiting()
        waiting.load_state_dict(block.attn.state_dict())
        block.attn = waiting
    layer = torch.nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, batch_first=True, dropout=0.0)
    encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    src = torch.randn(2, 7, 16)
    padding = torch.zeros(2, 7, dtype=torch.bool)
    padding[1, 5:] = True
    with torch.no_grad():
        plain = encoder(src, src_key_padding_mask=padding)
    seen = {}

    def run_b():
        with torch.no_grad():
            model(batches(1)[0])
            seen["modes"] = torch._C._len_torch_function_stack()
            seen["encoder"] = encoder(src, src_key_padding_mask=padding)

    monitor = connmon.Monitor(model, every_n_steps=1, diagnostics=("walk",))
    thread = threading.Thread(target=run_b, name="B")
    with monitor.step(0):
        model(batches(1)[0])
        thread.start()
        assert inside.wait(10)
    proceed.set()  # A's step is over and its hooks are gone; B leaves the armed module now
    thread.join(10)
    assert not thread.is_alive()
    assert seen["modes"] == 0
    assert torch.equal(seen["encoder"], plain)
    assert monitor.samples == 1 and math.isfinite(monitor.last_values["connmon/attention_entropy/L01"])


def test_captured_models_are_not_kept_alive_by_the_adapter():
    import gc
    import weakref

    from connmon.capture import ADAPTERS, KernelAttention

    model = TinyGPT()
    connmon.capture(model, batches(1)[0])
    ref = weakref.ref(model.blocks[0].attn)
    del model
    gc.collect()
    assert ref() is None
    assert all(len(a._resolved) == 0 for a in ADAPTERS if isinstance(a, KernelAttention))


def test_alert_rules_that_watch_the_first_steps_get_their_samples_at_any_cadence():
    model = TinyGPT()
    early = [Rule("logits tripled early", "connmon/max_attention_logit/L*", Growth(3.0), until=50)]
    with_rules = connmon.Monitor(model, every_n_steps=100, alerts=AlertRunner(early, actions=()))
    alone = connmon.Monitor(model, every_n_steps=100, alerts=AlertRunner(actions=()))  # the defaults watch no start
    dense = connmon.Monitor(model, every_n_steps=25, alerts=AlertRunner(early, actions=()))
    assert [s for s in range(201) if with_rules.due(s)] == [0, 25, 50, 100, 200]
    assert [s for s in range(201) if alone.due(s)] == [0, 100, 200]
    assert [s for s in range(101) if dense.due(s)] == [0, 25, 50, 75, 100]


def test_the_backoff_action_halves_the_plain_loops_rate_from_its_alert_on():
    from connmon.alerts import LearningRateBackoff

    edge = Rule("past the edge of stability", "connmon/max_attention_logit/L*", Threshold(-1.0), cooldown=0)
    torch.manual_seed(0)
    model = TinyGPT()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    runner = AlertRunner([edge], actions=("backoff",), backoff=LearningRateBackoff(factor=0.5, cooldown=100))
    logged = {}

    def log(values, step):
        logged[step] = values.get("connmon/lr_scale")

    monitor = connmon.Monitor(
        model, every_n_steps=2, diagnostics=("walk",), alerts=runner, optimizer=optimizer, log=log
    )
    for step, ids in enumerate(batches(3)):
        with monitor.step(step):
            loss = torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert logged == {0: 0.5, 2: 0.5}  # the alert at step 0's sample backs off before step 0's optimizer step
    torch.manual_seed(0)
    reference = TinyGPT()  # the same run at half the rate throughout
    halved = torch.optim.SGD(reference.parameters(), lr=5e-3)
    for ids in batches(3):
        torch.nn.functional.cross_entropy(reference(ids).flatten(0, 1), ids.flatten()).backward()
        halved.step()
        halved.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters(), strict=True))
    assert optimizer.param_groups[0]["lr"] == 1e-2
    monitor.close()
    assert not optimizer._optimizer_step_pre_hooks
    with pytest.warns(UserWarning, match="'backoff' action scales the optimizer's learning rate, and no optimizer"):
        connmon.Monitor(TinyGPT(), every_n_steps=2, alerts=AlertRunner([edge], actions=("backoff",)))


def test_the_checkpoint_action_saves_a_restore_point_that_resumes_bitwise_and_keeps_the_last(tmp_path):
    from connmon.alerts import RestorePoints

    def run(monitor, model, optimizer, steps):
        for step in steps:
            with monitor.step(step) if monitor is not None else torch.enable_grad():
                loss = torch.nn.functional.cross_entropy(model(data[step]).flatten(0, 1), data[step].flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()

    data = batches(8)
    rule = Rule("any logit", "connmon/max_attention_logit/L*", Threshold(-1.0), cooldown=2, since=3)  # 4 and 6
    points = RestorePoints(keep=1, dirpath=tmp_path / "points")
    runner = AlertRunner([rule], actions=("checkpoint",), restore_points=points)
    torch.manual_seed(0)
    model = TinyGPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    monitor = connmon.Monitor(model, every_n_steps=2, diagnostics=("walk",), alerts=runner, optimizer=optimizer)
    with pytest.warns(UserWarning, match=r"saved a restore point after step 5 \(alert at step 4\): .*step=5\.ckpt"):
        run(monitor, model, optimizer, range(6))
    first = torch.load(tmp_path / "points" / "step=5.ckpt", weights_only=True)
    with pytest.warns(UserWarning, match=r"after step 7 \(alert at step 6\)"):
        run(monitor, model, optimizer, range(6, 8))
    assert sorted(p.name for p in (tmp_path / "points").iterdir()) == ["step=7.ckpt"]  # keep=1: step 5's removed
    assert points.paths == [str(tmp_path / "points" / "step=7.ckpt")] and runner.state_dict()["restore_points"]
    torch.manual_seed(1)
    again = TinyGPT()  # other weights, replaced by the restore point's
    again.load_state_dict(first["model"])
    resumed = torch.optim.AdamW(again.parameters(), lr=1e-2)
    resumed.load_state_dict(first["optimizer"])
    assert first["step"] == 5 and first["connmon"]["samples"] == 3
    run(None, again, resumed, range(5, 8))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters(), strict=True))

    calls = []
    hooked = RestorePoints(save=lambda path, step: calls.append((path, step)))
    monitor = connmon.Monitor(TinyGPT(), every_n_steps=2, diagnostics=("walk",), optimizer=optimizer,
                              alerts=AlertRunner([rule], actions=("checkpoint",), restore_points=hooked))  # fmt: skip
    with pytest.warns(UserWarning, match="saved a restore point"):
        run(monitor, monitor._model, torch.optim.SGD(monitor._model.parameters(), lr=0.0), range(6))
    assert calls == [(os.path.join("connmon_restore_points", "step=5.ckpt"), 5)]  # the hook wrote it, not connmon
    assert not os.path.exists("connmon_restore_points")


def test_a_second_run_in_the_same_folder_never_writes_over_or_removes_the_firsts_restore_points(tmp_path, monkeypatch):
    """Two runs from one working directory with the default place: the second's get their own names, said once."""
    from connmon.alerts import RestorePoints

    monkeypatch.chdir(tmp_path)
    rule = Rule("any logit", "connmon/max_attention_logit/L*", Threshold(-1.0), cooldown=2, since=3)  # 4 and 6
    folder = tmp_path / "connmon_restore_points"
    runs = []
    for seed, keep in ((0, 2), (1, 1)):
        torch.manual_seed(seed)
        model = TinyGPT()
        points = RestorePoints(keep=keep)
        alerts = AlertRunner([rule], actions=("checkpoint",), restore_points=points)
        monitor = connmon.Monitor(model, every_n_steps=2, diagnostics=("walk",), alerts=alerts)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            train(model, batches(8), monitor)
        runs.append(
            (points.paths, [str(w.message) for w in caught], {p.name: p.read_bytes() for p in folder.iterdir()})
        )
    (first, _, files_after_first), (second, said, files_after_second) = runs
    assert [os.path.basename(p) for p in first] == ["step=5.ckpt", "step=7.ckpt"]
    assert [os.path.basename(p) for p in second] == ["step=7-v1.ckpt"]  # keep=1: its own step=5-v1 rotated away
    assert sum("this run did not write" in line for line in said) == 1
    assert {name: files_after_second[name] for name in files_after_first} == files_after_first  # run 1's untouched
    assert sorted(files_after_second) == ["step=5.ckpt", "step=7-v1.ckpt", "step=7.ckpt"]


def test_attention_dropout_is_said_once_for_the_model_at_the_users_line_naming_the_entry_point():
    import connmon.capture.session as session

    session._WARNED.discard("dropout")
    layer = torch.nn.TransformerEncoderLayer(16, 2, dropout=0.1, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, 3, enable_nested_tensor=False)
    monitor = connmon.Monitor(model, every_n_steps=1, diagnostics=("walk",), owner="MyLoop")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for step in range(2):
            with monitor.step(step):
                model(torch.randn(2, 5, 16)).sum().backward()
    said = [w for w in seen if "dropout" in str(w.message)]
    assert len(said) == 1  # one for the model, not one per layer or per sample
    assert "MyLoop(probe=batch" in str(said[0].message) and "reconstruction_error is not logged" in str(said[0].message)
    assert said[0].filename == __file__  # the user's line, not connmon's
    assert monitor.samples == 2 and "connmon/attention_entropy/L02" in monitor.last_values


def test_a_long_sample_is_said_once_with_what_it_was_doing(monkeypatch):
    import connmon.attention_sampler

    monkeypatch.setattr(connmon.attention_sampler, "LONG_SAMPLE_S", 0.0)  # every sample is "long" here
    torch.manual_seed(0)
    model = TinyGPT()
    monitor = connmon.Monitor(model, every_n_steps=1, full_every_n_samples=3, owner="MyLoop")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        train(model, batches(3), monitor)
    said = [str(w.message) for w in seen if "took" in str(w.message)]
    assert len(said) == 1 and said[0].startswith("MyLoop: the sample at step 0 took ")
    assert "a full sample: the connection spectra and the edge isometry gaps of 2 layers" in said[0]
    assert "which the next 2 samples skip" in said[0]


@pytest.mark.parametrize(
    "options, what",
    [
        ({"diagnostics": ("walk",)}, "(a sample of walk on 2 layers); a smaller num_sequences"),
        ({"full_every_n_samples": 1}, "edge isometry gaps of 2 layers, which every sample computes)"),
    ],
)
def test_a_long_sample_says_what_it_computed_and_nothing_it_did_not(monkeypatch, options, what):
    import connmon.attention_sampler

    monkeypatch.setattr(connmon.attention_sampler, "LONG_SAMPLE_S", 0.0)
    torch.manual_seed(0)
    model = TinyGPT()
    monitor = connmon.Monitor(model, every_n_steps=1, **options)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        train(model, batches(2), monitor)
    said = [str(w.message) for w in seen if "took" in str(w.message)]
    assert len(said) == 1 and what in said[0] and "next 0 samples" not in said[0]


def test_a_read_step_leaves_the_encoders_fused_eval_path_alone(monkeypatch):
    """nn.TransformerEncoder in eval under no_grad, padded: its fused kernel runs as often watched as unwatched."""
    from tests.capture.test_torch_mha import padded_encoder

    model, x, padding = padded_encoder()
    fused, calls = torch._transformer_encoder_layer_fwd, []

    def counted(*args, **kwargs):
        calls.append(1)
        return fused(*args, **kwargs)

    monkeypatch.setattr(torch, "_transformer_encoder_layer_fwd", counted)
    monitor = connmon.Monitor(model, every_n_steps=1, logit_every_n_steps=1, diagnostics=("walk",))
    with torch.no_grad():
        plain = model(x, src_key_padding_mask=padding)
        unwatched = len(calls)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the capture says it skips the fused path
            with monitor.step(0):
                watched = model(x, src_key_padding_mask=padding)
    assert unwatched == 2 and len(calls) == 2 * unwatched
    assert torch.equal(plain, watched) and no_hooks(model)
    assert all("forward" not in vars(m) for m in model.modules())


class Interrupted(torch.nn.Module):
    """Raises KeyboardInterrupt from inside the attention forward of layer 0 (after its SDPA call) when armed."""

    def __init__(self, model):
        super().__init__()
        self.model, self.armed = model, False
        self.handle = model.blocks[0].attn.c_proj.register_forward_hook(self.interrupt)

    def interrupt(self, *args):
        if self.armed:
            self.armed = False
            raise KeyboardInterrupt

    def forward(self, ids):
        return self.model(ids)


def test_a_keyboard_interrupt_inside_a_sampled_forward_leaves_no_mode_hook_or_flag():
    """Nothing of connmon's outlives the interrupted step: no torch-function mode, hook, pause or busy flag; a
    frozen teacher's forwards afterwards are not the student's, and the next step reads the student alone."""
    from connmon._pause import is_paused
    from connmon.capture.max_logit import head_max_logit
    from connmon.capture.session import busy

    torch.manual_seed(0)
    student, teacher = Interrupted(TinyGPT()), TinyGPT()
    for block in teacher.blocks:
        block.attn.c_attn.weight.data[:32] *= 30  # a teacher with far larger logits
    monitor = connmon.Monitor(student.model, every_n_steps=1, logit_every_n_steps=1, diagnostics=("walk",))
    data = batches(3)
    student.armed = True
    with pytest.raises(KeyboardInterrupt), monitor.step(0):
        student(data[0])
    student.handle.remove()  # the user's own hook
    assert torch._C._len_torch_function_stack() == 0 and not is_paused() and not busy()
    assert no_hooks(student) and not monitor.is_armed
    assert all("forward" not in vars(m) for m in student.modules())
    teacher(data[1]).sum().backward()  # a frozen teacher run outside the monitor's steps
    with monitor.step(1):
        student(data[1]).sum().backward()
    with monitor.step(2):
        student(data[2])
    seen = []
    attn = student.model.blocks[0].attn
    hook = attn.c_attn.register_forward_hook(lambda m, a, out: seen.append(out.detach()))
    student(data[1])
    hook.remove()
    q, k, _ = seen[0].split(32, dim=2)
    q, k = (t.view(4, 10, 4, 8).transpose(1, 2) for t in (q, k))
    truth = head_max_logit(q, k, is_causal=True).max().item()
    assert monitor.last_values["connmon/step_max_logit/L00"] == pytest.approx(truth, rel=1e-6)


def test_the_event_protocol_alone_samples_as_step_does_and_its_outcome_carries_stop_and_restore_point():
    """What every entry point calls: step_start, forward_end, step_end (a StepOutcome), as ``monitor.step`` does."""
    torch.manual_seed(0)
    models = [TinyGPT(), TinyGPT()]
    models[1].load_state_dict(models[0].state_dict())
    data = batches(3)
    logged: list[dict] = [{}, {}]
    saved = []
    rule = Rule("any entropy", "connmon/attention_entropy/all", Threshold(-1.0), level="ERROR", cooldown=1)

    def monitor(i):
        points = RestorePoints(save=lambda path, step: saved.append(step))
        alerts = AlertRunner([rule], actions=("stop", "checkpoint"), restore_points=points)
        log = lambda values, step: logged[i].update({step: values})  # noqa: E731
        return connmon.Monitor(models[i], every_n_steps=2, diagnostics=("walk",), log=log, alerts=alerts)

    by_step, by_events = monitor(0), monitor(1)
    train(models[0], data, by_step)
    outcomes = []
    optimizer = torch.optim.AdamW(models[1].parameters(), lr=1e-2)
    for step, ids in enumerate(data):
        sampled = by_events.step_start(step, models[1])
        loss = torch.nn.functional.cross_entropy(models[1](ids).flatten(0, 1), ids.flatten())
        by_events.forward_end()
        outcomes.append((sampled, by_events.step_end(step)))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert [sampled for sampled, _ in outcomes] == [True, False, True]
    first, _, last = (outcome for _, outcome in outcomes)
    assert first.values == logged[1][0] and last.values == logged[1][2] and outcomes[1][1].values == {}
    drop = lambda values: {k: v for k, v in values.items() if "overhead" not in k}  # noqa: E731  (wall clock)
    assert [drop(logged[1][s]) for s in (0, 2)] == [drop(logged[0][s]) for s in (0, 2)]
    assert first.stop == 0 and first.restore_point == 0  # the alert at step 0 asks both
    assert by_events.should_stop and no_hooks(models[1])
    assert saved == [1]  # monitor.step saves at the next step's start (the alert at 2 has none); the events leave it
    assert by_events.outcome().restore_point == 0  # due, for the entry point to save its way


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_a_raised_forward_discards_its_sample_through_the_protocol():
    model = TinyGPT()
    monitor = connmon.Monitor(model, every_n_steps=1, diagnostics=("walk",))
    assert monitor.step_start(0, model)
    model(batches(1)[0])
    monitor.forward_end(raised=True)
    assert monitor.step_end(0).values == {} and monitor.samples == 0 and no_hooks(model)


def test_events_out_of_order_raise_naming_the_missing_event_with_every_hook_removed():
    """A forward never ended, or a step never ended, is a clear error; nothing of the two steps is mixed."""
    torch.manual_seed(0)
    model = TinyGPT()
    logged: dict[int, dict] = {}
    monitor = connmon.Monitor(model, every_n_steps=1, diagnostics=("walk",), logit_every_n_steps=1,
                              log=lambda values, step: logged.update({step: values}))  # fmt: skip
    data = batches(3)
    monitor.step_start(0, model)
    model(data[0])
    with pytest.raises(RuntimeError, match=r"step_end\(0\) came before forward_end\(\)"):
        monitor.step_end(0)
    assert no_hooks(model) and not monitor.is_armed and torch._C._len_torch_function_stack() == 0
    assert logged == {} and monitor.samples == 0

    monitor.step_start(1, model)
    model(data[1])
    monitor.forward_end()  # and no step_end(1)
    with pytest.raises(RuntimeError, match=r"step_start\(2\) came before step_end\(1\)"):
        monitor.step_start(2, model)
    assert no_hooks(model) and not monitor.is_armed and logged == {}

    monitor.step_start(2, model)  # the protocol kept: step 2's sample is of its own forward alone
    model(data[2])
    monitor.forward_end()
    values = monitor.step_end(2).values
    reference = connmon.Monitor(model, every_n_steps=1, diagnostics=("walk",))
    with reference.step(0):
        model(data[2])
    entropy = "connmon/attention_entropy/all"
    assert values[entropy] == pytest.approx(reference.last_values[entropy], rel=1e-6) and list(logged) == [2]


def test_step_called_without_with_says_once_that_it_did_nothing():
    model = TinyGPT()
    monitor = connmon.Monitor(model, every_n_steps=1, diagnostics=("walk",))
    with pytest.warns(UserWarning, match=r"monitor.step\(0\) was called without `with`, so it did nothing") as said:
        monitor.step(0)
        model(batches(1)[0])
        monitor.step(1)
    assert len([w for w in said if "without `with`" in str(w.message)]) == 1 and monitor.samples == 0
    with pytest.raises(ValueError, match="an integer >= 0"):
        monitor.step(-1)
    with monitor.step(2):  # used as documented: no warning, a sample
        model(batches(1)[0])
    assert monitor.samples == 1 and no_hooks(model)
