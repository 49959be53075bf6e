"""Tiny shards written in the test (open_clip tests/test_wds.py style)."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path
from typing import Optional

import torch
from PIL import Image


def image_bytes(index: int, fmt: str = "JPEG", side: int = 8) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (side, side), (index * 37 % 256, index * 91 % 256, 128)).save(buf, format=fmt)
    return buf.getvalue()


def write_tar(path: Path, members: list[tuple[str, bytes]]) -> None:
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def sample_members(index: int, label: Optional[int] = None) -> list[tuple[str, bytes]]:
    """One good sample; JPEG for even indices, PNG for odd; ``cls`` holds ``label`` (default: index)."""
    ext, fmt = ("jpg", "JPEG") if index % 2 == 0 else ("png", "PNG")
    key = f"s{index:05d}"
    label = index if label is None else label
    return [(f"{key}.{ext}", image_bytes(index, fmt)), (f"{key}.txt", f"caption {index}".encode()),
            (f"{key}.cls", str(label).encode())]


def write_dataset(
    folder: Path, shard_sizes: list[int], sizes_json: bool = True, label: Optional[int] = None
) -> list[int]:
    """Shards of good samples numbered across shards; returns every sample index."""
    folder.mkdir(parents=True, exist_ok=True)
    index, sizes = 0, {}
    for s, count in enumerate(shard_sizes):
        members = []
        for _ in range(count):
            members += sample_members(index, label)
            index += 1
        write_tar(folder / f"{s:05d}.tar", members)
        sizes[f"{s:05d}.tar"] = count
    if sizes_json:
        (folder / "sizes.json").write_text(json.dumps(sizes))
    return list(range(index))


def count_tokenizer(texts: list[str]) -> torch.Tensor:
    """A picklable stand-in for open_clip's tokenizer: one token, the caption length."""
    return torch.tensor([[len(t)] for t in texts])


def write_shards_with_bad(folder: Path, good: list[int], bad: dict[int, int]) -> None:
    """Shards ``00000.tar ...`` holding ``good[s]`` samples each, shard ``s`` led by ``bad[s]``
    broken JPEGs (with caption and label, so only the image is at fault); ``sizes.json`` counts
    them as raw samples, as a real shard lists every sample it holds."""
    index, sizes = 0, {}
    for s, count in enumerate(good):
        members = [m for b in range(bad.get(s, 0)) for m in
                   ((f"bad{s}_{b}.jpg", b"not a jpeg"), (f"bad{s}_{b}.txt", b"x"), (f"bad{s}_{b}.cls", b"0"))]
        for _ in range(count):
            members += sample_members(index)
            index += 1
        write_tar(folder / f"{s:05d}.tar", members)
        sizes[f"{s:05d}.tar"] = count + bad.get(s, 0)
    (folder / "sizes.json").write_text(json.dumps(sizes))
