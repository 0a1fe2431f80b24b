"""timm VisionTransformer attention (fused qkv, proj, qk-norm, SDPA or eager path).

timm needs torchvision, which does not load beside the CPU torch 2.13 wheel, so these tests carry the `timm`
marker: the default run deselects them and `.ci/run` runs them in a second environment with torch 2.14.1,
torchvision 0.29.1 and timm (`python -m pytest -m timm tests/capture/test_timm.py`).
"""

import contextlib
import warnings

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


def swin():
    from timm.models.swin_transformer import SwinTransformer

    torch.manual_seed(0)
    return SwinTransformer(img_size=32, patch_size=4, embed_dim=16, depths=(2,), num_heads=(2,), window_size=4,
                           num_classes=0, attn_drop_rate=0.1).eval()  # fmt: skip


def eva():
    from timm.models.eva import Eva

    torch.manual_seed(0)
    return Eva(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=4, num_classes=0, use_rot_pos_emb=True,
               qkv_fused=True, attn_drop_rate=0.1).eval()  # qkv through F.linear with a concatenated bias  # fmt: skip


MODELS = {"ViT": (vit, 2, 17), "Swin": (swin, 2, 16), "EVA": (eva, 2, 17)}  # builder, layers, tokens per window


def _set_path(model, fused):
    for module in model.modules():
        if hasattr(module, "fused_attn"):
            module.fused_attn = fused


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "eager"])
@pytest.mark.parametrize("name", list(MODELS))
def test_every_attention_layer_is_recorded_exactly_on_both_paths(name, fused):
    """timm's eager path (softmax by hand) is read from the calls that run, never switched to SDPA."""
    build, layers, tokens = MODELS[name]
    model = build()
    _set_path(model, fused)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="connmon")
        records = connmon.capture(model, torch.randn(2, 3, 32, 32), dtype=torch.float64)
    assert len(records) == layers
    for record in records:
        assert record.attn.shape[-1] == tokens and record.reconstruction_error.item() <= TOL


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "eager"])
@pytest.mark.parametrize("name", list(MODELS))
def test_arming_changes_neither_outputs_nor_gradients(name, fused, mode):
    build, layers, _ = MODELS[name]
    model = build().train(mode == "train")
    _set_path(model, fused)
    x = torch.randn(2, 3, 32, 32)

    def run(armed):
        model.zero_grad()
        torch.manual_seed(3)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # attention dropout in train mode: said once
            with connmon.capture.armed(model) if armed else contextlib.nullcontext() as session:
                out = model(x)
        out.square().sum().backward()
        return out.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None], session

    plain, plain_grads, _ = run(False)
    armed, armed_grads, session = run(True)
    assert torch.equal(plain, armed) and all(map(torch.equal, plain_grads, armed_grads))
    assert len(session.records) == layers
    assert all(getattr(m, "fused_attn", fused) is fused for m in model.modules())


def test_scale_norm_attention_is_reported_and_skipped():
    model = vit(scale_attn_norm=True)
    with pytest.warns(UserWarning, match="scale-norm"):
        assert connmon.capture(model, torch.randn(1, 3, 32, 32)) == []
