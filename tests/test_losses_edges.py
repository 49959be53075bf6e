"""Edges of the pure losses that the reference tests leave open: SigLIP against Algorithm 1 of
its paper, alone and split over ranks; MAE's defaults, constant patches, one masked patch and
its shape error."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mmssl.losses import clip_loss, mae_loss, siglip_loss


def _features(n: int, d: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(n, d, generator=g), dim=-1), F.normalize(torch.randn(n, d, generator=g), dim=-1)


def _reference_siglip(img: torch.Tensor, txt: torch.Tensor, t: float, b: float) -> float:
    """SigLIP Algorithm 1, in loops: -sum_ij log sigmoid(z_ij (t x_i.y_j + b)) / n."""
    total = 0.0
    for i in range(img.shape[0]):
        for j in range(txt.shape[0]):
            z = 1.0 if i == j else -1.0
            total -= math.log(1 / (1 + math.exp(-z * (t * float(img[i] @ txt[j]) + b))))
    return total / img.shape[0]


def test_siglip_loss_is_algorithm_1():
    img, txt = _features(5)
    loss = siglip_loss(img, txt, torch.tensor(10.0), torch.tensor(-10.0))
    assert loss.item() == pytest.approx(_reference_siglip(img, txt, 10.0, -10.0), rel=1e-5)


@pytest.mark.parametrize("loss_fn", ["siglip", "clip"])
def test_mean_of_rank_losses_is_the_one_process_loss(loss_fn):
    # Three ranks of 2 pairs: rank r scores its own rows against every rank's texts, positives at
    # 2r + i (three, not two: with two, a sign error in the offset wraps round to the right column).
    img, txt = _features(6, seed=1)
    scale, bias = torch.tensor(7.0), torch.tensor(-4.0)
    part = [slice(2 * r, 2 * r + 2) for r in range(3)]
    if loss_fn == "siglip":
        whole = siglip_loss(img, txt, scale, bias)
        ranks = [siglip_loss(img[p], txt[p], scale, bias, all_text_features=txt, offset=2 * r)
                 for r, p in enumerate(part)]
    else:
        whole = clip_loss(img, txt, scale)
        ranks = [clip_loss(img[p], txt[p], scale, all_image_features=img, all_text_features=txt, offset=2 * r)
                 for r, p in enumerate(part)]
    torch.testing.assert_close(sum(ranks) / 3, whole)
    assert not torch.allclose(ranks[0], ranks[1])  # the parts really differ


def test_mae_loss_normalises_target_patches_by_default():
    g = torch.Generator().manual_seed(2)
    target, pred = 5 + 3 * torch.randn(2, 4, 12, generator=g), torch.randn(2, 4, 12, generator=g)
    mask = torch.ones(2, 4)
    assert torch.equal(mae_loss(target, pred, mask), mae_loss(target, pred, mask, norm_pix_loss=True))
    assert not torch.allclose(mae_loss(target, pred, mask), mae_loss(target, pred, mask, norm_pix_loss=False))


def test_mae_loss_of_a_constant_patch_is_finite():
    # A flat patch (a sky, a padded border) has zero variance: eps keeps its normalised target at 0.
    target, pred = torch.full((1, 2, 12), 0.5), torch.full((1, 2, 12), 0.25)
    loss = mae_loss(target, pred, torch.ones(1, 2))
    assert torch.isfinite(loss) and loss.item() == pytest.approx(0.0625)


def test_mae_loss_with_one_masked_patch_is_that_patchs_error():
    target, pred = torch.zeros(1, 3, 4), torch.zeros(1, 3, 4)
    pred[0, 1] = 2.0
    mask = torch.tensor([[0.0, 1.0, 0.0]])
    assert mae_loss(target, pred, mask, norm_pix_loss=False).item() == pytest.approx(4.0)
    assert mae_loss(target, pred, mask.bool(), norm_pix_loss=False).item() == pytest.approx(4.0)


def test_mae_loss_names_both_shapes():
    with pytest.raises(ValueError, match=r"target \(2, 4, 12\) and pred \(2, 4, 6\) differ"):
        mae_loss(torch.zeros(2, 4, 12), torch.zeros(2, 4, 6), torch.ones(2, 4))


def test_losses_build_their_labels_on_the_features_device():
    # The meta device stands in for a GPU: labels made on the CPU would fail cross_entropy there.
    img = torch.empty(4, 8, device="meta")
    assert clip_loss(img, img, torch.tensor(2.0, device="meta")).device.type == "meta"
    assert (
        siglip_loss(img, img, torch.tensor(2.0, device="meta"), torch.tensor(1.0, device="meta")).device.type == "meta"
    )
