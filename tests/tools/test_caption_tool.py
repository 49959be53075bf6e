"""``tools/caption.py`` on a tiny CoCa checkpoint: the default caption length is the model's text
context, and ``--ema`` captions with the average (refused, naming the file, for a checkpoint
without one)."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from mmssl.checkpoints.load import load_lightning
from mmssl.evaluation.captions import generate_captions
from mmssl.visualize.inputs import load_images
from tests.tools.ema_helpers import save_checkpoint, two_models

REPO = Path(__file__).resolve().parents[2]
COCA = "mmssl.models.coca.CoCa"


@pytest.fixture(scope="module")
def caption_main():
    return runpy.run_path(str(REPO / "tools" / "caption.py"), run_name="not_main")["main"]


@pytest.fixture(scope="module")
def files(tmp_path_factory, tiny_coca_json) -> dict:
    from mmssl.models.coca import CoCa

    root = tmp_path_factory.mktemp("caption")
    raw, average = two_models(lambda: CoCa(tiny_coca_json, warmup_steps=0))
    rng = np.random.default_rng(0)
    images = []
    for i in range(2):
        images.append(str(root / f"{i}.png"))
        Image.fromarray(rng.integers(0, 256, (40, 40, 3), dtype=np.uint8)).save(images[-1])
    return {"ema": save_checkpoint(root / "ema.ckpt", raw, average, COCA),
            "plain": save_checkpoint(root / "plain.ckpt", raw, None, COCA), "images": images, "root": root}


def _captions(caption_main, files, *extra: str) -> tuple[list[str], dict]:
    out, report = files["root"] / "rows.jsonl", files["root"] / "report.json"
    argv = ["--ckpt", files["ema"], "--images", *files["images"], "--num-beams", "1", "--min-seq-len", "2",
            "--output", str(out), "--output-json", str(report), *extra]
    assert caption_main(argv) == 0
    return [json.loads(line)["caption"] for line in out.read_text().splitlines()], json.loads(report.read_text())


def test_the_default_caption_length_is_the_models_text_context(caption_main, files, tiny_coca_json):
    _, report = _captions(caption_main, files)
    assert report["seq_len"] == json.loads(Path(tiny_coca_json).read_text())["text_cfg"]["context_length"] == 16


def test_ema_captions_with_the_average_and_is_refused_without_one(caption_main, files, capsys):
    raw, _ = _captions(caption_main, files)
    ema, report = _captions(caption_main, files, "--ema")
    assert report["ema"] is True
    for flag, got in ((False, raw), (True, ema)):
        model = load_lightning(files["ema"], ema=flag)
        images, _ = load_images(files["images"], model)
        assert got == generate_captions(model, images, seq_len=16, min_seq_len=2, num_beams=1)
    assert raw != ema
    capsys.readouterr()
    assert caption_main(["--ckpt", files["plain"], "--images", *files["images"], "--ema"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("caption: ") and "plain.ckpt" in err and "--ema" in err and err.count("\n") == 1
