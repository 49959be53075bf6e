"""MAE sec. 3: the module's loss is computed on the masked patches only, never the visible ones."""

from __future__ import annotations

import torch

from mmssl.models.mae import MAE
from mmssl.models.masking import num_kept, patchify

TINY = dict(image_size=16, patch_size=4, embed_dim=32, depth=1, num_heads=2,
            decoder_embed_dim=16, decoder_depth=1, decoder_num_heads=2, mask_ratio=0.75)


def _per_patch_mse(images: torch.Tensor, pred: torch.Tensor) -> torch.Tensor:
    """(B, L) squared error of each patch against its own-normalised pixels (norm_pix_loss)."""
    target = patchify(images, TINY["patch_size"])  # (B, L, p*p*3)
    target = (target - target.mean(-1, keepdim=True)) / (target.var(-1, keepdim=True) + 1e-6) ** 0.5
    return ((pred - target) ** 2).mean(dim=-1)


def test_module_loss_is_the_error_on_the_masked_patches_of_the_batch():
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = MAE(**TINY).eval()
    images = torch.randn(3, 3, 16, 16, generator=gen)
    noise = torch.rand(3, 16, generator=gen)  # (B, L): the largest noise is masked (MAE's argsort)
    loss, pred, mask = model(images, noise=noise)

    keep = num_kept(16, TINY["mask_ratio"])
    masked = torch.zeros(3, 16)
    masked.scatter_(1, noise.argsort(dim=1)[:, keep:], 1.0)  # 1 = removed, MAE's convention
    assert torch.equal(mask, masked)  # the mask returned is the one the noise chose

    err = _per_patch_mse(images, pred.detach())  # (B, L)
    on_masked = (err * masked).sum() / masked.sum()
    on_visible = (err * (1 - masked)).sum() / (1 - masked).sum()
    assert abs(on_masked - on_visible) > 1e-3  # the two choices give different figures here
    torch.testing.assert_close(loss.detach(), on_masked, rtol=1e-5, atol=1e-6)
