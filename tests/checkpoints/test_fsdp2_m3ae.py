"""M3AE under FSDP2 through the real CLI (2 gloo processes, validation on one shard): it trains the
weights a DDP run trains and logs the same held-out figures, its checkpoint a DCP folder.

The DDP run is ``ddp_reference``: also the uninterrupted run of tests/models/test_m3ae_cli.py's SIGKILL
test, run once per session."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mmssl.checkpoints.read import read_checkpoint
from tests.checkpoints.test_fsdp2 import DDP, FSDP2, _args, _ok, _params
from tests.cli_runs import last_metrics, run_mmssl, shared_run
from tests.tiny import TINY_MAE_FLAGS

MODEL = [*TINY_MAE_FLAGS, "--model.init_args.blr=0.05", "--model.init_args.warmup_steps=1"]
STEPS = 4


def ddp_reference(tmp_path_factory, demo) -> Path:
    """The folder of a 2-process DDP M3AE run of STEPS steps (``_args``: a checkpoint each step, the
    weights at start and end, validation every 2 steps on one shard), run once per session."""
    return shared_run(tmp_path_factory, lambda root: [*_args("m3ae", root, demo, MODEL, STEPS), *DDP], timeout=240)


def test_fsdp2_m3ae_trains_as_ddp(tmp_path, tmp_path_factory, tiny_demo):
    _ok(run_mmssl([*_args("m3ae", tmp_path / "fsdp2", tiny_demo, MODEL, STEPS), *FSDP2], tmp_path, timeout=240))
    ddp_run = ddp_reference(tmp_path_factory, tiny_demo)
    fsdp2, ddp = _params(tmp_path / "fsdp2"), _params(ddp_run)
    assert fsdp2.keys() == ddp.keys() and any("text_pred" in k for k in ddp)
    start = _params(tmp_path / "fsdp2", "start_rank0.pt")
    assert any(not torch.equal(fsdp2[k], start[k]) for k in fsdp2), "the FSDP2 run never changed its weights"
    for key in ddp:  # reduce-scatter against all-reduce: the same mean in another summation order
        torch.testing.assert_close(fsdp2[key], ddp[key], rtol=1e-4, atol=1e-5, msg=key)
    got, want = last_metrics(tmp_path / "fsdp2" / "version_0"), last_metrics(ddp_run / "version_0")
    for key in ("val/loss", "val/image_loss", "val/text_loss", "val/masked_token_top1"):
        assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-5), key
    folder = tmp_path / "fsdp2" / "kept" / f"step={STEPS}.ckpt"
    assert folder.is_dir() and (folder / ".metadata").is_file()
    torch.testing.assert_close(read_checkpoint(str(folder))["state_dict"]["text_pred.weight"],
                               fsdp2["text_pred.weight"], rtol=0, atol=0)
