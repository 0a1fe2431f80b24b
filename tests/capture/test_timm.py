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
@pytest.mark.parametrize("fused", [True, False])
def test_vision_transformer_attention_is_exact(qk_norm, fused):
    model = vit(qk_norm=qk_norm)
    for block in model.blocks:
        block.attn.fused_attn = fused
    records = connmon.capture(model, torch.randn(3, 3, 32, 32))
    assert [r.name for r in records] == ["blocks.0.attn", "blocks.1.attn"]
    for record in records:
        assert record.attn.shape == (2, 4, 17, 17)  # 16 patches + class token
        assert record.reconstruction_error.item() <= TOL
    assert all(block.attn.fused_attn is fused for block in model.blocks)  # restored


def test_scale_norm_attention_is_reported_and_skipped():
    model = vit(scale_attn_norm=True)
    with pytest.warns(UserWarning, match="scale-norm"):
        assert connmon.capture(model, torch.randn(1, 3, 32, 32)) == []
