"""A shard folder that an interrupted tools/make_shards.py left (its incomplete.json is there) is
refused wherever shards are read for training or evaluation, naming the folder; inspect_shards
still reads it, to report it incomplete."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from mmssl.cli import main
from mmssl.data.shards import inspect_shards
from mmssl.data.sources import INCOMPLETE_FILE, expand_urls
from tests.test_run_folders import tiny_config


def _interrupted_copy(tiny_demo, folder: Path) -> Path:
    """The demo's training shards, as a make_shards run killed before its sizes.json leaves them."""
    folder.mkdir()
    for url in expand_urls(tiny_demo.train):
        shutil.copy(url, folder)
    (folder / INCOMPLETE_FILE).write_text('{"pattern": "%d.tar"}')
    return folder


def test_fit_refuses_an_incomplete_shard_folder_at_start_up_naming_it(tmp_path, tiny_demo):
    shards = _interrupted_copy(tiny_demo, tmp_path / "shards")
    config = tiny_config(tmp_path, tiny_demo.root, max_steps=2)
    root = tmp_path / "runs"
    for spec in (str(shards), f"{shards}/{{0..3}}.tar"):
        with pytest.raises(ValueError, match=rf"data.train_data=.*{shards} is incomplete: its writer "
                           r"\(tools/make_shards.py\) stopped before writing sizes.json \(incomplete.json is there\)"
                           r".*run make_shards again with --overwrite"):
            main(["fit", "--config", config, f"--trainer.default_root_dir={root}", f"--data.train_data={spec}"])
    with pytest.raises(ValueError, match=rf"data.val_data=.*{shards} is incomplete"):
        main(["fit", "--config", config, f"--trainer.default_root_dir={root}", f"--data.val_data={shards}"])
    assert not list(root.rglob("*.ckpt"))  # refused before any step


def test_inspect_shards_still_reads_an_incomplete_folder_and_reports_it(tmp_path, tiny_demo):
    shards = _interrupted_copy(tiny_demo, tmp_path / "shards")
    good, problems, _, _ = inspect_shards(str(shards), show=0)
    assert good == 64 and problems[0].startswith(f"{shards}: incomplete")
    (shards / INCOMPLETE_FILE).unlink()
    assert len(expand_urls(str(shards))) == 4
