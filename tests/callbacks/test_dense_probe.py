"""The online dense probe (mmssl.callbacks.DenseProbe) on constructed models: its scale (an oracle's
tokens score mIoU 1, constant tokens the majority floor), its rank split (every rank's share gathered
back in scene order, held-out counts summed), and its refusals. Its figures on 2 gloo ranks against
one process: tests/test_ddp.py::test_two_processes_log_the_figures_of_one."""

from __future__ import annotations

import contextlib
import types

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F

from mmssl.callbacks import DenseProbe
from mmssl.data.demo import DENSE_CLASSES, dense_demo_set
from mmssl.evaluation.dense import confusion_matrix, patch_labels, segmentation_scores

SIDE, PATCH = 32, 8
MEAN, STD = (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)


class Oracle(pl.LightningModule):
    """Tokens that carry each patch's true class (one-hot), found by looking the scene up by its
    pixels: a linear probe on them is right on every patch. ``constant``: every token the same."""

    def __init__(self, scenes: list[tuple], constant: bool = False) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.image_size, self.image_mean, self.image_std, self.constant = SIDE, MEAN, STD, constant
        self.lookup = {}
        for images, masks in scenes:
            labels = patch_labels(torch.from_numpy(masks), PATCH, len(DENSE_CLASSES))
            for image, label in zip(images, labels):
                self.lookup[image.tobytes()] = label
        self.calls = 0

    def forward_features(self, images: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        pixels = (images * 255).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()
        labels = torch.stack([self.lookup[p.tobytes()] for p in pixels])  # (B, g, g)
        tokens = F.one_hot(labels.reshape(len(labels), -1), len(DENSE_CLASSES)).float()  # (B, L, C)
        if self.constant:
            tokens = torch.ones_like(tokens)
        return torch.cat([torch.zeros_like(tokens[:, :1]), tokens], dim=1)  # a class token first


def _trainer(world: int = 1, rank: int = 0):
    plugin = types.SimpleNamespace(forward_context=contextlib.nullcontext)
    return types.SimpleNamespace(world_size=world, global_rank=rank, precision_plugin=plugin)


def _scenes(train: int, test: int, seed: int = 0):
    return [dense_demo_set(train, SIDE, seed), dense_demo_set(test, SIDE, seed + 1)]


def test_an_oracles_tokens_score_one_and_constant_tokens_the_majority_floor():
    probe = DenseProbe(train_images=24, test_images=6, batch_size=5)  # 24 scenes: every class in training
    scores = probe.evaluate(_trainer(), Oracle(_scenes(24, 6)))
    assert scores["miou"] == pytest.approx(1.0) and scores["patch_accuracy"] == pytest.approx(1.0)
    assert scores["num_patches"] == 6 * (SIDE // PATCH) ** 2

    floor = probe.evaluate(_trainer(), Oracle(_scenes(24, 6), constant=True))
    (_, train_masks), (_, test_masks) = _scenes(24, 6)
    train_labels = patch_labels(torch.from_numpy(train_masks), PATCH, len(DENSE_CLASSES))
    test_labels = patch_labels(torch.from_numpy(test_masks), PATCH, len(DENSE_CLASSES))
    majority = torch.full_like(test_labels, int(torch.bincount(train_labels.reshape(-1)).argmax()))
    expected = segmentation_scores(confusion_matrix(majority, test_labels, len(DENSE_CLASSES)))
    assert floor["miou"] == pytest.approx(expected["miou"]) and floor["miou"] < 0.5
    assert floor["patch_accuracy"] == pytest.approx(expected["patch_accuracy"])


def test_two_ranks_gather_the_training_tokens_in_scene_order_and_sum_the_held_out_counts():
    """5 training and 3 held-out scenes on 2 ranks (uneven: rank 1 pads): each rank makes the same
    number of forwards, the gathered tokens are the one-process tokens, and the summed confusion is
    the one-process confusion, so both score alike."""
    scenes = _scenes(5, 3)
    probe = DenseProbe(train_images=5, test_images=3, batch_size=2)
    one = probe.evaluate(_trainer(), Oracle(scenes, constant=False))
    train_images, _ = probe.scenes(5, SIDE, 0)
    whole = probe._tokens(_trainer(), Oracle(scenes), train_images)

    shares, models = {}, {}
    for rank in (0, 1):
        models[rank] = Oracle(scenes)
        shares[rank] = probe._tokens(_trainer(2, rank), models[rank], train_images)
    assert shares[0].shape == shares[1].shape and models[0].calls == models[1].calls
    stacked = torch.stack([shares[0], shares[1]])

    class Gathering(Oracle):
        """all_gather as 2 ranks see it: train tokens stacked; the confusions of both ranks."""

        def all_gather(self, tensor):
            if tensor.ndim == 2:  # the (C, C) confusion: rank 0's and rank 1's
                return torch.stack([tensor, self.other_confusion])
            return stacked

    torch.testing.assert_close(probe._gather(Gathering(scenes), shares[0], 2)[:5], whole, rtol=0, atol=0)

    # The held-out counts: each rank's own scenes, summed, make the one-process figures.
    rank1 = Gathering(scenes)
    confusions = []
    original = confusion_matrix

    def record(*args):
        confusions.append(original(*args))
        return confusions[-1]

    import mmssl.callbacks.dense_probe as module

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(module, "confusion_matrix", record)
        rank1.other_confusion = torch.zeros(len(DENSE_CLASSES), len(DENSE_CLASSES), dtype=torch.long)
        probe.evaluate(_trainer(2, 1), rank1)  # rank 1's own confusion is confusions[0]
        rank0 = Gathering(scenes)
        rank0.other_confusion = confusions[0]
        two = probe.evaluate(_trainer(2, 0), rank0)
    assert confusions[0].sum() == 1 * (SIDE // PATCH) ** 2 and confusions[1].sum() == 2 * (SIDE // PATCH) ** 2
    assert two["miou"] == pytest.approx(one["miou"]) and two["num_patches"] == one["num_patches"]


def test_bad_settings_and_models_without_patch_tokens_fail_at_start_with_one_line():
    with pytest.raises(ValueError, match="init_args.test_images .* must be >= 1"):
        DenseProbe(test_images=0)
    with pytest.raises(ValueError, match="weight_decay"):
        DenseProbe(weight_decay=-1.0)
    trainer = types.SimpleNamespace(limit_val_batches=1.0)
    with pytest.raises(ValueError, match="gives no patch tokens"):
        DenseProbe().setup(trainer, pl.LightningModule(), "fit")
    rectangular = Oracle([])
    rectangular.image_size = (32, 48)
    with pytest.raises(ValueError, match="the demo scenes are square"):
        DenseProbe().setup(trainer, rectangular, "fit")
    DenseProbe().setup(types.SimpleNamespace(limit_val_batches=0), pl.LightningModule(), "fit")  # no validation


def test_it_logs_its_figures_at_validation_end_and_not_in_the_sanity_check():
    logged = {}

    class Logging(Oracle):
        def log(self, name, value, **kwargs):
            logged[name] = (value, kwargs)

    model = Logging(_scenes(24, 6), constant=True)  # the majority floor: mIoU and accuracy differ
    state = types.SimpleNamespace(fn="fit")
    trainer = types.SimpleNamespace(**vars(_trainer()), sanity_checking=True, state=state, current_epoch=0)
    probe = DenseProbe(train_images=24, test_images=6)
    probe.on_validation_epoch_end(trainer, model)
    assert logged == {} and model.calls == 0
    trainer.sanity_checking = False
    probe.on_validation_epoch_end(trainer, model)
    expected = probe.evaluate(_trainer(), Oracle(_scenes(24, 6), constant=True))
    assert expected["miou"] < 0.5 < expected["patch_accuracy"]
    assert logged["probe/dense_miou"] == (pytest.approx(expected["miou"]), {"sync_dist": True})
    assert logged["probe/dense_patch_accuracy"] == (pytest.approx(expected["patch_accuracy"]), {"sync_dist": True})
    logged.clear()
    probe.every_n_epochs = 2  # epoch 0 is the first of two: not its turn
    probe.on_validation_epoch_end(trainer, model)
    assert logged == {}
