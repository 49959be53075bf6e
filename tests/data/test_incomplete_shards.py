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
from tests.checkpoints.test_run_folders import tiny_config


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


def test_every_rank_refuses_an_incomplete_shard_folder_at_start_up(tmp_path, tiny_demo, tiny_clip_json):
    """On 2 gloo processes, validation on: both ranks refuse in setup, naming the folder; none waits."""
    from tests.cli_runs import PG_TIMEOUT, REPO, run_mmssl

    shards = _interrupted_copy(tiny_demo, tmp_path / "shards")
    out = run_mmssl([
        "fit", "--config", str(REPO / "configs/demo/clip.yaml"), "--config", str(REPO / "configs/trainer/ddp_cpu.yaml"),
        PG_TIMEOUT, f"--model.init_args.model_name={tiny_clip_json}", f"--data.init_args.demo_dir={tiny_demo.root}",
        f"--data.init_args.train_data={shards}", "--data.init_args.batch_size=4", "--data.init_args.num_workers=0",
        f"--trainer.default_root_dir={tmp_path / 'runs'}", "--trainer.max_steps=2",
    ], tmp_path, timeout=240)
    assert out.returncode != 0
    said = f"{shards} is incomplete: its writer (tools/make_shards.py) stopped"
    assert out.stdout.count(said) >= 2, out.stdout[-3000:]  # raised on both ranks, in setup
    assert "Sanity Checking" not in out.stdout and not list((tmp_path / "runs").rglob("*.ckpt"))
