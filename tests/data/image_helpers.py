"""Images that are cheap on disk but huge in their header, and small labelled image folders."""

from __future__ import annotations

import io
import struct
import warnings
import zlib
from pathlib import Path
from typing import Sequence

from PIL import Image, ImageFile

from tests.data.shard_helpers import image_bytes


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def huge_png(side: int = 13000) -> bytes:
    """A real, valid ``side`` x ``side`` black PNG (1 bit per pixel: ~20 KB for 13000 px), which
    PIL would decode to ``side**2`` bytes and mmssl's RGB conversion to 3x that."""
    row = b"\x00" * (1 + (side + 7) // 8)  # filter byte + packed bits
    packer = zlib.compressobj(9)
    data = b"".join(packer.compress(row) for _ in range(side)) + packer.flush()
    header = struct.pack(">IIBBBBB", side, side, 1, 0, 0, 0, 0)  # 1-bit grayscale
    return b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", header) + _png_chunk(b"IDAT", data) + _png_chunk(b"IEND", b"")


def jpeg_claiming(width: int = 12000, height: int = 12000) -> bytes:
    """An 8x8 JPEG whose frame header (SOF0) claims ``width`` x ``height``: a few hundred bytes."""
    data = bytearray(image_bytes(0, "JPEG"))
    sof = data.index(b"\xff\xc0")  # marker, length (2), precision (1), height (2), width (2)
    data[sof + 5:sof + 9] = struct.pack(">HH", height, width)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        assert Image.open(io.BytesIO(bytes(data))).size == (width, height)
    return bytes(data)


class DecodeSpy:
    """Records the size of every image PIL decodes (``ImageFile.load``), to show one never was."""

    def __init__(self, monkeypatch) -> None:
        self.sizes: list[tuple[int, int]] = []
        load = ImageFile.ImageFile.load

        def spy(image):
            self.sizes.append(image.size)
            return load(image)

        monkeypatch.setattr(ImageFile.ImageFile, "load", spy)

    def largest(self) -> int:
        return max((w * h for w, h in self.sizes), default=0)


def write_image_folder(root: Path, classes: Sequence[str], per_class: int, side: int = 8) -> Path:
    """``root/<class>/<i>.png``: a labelled image folder, label = the class folder's sorted place."""
    for c, name in enumerate(classes):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            (root / name / f"{i:03d}.png").write_bytes(image_bytes(c * per_class + i, "PNG", side))
    return root
