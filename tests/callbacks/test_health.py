"""EmbeddingHealth in a real Trainer: its step cadence, the once-only collapse warning, its buffer."""

from __future__ import annotations

import csv
import types
import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader

from mmssl.callbacks import EmbeddingHealth
from mmssl.data.heldout import read_heldout
from mmssl.data.transforms import eval_transform
from tests.data.shard_helpers import image_bytes, write_shards_with_bad, write_tar


def index_tokenizer(texts: list[str]) -> torch.Tensor:
    """'caption 7' -> [[7]]: the tokens say which sample each row is."""
    return torch.tensor([[int(t.split()[1])] for t in texts])


class TinyImageModel(pl.LightningModule):
    """An image-only model with the probe protocol; ``collapsed`` maps every image onto one line."""

    image_size, image_mean, image_std = 8, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)

    def __init__(self, collapsed: bool) -> None:
        super().__init__()
        self.collapsed = collapsed
        self.net = nn.Linear(3 * 8 * 8, 16)

    def encode_image(self, images: torch.Tensor) -> torch.Tensor:
        z = self.net(images.flatten(1))  # (B, 16)
        return z[:, :1] * torch.ones(1, 16) if self.collapsed else z

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.net(batch).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_read_heldout_keeps_the_first_n_readable_samples_in_order(tmp_path):
    write_shards_with_bad(tmp_path, good=[3, 3], bad={1: 1})  # samples 0-2, a broken JPEG, 3-5
    buffer = read_heldout(f"{tmp_path}/{{00000..00001}}.tar", eval_transform(8), index_tokenizer, limit=5)
    assert len(buffer) == 5 and buffer.skipped == 1
    assert buffer.tokens.flatten().tolist() == [0, 1, 2, 3, 4]
    assert read_heldout(f"{tmp_path}/00000.tar", eval_transform(8)).tokens is None  # images only


@pytest.mark.parametrize("collapsed", [True, False])
def test_every_n_steps_logs_each_step_and_a_collapse_warns_once(collapsed, tmp_path):
    (tmp_path / "val").mkdir()
    write_shards_with_bad(tmp_path / "val", good=[6], bad={})
    # 6 samples bound RankMe by 6: the warning is due below 0.25 x 6 (solid-colour images
    # span a few directions only: a healthy RankMe here is 2 to 4).
    health = EmbeddingHealth(data=str(tmp_path / "val" / "00000.tar"), every_n_steps=1, collapse_threshold=0.25,
                             batch_size=4)
    # every_n_steps logs from the training loop, which is what this checks: no validation, so every
    # figure in metrics.csv came from a training step (the validation path, 1 against 2 ranks: tests/test_ddp.py).
    trainer = pl.Trainer(max_steps=3, limit_val_batches=0, logger=CSVLogger(tmp_path, name="run"), callbacks=[health],
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(TinyImageModel(collapsed), DataLoader(torch.randn(12, 192), batch_size=4))
    collapse = [w for w in caught if "collapsing" in str(w.message)]
    assert len(collapse) == (1 if collapsed else 0), [str(w.message) for w in caught]
    with open(tmp_path / "run" / "version_0" / "metrics.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get("health/rankme")]
    assert [int(r["step"]) for r in rows] == [1, 2, 3]
    rank = float(rows[-1]["health/rankme"])
    assert rank == pytest.approx(1.0, abs=1e-3) if collapsed else rank > 1.5
    assert "health/modality_gap" not in rows[0]  # image-only: no text figures
    # An image model's positive pair is the image and its flip: alignment is defined and finite.
    assert 0 <= float(rows[-1]["health/alignment"]) <= 4


def test_a_missing_set_is_refused_at_setup_naming_the_key_and_no_set_turns_it_off(tmp_path):
    trainer = types.SimpleNamespace(datamodule=None, limit_val_batches=1.0, is_global_zero=True)
    health = EmbeddingHealth(data=str(tmp_path / "nowhere" / "{0..1}.tar"))
    with pytest.raises(FileNotFoundError, match="EmbeddingHealth: init_args.data="):
        health.setup(trainer, TinyImageModel(False), "validate")
    (tmp_path / "one").mkdir()
    write_tar(tmp_path / "one" / "0.tar", [("a.jpg", image_bytes(0))])
    with pytest.raises(ValueError, match="gave 1 readable samples"):
        EmbeddingHealth(data=str(tmp_path / "one" / "0.tar")).setup(trainer, TinyImageModel(False), "validate")
    health = EmbeddingHealth()  # no set anywhere: a warning, and the callback does nothing
    with pytest.warns(UserWarning, match="no held-out set"):
        health.setup(trainer, TinyImageModel(False), "validate")
    assert health.evaluate(trainer, TinyImageModel(False)) == {}
