"""Preemption: a run killed with SIGKILL resumes from its last periodic checkpoint."""

import os
import subprocess
import sys
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "mmssl", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


def test_sigkilled_run_resumes_with_schedule_and_step_count(tmp_path, tiny_demo, tiny_clip_json):
    overrides = {
        "trainer": {
            "max_steps": 8, "limit_val_batches": 0, "enable_progress_bar": False,
            "default_root_dir": str(tmp_path / "runs"),
            "callbacks": [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                           "init_args": {"every_n_train_steps": 2, "save_last": True}}],
        },
        "model": {"init_args": {"model_name": tiny_clip_json, "warmup_steps": 2}},
        "data": {"init_args": {"demo_dir": tiny_demo.root, "batch_size": 8, "num_workers": 0}},
    }
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump(overrides))
    base = ["fit", "--config", str(REPO / "configs/demo/clip.yaml"), "--config", str(cfg)]

    killed = _run([*base, "--trainer.callbacks+=helpers.KillAtStep", "--trainer.callbacks.step=5"], tmp_path)
    assert killed.returncode == -9, killed.stderr[-2000:]
    last = tmp_path / "runs" / "version_0" / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=False)["global_step"] == 4  # the last periodic save

    resumed = _run([*base, "--ckpt_path=last"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert not (tmp_path / "runs" / "version_1").exists()  # continued in the same run folder
    ckpt = torch.load(last, weights_only=False)
    assert ckpt["global_step"] == 8
    # The LR schedule continued from step 4 instead of restarting its warm-up at 0.
    scheduler = ckpt["lr_schedulers"][0]
    assert scheduler["last_epoch"] == 8 and scheduler["_step_count"] == 9  # 1 + 8 steps, not 1 + 4
    assert "Restoring states from the checkpoint" in resumed.stdout + resumed.stderr
