import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from mmssl.models.mae import MAE

TINY = dict(
    image_size=32, patch_size=4, embed_dim=64, depth=2, num_heads=4,
    decoder_embed_dim=32, decoder_depth=1, decoder_num_heads=4,
)


def test_forward_shapes_and_interface():
    model = MAE(**TINY)
    images = torch.randn(2, 3, 32, 32)
    loss, pred, mask = model(images)
    assert loss.ndim == 0 and pred.shape == (2, 64, 48) and mask.shape == (2, 64)
    assert mask.sum() == 2 * 48
    assert model.encode_image(images).shape == (2, 64)
    assert model.forward_features(images).shape == (2, 65, 64)
    assert len(model.forward_intermediates(images)) == 2
    recon, mask_img = model.reconstruct(images)
    assert recon.shape == images.shape and mask_img.shape == (2, 1, 32, 32)
    assert model.image_size == 32 and model.tokenizer is None and len(model.image_mean) == 3


def test_every_trainable_parameter_gets_a_gradient():
    model = MAE(**TINY)
    loss, _, _ = model(torch.randn(2, 3, 32, 32))
    loss.backward()
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert "decoder.mask_token" in names and "encoder.cls_token" in names
    for name, param in model.named_parameters():
        if param.requires_grad:
            assert param.grad is not None and param.grad.abs().sum() > 0, name
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen == {"encoder.pos_embed", "decoder.pos_embed"}  # fixed sin-cos, MAE sec. A.1


@pytest.mark.parametrize("kwargs, match", [
    (dict(mask_ratio=0.0), "mask_ratio"),
    (dict(mask_ratio=1.0), "mask_ratio"),
    (dict(image_size=30), "image_size"),
    (dict(decoder_num_heads=5), "decoder_num_heads"),
])
def test_bad_config_fails_early(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MAE(**{**TINY, **kwargs})


def test_loss_falls_on_a_fixed_batch():
    torch.manual_seed(0)
    model = MAE(**TINY)
    images = torch.randn(4, 3, 32, 32).cumsum(-1).cumsum(-2) / 10  # smooth, learnable images
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, betas=(0.9, 0.95))
    generator = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(30):
        loss, _, _ = model(images, generator)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5, losses


class Images(Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        return {"image": torch.randn(3, 32, 32, generator=torch.Generator().manual_seed(i))}


class ImageData(L.LightningDataModule):
    batch_size = 4

    def train_dataloader(self):
        return DataLoader(Images(), batch_size=self.batch_size)

    def val_dataloader(self):
        return DataLoader(Images(), batch_size=self.batch_size)


def test_blr_scaling_groups_and_schedule(tmp_path):
    model = MAE(**TINY, blr=1.5e-4, warmup_steps=2)
    trainer = L.Trainer(
        max_steps=3, accumulate_grad_batches=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, default_root_dir=tmp_path, limit_val_batches=1,
    )
    trainer.fit(model, datamodule=ImageData())
    optimizer = trainer.optimizers[0]
    expected = 1.5e-4 * 4 * 1 * 2 / 256  # blr x batch x world x accumulation / 256
    assert all(g["initial_lr"] == pytest.approx(expected) for g in optimizer.param_groups)
    assert optimizer.defaults["betas"] == (0.9, 0.95)
    decayed, plain = optimizer.param_groups
    assert plain["weight_decay"] == 0.0 and decayed["weight_decay"] == 0.05
    no_decay = {id(p) for p in plain["params"]}
    # Official pretraining (timm 0.3.2 add_weight_decay, empty skip list): 1-D and biases only.
    for name in ("encoder.blocks.0.norm1.weight", "decoder.pred.bias"):
        assert id(model.get_parameter(name)) in no_decay, name
    for name in ("encoder.cls_token", "decoder.mask_token", "decoder.embed.weight"):
        assert id(model.get_parameter(name)) not in no_decay, name
    assert not model.encoder.pos_embed.requires_grad  # fixed sin-cos: in no group
    assert trainer.lr_scheduler_configs[0].interval == "step"
    assert "val/loss" in trainer.callback_metrics and "train/loss" in trainer.callback_metrics
