"""A LoRA checkpoint where peft is not installed: export, zero_shot and evaluate end with one line
saying what to install (exit 1), not an ImportError traceback; any other ImportError (a bug, a
broken installation) keeps its traceback."""

from __future__ import annotations

import contextlib
import io
import runpy
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")  # the checkpoint is made with peft, then peft is hidden

from mmssl.models.clip import CLIP  # noqa: E402
from mmssl.tools._common import run  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
PEFT = "model.lora needs Hugging Face peft: pip install -e '.[lora]'"


@pytest.fixture(scope="module")
def lora_ckpt(tmp_path_factory, tiny_clip_json) -> Path:
    folder = tmp_path_factory.mktemp("lora")
    torch.save(CLIP(model_name=tiny_clip_json).model.state_dict(), folder / "base.pth")
    module = CLIP(model_name=tiny_clip_json, pretrained=str(folder / "base.pth"), lora={"r": 2})
    checkpoint = {"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams)}
    module.on_save_checkpoint(checkpoint)  # what Lightning writes, through the module's hook
    torch.save(checkpoint, folder / "lora.ckpt")
    return folder / "lora.ckpt"


def test_tools_on_a_lora_checkpoint_without_peft_say_what_to_install(lora_ckpt, tiny_demo, tmp_path, monkeypatch):
    for name in [n for n in sys.modules if n == "peft" or n.startswith("peft.")] or ["peft"]:
        monkeypatch.setitem(sys.modules, name, None)  # as with peft uninstalled
    suite = tmp_path / "suite.yaml"
    suite.write_text(f"sets:\n  demo:\n    test: {tiny_demo.eval_dir}\n    tasks: [zero_shot]\n")
    for tool, argv in (("export", ["--format", "open_clip", "--output", str(tmp_path / "clip.pth")]),
                       ("zero_shot", ["--data", tiny_demo.eval_dir]),
                       ("evaluate", ["--suite", str(suite), "--output", str(tmp_path / "eval")])):
        main = runpy.run_path(str(REPO / "tools" / f"{tool}.py"), run_name="test")["main"]
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            assert main(["--ckpt", str(lora_ckpt), *argv]) == 1
        assert err.getvalue().endswith(f"{tool}: {PEFT}\n") and err.getvalue().count("\n") == 1, err.getvalue()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["suite.yaml"]


def test_another_import_error_keeps_its_traceback():
    def broken() -> None:
        raise ImportError("cannot import name 'gone' from 'somewhere'")

    with pytest.raises(ImportError, match="gone"):
        run("tool", broken)
