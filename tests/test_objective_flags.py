"""One option of one objective from the command line (``--model.init_args.objectives.NAME.KEY=V``)
changes that option and keeps the others the configs gave (jsonargparse alone replaced NAME's
whole mapping: a flag on ``start`` silently reset the weight to its default)."""

from __future__ import annotations

import pytest
import yaml

from mmssl.cli import main, objective_flags
from tests.cli_runs import REPO

CONFIG = str(REPO / "configs/demo/siglip_caption.yaml")  # contrastive {weight: 1.0}, caption {weight: 1.0, start: 0.2}


def _objectives(capsys, *flags: str) -> dict:
    with pytest.raises(SystemExit) as done:
        main(["fit", "--config", CONFIG, *flags, "--print_config"])
    assert done.value.code in (0, None)
    return yaml.safe_load(capsys.readouterr().out)["model"]["init_args"]["objectives"]


def test_one_option_keeps_the_others_of_its_objective_and_the_other_objectives(capsys):
    assert _objectives(capsys) == {"contrastive": {"weight": 1.0}, "caption": {"weight": 1.0, "start": 0.2}}
    assert _objectives(capsys, "--model.init_args.objectives.caption.start=0.5") == {
        "contrastive": {"weight": 1.0}, "caption": {"weight": 1.0, "start": 0.5}}
    # the value as its own argument, init_args left out, two flags on two objectives, a new objective
    got = _objectives(capsys, "--model.objectives.caption.weight", "2.5",
                      "--model.init_args.objectives.contrastive.start=3", "--model.init_args.objectives.itm.weight=0")
    assert got == {"contrastive": {"weight": 1.0, "start": 3}, "caption": {"weight": 2.5, "start": 0.2},
                   "itm": {"weight": 0}}


def test_a_later_whole_mapping_still_replaces_and_an_earlier_one_is_merged_into(capsys):
    later = _objectives(capsys, "--model.init_args.objectives.caption.start=0.5",
                        "--model.init_args.objectives.caption={weight: 3.0}")
    assert later["caption"] == {"weight": 3.0}
    earlier = _objectives(capsys, "--model.init_args.objectives.caption={weight: 3.0}",
                          "--model.init_args.objectives.caption.start=0.5")
    assert earlier["caption"] == {"weight": 3.0, "start": 0.5}


def test_flags_are_found_with_their_values_and_give_way_to_a_later_whole_mapping():
    args = ["fit", "--model.init_args.objectives.caption.start=0.5", "--model.objectives.itm.head.width", "8",
            "--model.init_args.objectives.contrastive.weight=1", "--model.init_args.objectives={}", "--trainer.x=1"]
    assert objective_flags(args) == {}  # every objective given whole afterwards
    flags = objective_flags(args[:5])
    assert flags == {1: ("caption", ["start"], "0.5"), 2: ("itm", ["head", "width"], "8"),
                     3: ("itm", ["head", "width"], "8"), 4: ("contrastive", ["weight"], "1")}
    assert objective_flags(["--model.init_args.objectives.caption=1", "--trainer.max_steps=2"]) == {}
