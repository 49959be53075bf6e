"""CLIP with MAE's masked-image reconstruction through the real CLI, validation on:
configs/demo/clip_mae.yaml on 2 gloo ranks, under DDP and under FSDP2, trains what one process
trains (tests.cli_runs.lockstep_runs: one global batch of the same 8 samples an epoch, SGD, no
shuffle within a rank, since each sample's mask is drawn by its index in the global batch). The
term is the mean over every masked patch of the global batch (dropping its world-size factor, or
masking by the rank's own row index, fails here), and ``val/masked_image_loss`` is one process's."""

from __future__ import annotations

import csv

import pytest
import torch

from tests.cli_runs import REPO, last_metrics, lockstep_runs

STEPS = 4
DECODER = "decoder_embed_dim: 16, decoder_depth: 1, decoder_num_heads: 2"


def _terms(run) -> dict[int, float]:
    """train/masked_image_loss by step, from the run's metrics.csv (logged every step)."""
    with open(run / "metrics.csv", newline="") as f:
        return {int(r["step"]): float(r["train/masked_image_loss"]) for r in csv.DictReader(f)
                if r.get("train/masked_image_loss")}


def test_clip_mae_on_two_ranks_under_ddp_and_fsdp2_trains_what_one_process_trains(tmp_path, tiny_clip_json):
    runs = lockstep_runs(tmp_path, str(REPO / "configs/demo/clip_mae.yaml"), lambda processes: [
        f"--model.init_args.model_name={tiny_clip_json}",
        f"--model.init_args.objectives.masked_image={{start: 2, {DECODER}}}",  # from step 2 of 4
        "--data.init_args.shuffle_buffer=1",
        f"--trainer.max_steps={STEPS}", f"--trainer.max_epochs={STEPS}", "--trainer.log_every_n_steps=1",
        "--trainer.val_check_interval=1.0", f"--trainer.check_val_every_n_epoch={STEPS}",
    ], fsdp2=True)
    one, one_run = runs[1]
    one_val = last_metrics(one_run, ("val/",))
    assert {"val/masked_image_loss", "val/contrastive_loss", "val/zero_shot_top1", "val/i2t_R@1"} <= one_val.keys()
    assert "objectives.masked_image.decoder.pred.weight" in one
    for key in (2, "fsdp2"):
        params, run = runs[key]
        terms = _terms(run)  # weighted 0 before its start, counted from it on (rank 0's share of the term)
        assert sorted(terms) == list(range(STEPS)) and terms[0] == terms[1] == 0.0, (key, terms)
        assert terms[2] > 0 and terms[3] > 0, (key, terms)
        val = last_metrics(run, ("val/",))
        assert val.keys() == one_val.keys(), key
        for name in ("val/masked_image_loss", "val/zero_shot_top1", "val/i2t_R@1", "val/t2i_R@5"):
            assert val[name] == pytest.approx(one_val[name], rel=1e-4, abs=1e-5), (key, name)
        for name, value in one.items():  # FSDP2 keeps open_clip's 0-d logit scale 1-D (mmssl.models.scalars)
            torch.testing.assert_close(params[name].reshape(value.shape), value, rtol=1e-4, atol=1e-5,
                                       msg=f"{key}: {name}")
