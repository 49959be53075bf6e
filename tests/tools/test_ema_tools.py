"""``--ema`` in ``tools/evaluate.py``, ``teacher_embeddings.py`` and ``wise_ft.py``, and the teacher's
default: each reads a checkpoint's raw weights unless ``--ema``, which reads the average (the one
path, ``mmssl.checkpoints.read.lightning_weights``), and refuses a checkpoint without one naming it.
The checkpoints hold an average far from the raw weights (another seed), so every figure differs."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import numpy as np
import pytest
import torch

from mmssl.models.teacher import load_teacher
from tests.tools.ema_helpers import save_checkpoint, two_models

REPO = Path(__file__).resolve().parents[2]
CLIP_PATH = "mmssl.models.clip.CLIP"


def _tool(name: str):
    return runpy.run_path(str(REPO / "tools" / f"{name}.py"), run_name="not_main")["main"]


@pytest.fixture(scope="module")
def clips(tmp_path_factory, tiny_clip_json) -> dict[str, str]:
    """``ema``: raw = seed 0, average = seed 1; ``raw`` / ``average``: those weights alone; ``plain``
    is ``raw`` too (a checkpoint trained without the EMA callback)."""
    from mmssl.models.clip import CLIP

    root = tmp_path_factory.mktemp("ema_clips")
    raw, average = two_models(lambda: CLIP(model_name=tiny_clip_json))
    return {"ema": save_checkpoint(root / "ema.ckpt", raw, average, CLIP_PATH),
            "raw": save_checkpoint(root / "raw.ckpt", raw, None, CLIP_PATH),
            "average": save_checkpoint(root / "average.ckpt", average, None, CLIP_PATH),
            "plain": save_checkpoint(root / "plain.ckpt", raw, None, CLIP_PATH)}


def _refused(code: int, capsys, tool: str, name: str) -> None:
    err = capsys.readouterr().err
    assert code == 1 and err.startswith(f"{tool}: ") and name in err and "--ema" in err and err.count("\n") == 1, err


def test_evaluate_scores_the_average_with_ema(clips, tiny_demo, tmp_path, capsys):
    main = _tool("evaluate")
    suite = tmp_path / "suite.yaml"
    suite.write_text(
        f"resamples: 10\nsets:\n  demo:\n    test: {tiny_demo.eval_dir}\n    tasks: [zero_shot, retrieval]\n"
    )

    def figures(ckpt: str, *extra: str) -> dict:
        out = tmp_path / f"{Path(ckpt).stem}{''.join(extra)}"
        assert main(["--ckpt", ckpt, "--suite", str(suite), "--output", str(out), "--batch-size", "32", *extra]) == 0
        return {p.name: json.loads(p.read_text())["metrics"] for p in sorted(out.glob("demo_*.json"))}

    ema = figures(clips["ema"], "--ema")
    assert ema == figures(clips["average"]) and figures(clips["ema"]) == figures(clips["raw"]) != ema
    capsys.readouterr()
    _refused(main(["--ckpt", clips["plain"], "--suite", str(suite), "--output", str(tmp_path / "x"), "--ema"]),
             capsys, "evaluate", "plain.ckpt")


def test_a_teacher_reads_the_raw_weights_unless_ema(clips):
    def weights(path: str, ema: bool = False) -> dict:
        return load_teacher(path, ema=ema).model.state_dict()

    for got, wanted in ((weights(clips["ema"]), weights(clips["raw"])),
                            (weights(clips["ema"], ema=True), weights(clips["average"]))):
        for key, value in wanted.items():
            assert torch.equal(got[key], value), key
    with pytest.raises(ValueError, match="plain.ckpt: --ema asks for averaged weights"):
        load_teacher(clips["plain"], ema=True)


def test_teacher_embeddings_stores_the_averages_embeddings_with_ema(clips, tiny_demo, tmp_path, capsys):
    main = _tool("teacher_embeddings")
    shard = str(Path(tiny_demo.eval_dir) / "0.tar")

    def stored(ckpt: str, *extra: str) -> tuple[np.ndarray, dict]:
        out = tmp_path / f"{Path(ckpt).stem}{''.join(extra)}"
        assert main(["--ckpt", ckpt, "--data", shard, "--output", str(out), "--num-workers", "0", *extra]) == 0
        side = np.load(next(out.glob("*.npz")))
        return np.concatenate([side["image"], side["text"]], axis=1), json.loads((out / "teacher.json").read_text())

    raw, manifest = stored(clips["ema"])
    ema, ema_manifest = stored(clips["ema"], "--ema")
    assert manifest["ema"] is False and ema_manifest["ema"] is True
    np.testing.assert_array_equal(raw, stored(clips["raw"])[0])
    np.testing.assert_array_equal(ema, stored(clips["average"])[0])
    assert not np.allclose(raw, ema)
    capsys.readouterr()
    _refused(main(["--ckpt", clips["plain"], "--data", shard, "--output", str(tmp_path / "x"), "--ema"]),
             capsys, "teacher_embeddings", "plain.ckpt")


def test_wise_ft_mixes_the_averages_with_ema(clips, tmp_path, tiny_clip_json, capsys):
    from mmssl.models.clip import CLIP

    main = _tool("wise_ft")
    raw_end, average_end = two_models(lambda: CLIP(model_name=tiny_clip_json))
    for module in (raw_end, average_end):  # another fine-tune: shift every weight
        with torch.no_grad():
            for p in module.parameters():
                p.add_(0.5)
    end = save_checkpoint(tmp_path / "end.ckpt", raw_end, average_end, CLIP_PATH)
    start = {"raw": torch.load(clips["raw"], weights_only=True)["state_dict"],
             "average": torch.load(clips["average"], weights_only=True)["state_dict"]}
    for flag, start_state, end_module in ((), start["raw"], raw_end), (("--ema",), start["average"], average_end):
        out = tmp_path / f"mix{len(flag)}.ckpt"
        assert main(["--start", clips["ema"], "--end", end, "--export-alpha", "0.5", "--output", str(out), *flag]) == 0
        mixed = torch.load(out, weights_only=True)["state_dict"]
        for key, value in end_module.state_dict().items():
            want = (start_state[key] + value) / 2 if value.is_floating_point() else value
            torch.testing.assert_close(mixed[key], want, msg=key)
    capsys.readouterr()
    _refused(main(["--start", clips["plain"], "--end", end, "--export-alpha", "0.5", "--output",
                   str(tmp_path / "x.ckpt"), "--ema"]), capsys, "wise_ft", "plain.ckpt")
