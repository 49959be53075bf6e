"""SigLIP 2's recipe through the real CLI, validation on: configs/demo/siglip2.yaml (sigmoid loss,
captioning, self-distillation and masked prediction against the EMA callback's teacher, local crops
from the data module) on 2 gloo ranks trains what one process trains, the two late terms switching
on at the configured fraction of the run on both (tests.cli_runs.lockstep_runs: one global batch of
the same 8 samples an epoch, SGD, no shuffle within a rank: the masks are drawn per sample by its
index in the global batch). Sinkhorn-Knopp's sums are all-reduced, so the teacher's targets are
those of the global batch on both; the masked term's mean is over every rank's patches (dropping
its world-size factor fails here)."""

from __future__ import annotations

import csv

import pytest
import torch

from tests.cli_runs import REPO, last_metrics, lockstep_runs

STEPS = 4
LATE = ("self_distill", "masked_features")
HEAD = "out_dim: 256, hidden_dim: 128, bottleneck_dim: 64"  # configs/demo/siglip2.yaml's


def _terms(run) -> dict[str, dict[int, float]]:
    """train/<name>_loss of the late terms by step, from the run's metrics.csv (logged every step)."""
    with open(run / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    return {name: {int(r["step"]): float(r[f"train/{name}_loss"]) for r in rows if r.get(f"train/{name}_loss")}
            for name in LATE}


def test_siglip2_on_two_ranks_trains_what_one_process_trains(tmp_path, tiny_coca_json):
    runs = lockstep_runs(tmp_path, str(REPO / "configs/demo/siglip2.yaml"), lambda processes: [
        f"--model.init_args.model_name={tiny_coca_json}",
        # A flag on one key of an objective replaces its whole mapping: the demo's head sizes again.
        *(f"--model.init_args.objectives.{name}={{start: 0.5, weight: {weight}, {HEAD}}}"  # from step 2 of 4
          for name, weight in zip(LATE, (0.25, 0.0625))),
        # The masks are drawn per sample by its index in the global batch: one process must see the
        # 8 samples in the order of the ranks' batches put end to end, so no shuffle within a rank.
        "--data.init_args.shuffle_buffer=1",
        f"--trainer.max_steps={STEPS}", f"--trainer.max_epochs={STEPS}", "--trainer.log_every_n_steps=1",
        "--trainer.val_check_interval=1.0", f"--trainer.check_val_every_n_epoch={STEPS}",
    ])
    (two, two_run), (one, one_run) = runs[2], runs[1]
    for run in (one_run, two_run):
        for name, terms in _terms(run).items():  # weighted 0 before its start, counted from it on
            assert sorted(terms) == list(range(STEPS)), (name, terms)
            assert terms[0] == terms[1] == 0.0 and terms[2] > 0 and terms[3] > 0, (name, terms)
    one_val, two_val = last_metrics(one_run, ("val/",)), last_metrics(two_run, ("val/",))
    assert {"val/self_distill_loss", "val/masked_features_loss", "val/caption_loss", "val/zero_shot_top1"} <= \
        one_val.keys() == two_val.keys()
    for key in ("val/self_distill_loss", "val/masked_features_loss", "val/caption_loss", "val/zero_shot_top1"):
        assert two_val[key] == pytest.approx(one_val[key], rel=1e-4, abs=1e-5), key
    assert "objectives.self_distill.head.prototypes" in one and "objectives.masked_features.mask_token" in one
    for name, value in one.items():
        torch.testing.assert_close(two[name], value, rtol=1e-4, atol=1e-5, msg=name)
