"""``mmssl configs`` and the run arguments' checks (mmssl.commands), in-process without torch."""

from __future__ import annotations

import os

import pytest
import yaml

from mmssl.commands import dispatch


def _exit(args: list[str], capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as info:
        dispatch(args)
    return info.value.code, capsys.readouterr().err


@pytest.mark.parametrize("into_folder", [False, True])
def test_configs_copy_refuses_a_dangling_link_and_writes_nothing_through_it(tmp_path, capsys, into_folder):
    elsewhere = tmp_path / "elsewhere" / "clip.yaml"
    elsewhere.parent.mkdir()
    link = tmp_path / "out" / "clip.yaml"
    link.parent.mkdir()
    link.symlink_to(elsewhere)
    code, err = _exit(["configs", "--copy", "demo/clip", str(link.parent if into_folder else link)], capsys)
    assert code == 1 and f"{link} is a link" in err and len(err.splitlines()) == 1, err
    assert not os.path.lexists(elsewhere) and os.path.islink(link)


def test_configs_copy_writes_a_new_file(tmp_path, capsys):
    code, _ = _exit(["configs", "--copy", "demo/clip", str(tmp_path / "mine.yaml")], capsys)
    assert code == 0 and (tmp_path / "mine.yaml").read_text().startswith("#")


@pytest.mark.parametrize("text, key, lines", [
    ("trainer:\n  max_steps: 10\n  precision: 32\n  max_steps: 20\n", "max_steps", (2, 4)),
    ("seed_everything: 0\nmodel: {class_path: a.B}\nseed_everything: 1\n", "seed_everything", (1, 3)),
])
def test_a_config_with_a_key_written_twice_is_refused_naming_the_file_key_and_lines(tmp_path, capsys, text, key, lines):
    config = tmp_path / "mine.yaml"
    config.write_text(text)
    code, err = _exit(["fit", "--config", str(config)], capsys)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert str(config) in err and repr(key) in err and f"lines {lines[0]} and {lines[1]}" in err


def test_merge_keys_and_every_shipped_recipe_read(tmp_path):
    from mmssl.commands import read_config, recipe_names, shipped_file

    config = tmp_path / "merge.yaml"
    config.write_text("base: &b {lr: 1, wd: 2}\nopt:\n  <<: *b\n  lr: 3\n")
    assert read_config(str(config))["opt"] == {"lr": 3, "wd": 2}
    # An anchored mapping that merges another and overrides one of its keys, merged in turn: PyYAML
    # flattens the inner merge before the outer mapping is built, which read as "lr" written twice.
    nested = "defaults:\n  base: &base {lr: 1, wd: 0}\n  tuned: &tuned {<<: *base, lr: 2}\nmodel: {<<: *tuned}\n"
    config.write_text(nested)
    assert read_config(str(config)) == yaml.safe_load(nested)
    assert read_config(str(config))["model"] == {"lr": 2, "wd": 0}
    # A duplicate inside a mapping reached only through an alias is still found, once.
    config.write_text("base: &b\n  lr: 1\n  lr: 2\nopt: {<<: *b}\nagain: *b\n")
    with pytest.raises(SystemExit):
        read_config(str(config))
    for name in recipe_names():
        read_config(str(shipped_file(name)))


def test_a_yaml_file_given_to_another_option_is_checked_alike(tmp_path, capsys):
    trainer = tmp_path / "trainer.yaml"
    trainer.write_text("max_steps: 1\nmax_steps: 2\n")
    for args in (["fit", "--trainer", str(trainer)], ["fit", f"--trainer={trainer}"]):
        code, err = _exit(args, capsys)
        assert code == 2 and f"--trainer {trainer}: key 'max_steps'" in err and "lines 1 and 2" in err, err
