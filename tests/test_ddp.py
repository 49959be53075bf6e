"""DDP through the real CLI: 2 CPU processes (gloo), stacked with configs/trainer/ddp_cpu.yaml."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("recipe", ["clip", "mae"])
def test_two_process_ddp_ends_with_identical_parameters(recipe, tmp_path, tiny_demo, tiny_clip_json):
    model_args = [f"--model.init_args.model_name={tiny_clip_json}"] if recipe == "clip" else [
        "--model.init_args.embed_dim=32", "--model.init_args.depth=1", "--model.init_args.num_heads=2",
        "--model.init_args.decoder_embed_dim=32", "--model.init_args.decoder_depth=1",
        "--model.init_args.decoder_num_heads=2",
    ]
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([
        sys.executable, "-m", "mmssl", "fit",
        "--config", str(REPO / f"configs/demo/{recipe}.yaml"),
        "--config", str(REPO / "configs/trainer/ddp_cpu.yaml"),
        *model_args,
        f"--data.init_args.demo_dir={tiny_demo.root}", "--data.init_args.batch_size=4",
        "--data.init_args.num_workers=0", "--trainer.max_steps=3", "--trainer.limit_val_batches=0",
        f"--trainer.default_root_dir={tmp_path / 'runs'}", "--trainer.enable_progress_bar=false",
        "--trainer.callbacks+=helpers.DumpParams", f"--trainer.callbacks.folder={tmp_path / 'params'}",
    ], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "world_size=2" in out.stdout and "global_batch_size=8" in out.stdout
    rank0 = torch.load(tmp_path / "params" / "rank0.pt")
    rank1 = torch.load(tmp_path / "params" / "rank1.pt")
    start = torch.load(tmp_path / "runs" / "version_0" / "checkpoints" / "last.ckpt", weights_only=False)
    assert start["global_step"] == 3
    assert rank0.keys() == rank1.keys()
    for name in rank0:
        torch.testing.assert_close(rank0[name], rank1[name], rtol=0, atol=0, msg=name)
