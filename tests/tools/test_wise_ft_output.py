"""tools/wise_ft.py --export-alpha writes a Lightning checkpoint: a .safetensors --output (which it
wrote as a torch pickle under that name) is refused before anything is read or written."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_export_alpha_refuses_a_safetensors_output(tmp_path, capsys):
    main = runpy.run_path(str(REPO / "tools" / "wise_ft.py"), run_name="test")["main"]
    for name in ("mixed.safetensors", "MIXED.SAFETENSORS"):
        with pytest.raises(SystemExit) as exit_info:
            main(["--start", str(tmp_path / "a.ckpt"), "--end", str(tmp_path / "b.ckpt"), "--export-alpha", "0.5",
                  "--output", str(tmp_path / name)])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert f"--output '{tmp_path / name}': --export-alpha writes a Lightning checkpoint (torch.save), not " \
               "safetensors: name a .ckpt file" in err, err
    assert list(tmp_path.iterdir()) == []
