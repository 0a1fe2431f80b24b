"""Every transformers family of tests/capture/families.py: recorded exactly or skipped with a reason, never altered."""

import contextlib

import pytest
import torch

import connmon
from tests.capture.families import FAMILIES, capture_family

pytest.importorskip("transformers", minversion="5.0")


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_every_attention_layer_is_recorded_exactly_or_skipped_with_a_reason(family):
    result = capture_family(family)
    assert result.recorded or result.skipped, "nothing recorded and nothing said"
    if result.recorded:
        assert result.worst_error <= 1e-5
    assert not set(result.recorded) & set(result.skipped)
    model = family.build()
    attention = {n for n, m in model.named_modules() if "attention" in type(m).__name__.lower() and "." in n}
    leaves = {n for n in attention if not any(o.startswith(f"{n}.") for o in attention)}  # innermost ones
    for name in leaves:  # each attention module is accounted for, itself or through the module that holds it
        related = [r for r in [*result.recorded, *result.skipped] if name.startswith(r) or r.startswith(name)]
        assert related, f"{name} neither recorded nor reported"


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_arming_changes_neither_outputs_nor_gradients(family):
    model = family.build().train()  # dropout active: the armed run must draw the same random numbers
    batch = family.batch()
    try:
        connmon.capture.attention_layers(model)
    except ValueError:
        pytest.skip(f"{family.name} has no readable attention (the coverage test checks the warning)")

    def run(arm):
        model.zero_grad()
        torch.manual_seed(0)
        with connmon.capture.armed(model) if arm else contextlib.nullcontext():
            output = model(**batch)[0]
            output.float().square().mean().backward()
        return [output.detach(), *(p.grad.clone() for p in model.parameters() if p.grad is not None)]

    plain, armed = run(False), run(True)
    assert len(plain) == len(armed)
    for a, b in zip(plain, armed, strict=True):
        assert torch.equal(a, b)
