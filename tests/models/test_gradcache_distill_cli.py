"""GradCache and distillation through the real CLI: 2 gloo ranks with GradCache chunking and a
teacher train what one plain process with the teacher trains, validation on.

An 8-sample training set, 4 per rank on 2 ranks, 8 in one process: every epoch is ONE global batch
holding all 8 samples in both runs (mmssl.data.plan deals contiguous runs and shuffles within a
rank), so the two runs take the same optimizer steps (the contrastive loss does not depend on the
order of the pairs). The 2-process run chunks 3 + 1 per rank; the one-process run does not chunk.
The teacher has another width and context, so the projection, the second tokenisation, the
teacher's gathered logits and its chunked forward are all in the step. Gradient clipping, the
warm-up/cosine schedule, NonFiniteGuard and validation (zero-shot, loss, retrieval) are all on.
FLIP is off here: each rank draws its own masks, so masked runs of 1 and 2 processes differ by
design (chunked FLIP against the whole batch on 1 and 2 ranks, and accumulation:
tests/models/test_gradcache.py). Both runs must end with the same weights.
"""

from __future__ import annotations

import json

import pytest
import torch

from mmssl.checkpoints import read_checkpoint
from mmssl.models.clip import CLIP
from tests.cli_runs import REPO, last_metrics, lockstep_runs
from tests.models.test_distill import STUDENT, save_lightning


def test_two_chunked_ranks_with_a_teacher_train_what_one_process_trains(tmp_path, tiny_clip_json):
    torch.manual_seed(3)
    teacher = save_lightning(CLIP(tiny_clip_json), tmp_path / "teacher.ckpt")
    student = tmp_path / "student.json"
    student.write_text(json.dumps(STUDENT))

    def flags(processes: int) -> list[str]:
        chunk = 3 if processes == 2 else None
        return [
            f"--model.init_args.model_name={student}",
            f"--model.init_args.distill.teacher={teacher}",
            '--model.init_args.distill.weights={"contrastive": 1.0, "logits": 1.0, "features": 1.0}',
            f"--model.init_args.contrastive_chunk_size={chunk or 'null'}",
            "--trainer.max_epochs=2", "--trainer.gradient_clip_val=0.5", "--trainer.log_every_n_steps=1",
        ]

    runs = {p: (params, last_metrics(run, ("val/", "train/", "epoch")))
            for p, (params, run) in lockstep_runs(tmp_path, str(REPO / "configs/demo/clip.yaml"), flags).items()}
    (two, two_metrics), (one, one_metrics) = runs[2], runs[1]
    assert two_metrics["epoch"] == one_metrics["epoch"] == 1
    assert {"train/logits_loss", "train/features_loss", "val/loss", "val/zero_shot_top1"} <= two_metrics.keys()
    # (val/loss is an in-batch loss: batches of 4 per rank against 8 in one process differ by design)
    # (train/* are rank 0's own shares, logged unreduced; the weights below carry the whole loss)
    for key in ("val/zero_shot_top1", "val/zero_shot_top5", "val/i2t_R@1", "val/i2t_R@5", "val/t2i_R@5"):
        assert two_metrics[key] == pytest.approx(one_metrics[key], rel=1e-4, abs=1e-5), key
    assert "distiller.projection.weight" in one
    for name, value in one.items():
        torch.testing.assert_close(two[name], value, rtol=1e-4, atol=1e-5, msg=name)
    for processes in (1, 2):  # both trained: one optimizer step per epoch
        (last,) = (tmp_path / f"p{processes}" / "runs").glob("version_0/checkpoints/last.ckpt")
        checkpoint = read_checkpoint(str(last))
        assert checkpoint["global_step"] == 2 and checkpoint["teacher"]["path"] == str(teacher)
        assert not any("teacher" in k for k in checkpoint["state_dict"])
