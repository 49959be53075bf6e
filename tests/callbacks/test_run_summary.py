"""RunSummary's FLOP count reaches Lightning's ThroughputMonitor (``flops_per_batch``), without
its "you need to define a flops_per_batch" warning, and survives a checkpoint; the model table
shows no FLOPs of zero, and the step's count is printed."""

from __future__ import annotations

import json
import logging
import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelSummary
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from mmssl.callbacks import RunSummary, Throughput
from mmssl.flops import COMPUTE_FILE


class _Linear(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 4)

    def training_step(self, batch, batch_idx):
        return self.layer(batch["image"]).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _batches(n: int = 6) -> DataLoader:
    return DataLoader([{"image": torch.randn(2, 8)} for _ in range(n)], batch_size=None)


def test_flops_reach_the_throughput_monitor_and_the_checkpoint(tmp_path):
    model, summary = _Linear(), RunSummary()
    trainer = pl.Trainer(
        max_steps=6, accelerator="cpu", logger=CSVLogger(tmp_path, name="", version=0), log_every_n_steps=1,
        callbacks=[summary, Throughput(window_size=2)], enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, _batches())
    assert not [w for w in caught if "flops_per_batch" in str(w.message)]
    # A (2, 8) x (8, 4) layer: forward 2*2*8*4; backward the weight gradient alone (the input
    # needs none), as many again.
    per_step = json.loads((tmp_path / "version_0" / COMPUTE_FILE).read_text())["flops_per_step_per_device"]
    assert per_step == model.flops_per_batch == 2 * (2 * 2 * 8 * 4)
    logged = (tmp_path / "version_0" / "metrics.csv").read_text().splitlines()[0].split(",")
    assert "train/device/flops_per_sec" in logged
    # A resumed run (no count after step 0) gets the figure back from the checkpoint's state.
    restored = RunSummary()
    restored.load_state_dict(summary.state_dict())
    assert restored.flops_per_step_per_device == per_step


@pytest.mark.parametrize("table", ["rich", "text"])
def test_the_model_table_shows_no_zero_flops_and_the_step_count_is_printed(tmp_path, table, capsys, caplog):
    # Lightning's table counts FLOPs as a forward of example_input_array: zeros for a module
    # without one. The table keeps its other columns.
    callbacks = [RunSummary(), *([ModelSummary(max_depth=2)] if table == "text" else [])]
    trainer = pl.Trainer(max_steps=1, accelerator="cpu", logger=False, callbacks=callbacks, enable_progress_bar=False,
                         enable_checkpointing=False, default_root_dir=tmp_path)
    with caplog.at_level(logging.INFO):
        trainer.fit(_Linear(), _batches())
    out = capsys.readouterr().out + caplog.text
    assert "Total params" in out and "layer" in out and "Linear" in out
    assert "FLOPs" not in out.replace("FLOPs per step", "") and "Total Flops" not in out
    assert "FLOPs per step" in out and "mmssl: 2.56e-07 GFLOP per training step per device" in out  # 2 * 2*2*8*4
