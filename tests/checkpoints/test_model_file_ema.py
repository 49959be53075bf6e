"""mmssl.checkpoints.model_file's readers and an EMA checkpoint: the raw weights by default, the
average with ``ema`` (WiSE-FT's ``--ema`` reads through ``read_lightning``), and a refusal where
there is no average. The tools' end-to-end runs: tests/tools/test_ema_tools.py."""

from __future__ import annotations

import pytest
import torch

from mmssl.checkpoints.model_file import read_lightning, read_model_file


def test_read_lightning_takes_the_raw_weights_unless_ema(tmp_path):
    raw = {"w": torch.zeros(2), "steps": torch.tensor(3)}
    averaged = {"w": torch.ones(2), "steps": torch.tensor(3)}
    path = tmp_path / "ema.ckpt"
    torch.save({"state_dict": averaged, "current_model_state": raw, "averaging_state": {"n_averaged": 3},
                "hyper_parameters": {"lr": 0.1}}, path)
    for ema, want in ((False, raw), (True, averaged)):
        got = read_lightning(str(path), ema=ema)
        assert got["state_dict"].keys() == want.keys() and got["hyper_parameters"] == {"lr": 0.1}
        assert all(torch.equal(got["state_dict"][k], want[k]) for k in want), ema
    plain = tmp_path / "plain.ckpt"
    torch.save({"state_dict": raw}, plain)
    assert torch.equal(read_lightning(str(plain))["state_dict"]["w"], raw["w"])
    with pytest.raises(ValueError, match="plain.ckpt"):
        read_lightning(str(plain), ema=True)
    with pytest.raises(ValueError, match="--ema"):
        read_model_file(str(plain), ema=True)
