"""``--images`` of caption, attention_maps and similarity_map: an image larger than training
decodes (or than PIL opens) is refused from its header, naming the file and its size, before the
model is read; caption's sampling refuses a temperature of 0 (it crashed inside generation)."""

from __future__ import annotations

import runpy
import struct
import zlib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _png_header(path: Path, width: int, height: int) -> Path:
    """A PNG whose header claims ``width`` x ``height`` (no pixel data: only a decode would notice)."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = struct.pack(">I", len(ihdr)) + b"IHDR" + ihdr + struct.pack(">I", zlib.crc32(b"IHDR" + ihdr))
    end = struct.pack(">I", 0) + b"IEND" + struct.pack(">I", zlib.crc32(b"IEND"))
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk + end)
    return path


def _main(tool: str):
    return runpy.run_path(str(REPO / "tools" / f"{tool}.py"), run_name="test")["main"]


@pytest.mark.parametrize("tool,extra", [("caption", []), ("attention_maps", ["--output", "maps"]),
                                        ("similarity_map", ["--output", "maps", "--text", "a cat"])])
def test_images_larger_than_training_decodes_are_refused_naming_them_before_the_model_is_read(
        tool, extra, tmp_path, capsys):
    big = _png_header(tmp_path / "big.png", 10_000, 10_000)  # 100 Mpx: above mmssl's limit, PIL warns
    bomb = _png_header(tmp_path / "bomb.png", 13_400, 13_400)  # 179.6 Mpx: PIL's DecompressionBombError
    missing_ckpt = str(tmp_path / "no.ckpt")  # the images are refused first
    for image, said in ((big, f"--images: '{big}' is 10000 x 10000 pixels, above the 89478485 that mmssl decodes "
                              "(training skips such images): resize it first"),
                        (bomb, f"--images: '{bomb}' is too large to decode (Image size (179560000 pixels) exceeds")):
        assert _main(tool)(["--ckpt", missing_ckpt, "--images", str(image), *extra]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"{tool}: {said}") and err.count("\n") == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.png", "bomb.png"]


@pytest.mark.parametrize("generation", [["--generation-type", "top_k"], ["--generation-type", "top_p"]])
def test_caption_sampling_refuses_a_temperature_of_zero(generation, tmp_path, capsys):
    image = _png_header(tmp_path / "a.png", 8, 8)
    for value in ("0", "-1"):
        with pytest.raises(SystemExit) as exit_info:
            _main("caption")(["--ckpt", str(tmp_path / "no.ckpt"), "--images", str(image), *generation,
                              "--temperature", value])
        assert exit_info.value.code == 2
        assert f"--temperature {value}: sampling needs a temperature above 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _main("caption")(["--ckpt", "x", "--images", str(image), "--generation-type", "top_k", "--top-k", "0"])
    assert "--top-k 0: keep at least 1 token" in capsys.readouterr().err
