"""Every script in tools/ keeps one convention (tools/_common.py): ``main(argv) -> int``, a usage
error exits 2, a missing file exits 1 after one line on stderr naming it; old spellings of renamed
options still work, hidden from ``--help``. In-process and without models: each case fails before
anything is built."""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from pathlib import Path

import pytest
from PIL import Image

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # tools._common, as the tools import it
    sys.path.insert(0, str(REPO))
from tools._common import add_option, describe, run  # noqa: E402

MISSING = "no_such_input"  # below tmp_path: a file or folder that does not exist
# tool -> its arguments with MISSING as the one input that is absent
CASES = {
    "attention_maps": ["--ckpt", MISSING, "--images", "a.png", "--output", "out"],
    "benchmark": ["--config", MISSING, "--steps", "1"],
    "caption": ["--ckpt", MISSING, "--images", "a.png"],
    "consolidate": ["--ckpt", MISSING, "--output", "out.pth"],
    "dense_probe": ["--ckpt", MISSING],
    "evaluate": ["--ckpt", "a.ckpt", "--suite", MISSING, "--output", "out"],
    "export": ["--ckpt", MISSING, "--format", "timm", "--output", "out.pth"],
    "fashion_mnist": ["--data", MISSING, "--output", "out"],
    "inspect_shards": ["--data", MISSING],
    "linear_probe": ["--ckpt", MISSING, "--train-data", "a", "--val-data", "b"],
    "make_shards": ["--data", MISSING, "--output", "out"],
    "plan_stream": ["--data", f"{MISSING}/{{0..3}}.tar", "--batch-size", "4"],
    "scaling_fit": [MISSING, "--output", "out"],
    "similarity_map": ["--ckpt", MISSING, "--images", "a.png", "--text", "a", "--output", "out"],
    "teacher_embeddings": ["--ckpt", MISSING, "--data", "a", "--output", "out"],
    "wise_ft": ["--start", MISSING, "--end", MISSING, "--keep", "a", "--export-alpha", "0.5", "--output", "out.pth"],
    "masked_words": ["--ckpt", MISSING, "--data", "a"],
    "zero_shot": ["--ckpt", MISSING, "--data", "a"],
}


def _main(tool: str):
    return runpy.run_path(str(REPO / "tools" / f"{tool}.py"), run_name="not_main")["main"]


def test_every_tool_is_covered():
    assert sorted(CASES) == sorted(p.stem for p in (REPO / "tools").glob("*.py") if not p.stem.startswith("_"))


@pytest.mark.parametrize("tool", sorted(CASES))
def test_usage_error_exits_2(tool, capsys):
    main = _main(tool)
    for argv in ([], [*CASES[tool], "--no-such-option"]):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2, argv
        assert "error:" in capsys.readouterr().err


@pytest.mark.parametrize("tool", sorted(CASES))
def test_missing_input_exits_1_with_one_line_naming_it(tool, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    Image.new("RGB", (8, 8)).save("a.png")  # the --images of the image tools, there to be checked
    os.mkdir("a"), os.mkdir("b")  # the data sets: there, checked before a model loads (MISSING is the one absent)
    assert _main(tool)(list(CASES[tool])) == 1
    captured = capsys.readouterr()
    assert captured.err.startswith(f"{tool}: ") and captured.err.count("\n") == 1, captured.err
    assert MISSING in captured.err
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.pth").exists()  # nothing written


def test_an_old_spelling_works_hidden_and_a_required_option_takes_either():
    parser = argparse.ArgumentParser()
    add_option(parser, "--images", "--image", required=True, nargs="+", help="image files")
    add_option(parser, "--num-workers", "--workers", type=int, default=0, help="workers")
    assert parser.parse_args(["--image", "a", "b"]).images == ["a", "b"]
    assert parser.parse_args(["--images", "a", "--workers", "3"]).num_workers == 3
    assert parser.parse_args(["--images", "a"]).num_workers == 0
    usage, text = parser.format_usage(), parser.format_help()
    assert "--image " not in usage and "--workers" not in usage.replace("--num-workers", "")
    listed = [line.split()[0] for line in text.splitlines() if line.startswith("  -")]
    assert listed == ["-h,", "--images", "--num-workers"]  # the old spellings: only in the notes
    assert "(--image: the old spelling, deprecated, still accepted)" in " ".join(text.split())
    for argv in ([], ["--images", "a", "--image", "b"]):  # required; one spelling at a time
        with pytest.raises(SystemExit):
            parser.parse_args(argv)


def test_run_turns_expected_failures_into_one_line_and_lets_bugs_through(capsys):
    assert run("t", lambda: None) == 0 and run("t", lambda: 3) == 3
    try:
        open("/nonexistent/x.ckpt")
    except OSError as err:
        assert describe(err) == "/nonexistent/x.ckpt: No such file or directory"
    assert describe(KeyError("run/metrics.csv has no 'val/loss' column")) == "run/metrics.csv has no 'val/loss' column"
    assert describe(KeyError("lr")) == "missing key 'lr'"

    def fails():
        raise ValueError("a.yaml, line 3:\n  bad value")

    assert run("t", fails) == 1
    assert capsys.readouterr().err == "t: a.yaml, line 3: bad value\n"
    with pytest.raises(ZeroDivisionError):  # a bug keeps its traceback
        run("t", lambda: 1 / 0)
