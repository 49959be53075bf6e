"""A config value, a data set or a checkpoint file at fault ends the ``mmssl`` command with one line
naming it (mmssl.errors), not a traceback: run in-process through ``main``, as the command runs."""

from __future__ import annotations

import os

import pytest
import torch
import yaml

from mmssl.entry import main
from mmssl.errors import ConfigError, DataError, one_line, one_line_errors
from tests.conftest import REPO

DEMO = REPO / "configs" / "demo"


def _fails_in_one_line(capsys, args) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    err = capsys.readouterr().err
    assert exit_info.value.code == 1, err[-2000:]
    lines = [line for line in err.splitlines() if line.startswith("mmssl: ") and "the shipped recipe" not in line]
    assert len(lines) == 1 and "Traceback" not in err, err[-2000:]
    return lines[0]


def test_an_old_and_a_new_key_that_disagree_are_one_line_naming_the_file_and_both_keys(tmp_path, capsys):
    override = tmp_path / "override.yaml"
    override.write_text(yaml.safe_dump({"model": {"init_args": {"image_mask_ratio": 0.5,
                                                                 "flip": {"mask_ratio": 0.25}}}}))
    line = _fails_in_one_line(capsys, ["fit", "--config", str(DEMO / "clip.yaml"), "--config", str(override)])
    assert str(override) in line and "'image_mask_ratio'" in line and "'flip.mask_ratio'" in line


def test_a_constructors_refusal_is_one_line_naming_the_key(tmp_path, capsys, tiny_demo):
    line = _fails_in_one_line(capsys, [
        "fit", "--config", str(DEMO / "clip_mlm.yaml"), "--model.init_args.mlm_mask_ratio=1.0",
        f"--data.init_args.demo_dir={tiny_demo.root}", f"--trainer.default_root_dir={tmp_path}"])
    assert line == "mmssl: model.init_args.mlm_mask_ratio must be in (0, 1), got 1.0"


@pytest.mark.parametrize("content", ["truncated", "crafted"])
def test_a_bad_ckpt_path_is_one_line_naming_the_file(tmp_path, capsys, content):
    path = tmp_path / "bad.ckpt"
    if content == "truncated":
        torch.save({"state_dict": {"w": torch.zeros(100)}}, path)
        path.write_bytes(path.read_bytes()[:200])
    else:
        class Code:
            def __reduce__(self):
                return (os.getpid, ())

        torch.save({"state_dict": {}, "x": Code()}, path)
    line = _fails_in_one_line(capsys, ["validate", "--config", str(DEMO / "mae.yaml"), "--ckpt_path", str(path),
                                       "--trainer.logger=false", f"--trainer.default_root_dir={tmp_path}"])
    assert str(path) in line


def test_errors_wrapped_by_a_library_are_found_and_bugs_keep_their_traceback(capsys):
    try:
        try:
            raise ConfigError("model.init_args.x must be > 0")
        except ValueError as inner:
            raise ValueError("Does not validate against any of the Union subtypes\nGiven value: ...") from inner
    except ValueError as err:
        assert one_line(err) == "model.init_args.x must be > 0"
    key_first = "model.init_args.depth must be >= 1, got 0"
    assert one_line(ValueError(key_first)) == key_first
    assert one_line(ValueError("could not broadcast shapes (3,) and (4,)")) is None
    assert one_line(RuntimeError("CUDA error")) is None
    with pytest.raises(ZeroDivisionError), one_line_errors():
        1 / 0
    with pytest.raises(SystemExit) as exit_info, one_line_errors():
        raise DataError("70 of 70 samples were bad or missing,\n more than data.max_bad_fraction=0.1")
    assert exit_info.value.code == 1
    assert capsys.readouterr().err == \
        "mmssl: 70 of 70 samples were bad or missing, more than data.max_bad_fraction=0.1\n"


@pytest.mark.parametrize("handled", [ConfigError("model.init_args.x must be > 0"),
                                     ValueError("model.init_args.depth must be >= 1, got 0")])
def test_a_bug_raised_while_handling_a_users_error_keeps_its_traceback(handled):
    # The handled error is the bug's __context__, not its cause: the bug is not that error's one line.
    with pytest.raises(AttributeError), one_line_errors():
        try:
            raise handled
        except ValueError:
            None.missing  # noqa: B018 - the bug
    try:
        try:
            raise handled
        except ValueError:
            raise KeyError("patch_size")  # noqa: B904 - what a bug in an except block raises
    except KeyError as err:
        assert one_line(err) is None


def test_a_plain_subscript_in_a_checkpoints_module_keeps_its_traceback():
    from mmssl.checkpoints.read import lightning_weights

    with pytest.raises(KeyError) as raised:
        lightning_weights("run.ckpt", {})  # a bare checkpoint["state_dict"], its innermost frame in mmssl.checkpoints
    assert raised.value.__traceback__ is not None and one_line(raised.value) is None
    with pytest.raises(KeyError), one_line_errors():
        lightning_weights("run.ckpt", {})


def test_the_checkpoint_readers_refusals_are_one_line_naming_the_file(tmp_path, capsys):
    from mmssl.checkpoints.read import read_checkpoint
    from mmssl.errors import CheckpointError

    path = tmp_path / "list.ckpt"
    torch.save([1, 2], path)
    with pytest.raises(SystemExit) as exit_info, one_line_errors():
        read_checkpoint(str(path))
    err = capsys.readouterr().err
    assert exit_info.value.code == 1, err
    assert err == f"mmssl: {path}: expected a dict (checkpoint or state dict), found list\n"
    with pytest.raises(ValueError) as raised:  # still a ValueError for every caller that catches one
        read_checkpoint(str(path))
    assert isinstance(raised.value, CheckpointError)
    try:  # wrapped by a library (jsonargparse's "raise ... from")
        try:
            read_checkpoint(str(path))
        except ValueError as inner:
            raise ValueError("Problem with given class_path 'mmssl.models.MAE'") from inner
    except ValueError as outer:
        assert one_line(outer) == f"{path}: expected a dict (checkpoint or state dict), found list"
