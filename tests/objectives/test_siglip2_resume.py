"""SigLIP 2's recipe SIGKILLed and resumed across the switch of its late terms (issue #56 item 5):
2 DDP ranks with validation on, the EMA teacher, local crops and the two late terms starting at
step 2 of 5; killed at step 3, resumed with ``--ckpt_path last`` (its checkpoint: step 2, the terms
still off there), the run ends on the uninterrupted run's weights, heads and mask token included,
bit for bit on each rank: the EMA's average, the data position, every crop and mask drawn again."""

from __future__ import annotations

import csv

from tests.checkpoints.test_fsdp2 import DDP, _args, _ok, assert_resumed_as_whole, kill_and_resume
from tests.cli_runs import run_mmssl

STEPS = 5
LATE = ["--model.init_args.objectives.self_distill.start=2", "--model.init_args.objectives.masked_features.start=2"]


def test_a_sigkilled_run_resumes_across_the_late_terms_switch_bit_exactly(tmp_path, tiny_demo, tiny_coca_json):
    model = [f"--model.init_args.model_name={tiny_coca_json}", *LATE]
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    _ok(run_mmssl([*_args("siglip2", whole, tiny_demo, model, STEPS), *DDP], tmp_path, timeout=300))
    kill_and_resume("siglip2", killed, tiny_demo, model, STEPS, tmp_path, timeout=300)
    weights = assert_resumed_as_whole(whole, killed)
    assert {"objectives.self_distill.head.prototypes", "objectives.masked_features.mask_token"} <= weights.keys()
    # The late terms are 0 before step 2 and count from it, in the uninterrupted run and the resumed
    # one alike (the resumed run crossed the switch: its checkpoint was step 2's, before it).
    terms = [_late_terms(run / "version_0" / "metrics.csv") for run in (whole, killed)]
    assert terms[0] == terms[1], terms
    assert [step for step, values in terms[0].items() if all(v > 0 for v in values)] == [2, 3, 4], terms[0]
    assert terms[0][0] == terms[0][1] == (0.0, 0.0)


def _late_terms(path) -> dict[int, tuple[float, float]]:
    """train/self_distill_loss and train/masked_features_loss by step (logged every step)."""
    with open(path, newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get("train/self_distill_loss")]
    return {int(r["step"]): (float(r["train/self_distill_loss"]), float(r["train/masked_features_loss"]))
            for r in rows}
