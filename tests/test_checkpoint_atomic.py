"""A crash while writing a checkpoint leaves the previous one whole (Lightning's atomic save)."""

import fsspec.implementations.local as local_fs
import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel

from mmssl.checkpoints import read_checkpoint


def test_crash_mid_write_keeps_previous_last_ckpt(tmp_path, monkeypatch):
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_last=True, save_top_k=0)
    trainer = pl.Trainer(max_steps=2, callbacks=[ckpt], logger=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(BoringModel())
    last = tmp_path / "last.ckpt"
    good = read_checkpoint(str(last))
    assert good["global_step"] == 2

    real_write = local_fs.LocalFileOpener.write

    def write_half_then_die(self, data):
        real_write(self, data[: len(data) // 2])
        raise OSError("disk gone mid-write")

    monkeypatch.setattr(local_fs.LocalFileOpener, "write", write_half_then_die)
    trainer = pl.Trainer(max_steps=4, callbacks=[ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2,
                         save_last=True, save_top_k=0)], logger=False, enable_progress_bar=False,
                         enable_model_summary=False)
    with pytest.raises(OSError, match="disk gone"):
        trainer.fit(BoringModel(), ckpt_path=str(last))
    monkeypatch.undo()
    after = read_checkpoint(str(last))  # still loads: no half-written file replaced it
    assert after["global_step"] == 2
    for key, value in good["state_dict"].items():
        assert torch.equal(after["state_dict"][key], value)
