"""timm VisionTransformer attention (fused qkv, proj, qk-norm, SDPA or eager path).

timm needs torchvision, which does not load beside the CPU torch 2.13 wheel, so these tests carry the `timm`
marker: the default run deselects them and `.ci/run` runs them in a second environment with torch 2.14.1,
torchvision 0.29.1 and timm (`python -m pytest -m timm tests/capture/test_timm.py`).
"""

import pytest
import torch

import connmon

pytestmark = pytest.mark.timm
TOL = 1e-5


def vit(**kwargs):
    from timm.models.vision_transformer import VisionTransformer  # imported here: the default run deselects these

    torch.manual_seed(0)
    model = VisionTransformer(
        img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=4, num_classes=0, **kwargs
    ).eval()
    with torch.no_grad():
        for block in model.blocks:
            block.attn.qkv.weight[:64] *= 8  # far from uniform attention
    return model


@pytest.mark.parametrize("qk_norm", [False, True])
def test_vision_transformer_attention_is_exact(qk_norm):
    model = vit(qk_norm=qk_norm)
    records = connmon.capture(model, torch.randn(3, 3, 32, 32))
    assert [r.name for r in records] == ["blocks.0.attn", "blocks.1.attn"]
    for record in records:
        assert record.attn.shape == (2, 4, 17, 17)  # 16 patches + class token
        assert record.reconstruction_error.item() <= TOL


def test_the_eager_path_is_left_alone_and_skipped_with_a_warning():
    """fused_attn=False (softmax by hand) is never switched to SDPA: outputs and gradients stay bitwise equal."""
    model = vit()
    for block in model.blocks:
        block.attn.fused_attn = False
    x = torch.randn(2, 3, 32, 32)
    plain = model(x)
    plain.square().sum().backward()
    plain_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with pytest.warns(UserWarning, match="fused_attn=False"):
        with connmon.capture.armed(model) as session:
            armed = model(x)
    armed.square().sum().backward()
    assert torch.equal(plain, armed) and session.records == []
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), plain_grads, strict=True))
    assert all(block.attn.fused_attn is False for block in model.blocks)


def test_scale_norm_attention_is_reported_and_skipped():
    model = vit(scale_attn_norm=True)
    with pytest.warns(UserWarning, match="scale-norm"):
        assert connmon.capture(model, torch.randn(1, 3, 32, 32)) == []
