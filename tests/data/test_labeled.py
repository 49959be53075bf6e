"""Labelled evaluation sets: unreadable samples counted, one canonical order, limits the same on any ranks;
clip_benchmark's wds/ layout written and read both ways."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from image_helpers import DecodeSpy, huge_png, write_image_folder
from shard_helpers import image_bytes, sample_members, write_dataset, write_tar

from mmssl.data.label_files import is_image_folder, read_classnames, read_templates
from mmssl.data.labeled import labeled_loader
from mmssl.data.transforms import eval_transform
from mmssl.evaluation.online import check_labelled_set

TRANSFORM = eval_transform(8)


def _read(folder, rank=0, world=1, limit=None, batch_size=3):
    batches = list(labeled_loader(str(folder), TRANSFORM, batch_size, rank=rank, world_size=world, limit=limit))
    labels = [int(x) for b in batches for x in b["label"]]
    index = [int(x) for b in batches for x in b["index"]]
    return labels, index, sum(b["skipped"] for b in batches), batches


def test_unreadable_samples_are_skipped_and_counted(tmp_path):
    write_dataset(tmp_path, [4])
    bad = sample_members(4)
    bad[0] = (bad[0][0], b"not an image")  # a corrupt JPEG
    no_label = [m for m in sample_members(5) if not m[0].endswith(".cls")]
    write_tar(tmp_path / "00001.tar", bad + no_label + sample_members(6))
    labels, _, skipped, batches = _read(tmp_path)
    assert labels == [0, 1, 2, 3, 6] and skipped == 2
    assert all(b["image"].shape[0] == len(b["label"]) for b in batches)


def test_a_rank_left_with_only_bad_samples_still_reports_them(tmp_path):
    write_tar(tmp_path / "00000.tar", [(n, b"junk" if n.endswith(".jpg") else d) for n, d in sample_members(0)])
    labels, _, skipped, batches = _read(tmp_path)
    assert labels == [] and skipped == 1 and batches[0]["image"].shape[0] == 0


@pytest.mark.parametrize("limit", [None, 7])
def test_ranks_read_disjoint_parts_that_restore_one_process_order(tmp_path, limit):
    write_dataset(tmp_path, [4, 3, 5])
    one_labels, one_index, _, _ = _read(tmp_path, limit=limit)
    parts = [_read(tmp_path, rank, 2, limit) for rank in range(2)]
    index = [i for p in parts for i in p[1]]
    labels = [x for p in parts for x in p[0]]
    assert sorted(index) == one_index and len(set(index)) == len(index)  # nothing twice, nothing lost
    assert [labels[i] for i in torch.tensor(index).argsort().tolist()] == one_labels
    assert one_labels == list(range(12 if limit is None else limit))  # limit: the set's first samples


# ---- clip_benchmark's wds/ layout, both ways ------------------------------------------------------
# The rules, as clip_benchmark's datasets/builder.py build_wds_dataset reads a set: N from
# DIR/{split}/nshards.txt, shards "DIR/{split}/{0..N-1}.tar" (brace-expanded, unpadded), the image
# from the first of webp/png/jpg/jpeg, the label from "cls", classnames.txt and
# zeroshot_classification_templates.txt at DIR (not in the split).


def _clip_benchmark_read(root, split="test"):
    """Labels, class names and templates read by those rules alone (no mmssl code)."""
    import braceexpand
    import webdataset as wds

    nshards = int((root / split / "nshards.txt").read_text())
    urls = list(braceexpand.braceexpand(str(root / split / f"{{0..{nshards - 1}}}.tar")))
    dataset = (wds.WebDataset(urls, shardshuffle=False, nodesplitter=lambda src: src)
               .decode(wds.autodecode.ImageHandler("pil", extensions=["webp", "png", "jpg", "jpeg"]))
               .to_tuple(["webp", "png", "jpg", "jpeg"], "cls"))
    labels = [int(label) for _, label in dataset]
    classes = [line.strip() for line in (root / "classnames.txt").read_text().splitlines()]
    templates = [line.strip() for line in (root / "zeroshot_classification_templates.txt").read_text().splitlines()]
    return labels, classes, templates


def test_a_set_mmssl_writes_reads_back_through_clip_benchmark_rules(tmp_path):
    from mmssl.data.shards import clip_benchmark_shard_pattern, write_clip_benchmark_files

    # 12 shards: clip_benchmark reads 10.tar after 9.tar, where a sorted listing puts it after 1.tar.
    (tmp_path / "test").mkdir()
    for s in range(12):
        write_tar(Path(clip_benchmark_shard_pattern(str(tmp_path), "test") % s),
                  sample_members(s, label=s % 3))
    names, prompts = ["red thing", "green thing", "blue thing"], ["a {c}.", "a photo of a {c}."]
    assert write_clip_benchmark_files(str(tmp_path), "test", names, prompts) == 12
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "classnames.txt",
        "test",
        "zeroshot_classification_templates.txt",
    ]
    labels, classes, templates = _clip_benchmark_read(tmp_path)
    assert labels == [s % 3 for s in range(12)] and classes == names and templates == prompts
    # mmssl reads the split folder and the root (its test split) the same way, in the same order.
    for data in (tmp_path / "test", tmp_path):
        mine, index, skipped, _ = _read(data, batch_size=5)
        assert mine == labels and skipped == 0 and index == [s << 32 for s in range(12)]
        assert read_classnames(str(data)) == names and read_templates(str(data)) == prompts
        check_labelled_set(str(data), "ZeroShot", "data", need_classnames=True)
    # Ranks split clip_benchmark's shard list, and a sample limit keeps its first samples.
    parts = [_read(tmp_path, rank, 2, limit=7)[0] for rank in range(2)]
    assert sorted(parts[0] + parts[1]) == sorted(labels[:7])


def test_a_real_clip_benchmark_folder_reads_in_every_tool(tmp_path):
    """What clip_benchmark_export_wds writes (webp images, keys s0000000, side files at the root)."""
    root = tmp_path / "wds_set"
    for split, count in (("train", 4), ("test", 3)):
        (root / split).mkdir(parents=True)
        members = []
        for i in range(count):
            key = f"s{i:07d}"
            members += [(f"{key}.webp", image_bytes(i, "WEBP")), (f"{key}.cls", str(i % 2).encode())]
        write_tar(root / split / "0.tar", members)
        (root / split / "nshards.txt").write_text("1\n")
    (root / "classnames.txt").write_text("cat\ndog\n")
    (root / "zeroshot_classification_templates.txt").write_text("a photo of a {c}.\n")
    assert _read(root)[0] == [0, 1, 0]  # the test split, as clip_benchmark's default --split
    assert _read(root / "train")[0] == [0, 1, 0, 1]
    assert read_classnames(str(root / "train")) == ["cat", "dog"]
    assert read_templates(str(root / "test")) == ["a photo of a {c}."]
    assert not is_image_folder(str(root))  # split folders are not class folders
    check_labelled_set(str(root / "test"), "ZeroShot", "data", need_classnames=True)
    # A root without the test split, and an nshards.txt naming a shard that is not there.
    (root / "test").rename(root / "val")
    with pytest.raises(FileNotFoundError, match=r"without a 'test' split \(it has \['train', 'val'\]\)"):
        check_labelled_set(str(root), "ZeroShot", "data")
    (root / "val" / "nshards.txt").write_text("2\n")
    with pytest.raises(FileNotFoundError, match=r"ZeroShot: data=.*nshards.txt says 2 shards.*1.tar"):
        check_labelled_set(str(root / "val"), "ZeroShot", "data")


def test_write_clip_benchmark_files_refuses_what_clip_benchmark_would_not_read(tmp_path):
    from mmssl.data.shards import write_clip_benchmark_files

    (tmp_path / "test").mkdir()
    with pytest.raises(FileNotFoundError, match="0.tar"):
        write_clip_benchmark_files(str(tmp_path), "test")
    write_tar(tmp_path / "test" / "0.tar", sample_members(0))
    write_tar(tmp_path / "test" / "00001.tar", sample_members(1))
    with pytest.raises(ValueError, match=r"\['00001.tar'\] are not among 0.tar .. 0.tar"):
        write_clip_benchmark_files(str(tmp_path), "test")
    (tmp_path / "test" / "00001.tar").unlink()
    with pytest.raises(ValueError, match="placeholder"):
        write_clip_benchmark_files(str(tmp_path), "test", ["a"], ["no class here"])


# ---- labels, class names, image folders -----------------------------------------------------------


def test_bad_cls_in_a_labelled_set_is_skipped_counted_and_named(tmp_path, caplog):
    # Before: 99999999999999999999999 crashed batch stacking ("Overflow when unpacking long long").
    members = sample_members(0)
    for i, cls in ((1, b"99999999999999999999999"), (2, b"-2"), (3, b"two")):
        members += [m for m in sample_members(i) if not m[0].endswith(".cls")] + [(f"s{i:05d}.cls", cls)]
    write_tar(tmp_path / "00000.tar", members + sample_members(4))
    with caplog.at_level("WARNING", logger="mmssl.data"):
        labels, _, skipped, _ = _read(tmp_path)
    assert labels == [0, 4] and skipped == 3
    lines = [r.getMessage() for r in caplog.records]
    for key, reason in (("s00001", "cls overflows int64"), ("s00002", "cls is negative: -2"),
                        ("s00003", "cls is not an integer: b'two'")):
        assert any(f"'{key}'" in line and "00000.tar" in line and reason in line for line in lines), key


@pytest.mark.parametrize("text,line,reason", [
    ("cat\n\ndog\n", 2, "blank line among the class names"),
    ("cat\n  \ndog\n", 2, "blank line"),
    ("\ncat\ndog\n", 1, "blank line"),
    ("cat\ndog\ncat\n", 3, "'cat' repeats line 1"),
    ("Cat\ndog\ncat\n", 3, r"'cat' differs from line 1 \('Cat'\) only in case or spacing"),
    ("red fox\ndog\nred  fox\n", 3, r"'red  fox' differs from line 1 \('red fox'\) only in case or spacing"),
    ("\n\n", 1, "no class names"),
])
def test_classnames_with_a_blank_line_or_a_repeat_are_refused_at_start_up(tmp_path, text, line, reason):
    # Before: blank lines were dropped (every later class shifted by one) and repeats accepted;
    # names differing only in case were accepted and zero-shot scored one prompt for two classes.
    write_dataset(tmp_path, [2])
    (tmp_path / "classnames.txt").write_text(text)
    where = rf"{tmp_path / 'classnames.txt'}, line {line}: .*{reason}"
    with pytest.raises(ValueError, match=where):
        read_classnames(str(tmp_path))
    for need in (True, False):  # the probes' start-up check reads a file that is there too
        with pytest.raises(ValueError, match=rf"LinearProbe: val_data=.*{where}"):
            check_labelled_set(str(tmp_path), "LinearProbe", "val_data", need_classnames=need)
    (tmp_path / "classnames.txt").write_text("cat\ndog\n\n\n")  # blank lines at the end shift nothing
    assert read_classnames(str(tmp_path)) == ["cat", "dog"]


def test_a_labelled_image_folder_reads_with_folder_names_and_skips_bad_images(tmp_path, caplog, monkeypatch):
    # Before: every read of an image folder's classes died on ImageFolder.find_classes(data).
    root = write_image_folder(tmp_path / "set", ["cat", "red_fox"], 3)
    (root / "cat" / "001.png").write_bytes(b"not a png")
    (root / "red_fox" / "big.png").write_bytes(huge_png(13000))
    assert read_classnames(str(root)) == ["cat", "red fox"]
    check_labelled_set(str(root), "ZeroShot", "data", need_classnames=True)
    spy = DecodeSpy(monkeypatch)
    with caplog.at_level("WARNING", logger="mmssl.data"):
        labels, index, skipped, _ = _read(root, batch_size=4)
    # torchvision's order (big.png sorts after 002.png); the bad images counted, not read.
    assert labels == [0, 0, 1, 1, 1] and index == [0, 2, 3, 4, 5] and skipped == 2
    assert spy.largest() <= 64
    lines = [r.getMessage() for r in caplog.records]
    assert any("cat/001.png" in line and "unreadable" in line for line in lines)
    assert any("red_fox/big.png" in line and "13000x13000" in line and "max_image_pixels" in line for line in lines)
    parts = [_read(root, rank, 2, batch_size=4) for rank in range(2)]
    assert sorted(parts[0][1] + parts[1][1]) == index and parts[0][2] + parts[1][2] == 2
    (root / "classnames.txt").write_text("cat\n")  # one name for two class folders
    with pytest.raises(ValueError, match=r"classnames.txt lists 1 class names for the 2 class folders"):
        check_labelled_set(str(root), "ZeroShot", "data", need_classnames=True)


def test_class_names_written_for_clip_benchmark_are_checked_as_read(tmp_path):
    from mmssl.data.shards import write_clip_benchmark_files

    (tmp_path / "test").mkdir()
    write_tar(tmp_path / "test" / "0.tar", sample_members(0))
    for names, reason in ((["cat", "dog", "cat"], r"classnames\[2\]: .*'cat' repeats line 1"), (["cat", ""], "blank")):
        with pytest.raises(ValueError, match=reason):
            write_clip_benchmark_files(str(tmp_path), "test", names)
    assert not (tmp_path / "classnames.txt").exists()


def test_an_evaluation_label_beyond_classnames_stops_naming_the_sample(tmp_path):
    """An evaluation set whose labels its class list does not cover is refused (its figures would
    all be wrong), naming the first such sample's shard or image."""
    from mmssl.evaluation.online import check_labels

    write_tar(tmp_path / "00000.tar", sample_members(0, label=0) + sample_members(1, label=1))
    write_tar(tmp_path / "00001.tar", sample_members(2, label=1) + sample_members(3, label=2))
    labels, index, _, _ = _read(tmp_path)
    with pytest.raises(ValueError, match=r"1 labels outside \[0, 2\).*label 2 of sample 1 of shard .*00001.tar"):
        check_labels(torch.tensor(labels), 2, str(tmp_path), "probe", lambda t: t, torch.tensor(index))
    folder = write_image_folder(tmp_path / "folder", ["a", "b", "c"], 2)
    labels, index, _, _ = _read(folder)
    with pytest.raises(ValueError, match=r"2 labels outside \[0, 2\).*label 2 of '.*c/000.png'"):
        check_labels(torch.tensor(labels), 2, str(folder), "probe", lambda t: t, torch.tensor(index))
