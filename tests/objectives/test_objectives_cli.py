"""Composed objectives through the real CLI, validation on: configs/demo/siglip_caption.yaml (the
sigmoid loss plus captioning, from CLIP's module) on 2 gloo ranks, under DDP and under FSDP2,
trains what one process trains,
and its caption term switches on at the configured fraction of the run on both.

tests.cli_runs.lockstep_runs: an 8-sample training set, 4 per rank on 2 ranks and 8 in one process,
so every epoch is one global batch of the same 8 samples and both runs take the same optimizer
steps; SGD. The caption term is a token mean over the whole global batch (each rank's share
rescaled by its token count), the sigmoid loss a sum over all pairs: both are one process's on 2
ranks, so the weights must agree.
"""

from __future__ import annotations

import csv

import pytest
import torch

from tests.cli_runs import REPO, last_metrics, lockstep_runs

STEPS = 4  # one global batch an epoch


def _caption_terms(run) -> dict[int, float]:
    """train/caption_loss by step, from the run's metrics.csv (logged every step here)."""
    with open(run / "metrics.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get("train/caption_loss")]
    return {int(r["step"]): float(r["train/caption_loss"]) for r in rows}


def test_siglip_with_captioning_on_two_ranks_trains_what_one_process_trains(tmp_path, tiny_coca_json):
    runs = lockstep_runs(tmp_path, str(REPO / "configs/demo/siglip_caption.yaml"), lambda processes: [
        f"--model.init_args.model_name={tiny_coca_json}",
        "--model.init_args.objectives.caption.start=0.5",  # from step 2 of 4
        f"--trainer.max_steps={STEPS}", f"--trainer.max_epochs={STEPS}", "--trainer.log_every_n_steps=1",
        "--trainer.val_check_interval=1.0", f"--trainer.check_val_every_n_epoch={STEPS}",
    ], fsdp2=True)
    runs = {p: (params, last_metrics(run, ("val/",)), _caption_terms(run)) for p, (params, run) in runs.items()}
    one, one_val, one_terms = runs[1]
    assert {"val/loss", "val/contrastive_loss", "val/caption_loss", "val/caption_token_top1",
            "val/zero_shot_top1"} <= one_val.keys()
    assert "model.logit_bias" in one and "model.text_decoder.text_projection" in one
    for strategy in (2, "fsdp2"):  # DDP and FSDP2 on 2 ranks
        two, two_val, two_terms = runs[strategy]
        for terms in (one_terms, two_terms):  # weighted 0 before its start, counted from it on
            assert sorted(terms) == list(range(STEPS)), (strategy, terms)
            assert terms[0] == terms[1] == 0.0 and terms[2] > 0 and terms[3] > 0, (strategy, terms)
        assert two_val.keys() == one_val.keys(), strategy
        # Token means and whole-set figures match; val/loss and val/contrastive_loss are in-batch (4 vs 8).
        for key in ("val/caption_loss", "val/caption_token_top1", "val/zero_shot_top1", "val/i2t_R@1",
                    "val/t2i_R@5"):
            assert two_val[key] == pytest.approx(one_val[key], rel=1e-4, abs=1e-5), (strategy, key)
        for name, value in one.items():  # FSDP2 keeps open_clip's 0-d scalars 1-D (mmssl.models.scalars)
            torch.testing.assert_close(two[name].reshape(value.shape), value, rtol=1e-4, atol=1e-5,
                                       msg=f"{strategy}: {name}")
