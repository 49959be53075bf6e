"""A resume continues the EMA where the checkpoint left it: the update count comes back with the
average, so the first update after the resume averages (torch's ``AveragedModel`` copies the
weights while its count is 0). One process, a few steps: the CLI resumes (SIGKILL, 2 ranks)
against uninterrupted runs are in tests/checkpoints/test_resume.py."""

from __future__ import annotations

import lightning.pytorch as pl
import torch

from mmssl.callbacks import EMA
from mmssl.upstream import weight_averaging_model
from tests.callbacks.test_ema import _BNNet


def _fit(root, max_steps: int, ckpt_path=None) -> tuple[pl.Trainer, EMA, _BNNet]:
    torch.manual_seed(0)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(28, 4)), batch_size=4)
    ema, model = EMA(decay=0.8, evaluate="raw"), _BNNet()
    trainer = pl.Trainer(max_steps=max_steps, callbacks=[ema], logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, default_root_dir=root,
                         accelerator="cpu")
    trainer.fit(model, data, ckpt_path=ckpt_path)
    return trainer, ema, model


def test_the_first_update_after_a_resume_averages_from_the_checkpoints_average(tmp_path):
    first, _, _ = _fit(tmp_path / "first", 5)
    first.save_checkpoint(tmp_path / "step5.ckpt")
    checkpoint = torch.load(tmp_path / "step5.ckpt", weights_only=True)
    assert int(checkpoint["averaging_state"]["n_averaged"]) == 5
    _, ema, model = _fit(tmp_path / "resumed", 6, str(tmp_path / "step5.ckpt"))  # one more step, one update
    got, raw = ema.averaged_module().state_dict(), model.state_dict()
    for key in ("net.0.weight", "net.1.weight", "net.1.bias", "net.1.running_mean"):  # net.0.bias: no gradient
        want = 0.8 * checkpoint["state_dict"][key] + 0.2 * raw[key]
        torch.testing.assert_close(got[key], want, msg=key)
        # A copy is exact; a tolerance would call a bias of ~1e-9 (BatchNorm's, barely moved) copied on some CPUs.
        assert not torch.equal(got[key], raw[key]), f"{key}: the update copied the weights"
    assert int(weight_averaging_model(ema).n_averaged) == 6
