"""A newcomer's demo run prints only the warnings that matter: two steps of the CLIP demo, in a
fresh process (as a user runs it), and the exact set of warnings its output holds."""

from __future__ import annotations

import json
import re

from tests.cli_runs import run_mmssl
from tests.conftest import REPO

# What a warning looks like in the output: Python's "path:line: message" (Lightning's
# rank_zero_warn format; warnings.warn adds "Category: " before the message) or a logging
# "WARNING:logger:message" line.
WARNING_LINE = re.compile(r"^(?:(?P<path>\S+\.py):\d+: (?:\w+Warning: )?|WARNING:[\w.]*:)(?P<message>.+)$")

# Nothing mmssl could prevent is left: the CSV logger writes into its own reserved run folder
# (no "Experiment logs directory ... exists" note), and the data module's deliberate loader length
# no longer draws Lightning's IterableDataset note.
EXPECTED: set[tuple[str, str]] = set()
# Lightning 2.6 calling a torch 2.9 deprecated pytree API: present or not by version.
OPTIONAL = {("_pytree.py", "`isinstance(treespec, LeafSpec)` is deprecated")}


def warnings_in(output: str) -> set[tuple[str, str]]:
    found = set()
    for line in output.splitlines():
        m = WARNING_LINE.match(line.strip())
        if m:
            origin = m["path"].rsplit("/", 1)[-1] if m["path"] else "logging"
            prefix = next(
                (p for o, p in EXPECTED | OPTIONAL if o == origin and m["message"].startswith(p)), m["message"]
            )
            found.add((origin, prefix))
    return found


def test_two_demo_steps_print_only_the_warnings_that_matter(tmp_path, tiny_demo, tiny_clip_json):
    out = run_mmssl([
        "fit", "--config", str(REPO / "configs/demo/clip.yaml"),
        f"--model.init_args.model_name={tiny_clip_json}", f"--data.init_args.demo_dir={tiny_demo.root}",
        "--data.init_args.batch_size=16", "--data.init_args.num_workers=0",
        # Two steps (and a logging interval that fits them), then validation with zero-shot.
        "--trainer.max_epochs=1", "--trainer.limit_train_batches=2", "--trainer.log_every_n_steps=1",
        "--trainer.limit_val_batches=1", f"--trainer.default_root_dir={tmp_path}",
        "--trainer.enable_progress_bar=false",
    ], tmp_path, timeout=240)
    assert out.returncode == 0, out.stdout[-3000:]
    found = warnings_in(out.stdout)
    assert found - OPTIONAL == EXPECTED, "\n".join(sorted(map(str, found)))
    # Validation ran (zero-shot on the demo's labelled split) and the FLOPs were counted.
    assert "val/zero_shot_top1" in out.stdout
    compute = json.loads(next(tmp_path.rglob("compute.json")).read_text())
    assert compute["flops_per_step_per_device"] > 0
    # The model table shows no FLOPs of zero (Lightning's count needs an example_input_array); the
    # step's count is printed instead.
    assert "Total FLOPs" not in out.stdout and "┃ FLOPs" not in out.stdout
    assert f"mmssl: {compute['flops_per_step_per_device'] / 1e9:.3g} GFLOP per training step" in out.stdout


def test_building_a_clip_drops_only_open_clips_random_init_notice(tiny_clip_json, caplog):
    import logging

    from mmssl.models.clip import CLIP

    filters = list(logging.getLogger().filters)
    with caplog.at_level(logging.WARNING):
        CLIP(model_name=tiny_clip_json)  # weights come later (a checkpoint) or are meant random
        logging.warning("No pretrained weights loaded for model 'x'. Model initialized randomly.")
    # Dropped during the model's creation only: the same message logged afterwards still shows.
    assert [r.getMessage() for r in caplog.records] == [
        "No pretrained weights loaded for model 'x'. Model initialized randomly."
    ]
    assert logging.getLogger().filters == filters
