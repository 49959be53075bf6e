"""docs/parity.md cannot go stale: every ``open_clip_train`` argument has its row, and every mmssl
key, callback argument, model-config field and tool the table names exists.

The arguments are those of ``open_clip_train/params.py`` in open_clip v3.3.0 (src/open_clip_train/
params.py at the v3.3.0 tag; the same file ships in the open_clip_torch 3.3.0 wheel), stored here
so the test needs no open_clip_train; where it is installed at 3.3.0 the list is checked against
its parser too."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import inspect
import re
from pathlib import Path

import lightning.pytorch.callbacks as lightning_callbacks
import open_clip
import pytest
import yaml
from open_clip.model import CLIPTextCfg, CLIPVisionCfg

import mmssl.callbacks
from tests.test_docs import resolve

REPO = Path(__file__).resolve().parents[1]
TABLE = REPO / "docs/parity.md"

# open_clip_train 3.3.0 params.py: every option string of its parser, in order.
PARAMS_3_3 = """
-h --help --train-data --train-data-upsampling-factors --val-data --train-num-samples --val-num-samples
--dataset-type --dataset-resampled --csv-separator --csv-img-key --csv-caption-key --imagenet-val --imagenet-v2
--cache-dir --logs --log-local --name --workers --batch-size --epochs --epochs-cooldown --lr --beta1 --beta2 --eps
--wd --momentum --warmup --opt --use-bn-sync --skip-scheduler --lr-scheduler --lr-cooldown-end --lr-cooldown-power
--save-frequency --save-most-recent --zeroshot-frequency --val-frequency --resume --precision --model --pretrained
--pretrained-image --lock-image --lock-image-unlocked-groups --lock-image-freeze-bn-stats --image-mean --image-std
--image-interpolation --image-resize-mode --aug-cfg --grad-checkpointing --local-loss --gather-with-grad
--force-context-length --force-image-size --force-quick-gelu --force-patch-dropout --force-custom-text
--torchscript --torchcompile --trace --accum-freq --device --dist-url --dist-backend --report-to --wandb-notes
--wandb-project-name --debug --copy-codebase --horovod --ddp-static-graph --no-set-device-rank --seed
--grad-clip-norm --lock-text --lock-text-unlocked-layers --lock-text-freeze-layer-norm --log-every-n-steps
--coca-caption-loss-weight --coca-contrastive-loss-weight --remote-sync --remote-sync-frequency
--remote-sync-protocol --delete-previous-checkpoint --distill-model --distill-pretrained --use-bnb-linear --siglip
--loss-dist-impl
""".split()
TOP_LEVEL = ("model", "data", "trainer", "seed_everything", "ckpt_path", "summary", "nonfinite_guard")
CODE = re.compile(r"`([^`]+)`")


def _rows() -> list[tuple[list[str], list[str]]]:
    """(flags, mmssl items) of every row of the tables headed ``open_clip_train | mmssl | notes``."""
    rows, in_table = [], False
    for line in TABLE.read_text().splitlines():
        if line.startswith("| open_clip_train | mmssl |"):
            in_table = True
        elif not line.startswith("|"):
            in_table = False
        elif in_table and not line.startswith("| ---"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows.append((CODE.findall(cells[0]), CODE.findall(cells[1])))
    return rows


def _flatten(node, prefix: str = "") -> set[str]:
    """Dotted keys of a printed config, ``init_args`` levels dropped, lists not entered."""
    keys = set()
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "class_path":
                continue
            path = prefix if key == "init_args" else f"{prefix}.{key}" if prefix else key
            keys.add(path)
            keys |= _flatten(value, path)
    return keys


@pytest.fixture(scope="module")
def cli_keys() -> set[str]:
    # The CLIP demo: CLIP, ImageTextDataModule, the trainer and the CLI's own sections.
    return _flatten(yaml.safe_load(resolve(["fit", "--config", "configs/demo/clip.yaml"])))


def _model_config_fields() -> dict[str, set[str]]:
    top = set().union(*(open_clip.get_model_config(n) or {} for n in open_clip.list_models()))
    return {"text_cfg": {f.name for f in dataclasses.fields(CLIPTextCfg)},
            "vision_cfg": {f.name for f in dataclasses.fields(CLIPVisionCfg)}, "": top}


def _problem(item: str, cli_keys: set[str], model_fields: dict[str, set[str]]) -> str | None:
    """Why ``item`` (a backticked name in the mmssl column) does not exist, or None."""
    if item.split(".")[0] in TOP_LEVEL:
        return None if item in cli_keys else "not a key of `mmssl fit --print_config`"
    if item.startswith("tools/"):
        return None if (REPO / item.split()[0]).is_file() else "no such tool"
    if item.startswith("mmssl "):
        return None
    name, _, arg = item.partition(".")
    callback = getattr(mmssl.callbacks, name, None) or getattr(lightning_callbacks, name, None)
    if callback is not None and arg:
        return None if arg in inspect.signature(callback).parameters else f"not an argument of {name}"
    section, _, field = item.rpartition(".")
    if section in model_fields:
        return None if field in model_fields[section] else "not an open_clip model-config field"
    return "neither a key, a callback argument, a model-config field nor a tool"


def test_every_open_clip_train_argument_has_a_row():
    flags = [flag for row, _ in _rows() for flag in row]
    assert sorted(set(flags)) == sorted(PARAMS_3_3), {
        "missing": sorted(set(PARAMS_3_3) - set(flags)), "not in params.py": sorted(set(flags) - set(PARAMS_3_3))}
    assert len(flags) == len(set(flags)), "an argument has two rows"


def test_every_name_in_the_mmssl_column_exists(cli_keys):
    model_fields = _model_config_fields()
    problems = {item: why for _, items in _rows() for item in items
                if (why := _problem(item, cli_keys, model_fields)) is not None}
    assert not problems, problems
    assert {"model.lock.text", "model.grad_checkpointing", "model.compile"} <= cli_keys


def test_stored_arguments_are_those_of_the_installed_open_clip_train(monkeypatch):
    params = pytest.importorskip("open_clip_train.params")
    if importlib.metadata.version("open_clip_torch") != "3.3.0":
        pytest.skip("the stored list is open_clip_train 3.3.0's")
    captured = {}

    def capture(self, *args, **kwargs):
        captured["parser"] = self
        raise SystemExit(0)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    with pytest.raises(SystemExit):
        params.parse_args([])
    options = [o for action in captured["parser"]._actions for o in action.option_strings]
    assert options == PARAMS_3_3
