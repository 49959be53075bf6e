"""MAE on 2 gloo CPU processes: per-rank masks and the global-batch learning-rate rule."""

import json

import lightning as L
import pytest
import torch

from mmssl.models.mae import MAE
from tests.models.test_mae import TINY, ImageData


class Probe(MAE):
    """Records, on rank 0, whether the ranks drew different masks and the LR in use."""

    def __init__(self, report: str, **kwargs):
        super().__init__(**kwargs)
        self.report = report

    def training_step(self, batch, batch_idx):
        loss, _, mask = self(batch["image"])
        masks = self.all_gather(mask)  # (world, B, L)
        if self.global_rank == 0 and batch_idx == 0:
            lr = self.trainer.optimizers[0].param_groups[0]["initial_lr"]
            with open(self.report, "w") as f:
                json.dump({"masks_differ": not torch.equal(masks[0], masks[1]), "lr": lr}, f)
        return loss


@pytest.mark.filterwarnings("ignore")
def test_two_ranks_draw_different_masks_and_scale_lr(tmp_path):
    L.seed_everything(0)  # the same seed on every rank, as LightningCLI's seed_everything does
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy="ddp_spawn", max_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, limit_val_batches=1,
        default_root_dir=tmp_path,
    )
    report = tmp_path / "report.json"
    trainer.fit(Probe(str(report), **TINY, blr=1.5e-4), datamodule=ImageData())
    result = json.loads(report.read_text())
    assert result["masks_differ"]  # MAE main_pretrain.py: seed + rank
    assert result["lr"] == pytest.approx(1.5e-4 * 4 * 2 / 256)  # blr x batch x world / 256
