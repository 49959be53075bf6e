"""configs/demo/m3ae.yaml through the real CLI: in process (trains, validates), and 2 DDP gloo
processes logging the validation figures of one."""

from __future__ import annotations

import csv
import os

import pytest
import torch

from tests.cli_runs import PG_TIMEOUT, REPO, last_metrics, run_mmssl, run_one_process

TINY_ARGS = ["--model.init_args.embed_dim=32", "--model.init_args.depth=2", "--model.init_args.num_heads=2",
             "--model.init_args.decoder_embed_dim=32", "--model.init_args.decoder_depth=1",
             "--model.init_args.decoder_num_heads=2"]
VAL_KEYS = {"val/loss", "val/image_loss", "val/text_loss", "val/masked_token_top1"}


def _train_losses(run) -> list[float]:
    with open(run / "metrics.csv", newline="") as f:
        return [float(r["train/loss"]) for r in csv.DictReader(f) if r.get("train/loss")]


def test_demo_config_trains_and_validates_in_process(tmp_path, tiny_demo):
    run_one_process([
        "fit", "--config", str(REPO / "configs/demo/m3ae.yaml"), *TINY_ARGS,
        f"--data.init_args.demo_dir={tiny_demo.root}", "--data.init_args.num_workers=0",
        "--data.init_args.batch_size=8", "--trainer.max_steps=20", "--trainer.log_every_n_steps=1",
        "--model.init_args.blr=0.05", "--model.init_args.warmup_steps=2",  # lr 1.6e-3 from step 2
        "--trainer.val_check_interval=10", "--trainer.check_val_every_n_epoch=null",
        "--trainer.limit_val_batches=2",
        f"--trainer.default_root_dir={tmp_path}", "--trainer.enable_progress_bar=false",
    ])
    run = tmp_path / "version_0"
    metrics = last_metrics(run, ("val/", "train/"))
    assert VAL_KEYS | {"train/loss", "train/image_loss", "train/text_loss"} <= metrics.keys()
    losses = _train_losses(run)
    assert len(losses) == 20 and all(torch.isfinite(torch.tensor(losses)))
    print("train/loss", [round(v, 3) for v in losses], {k: round(v, 4) for k, v in metrics.items()})
    assert sum(losses[-5:]) / 5 < 0.9 * sum(losses[:5]) / 5, losses  # 7.04 -> 5.67 when written
    assert 0 <= metrics["val/masked_token_top1"] <= 1
    assert metrics["val/loss"] == pytest.approx(metrics["val/image_loss"] + 0.5 * metrics["val/text_loss"], rel=1e-5)
    assert (run / "checkpoints" / "last.ckpt").is_file()


def test_two_processes_log_the_validation_figures_of_one(tmp_path, tiny_demo):
    """lr 0, one validation shard (rank 1 has no batch): 2 DDP ranks log the figures of 1 process."""
    val = f"{os.path.dirname(tiny_demo.val)}/0.tar"
    figures = []
    for processes in (1, 2):
        folder = tmp_path / f"p{processes}"
        folder.mkdir()
        args = [
            "fit", "--config", str(REPO / "configs/demo/m3ae.yaml"), *TINY_ARGS,
            f"--data.init_args.demo_dir={tiny_demo.root}", f"--data.init_args.val_data={val}",
            "--data.init_args.batch_size=4", "--data.init_args.num_workers=2", "--model.init_args.blr=0.0",
            "--trainer.max_epochs=1", "--trainer.limit_train_batches=2",
            f"--trainer.default_root_dir={folder / 'runs'}", "--trainer.enable_progress_bar=false",
        ]
        if processes == 2:
            args += ["--config", str(REPO / "configs/trainer/ddp_cpu.yaml"), PG_TIMEOUT]
        out = run_mmssl(args, folder) if processes == 2 else run_one_process(args)
        assert out.returncode == 0, out.stdout[-3000:]
        assert "sync_dist=True" not in out.stdout, out.stdout[-3000:]  # figures reduced as sums and counts
        figures.append(last_metrics(folder / "runs" / "version_0"))
    one, two = figures
    assert VAL_KEYS <= one.keys() and one.keys() == two.keys()
    for key in one:
        assert two[key] == pytest.approx(one[key], rel=1e-4, abs=1e-5), key


def test_a_sigkilled_two_process_run_resumes_bit_exactly(tmp_path, tmp_path_factory, tiny_demo):
    """2 DDP ranks SIGKILLed at step 3 and resumed with ``--ckpt_path last`` (its checkpoint: step 2)
    end with the uninterrupted run's weights on each rank, bit for bit: the image and caption masks
    each rank drew are drawn again, the data position and optimizer state restored (validation
    every 2 steps, rank 1 without a held-out batch). The uninterrupted run is the DDP reference of
    tests/checkpoints/test_fsdp2_m3ae.py (the same command, run once per session)."""
    from tests.checkpoints.test_fsdp2 import assert_resumed_as_whole, kill_and_resume
    from tests.checkpoints.test_fsdp2_m3ae import MODEL, STEPS, ddp_reference

    whole, killed = ddp_reference(tmp_path_factory, tiny_demo), tmp_path / "killed"
    kill_and_resume("m3ae", killed, tiny_demo, MODEL, STEPS, tmp_path, timeout=240)
    assert_resumed_as_whole(whole, killed)
