"""What the masking module promises beyond its invariants: unpatchify's square default and its
error, and validation noise that depends on each image alone (so every split masks alike)."""

from __future__ import annotations

import pytest
import torch

from mmssl.models.masking import num_kept, patchify, random_masking, sample_noise, unpatchify


def test_unpatchify_assumes_a_square_grid_and_refuses_another_without_grid_size():
    imgs = torch.randn(2, 3, 12, 12, generator=torch.Generator().manual_seed(0))
    assert torch.equal(unpatchify(patchify(imgs, 4), 4), imgs)  # 9 patches: a 3 x 3 grid
    with pytest.raises(ValueError, match="^6 patches do not form a square grid; pass grid_size$"):
        unpatchify(patchify(torch.zeros(1, 3, 8, 12), 4), 4)


def _images(n: int, seed: int) -> torch.Tensor:
    """Images on the 1/64 grid that sample_noise quantises to (so a 0.004 shift stays in the bin)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-128, 128, (n, 3, 8, 8), generator=g).float() / 64


def test_sample_noise_depends_on_each_image_and_the_seed_only():
    images = _images(4, seed=1)
    noise = sample_noise(images, 16)
    assert noise.shape == (4, 16) and noise.dtype == torch.float32 and 0 <= noise.min() and noise.max() < 1
    assert len({tuple(r.tolist()) for r in noise}) == 4  # every image its own noise
    # The same image in another batch, at another place, gets the same noise.
    torch.testing.assert_close(sample_noise(torch.stack([images[2], _images(1, seed=7)[0]]), 16)[0], noise[2],
                               rtol=0, atol=0)
    torch.testing.assert_close(sample_noise(images + 0.004, 16), noise, rtol=0, atol=0)  # within a bin
    moved = images.clone()
    moved[1, 0, 0, 0] += 1 / 64  # one pixel one bin up
    changed = sample_noise(moved, 16)
    assert not torch.equal(changed[1], noise[1]) and torch.equal(changed[[0, 2, 3]], noise[[0, 2, 3]])
    assert not torch.equal(sample_noise(images, 16, seed=1), noise)  # the seed changes every mask
    assert sample_noise(images, 7).shape == (4, 7)


def test_sample_noise_of_a_fixed_image_is_stable():
    # Validation masks, hence a checkpoint's val/loss, are the same in every release: the noise of
    # these two images is pinned (any change to the hash would move every validation figure).
    noise = sample_noise(_images(2, seed=3), 4)
    torch.testing.assert_close(noise, torch.tensor([[0.392352, 0.107029, 0.85514, 0.569111],
                                                    [0.089379, 0.836219, 0.056064, 0.853511]]), rtol=0, atol=1e-6)
    seeded = sample_noise(_images(2, seed=3), 4, seed=1)
    torch.testing.assert_close(seeded, torch.tensor([[0.361741, 0.756557, 0.033997, 0.473536],
                                                     [0.596961, 0.972178, 0.749209, 0.478515]]), rtol=0, atol=1e-6)


def test_num_kept_keeps_at_least_one_patch():
    assert num_kept(4, 0.9) == 1 and num_kept(196, 0.75) == 49 and num_kept(10, 0.0) == 10


def test_patchify_refuses_a_side_that_the_patch_does_not_divide():
    for h, w in ((16, 18), (18, 16)):
        with pytest.raises(ValueError, match=f"image size {h}x{w} is not divisible by patch_size=4"):
            patchify(torch.zeros(1, 3, h, w), 4)


def test_random_masking_draws_from_the_generator_given_and_stays_on_the_tokens_device():
    x = torch.zeros(3, 16, 8)
    a = random_masking(x, 0.75, generator=torch.Generator().manual_seed(5))
    torch.manual_seed(0)
    b = random_masking(x, 0.75, generator=torch.Generator().manual_seed(5))
    assert all(torch.equal(u, v) for u, v in zip(a, b))  # the generator alone decides
    torch.manual_seed(0)
    before = torch.rand(1)
    torch.manual_seed(0)
    random_masking(x, 0.75, generator=torch.Generator().manual_seed(5))
    assert torch.equal(torch.rand(1), before)  # and the global stream is left alone
    # The meta device stands in for a GPU: noise and mask are made where the tokens are.
    meta = random_masking(torch.empty(3, 16, 8, device="meta"), 0.75)
    assert {t.device.type for t in meta} == {"meta"}
