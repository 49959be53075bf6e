"""The dense probe's pure functions (``mmssl.evaluation.dense``): patch labels, mIoU on cases worked
by hand, the probe as a statistic (features that carry the class reach mIoU ~1, random ones stay
near what a probe that learnt nothing scores), and the patch tokens of real tiny models."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mmssl.data.demo import DENSE_CLASSES, dense_demo_set
from mmssl.evaluation.dense import (
    confusion_matrix,
    dense_probe,
    extract_patch_tokens,
    grid_side,
    patch_labels,
    patch_tokens,
    segmentation_scores,
)

C = len(DENSE_CLASSES)
MEAN, STD = (0.5, 0.4, 0.3), (0.25, 0.2, 0.1)  # the stub encoder's normalisation


def _scores(pred: list[int], target: list[int], num_classes: int = 4) -> dict:
    return segmentation_scores(confusion_matrix(torch.tensor(pred), torch.tensor(target), num_classes))


def test_patch_labels_take_each_patchs_majority_and_ties_go_to_the_lower_class():
    mask = torch.tensor([[[0, 0, 3, 3, 2, 5],
                          [0, 1, 3, 0, 5, 2],
                          [4, 4, 1, 1, 0, 0],
                          [4, 0, 2, 2, 0, 0]]])  # fmt: skip
    # Patches in raster order: (0,0) 3 of 0; (0,1) 3 of 3; (0,2) 2 of 2 and 2 of 5: a tie, the lower;
    # (1,0) 3 of 4; (1,1) 2 of 1 and 2 of 2: a tie; (1,2) all 0.
    np.testing.assert_array_equal(patch_labels(mask, 2, 6), [[[0, 3, 2], [4, 1, 0]]])
    half = torch.tensor([[[0, 6], [6, 0]], [[6, 6], [6, 0]]])  # half background is background
    np.testing.assert_array_equal(patch_labels(half, 2, 7), [[[0]], [[6]]])
    whole = torch.randint(0, C, (3, 8, 8))
    np.testing.assert_array_equal(patch_labels(whole, 1, C), whole)  # a pixel is its own patch
    assert patch_labels(whole, 4, C).shape == (3, 2, 2) and patch_labels(whole, 4, C).dtype == torch.int64
    with pytest.raises(ValueError, match="do not split into patches of 3"):
        patch_labels(whole, 3, C)
    with pytest.raises(ValueError, match=r"must lie in \[0, 2\)"):
        patch_labels(torch.full((1, 2, 2), 2), 2, 2)


def test_miou_is_one_for_a_perfect_prediction():
    target = [0, 0, 0, 1, 2, 2, 3, 0]
    out = _scores(target, target)
    assert out["miou"] == 1.0 and out["patch_accuracy"] == 1.0 and out["num_patches"] == 8
    assert out["per_class_iou"] == {"0": 1.0, "1": 1.0, "2": 1.0, "3": 1.0}


def test_miou_of_an_all_background_prediction():
    # Background: TP 4, FP 4 (the other classes' patches), FN 0 -> 4/8; classes 1 and 2: TP 0 -> 0;
    # class 3 is neither present nor predicted: not counted. mIoU = (1/2 + 0 + 0) / 3.
    out = _scores([0] * 8, [0, 0, 0, 0, 1, 1, 2, 2])
    assert out["miou"] == pytest.approx(1 / 6) and out["patch_accuracy"] == 0.5
    assert out["per_class_iou"] == {"0": 0.5, "1": 0.0, "2": 0.0, "3": None}


def test_miou_of_swapped_classes_worked_by_hand():
    target = [0, 0, 0, 0, 1, 1, 2, 2]
    out = _scores([0, 0, 0, 0, 2, 2, 1, 1], target)  # 1 and 2 swapped everywhere
    assert out["miou"] == pytest.approx(1 / 3) and out["patch_accuracy"] == 0.5
    # One patch of each swapped: class 1 has TP 1, FP 1 (the 2 called 1), FN 1 -> 1/3; class 2 alike.
    out = _scores([0, 0, 0, 0, 1, 2, 2, 1], target)
    assert out["per_class_iou"] == pytest.approx({"0": 1.0, "1": 1 / 3, "2": 1 / 3, "3": None})
    assert out["miou"] == pytest.approx((1 + 1 / 3 + 1 / 3) / 3) and out["patch_accuracy"] == 0.75


def test_an_absent_class_is_not_counted_but_a_wrongly_predicted_one_is():
    target, pred = [0, 0, 1, 1, 2, 0], [0, 1, 1, 1, 2, 0]
    few, many = _scores(pred, target, 3), _scores(pred, target, 9)  # six classes that never occur
    assert few["miou"] == many["miou"] == pytest.approx((2 / 3 + 2 / 3 + 1) / 3)
    assert [many["per_class_iou"][str(c)] for c in range(3, 9)] == [None] * 6
    # A class predicted but never true has a union (its false positives) and IoU 0: it counts.
    out = _scores([0, 3, 1, 1], [0, 0, 1, 1])
    assert out["per_class_iou"]["3"] == 0.0 and out["miou"] == pytest.approx((1 / 2 + 1 + 0) / 3)


def test_confusion_parts_add_up_and_iou_matches_torchmetrics():
    from torchmetrics.functional.classification import multiclass_jaccard_index

    gen = torch.Generator().manual_seed(0)
    target = torch.randint(0, 5, (400,), generator=gen)
    pred = torch.where(torch.rand(400, generator=gen) < 0.6, target, torch.randint(0, 5, (400,), generator=gen))
    whole = confusion_matrix(pred, target, 5)
    parts = confusion_matrix(pred[:150], target[:150], 5) + confusion_matrix(pred[150:], target[150:], 5)
    assert torch.equal(whole, parts)  # a sum over patches: ranks' and batches' parts add up
    assert whole[2, 4] == int(((target == 2) & (pred == 4)).sum())  # rows are the truth
    out = segmentation_scores(whole, list("abcde"))
    reference = multiclass_jaccard_index(pred, target, 5, average=None)
    assert list(out["per_class_iou"].values()) == pytest.approx(reference.tolist())
    assert out["miou"] == pytest.approx(float(reference.mean()))
    assert out["patch_accuracy"] == pytest.approx(float((pred == target).float().mean()))
    with pytest.raises(ValueError, match="no patches"):
        segmentation_scores(torch.zeros(3, 3, dtype=torch.long))


class LabelEncoder(nn.Module):
    """A stub ViT whose patch tokens are the one-hot of the patch's class plus noise: the images
    carry each pixel's class in their red channel (class * 30), read back through the normalisation
    (MEAN, STD) that extract_patch_tokens must apply."""

    def __init__(self, patch_size: int, noise: float, informative: bool = True) -> None:
        super().__init__()
        self.patch_size, self.noise, self.informative = patch_size, noise, informative
        self.scale = nn.Parameter(torch.ones(()))  # extract_patch_tokens finds the device through it
        self.generator = torch.Generator().manual_seed(0)

    def forward_features(self, images: torch.Tensor) -> torch.Tensor:
        classes = ((images[:, 0] * STD[0] + MEAN[0]) * 255 / 30).round().long()  # (B, H, W)
        labels = patch_labels(classes, self.patch_size, C)  # (B, g, g)
        signal = F.one_hot(labels.flatten(1), C).float() * self.informative  # (B, L, C), raster order
        noise = torch.randn(signal.shape, generator=self.generator) * self.noise
        cls = torch.full((signal.shape[0], 1, C), 7.0)  # a class token the probe must drop
        return torch.cat([cls, signal + noise], dim=1) * self.scale


def _labelled(n: int, seed: int, size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    images, masks = dense_demo_set(n, size, seed)
    images[..., 0] = masks * 30  # the class, for the stub to read
    return torch.from_numpy(images), torch.from_numpy(masks)


@pytest.mark.parametrize("informative", [True, False])
def test_the_probe_reads_the_class_from_features_that_carry_it_and_not_from_noise(informative):
    encoder = LabelEncoder(patch_size=4, noise=0.15, informative=informative)
    sets = []
    for n, seed in ((48, 0), (32, 1)):
        images, masks = _labelled(n, seed)
        tokens = extract_patch_tokens(encoder, images, MEAN, STD, batch_size=10)
        assert tokens.shape == (n, 8, 8, C)
        sets += [tokens, patch_labels(masks, 4, C)]
    out = dense_probe(*sets, C, list(DENSE_CLASSES))
    test_labels = sets[3]
    background = segmentation_scores(confusion_matrix(torch.zeros_like(test_labels), test_labels, C))
    assert out["num_patches"] == 32 * 64 and out["num_train_patches"] == 48 * 64
    if informative:
        assert out["miou"] > 0.95 and out["patch_accuracy"] > 0.98
        assert all(v is not None and v > 0.9 for v in out["per_class_iou"].values())  # every shape turns up
    else:
        # Chance: what calling every patch background scores (background is most patches), within a margin.
        assert background["miou"] - 0.03 < out["miou"] < background["miou"] + 0.1
        assert out["patch_accuracy"] < background["patch_accuracy"] + 0.02
    assert sum(map(sum, out["confusion"])) == out["num_patches"]


def test_patch_tokens_of_real_tiny_vits_are_the_grid_in_raster_order(tiny_clip_json):
    from mmssl.models.clip import CLIP
    from mmssl.models.mae import MAE
    from tests.tiny import TINY_MAE

    torch.manual_seed(0)
    images = torch.randn(2, 3, 32, 32)
    for model in (CLIP(model_name=tiny_clip_json).eval(), MAE(**TINY_MAE).eval()):
        with torch.no_grad():
            tokens = model.forward_features(images)  # (2, 1+16, D)
            grid = patch_tokens(model, images)
        assert grid.shape == (2, 4, 4, tokens.shape[-1]) and grid.dtype == torch.float32
        torch.testing.assert_close(grid[:, 1, 2], tokens[:, 1 + 1 * 4 + 2])  # row 1, column 2
        torch.testing.assert_close(grid[:, 3, 0], tokens[:, 1 + 3 * 4 + 0])


def test_shapes_and_inputs_are_checked():
    assert grid_side(16) == 4 and grid_side(1) == 1
    with pytest.raises(ValueError, match="17 patch tokens form no square grid"):
        grid_side(17)
    with pytest.raises(ValueError, match="uint8"):
        extract_patch_tokens(LabelEncoder(4, 0.0), torch.zeros(2, 8, 8, 3), (0.0,) * 3, (1.0,) * 3)
    with pytest.raises(ValueError, match="do not match"):
        dense_probe(torch.zeros(2, 2, 2, 3), torch.zeros(2, 2, 3, dtype=torch.long),
                    torch.zeros(1, 2, 2, 3), torch.zeros(1, 2, 2, dtype=torch.long), 2)
