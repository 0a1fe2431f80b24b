"""The curvature along the optimizer's update (UpdateProbe) against its definition.

``R = u^T (H + wd) u / u^T U^-1 u`` with ``u`` the update the optimizer took, ``H`` a dense float64 Hessian and ``U``
written out by hand per optimizer (tests/test_curvature.py); exact on a quadratic; never above the top eigenvalue
that sharpness_ratio estimates, and equal to it when the update lies along the top direction.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from connmon.curvature import UpdateProbe, sharpness_ratio
from tests.test_curvature import CASES, adam_step, batch, dense_hessian, loss_of, reference, sgd_step, tiny_gpt, trained


def probed_step(model, optimizer, data):
    """One training step on ``data`` with a probe around it; returns the probe and the update it saw (float64)."""
    optimizer.zero_grad()
    loss_of(model, data).backward()
    probe = UpdateProbe(optimizer)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer.step()
    probe.stepped()
    return probe, torch.cat([(p.detach() - b).reshape(-1) for p, b in zip(model.parameters(), before, strict=True)])


def directional(model, optimizer, data, u, step_size, constant, decay):
    """``u^T (H + wd) u / u^T U^-1 u / c`` from the dense Hessian at the parameters now."""
    params = list(model.parameters())
    sizes = torch.cat([step_size(group, p).reshape(-1) for group in optimizer.param_groups for p in group["params"]])
    hessian = dense_hessian(model, params, data)
    return ((u @ hessian @ u + decay * u @ u) / (u @ (u / sizes))).item() / constant


@pytest.mark.parametrize("case", list(CASES))
def test_difference_reading_equals_the_dense_float64_rayleigh_quotient_along_the_update(case):
    make, kind, constant, decay = CASES[case]
    model = tiny_gpt()
    for group in (optimizer := make(model.parameters())).param_groups:
        group["lr"] *= 1e-3  # a small step: the second difference's fourth-order term is negligible
    trained(model, optimizer)
    probe, u = probed_step(model, optimizer, batch(3))
    data = batch(7)
    step_size = adam_step(optimizer) if kind == "adam" else sgd_step
    expected = directional(model, optimizer, data, u, step_size, constant, decay)
    result = probe.difference(lambda: loss_of(model, data), model=model)
    lanczos = reference(model, optimizer, data, step_size, constant, decay)  # lambda_max(U^1/2 (H + wd) U^1/2) / c
    # errors against the spectrum's scale: along some updates the curvature is near 0 (or below)
    assert result.ratio == pytest.approx(expected, abs=1e-6 * lanczos) and result.reading == "difference"
    assert result.constant == pytest.approx(constant) and result.curvature == pytest.approx(result.ratio * constant)
    assert result.ratio <= lanczos * (1 + 1e-6)


@pytest.mark.parametrize("case", ["Adam", "SGD momentum", "SGD Nesterov", "AdamW (decoupled decay left out)"])
def test_secant_reading_on_one_batch_equals_the_rayleigh_quotient_to_first_order(case):
    make, kind, constant, decay = CASES[case]
    model = tiny_gpt()
    optimizer = make(model.parameters())
    for group in optimizer.param_groups:
        group["lr"] *= 1e-3
    data = batch(7)
    trained(model, optimizer)
    probe, u = probed_step(model, optimizer, data)
    optimizer.zero_grad()
    loss_of(model, data).backward()  # the next gradient, on the same batch: only the Hessian's change is left
    step_size = adam_step(optimizer) if kind == "adam" else sgd_step
    expected = directional(model, optimizer, data, u, step_size, constant, decay)
    lanczos = reference(model, optimizer, data, step_size, constant, decay)
    assert probe.secant().ratio == pytest.approx(expected, abs=1e-3 * lanczos)  # the Hessian moves along u: first order


@pytest.mark.parametrize(
    ("optimizer_name", "momentum", "nesterov"),
    [("sgd", 0.0, False), ("sgd", 0.9, False), ("sgd", 0.9, True), ("adam", 0.0, False), ("adam", 0.9, False)],
)
def test_both_readings_are_exact_on_a_quadratic_and_reach_the_edge_along_the_top_direction(
    optimizer_name, momentum, nesterov
):
    gen = torch.Generator().manual_seed(0)
    basis, _ = torch.linalg.qr(torch.randn(5, 5, dtype=torch.float64, generator=gen))
    a = basis @ torch.diag(torch.tensor([0.1, 0.5, 1.0, 2.0, 4.0], dtype=torch.float64)) @ basis.T
    x = nn.Parameter(torch.randn(5, dtype=torch.float64, generator=gen))
    if optimizer_name == "sgd":
        optimizer = torch.optim.SGD([x], lr=0.3, momentum=momentum, nesterov=nesterov)
    else:
        optimizer = torch.optim.Adam([x], lr=0.05, betas=(momentum, 0.999))
    loss = lambda: 0.5 * x @ a @ x  # noqa: E731
    readings = []
    for step in range(60):
        optimizer.zero_grad()
        loss().backward()
        probe = UpdateProbe(optimizer)
        before = x.detach().clone()
        optimizer.step()
        probe.stepped()
        u = x.detach() - before
        sizes = adam_step(optimizer)(optimizer.param_groups[0], x) if optimizer_name == "adam" else 0.3
        exact = (u @ a @ u / (u @ (u / sizes))).item() / probe._constant
        if step % 2:
            readings.append((probe.difference(loss).ratio, exact))
        else:
            optimizer.zero_grad()
            loss().backward()
            readings.append((probe.secant().ratio, exact))
    assert all(found == pytest.approx(exact, rel=1e-9) for found, exact in readings)
    top = sharpness_ratio(loss, optimizer, steps=5).ratio
    assert all(exact <= top * (1 + 1e-9) for _, exact in readings)


def test_along_the_top_eigenvector_the_reading_is_the_lanczos_ratio():
    a = torch.diag(torch.tensor([0.5, 1.0, 3.0], dtype=torch.float64))
    x = nn.Parameter(torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64))  # the top direction: the update stays on it
    optimizer = torch.optim.SGD([x], lr=0.5, momentum=0.9)
    loss = lambda: 0.5 * x @ a @ x  # noqa: E731
    loss().backward()
    probe = UpdateProbe(optimizer)
    optimizer.step()
    probe.stepped()
    exact = sharpness_ratio(loss, optimizer, steps=3, products="double_backward").ratio
    assert probe.difference(loss).ratio == pytest.approx(exact, rel=1e-12)
    assert probe.difference.__self__ is probe  # (bound method) a probe reads once:
    with pytest.raises(ValueError, match="read already"):
        probe.secant()


def noisy_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Tanh(), nn.Linear(8, 1))


def test_difference_leaves_parameters_grads_buffers_random_streams_and_mode_bitwise_as_they_were():
    model = noisy_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    nn.functional.mse_loss(model(x), y).backward()
    probe = UpdateProbe(optimizer)
    optimizer.step()
    probe.stepped()
    saved = [t.detach().clone() for t in (*model.parameters(), *model.buffers())]
    grads = [p.grad.clone() for p in model.parameters()]
    rng = torch.get_rng_state()
    result = probe.difference(lambda: nn.functional.mse_loss(model(x), y), model=model, seed=3)
    assert math.isfinite(result.ratio)
    assert torch.equal(torch.get_rng_state(), rng) and model.training
    assert all(torch.equal(a, b) for a, b in zip(saved, (*model.parameters(), *model.buffers()), strict=True))
    assert all(torch.equal(a, p.grad) for a, p in zip(grads, model.parameters(), strict=True))


def test_one_dropout_mask_for_the_three_points():
    """With one mask, a loss linear in the parameters has no curvature whatever the dropout draws."""
    torch.manual_seed(0)
    weight = nn.Parameter(torch.randn(6, 1))
    x = torch.randn(32, 6)
    loss = lambda: nn.functional.dropout(x, 0.5) @ weight  # noqa: E731
    optimizer = torch.optim.SGD([weight], lr=0.1)
    loss().sum().backward()
    probe = UpdateProbe(optimizer)
    optimizer.step()
    probe.stepped()
    assert probe.difference(lambda: loss().sum()).curvature == pytest.approx(0.0, abs=1e-4)


@pytest.mark.parametrize("fail_at", [2, 3])
def test_parameters_are_restored_bitwise_when_the_loss_raises_at_a_perturbed_point(fail_at):
    model = tiny_gpt().float()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    probe, _ = probed_step(model, optimizer, batch())
    saved = [p.detach().clone() for p in model.parameters()]
    calls = []

    def loss_fn():
        calls.append(1)
        if len(calls) == fail_at:
            raise RuntimeError("boom")
        return loss_of(model, batch())

    with pytest.raises(RuntimeError, match="boom"):
        probe.difference(loss_fn)
    assert all(torch.equal(a, b) for a, b in zip(saved, model.parameters(), strict=True))


def test_runs_on_the_fused_attention_kernel_and_a_compiled_model():
    """No double backward: the flash kernel (which has none) and torch.compile give the math kernel's reading."""
    model = tiny_gpt().float()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    probe, _ = probed_step(model, optimizer, batch())
    before = [b.clone() for b in probe._before]  # a probe reads once: read one three times from the same copy
    readings = {}
    compiled = torch.compile(model, backend="aot_eager")
    runs = {
        "math": (model, SDPBackend.MATH),
        "flash": (model, SDPBackend.FLASH_ATTENTION),
        "compiled": (compiled, SDPBackend.FLASH_ATTENTION),
    }
    saved = [p.detach().clone() for p in model.parameters()]
    for name, (net, backend) in runs.items():
        probe._used, probe._before = False, [b.clone() for b in before]
        with sdpa_kernel(backend):
            readings[name] = probe.difference(lambda net=net: loss_of(net, batch())).ratio
        assert all(torch.equal(a, b) for a, b in zip(saved, model.parameters(), strict=True))
    assert readings["flash"] == pytest.approx(readings["math"], rel=2e-2)
    assert readings["compiled"] == pytest.approx(readings["flash"], rel=2e-2)


def test_clipping_the_gradient_by_its_norm_before_the_step_is_undone():
    a = torch.diag(torch.tensor([1.0, 2.0], dtype=torch.float64))
    results = {}
    for clip in (False, True):
        x = nn.Parameter(torch.tensor([1.0, 1.0], dtype=torch.float64))
        optimizer = torch.optim.SGD([x], lr=0.1)
        (0.5 * x @ a @ x).backward()
        probe = UpdateProbe(optimizer)  # sees the gradient as the backward left it
        if clip:
            torch.nn.utils.clip_grad_norm_([x], 0.1)
        optimizer.step()
        probe.stepped()
        optimizer.zero_grad()
        (0.5 * x @ a @ x).backward()
        results[clip] = probe.secant().ratio
    assert results[True] == pytest.approx(results[False], rel=1e-12)


def test_misuse_is_refused_with_the_reason():
    w = nn.Parameter(torch.ones(2))
    with pytest.raises(ValueError, match="RMSprop is not supported"):
        UpdateProbe(torch.optim.RMSprop([w]))
    optimizer = torch.optim.SGD([w], lr=0.0)
    probe = UpdateProbe(optimizer)
    with pytest.raises(ValueError, match=r"call stepped\(\) after optimizer.step\(\)"):
        probe.secant()
    w.sum().backward()
    optimizer.step()
    with pytest.raises(ValueError, match="update is zero"):
        probe.stepped()
    optimizer.param_groups[0]["lr"] = 0.1
    probe = UpdateProbe(optimizer)
    optimizer.step()
    probe.stepped()
    with pytest.raises(ValueError, match=r"scalar tensor, got a tensor of shape \(2,\)"):
        probe.difference(lambda: w * 2)


# --- critical sharpness: eta / eta_c by a line search of forwards along the update -----------------------------------


def regression(kind: str, lr: float):
    """A tanh MLP fitting ``sin`` (float64), trained 30 steps: the model, its loss and its optimizer."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1)).double()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64, 4, generator=gen, dtype=torch.float64)
    y = torch.sin(x.sum(1, keepdim=True))
    makers = {"Adam": lambda ps: torch.optim.Adam(ps, lr=lr), "SGD": lambda ps: torch.optim.SGD(ps, lr=lr),
              "AdamW": lambda ps: torch.optim.AdamW(ps, lr=lr, weight_decay=0.1),
              "SGD momentum": lambda ps: torch.optim.SGD(ps, lr=lr, momentum=0.9)}  # fmt: skip
    optimizer = makers[kind](model.parameters())

    def loss_fn():
        return nn.functional.mse_loss(model(x), y)

    for _ in range(30):
        optimizer.zero_grad()
        loss_fn().backward()
        optimizer.step()
    return model, loss_fn, optimizer


def along(params, before, u, t, loss_fn) -> float:
    """The loss at ``before + t u`` (the parameters left there)."""
    with torch.no_grad():
        offset = 0
        for p, b in zip(params, before, strict=True):
            p.copy_(b + t * u[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
    return loss_fn().item()


# near the edge along the update (ratios 0.2-5): where the reading decides anything
@pytest.mark.parametrize(("kind", "lr"), [("Adam", 0.1), ("AdamW", 0.3), ("SGD", 0.6), ("SGD", 0.8),
                                          ("SGD momentum", 0.1)])  # fmt: skip
def test_critical_sharpness_is_the_first_rise_along_the_update_and_near_its_quadratic_model(kind, lr):
    """Against the first rise of the loss along ``u`` found by a dense scan and bisection (float64), and the
    quadratic model's ``u^T H u / (-2 g . u)`` from a double backward at the parameters before the step."""
    model, loss_fn, optimizer = regression(kind, lr)
    optimizer.zero_grad()
    loss_fn().backward()
    params = list(model.parameters())
    gradient = torch.cat([p.grad.reshape(-1) for p in params])
    before = [p.detach().clone() for p in params]
    probe = UpdateProbe(optimizer)
    optimizer.step()
    probe.stepped()
    after = [p.detach().clone() for p in params]
    u = torch.cat([(a - b).reshape(-1) for a, b in zip(after, before, strict=True)])
    base = along(params, before, u, 0.0, loss_fn)
    grid = [2 ** (k / 50) for k in range(-300, 301)]  # 1/64 .. 64
    low = next(t for t in reversed(grid[: next(i for i, t in enumerate(grid) if along(params, before, u, t, loss_fn)
                                              > base)]))  # fmt: skip
    high = low * 2 ** (1 / 50)
    for _ in range(60):  # bisection to the first rise
        middle = (low + high) / 2
        low, high = (low, middle) if along(params, before, u, middle, loss_fn) > base else (middle, high)
    along(params, before, u, 0.0, loss_fn)  # the parameters before the step
    grads = torch.autograd.grad(loss_fn(), params, create_graph=True)
    curvature = torch.cat([h.reshape(-1) for h in torch.autograd.grad(
        torch.cat([g.reshape(-1) for g in grads]) @ u, params)]) @ u  # fmt: skip
    with torch.no_grad():
        for p, a in zip(params, after, strict=True):
            p.copy_(a)
    read = probe.critical([loss_fn])
    assert read.critical_step == pytest.approx(high, rel=1e-2)
    assert read.ratio == pytest.approx((curvature / (-2 * gradient @ u)).item(), rel=0.1)
    assert all(torch.equal(p, a) for p, a in zip(params, after, strict=True))


def test_critical_sharpness_reads_the_whole_step_restores_everything_and_warm_starts():
    """Two micro-batches (their mean) read what their concatenation reads; parameters, gradients, buffers, random
    streams and mode are left bitwise; a start at the last critical step brackets it in fewer forwards."""
    model = noisy_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    nn.functional.mse_loss(model(x), y).backward()
    probe = UpdateProbe(optimizer)
    optimizer.step()
    probe.stepped()
    saved = [t.detach().clone() for t in (*model.parameters(), *model.buffers())]
    grads = [p.grad.clone() for p in model.parameters()]
    rng = torch.get_rng_state()
    halves = [lambda i=i: nn.functional.mse_loss(model(x[8 * i : 8 * i + 8]), y[8 * i : 8 * i + 8]) for i in (0, 1)]
    model.eval()  # one batch-norm statistic for the halves and the whole
    whole = probe.critical([lambda: nn.functional.mse_loss(model(x), y)], model=model, seed=3)
    probe._used = False  # the same probe again (a test of the reading alone)
    parts = probe.critical(halves, model=model, seed=3, start=whole.critical_step)
    model.train()
    assert parts.ratio == pytest.approx(whole.ratio, rel=1e-9) and parts.forwards < whole.forwards
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(a, b) for a, b in zip(saved, (*model.parameters(), *model.buffers()), strict=True))
    assert all(torch.equal(a, p.grad) for a, p in zip(grads, model.parameters(), strict=True))


def test_critical_sharpness_restores_the_parameters_bitwise_when_a_forward_raises():
    model = tiny_gpt().float()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    probe, _ = probed_step(model, optimizer, batch())
    saved = [p.detach().clone() for p in model.parameters()]
    calls = []

    def loss_fn():
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("boom")
        return loss_of(model, batch())

    with pytest.raises(RuntimeError, match="boom"):
        probe.critical([loss_fn])
    assert all(torch.equal(a, b) for a, b in zip(saved, model.parameters(), strict=True))
    with pytest.raises(ValueError, match="start must be a positive"):
        probed_step(model, optimizer, batch())[0].critical([loss_fn], start=0)


def test_the_critical_estimator_logs_the_step_it_trained_on_and_leaves_training_bitwise():
    """``SharpnessSampler(estimator="critical")`` in a plain loop: at steps 2 and 4 it logs the reading of the
    updates of steps 1 and 3 on their own batches (what a probe around those steps reads), and trains as without it."""
    import warnings

    import connmon
    from connmon.curvature.sampler import SharpnessSampler

    def run(watched: bool):
        model = tiny_gpt()
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-2)
        logged, probes = {}, {}
        monitor = None
        if watched:
            sampler = SharpnessSampler(every_n_steps=2, cadence="fixed", estimator="critical", budget=None)
            monitor = connmon.Monitor(model, attention=False, optimizer=optimizer, loss_fn=loss_of, sharpness=sampler,
                                      log=lambda values, step: logged.update({step: values}))  # fmt: skip
        for step in range(6):
            data = batch(step)
            if monitor is not None:
                with monitor.step(step, batch=data):
                    loss = loss_of(model, data)
            else:
                loss = loss_of(model, data)
            loss.backward()
            probe = UpdateProbe(optimizer) if not watched and step in (1, 3) else None
            optimizer.step()
            if probe is not None:
                probe.stepped()
                probes[step + 1] = probe.critical([lambda d=data: loss_of(model, d)], model=model, seed=step + 1,
                                                  start=probes[2].critical_step if step == 3 else 1.0)  # fmt: skip
            optimizer.zero_grad()
        return [p.detach().clone() for p in model.parameters()], logged, probes

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        watched, logged, _ = run(True)
        plain, _, probes = run(False)
    assert all(torch.equal(a, b) for a, b in zip(watched, plain, strict=True))
    key = "connmon/critical_sharpness_ratio"
    assert sorted(step for step, values in logged.items() if key in values) == [2, 4]
    for step in (2, 4):
        assert logged[step][key] == pytest.approx(probes[step].ratio, rel=1e-12)
        lr = 3e-2
        assert logged[step]["connmon/critical_sharpness_eigenvalue"] == pytest.approx(2 * probes[step].ratio / lr)


def _two_looks_run(samplers: list, steps: int):
    """A plain loop under a Monitor per sampler (or none): the parameters after it, and each monitor's logged rows."""
    import warnings

    import connmon

    model = tiny_gpt()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-2)
    logs: list[dict] = [{} for _ in samplers]
    monitors = [connmon.Monitor(model, attention=False, optimizer=optimizer, loss_fn=loss_of, sharpness=sampler,
                                log=lambda values, step, log=log: log.setdefault(step, {}).update(values))
                for sampler, log in zip(samplers, logs, strict=True)]  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(steps):
            data = batch(step)
            with contextlib.ExitStack() as stack:
                for monitor in monitors:
                    stack.enter_context(monitor.step(step, batch=data))
                loss = loss_of(model, data)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        for monitor in monitors:
            monitor.close()
    return [p.detach().clone() for p in model.parameters()], logs


def test_two_looks_read_what_each_estimator_reads_alone_and_the_first_look_brings_the_second_forward():
    """Critical sharpness every 2 steps (the first look) beside Lanczos every 4 (the second): with a trigger never
    reached, each logs what its estimator alone logs, and training is bitwise unchanged; with a trigger always
    reached, the second look comes at the step after the first look that moved, then once per 4 steps."""
    from connmon.curvature.sampler import SharpnessSampler

    lanczos, critical = "connmon/sharpness_ratio", "connmon/critical_sharpness_ratio"
    plain, _ = _two_looks_run([], 12)
    never = SharpnessSampler(
        every_n_steps=4, cadence="fixed", first_look_every_n_steps=2, first_look_trigger=1e9, budget=None
    )
    watched, (both,) = _two_looks_run([never], 12)
    assert all(torch.equal(a, b) for a, b in zip(watched, plain, strict=True))
    _, (alone,) = _two_looks_run([SharpnessSampler(every_n_steps=4, cadence="fixed", budget=None)], 12)
    _, (first,) = _two_looks_run(
        [SharpnessSampler(every_n_steps=2, cadence="fixed", estimator="critical", budget=None)], 12
    )
    assert sorted(s for s, v in both.items() if lanczos in v) == sorted(s for s, v in alone.items() if lanczos in v)
    assert sorted(s for s, v in both.items() if critical in v) == [2, 4, 6, 8, 10]
    for step, values in alone.items():
        assert both[step][lanczos] == values[lanczos]
    for step, values in first.items():
        assert both[step][critical] == values[critical]
    assert never.first_looks == 5 and never.samples == 2
    always = SharpnessSampler(
        every_n_steps=4, cadence="fixed", first_look_every_n_steps=2, first_look_trigger=0.0, budget=None
    )
    _, (moved,) = _two_looks_run([always], 12)
    assert sorted(s for s, v in moved.items() if lanczos in v) == [3, 7, 11]
    restored = SharpnessSampler(every_n_steps=4, cadence="fixed", first_look_every_n_steps=2, budget=None)
    restored.load_state_dict(always.state_dict())
    assert restored.state_dict() == always.state_dict() and restored.first_looks == 5


def test_two_looks_take_a_lanczos_estimator():
    from connmon.curvature.sampler import SharpnessSampler

    with pytest.raises(ValueError, match="first_look_every_n_steps takes a Lanczos estimator"):
        SharpnessSampler(estimator="secant", first_look_every_n_steps=2, budget=None)
    with pytest.raises(ValueError, match="first_look_every_n_steps"):
        SharpnessSampler(first_look_every_n_steps=0, budget=None)
