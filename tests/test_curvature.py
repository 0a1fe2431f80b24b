"""sharpness_ratio against its definition: a dense float64 Hessian, the optimizer's own step on a quadratic."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from connmon.curvature import sharpness_ratio, step_geometry
from tests.capture.models import TinyGPT

VOCAB = 7


def tiny_gpt() -> nn.Module:
    torch.manual_seed(0)
    return TinyGPT(vocab=VOCAB, n_embd=4, n_head=2, n_layer=1).double()


def batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (3, 6), generator=gen)
    return ids[:, :-1], ids[:, 1:]


def loss_of(model: nn.Module, data: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    idx, target = data
    return nn.functional.cross_entropy(model(idx).flatten(0, 1), target.flatten())


def trained(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int = 3) -> None:
    for step in range(steps):
        optimizer.zero_grad()
        loss_of(model, batch(step)).backward()
        optimizer.step()


def dense_hessian(model: nn.Module, params: list[nn.Parameter], data) -> torch.Tensor:
    """The Hessian of the loss in ``params`` (every other parameter held), float64, column by column.

    ``torch.autograd.functional.hessian``, not ``torch.func.hessian``: under the latter's vmap SDPA's math path
    gave a Hessian 10% off (torch 2.13).
    """
    names = {id(p): name for name, p in model.named_parameters()}
    keys = [names[id(p)] for p in params]
    sizes = [p.numel() for p in params]

    def loss(flat: torch.Tensor) -> torch.Tensor:
        values = {k: v.view_as(p) for k, v, p in zip(keys, flat.split(sizes), params, strict=True)}
        with sdpa_kernel(SDPBackend.MATH):
            logits = torch.func.functional_call(model, values, (data[0],), strict=False)
        return nn.functional.cross_entropy(logits.flatten(0, 1), data[1].flatten())

    return torch.autograd.functional.hessian(loss, torch.cat([p.detach().reshape(-1) for p in params]))


def reference(model, optimizer, data, step_size, constant, coupled_decay=0.0) -> float:
    """``lambda_max(U^1/2 (H + wd I) U^1/2) / c`` from the dense Hessian, U written out per optimizer by hand."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    root = torch.cat([step_size(group, p).sqrt().reshape(-1) for group in optimizer.param_groups
                      for p in group["params"]])  # fmt: skip
    hessian = dense_hessian(model, params, data) + coupled_decay * torch.eye(root.numel(), dtype=torch.float64)
    return torch.linalg.eigvalsh(root[:, None] * hessian * root[None, :])[-1].item() / constant


def adam_step(optimizer):
    beta1, beta2 = optimizer.param_groups[0]["betas"]

    def size(group, p):
        state = optimizer.state[p]
        second = state["max_exp_avg_sq"] if group["amsgrad"] else state["exp_avg_sq"]
        return group["lr"] * (1 - beta1) / ((second / (1 - beta2 ** state["step"].item())).sqrt() + group["eps"])

    return size


def sgd_step(group, p):
    damp = group["dampening"] if group["momentum"] else 0.0
    return torch.full_like(p, group["lr"] * (1 - damp))


CASES = {
    "Adam": (lambda ps: torch.optim.Adam(ps, lr=1e-2), "adam", 2 * 1.9, 0.0),
    "Adam betas (0.8, 0.99)": (lambda ps: torch.optim.Adam(ps, lr=1e-2, betas=(0.8, 0.99)), "adam", 2 * 1.8, 0.0),
    "Adam coupled decay": (lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.3), "adam", 3.8, 0.3),
    "Adam amsgrad": (lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True), "adam", 3.8, 0.0),
    "AdamW (decoupled decay left out)": (lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.3), "adam", 3.8, 0),
    "SGD": (lambda ps: torch.optim.SGD(ps, lr=0.5), "sgd", 2.0, 0.0),
    "SGD momentum": (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), "sgd", 3.8, 0.0),
    "SGD Nesterov": (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True), "sgd", 3.8 / 2.8, 0.0),
    "SGD dampening, decay": (
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.5, dampening=0.3, weight_decay=0.2), "sgd", 3.0, 0.2),
}  # fmt: skip


# the exact products to round-off; gradient differences (float64, eps = 1e-7) to their truncation error
PRODUCTS = {"double_backward": 1e-8, "gradient_difference": 1e-4}


@pytest.mark.parametrize("products", list(PRODUCTS))
@pytest.mark.parametrize("case", list(CASES))
def test_ratio_equals_the_dense_float64_definition(case, products):
    make, kind, constant, decay = CASES[case]
    model = tiny_gpt()
    optimizer = make(model.parameters())
    trained(model, optimizer)
    data = batch(7)
    step_size = adam_step(optimizer) if kind == "adam" else sgd_step
    expected = reference(model, optimizer, data, step_size, constant, decay)
    n = sum(p.numel() for p in model.parameters())
    result = sharpness_ratio(lambda: loss_of(model, data), optimizer, steps=n, model=model, products=products)
    assert result.ratio == pytest.approx(expected, rel=PRODUCTS[products])
    assert result.constant == pytest.approx(constant, rel=1e-12) and result.converged
    assert result.eigenvalue == pytest.approx(expected * constant, rel=PRODUCTS[products])
    assert result.gradient_evaluations >= n + 1  # one per product and g(theta), and any product retaken


@pytest.mark.parametrize("products", list(PRODUCTS))
def test_parameter_groups_with_their_own_learning_rates_and_frozen_or_unused_parameters(products):
    model = tiny_gpt()
    model.unused = nn.Linear(2, 2).double()  # trainable, never in the loss: no state, not part of the step
    model.head.bias.requires_grad_(False)  # frozen
    embed = list(model.wte.parameters())
    rest = [p for n, p in model.named_parameters() if not n.startswith("wte") and p.requires_grad]
    optimizer = torch.optim.Adam([{"params": embed, "lr": 3e-2}, {"params": rest, "lr": 1e-3}])
    trained(model, optimizer)
    data = batch(7)
    moved = [group for group in optimizer.param_groups]
    for group in moved:
        group["params"] = [p for p in group["params"] if p in optimizer.state]
    expected = reference(model, optimizer, data, adam_step(optimizer), 3.8)
    n = sum(p.numel() for group in moved for p in group["params"])
    result = sharpness_ratio(lambda: loss_of(model, data), optimizer, steps=n, products=products)
    assert result.ratio == pytest.approx(expected, rel=PRODUCTS[products])


@pytest.mark.parametrize("products", list(PRODUCTS))
def test_a_parameter_the_loss_is_linear_in_adds_no_curvature(products):
    model = nn.Linear(3, 1, bias=False).double()
    shift = nn.Parameter(torch.ones(2, dtype=torch.float64))
    x = torch.tensor([[1.0, 0, 0], [0, 2, 0], [0, 0, 3]], dtype=torch.float64)
    optimizer = torch.optim.SGD([*model.parameters(), shift], lr=0.1)
    result = sharpness_ratio(lambda: model(x).pow(2).mean() + shift.sum(), optimizer, steps=5, products=products)
    assert result.ratio == pytest.approx(0.1 * 2 * 9 / 3 / 2, rel=PRODUCTS[products] / 1e4)  # H = diag(2, 8, 18) / 3


@pytest.mark.parametrize(("momentum", "nesterov"), [(0.0, False), (0.9, False), (0.9, True), (0.5, True)])
def test_ratio_one_is_where_the_optimizer_own_step_turns_unstable_on_a_quadratic(momentum, nesterov):
    """torch.optim.SGD itself on ``0.5 x^T A x``: it settles just below ratio 1 and blows up just above."""
    gen = torch.Generator().manual_seed(0)
    basis, _ = torch.linalg.qr(torch.randn(5, 5, dtype=torch.float64, generator=gen))
    a = basis @ torch.diag(torch.tensor([0.1, 0.5, 1.0, 2.0, 4.0], dtype=torch.float64)) @ basis.T
    norms = {}
    for target in (0.97, 1.03):
        x = nn.Parameter(torch.ones(5, dtype=torch.float64))
        optimizer = torch.optim.SGD([x], lr=1.0, momentum=momentum, nesterov=nesterov)
        ratio = sharpness_ratio(lambda x=x: 0.5 * x @ a @ x, optimizer, steps=5).ratio
        optimizer.param_groups[0]["lr"] = target / ratio  # now the ratio is `target`
        assert sharpness_ratio(lambda x=x: 0.5 * x @ a @ x, optimizer, steps=5).ratio == pytest.approx(target)
        for _ in range(3000):
            optimizer.zero_grad()
            (0.5 * x @ a @ x).backward()
            optimizer.step()
        norms[target] = x.norm().item()
    assert norms[0.97] < 1e-3 and not norms[1.03] < 1e3  # past 1: it overflows to inf or NaN


def test_training_state_is_untouched_grads_random_streams_buffers_and_mode():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Tanh(), nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
    grads = [p.grad.clone() for p in model.parameters()]
    params = [p.detach().clone() for p in model.parameters()]
    buffers = [b.clone() for b in model.buffers()]
    rng = torch.get_rng_state()
    result = sharpness_ratio(lambda: nn.functional.mse_loss(model(x), y), optimizer, steps=8, model=model)
    assert math.isfinite(result.ratio) and result.ratio > 0
    assert torch.equal(torch.get_rng_state(), rng) and model.training
    assert all(torch.equal(a, b) for a, b in zip(grads, [p.grad for p in model.parameters()], strict=True))
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters(), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(buffers, model.buffers(), strict=True))


def test_one_dropout_mask_for_every_product_so_the_estimate_is_repeatable():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 32), nn.Dropout(0.5), nn.Tanh(), nn.Linear(32, 1)).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(16, 4, dtype=torch.float64), torch.randn(16, 1, dtype=torch.float64)
    first = sharpness_ratio(lambda: nn.functional.mse_loss(model(x), y), optimizer, steps=40)
    again = sharpness_ratio(lambda: nn.functional.mse_loss(model(x), y), optimizer, steps=40)
    assert first == again and first.converged  # the same stream (forked) and the same mask in every product


def test_the_fused_attention_kernel_is_avoided():
    """SDPA's fused CPU kernel has no double backward; the estimate runs SDPA's math kernel instead."""
    model = tiny_gpt().float()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = batch()
    grads = torch.autograd.grad(loss_of(model, data), list(model.parameters()), create_graph=True)
    with pytest.raises(RuntimeError, match=r"derivative|double backward|not implemented"):
        torch.autograd.grad(sum(g.sum() for g in grads), list(model.parameters()))
    assert math.isfinite(sharpness_ratio(lambda: loss_of(model, data), optimizer, steps=4).ratio)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda ps: torch.optim.RMSprop(ps), "RMSprop is not supported"),
        (lambda ps: torch.optim.Adam(ps), "has not stepped yet"),
        (lambda ps: torch.optim.SGD(ps, lr=0.1, maximize=True), "maximize"),
        (lambda ps: torch.optim.SGD([{"params": ps[:1], "momentum": 0.9}, {"params": ps[1:]}], lr=0.1), "momentum"),
    ],
)
def test_an_optimizer_without_a_known_edge_of_stability_is_refused_with_the_reason(make, match):
    model = nn.Linear(3, 1)
    with pytest.raises(ValueError, match=match):
        step_geometry(make(list(model.parameters())))


def test_bad_arguments_are_refused_with_the_value():
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="steps"):
        sharpness_ratio(lambda: model(torch.ones(1, 3)).sum(), optimizer, steps=0)
    with pytest.raises(ValueError, match=r"scalar tensor, got a tensor of shape \(2, 1\)"):
        sharpness_ratio(lambda: model(torch.ones(2, 3)), optimizer)
    with pytest.raises(ValueError, match="scalar tensor, got float"):
        sharpness_ratio(lambda: 1.0, optimizer)


def test_non_finite_loss_gives_nan_not_an_exception():
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    result = sharpness_ratio(lambda: model(torch.full((1, 3), math.inf)).pow(2).sum(), optimizer, steps=3)
    assert math.isnan(result.ratio) and not result.converged
