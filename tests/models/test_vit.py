import numpy as np
import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from mmssl.models.vit import MaskedViT, load_encoder, sincos_pos_embed_2d

TINY = dict(image_size=32, patch_size=4, embed_dim=64, depth=2, num_heads=4)


def mae_reference_pos_embed(embed_dim, grid_size):
    """facebookresearch/mae util/pos_embed.py, transcribed."""

    def one_d(dim, pos):
        omega = np.arange(dim // 2, dtype=np.float64) / (dim / 2.0)
        omega = 1.0 / 10000**omega
        out = np.einsum("m,d->md", pos.reshape(-1), omega)
        return np.concatenate([np.sin(out), np.cos(out)], axis=1)

    grid = np.meshgrid(np.arange(grid_size, dtype=np.float32), np.arange(grid_size, dtype=np.float32))
    grid = np.stack(grid, axis=0).reshape([2, 1, grid_size, grid_size])
    emb = np.concatenate([one_d(embed_dim // 2, grid[0]), one_d(embed_dim // 2, grid[1])], axis=1)
    return np.concatenate([np.zeros([1, embed_dim]), emb], axis=0)


def test_pos_embed_matches_mae():
    ours = sincos_pos_embed_2d(64, 7, cls_token=True)
    np.testing.assert_allclose(ours.numpy(), mae_reference_pos_embed(64, 7), atol=1e-6)


def test_shapes_and_masking():
    vit = MaskedViT(**TINY)
    images = torch.randn(2, 3, 32, 32)
    assert vit.forward_features(images).shape == (2, 65, 64)
    tokens, masking = vit.forward_masked(images, 0.75)
    assert tokens.shape == (2, 1 + 16, 64)
    assert masking.mask.shape == (2, 64) and masking.mask.sum() == 2 * 48
    assert vit(images).shape == (2, 64)
    assert not vit.pos_embed.requires_grad


def test_intermediates():
    vit = MaskedViT(**TINY).eval()
    images = torch.randn(2, 3, 32, 32)
    feats = vit.forward_intermediates(images, pool="cls", norm=True)
    assert len(feats) == 2 and all(f.shape == (2, 64) for f in feats)
    torch.testing.assert_close(feats[-1], vit(images))
    avg = vit.forward_intermediates(images, pool="avg")
    torch.testing.assert_close(
        avg[-1], vit.blocks[1](vit.blocks[0](vit.prepend_cls(vit.embed_patches(images))))[:, 1:].mean(1)
    )


def test_validation_errors():
    with pytest.raises(ValueError, match="image_size"):
        MaskedViT(image_size=30, patch_size=4)
    with pytest.raises(ValueError, match="num_heads"):
        MaskedViT(embed_dim=64, num_heads=5)
    vit = MaskedViT(**TINY)
    with pytest.raises(ValueError, match="mask_ratio"):
        vit.forward_features(torch.randn(1, 3, 32, 32), mask_ratio=1.0)
    with pytest.raises(ValueError, match="32x32"):
        vit(torch.randn(1, 3, 64, 64))


def encoder_flops(vit, images, ratio):
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        vit.forward_features(images, mask_ratio=ratio)
    return counter.get_total_flops()


@pytest.mark.parametrize("size", ["tiny", "vit_base_patch16_224"])
def test_flops_quarter_at_075(size):
    # MAE sec. 3: the encoder operates on the visible 25% of patches only. ViT-B/16 is counted
    # on the meta device: FLOPs need shapes only.
    device = "cpu" if size == "tiny" else "meta"
    with torch.device(device):
        vit = MaskedViT(**TINY) if size == "tiny" else MaskedViT()
        images = torch.randn(2, 3, vit.image_size, vit.image_size)
    ratio = encoder_flops(vit, images, 0.75) / encoder_flops(vit, images, 0.0)
    # 1+L/4 of 1+L tokens in the blocks; the patch embedding sees every patch and attention
    # shrinks faster, so the ratio sits near 0.25 (tiny: 0.253, ViT-B/16: 0.251).
    assert 0.24 < ratio < 0.26, ratio


def test_load_encoder_from_mae_release_layout(tmp_path):
    src = MaskedViT(**TINY)
    state = {
        "model": {**src.state_dict(), "mask_token": torch.zeros(1, 1, 32), "decoder_embed.weight": torch.zeros(32, 64)}
    }
    torch.save(state, tmp_path / "mae.pth")
    dst = MaskedViT(**TINY)
    load_encoder(dst, str(tmp_path / "mae.pth"))
    images = torch.randn(1, 3, 32, 32)
    torch.testing.assert_close(dst(images), src(images))
    bigger = MaskedViT(image_size=48, patch_size=4, embed_dim=64, depth=2, num_heads=4)
    load_encoder(bigger, str(tmp_path / "mae.pth"))  # pos_embed resampled 8x8 -> 12x12
    assert bigger.pos_embed.shape == (1, 145, 64)
    with pytest.raises(KeyError, match="lacks"):
        load_encoder(
            MaskedViT(image_size=32, patch_size=4, embed_dim=64, depth=3, num_heads=4), str(tmp_path / "mae.pth")
        )
