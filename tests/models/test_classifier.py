"""ImageClassifier: MAE's layer-wise LR decay, loading pretrained encoders, the timm export."""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import timm
import torch
from PIL import Image

from mmssl.checkpoints import read_state_dict
from mmssl.checkpoints.layouts import classifier_to_timm
from mmssl.data.transforms import timm_train_transform
from mmssl.export import export_checkpoint
from mmssl.models import ImageClassifier
from mmssl.models.mae import MAE

SHAPE = {"patch_size": 4, "embed_dim": 32, "depth": 3, "num_heads": 2}


def classifier(**kwargs) -> ImageClassifier:
    args = {"num_classes": 5, "image_size": 16, "model_kwargs": SHAPE, **kwargs}
    return ImageClassifier(**args)


def mae_layer_id(name: str, num_layers: int) -> int:
    """facebookresearch/mae util/lr_decay.py get_layer_id_for_vit, verbatim in logic."""
    if name in ["cls_token", "pos_embed"]:
        return 0
    if name.startswith("patch_embed"):
        return 0
    if name.startswith("blocks"):
        return int(name.split(".")[1]) + 1
    return num_layers


def attach_trainer(module: ImageClassifier, batch: int, world: int, steps_per_epoch: int, epochs: int) -> None:
    """The few trainer attributes configure_optimizers reads (no data or process group needed)."""
    module._trainer = SimpleNamespace(
        estimated_stepping_batches=steps_per_epoch * epochs, num_training_batches=steps_per_epoch,
        max_epochs=epochs, world_size=world, accumulate_grad_batches=1,
        datamodule=SimpleNamespace(batch_size=batch), train_dataloader=None)


def test_layer_decay_lr_is_blr_x_scale_x_decay_power_as_in_mae_param_groups_lrd():
    torch.manual_seed(0)
    blr, decay, depth = 1e-3, 0.65, SHAPE["depth"]
    module = classifier(blr=blr, layer_decay=decay, weight_decay=0.05, warmup_epochs=1, min_lr=1e-6)
    attach_trainer(module, batch=32, world=2, steps_per_epoch=10, epochs=4)
    config = module.configure_optimizers()
    optimizer, scheduler = config["optimizer"], config["lr_scheduler"]["scheduler"]
    lr = blr * 64 / 256  # MAE main_finetune.py: blr x eff_batch_size / 256
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    names = dict(module.model.named_parameters())
    assert {id(p) for p in names.values()} == set(group_of)  # every parameter is optimised
    num_layers = depth + 1
    for name, param in names.items():
        group, layer = group_of[id(param)], mae_layer_id(name, num_layers)
        # util/lr_decay.py: layer_scales = decay ** (num_layers - i); util/lr_sched.py: lr x lr_scale.
        assert group["initial_lr"] == lr * decay ** (num_layers - layer), name
        mae_decay = 0.0 if (param.ndim == 1 or name in {"pos_embed", "cls_token", "dist_token"}) else 0.05
        assert group["weight_decay"] == mae_decay, name
    # The numbers: block i at blr x scale x decay^(depth - i), stem one step lower, head at lr.
    for i in range(depth):
        assert group_of[id(names[f"blocks.{i}.attn.qkv.weight"])]["initial_lr"] == pytest.approx(
            lr * decay ** (depth - i), rel=1e-12)
    assert group_of[id(names["patch_embed.proj.weight"])]["initial_lr"] == pytest.approx(lr * decay ** 4, rel=1e-12)
    assert group_of[id(names["head.weight"])]["initial_lr"] == lr
    assert group_of[id(names["fc_norm.weight"])]["initial_lr"] == lr
    # Warm-up of one epoch (10 steps), then cosine to min_lr x scale.
    head = group_of[id(names["head.weight"])]
    stem = group_of[id(names["patch_embed.proj.weight"])]
    assert head["lr"] == pytest.approx(lr / 10)
    for _ in range(9):
        optimizer.step()
        scheduler.step()
    assert head["lr"] == pytest.approx(lr) and stem["lr"] == pytest.approx(lr * decay ** 4)
    for _ in range(31):  # to the end of the 40 steps: the cosine reaches min_lr there
        optimizer.step()
        scheduler.step()
    assert head["lr"] == pytest.approx(1e-6, rel=1e-3) and stem["lr"] == pytest.approx(1e-6 * decay ** 4, rel=1e-3)


def tiny_mae(image_size: int = 16) -> MAE:
    return MAE(image_size=image_size, decoder_embed_dim=32, decoder_depth=1, decoder_num_heads=2, **SHAPE)


@pytest.mark.parametrize("pool", ["avg", "token"])
def test_mae_checkpoint_sets_the_encoder_exactly_leaves_the_head_new_and_no_decoder(pool, tmp_path):
    torch.manual_seed(0)
    mae = tiny_mae()
    with torch.no_grad():
        for p in mae.parameters():
            p.add_(torch.randn_like(p))  # unlike any fresh initialisation
    path = tmp_path / "mae.ckpt"
    torch.save({"state_dict": mae.state_dict(), "hyper_parameters": dict(mae.hparams)}, path)
    torch.manual_seed(1)
    fresh = classifier(global_pool=pool)
    torch.manual_seed(1)
    module = classifier(global_pool=pool, init_encoder=str(path))
    loaded = module.model.state_dict()
    encoder = mae.encoder.state_dict()
    expected = {k for k in encoder if pool == "token" or not k.startswith("norm.")}  # avg: fc_norm, no norm
    for key in expected:
        assert torch.equal(loaded[key], encoder[key]), key
        assert not torch.equal(fresh.model.state_dict()[key], encoder[key]), key
    new = set(loaded) - expected
    assert new == ({"head.weight", "head.bias"} | ({"fc_norm.weight", "fc_norm.bias"} if pool == "avg" else set()))
    assert 0 < module.model.head.weight.std() < 1e-4  # MAE main_finetune.py: trunc_normal_(std=2e-5)
    assert torch.equal(module.model.head.bias, torch.zeros(5))
    if pool == "avg":
        assert torch.equal(module.model.fc_norm.weight, torch.ones(32))
    assert not any("decoder" in k or "mask_token" in k for k in module.state_dict())


def test_mae_release_file_and_bad_files(tmp_path):
    """An MAE release ({"model": timm names + decoder_*}) loads too; wrong shapes and missing keys fail clearly."""
    torch.manual_seed(0)
    vit = timm.create_model("vit_base_patch16_224", num_classes=0, global_pool="token", img_size=16, **SHAPE)
    release = {**vit.state_dict(), "mask_token": torch.zeros(1, 1, 32), "decoder_embed.weight": torch.zeros(32, 32)}
    torch.save({"model": release}, tmp_path / "release.pth")
    module = classifier(global_pool="token", init_encoder=str(tmp_path / "release.pth"))
    assert torch.equal(module.model.blocks[2].mlp.fc2.weight, vit.blocks[2].mlp.fc2.weight)
    with pytest.raises(ValueError, match=r"wide\.pth.*model_kwargs"):
        wide = timm.create_model("vit_base_patch16_224", num_classes=0, img_size=16, **{**SHAPE, "embed_dim": 64})
        torch.save(wide.state_dict(), tmp_path / "wide.pth")
        classifier(init_encoder=str(tmp_path / "wide.pth"))
    with pytest.raises(KeyError, match=r"short\.pth.*blocks\.2"):
        torch.save({k: v for k, v in vit.state_dict().items() if not k.startswith("blocks.2.")}, tmp_path / "short.pth")
        classifier(init_encoder=str(tmp_path / "short.pth"))
    with pytest.raises(FileNotFoundError, match="model.init_encoder"):
        classifier(init_encoder=str(tmp_path / "missing.ckpt"))


def test_timm_export_with_head_loads_into_plain_timm():
    torch.manual_seed(0)
    module = classifier().eval()
    exported = classifier_to_timm({f"model.{k}": v for k, v in module.model.state_dict().items()})
    plain = timm.create_model("vit_base_patch16_224", num_classes=5, global_pool="avg", img_size=16, **SHAPE).eval()
    plain.load_state_dict(exported)  # strict
    images = torch.randn(2, 3, 16, 16)
    torch.testing.assert_close(plain(images), module(images), rtol=0, atol=0)
    with pytest.raises(KeyError, match="ImageClassifier"):
        classifier_to_timm({"encoder.cls_token": torch.zeros(1)})


def test_export_checkpoint_timm_format_writes_the_classifier_with_its_head(tmp_path):
    """``tools/export.py --format timm`` on a fine-tuned checkpoint: plain timm loads it strictly."""
    torch.manual_seed(0)
    module = classifier().eval()
    torch.save({"state_dict": module.state_dict()}, tmp_path / "ft.ckpt")
    export_checkpoint(str(tmp_path / "ft.ckpt"), "timm", str(tmp_path / "vit.safetensors"))
    plain = timm.create_model("vit_base_patch16_224", num_classes=5, global_pool="avg", img_size=16, **SHAPE).eval()
    plain.load_state_dict(read_state_dict(str(tmp_path / "vit.safetensors")))
    images = torch.randn(2, 3, 16, 16)
    torch.testing.assert_close(plain(images), module(images), rtol=0, atol=0)


def test_mixup_training_step_and_labels_are_checked():
    torch.manual_seed(0)
    module = classifier()
    batch = {"image": torch.randn(4, 3, 16, 16), "label": torch.tensor([0, 1, 2, 4])}
    loss = module.training_step(batch, 0)
    loss.backward()
    assert all(p.grad is not None for p in module.parameters())  # every parameter gets a gradient
    with pytest.raises(ValueError, match="num_classes=5"):
        module.training_step({"image": batch["image"], "label": torch.tensor([0, 1, 2, 5])}, 0)
    with pytest.raises(KeyError, match="cls"):
        module.validation_step({"image": batch["image"]}, 0)
    with pytest.raises(ValueError, match="even"):
        module.training_step({"image": batch["image"][:3], "label": batch["label"][:3]}, 0)


AUGMENT = {"auto_augment": "rand-m9-mstd0.5-inc1", "interpolation": "bicubic", "re_prob": 0.25, "re_mode": "pixel"}


def test_timm_train_transform_is_seeded_per_sample_and_leaves_global_rngs_alone():
    transform = timm_train_transform(16, (0.5,) * 3, (0.5,) * 3, (0.5, 1.0), True, AUGMENT)
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (20, 20, 3), dtype=np.uint8))
    torch.manual_seed(3)
    before = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state())
    first = transform(image, random.Random("a"))
    assert random.getstate() == before[0] and np.array_equal(np.random.get_state()[1], before[1])
    assert torch.equal(torch.get_rng_state(), before[2])
    assert torch.equal(first, transform(image, random.Random("a")))  # the sample's own draws
    assert any(not torch.equal(first, transform(image, random.Random(f"b{i}"))) for i in range(4))
    assert first.shape == (3, 16, 16) and first.dtype == torch.float32
    # Magnitude 10 makes RandAugment's PosterizeIncreasing keep 0 bits: a black image, no error.
    posterize = next(op for op in transform.transform.transforms[2].ops if op.name == "PosterizeIncreasing")
    assert posterize.aug_fn(image, 0).getextrema() == ((0, 0),) * 3
    with pytest.raises(ValueError, match="train_augment.*scale"):
        timm_train_transform(16, (0.5,) * 3, (0.5,) * 3, (0.5, 1.0), True, {"scale": (0.1, 1.0)})
    with pytest.raises(ValueError, match="train_augment"):
        timm_train_transform(16, (0.5,) * 3, (0.5,) * 3, (0.5, 1.0), True, {"no_such_option": 1})


def test_clip_checkpoint_with_a_timm_tower_initialises_the_vit(tmp_path):
    from mmssl.models.clip import CLIP

    torch.manual_seed(0)
    clip = CLIP(model_name=str(Path(__file__).resolve().parents[2] / "configs/models/clip_micro_timm.json"))
    torch.save({"state_dict": clip.state_dict()}, tmp_path / "clip.ckpt")
    module = ImageClassifier(num_classes=3, model_name="test_vit", image_size=160, global_pool="token",
                             init_encoder=str(tmp_path / "clip.ckpt"))
    trunk = clip.model.visual.trunk.state_dict()
    loaded = module.model.state_dict()
    assert set(loaded) - set(trunk) == {"head.weight", "head.bias"}
    for key, value in trunk.items():
        assert torch.equal(loaded[key], value), key
