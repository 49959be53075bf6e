"""The edges of mmssl.data.teacher_embeddings that the distillation tests leave open: side-file
names, every refusal of a manifest with its exact message (and where an interrupted overwrite left
the earlier folder), a shard's identity from its size and leading bytes, the start-up check of the
training shards (same, other, unrecorded and remote shards), the atomic float32 side file, and a
worker's join: picklable without its open files, the last 4 shards kept (least recently used out),
and each bad side file or row named."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import re

import numpy as np
import pytest

from mmssl.data.decode import BadSample
from mmssl.data.teacher_embeddings import (
    FORMAT,
    HEAD_BYTES,
    KEY,
    MANIFEST,
    TeacherEmbeddings,
    check_shards,
    missing_side_files,
    read_manifest,
    shard_identity,
    side_file,
    write_side_file,
)


def _manifest(folder, **fields) -> str:
    folder.mkdir(exist_ok=True)
    (folder / MANIFEST).write_text(json.dumps({"format": FORMAT, "embed_dim": 2, "logit_scale": 10.0, **fields}))
    return str(folder)


def test_a_shards_side_file_is_its_name_with_npz_for_tar():
    assert side_file("/emb", "/data/shards/00003.tar") == "/emb/00003.npz"
    assert side_file("/emb", "https://host/set/7.tar/") == "/emb/7.npz"
    assert side_file("/emb", "pipe:curl -s https://host/a.tar") == "/emb/a.npz"
    assert side_file("/emb", "s3://bucket/0.tar.gz") == "/emb/0.tar.gz.npz"
    assert side_file("/emb", "/data/tarred") == "/emb/tarred.npz"  # ends with "tar", not ".tar"
    assert side_file("/emb", "/data/BOX/") == "/emb/BOX.npz"  # only slashes are stripped


def _refusal(tmp_path, text: str) -> str:
    (tmp_path / MANIFEST).write_text(text)
    with pytest.raises(ValueError) as info:
        read_manifest(str(tmp_path))
    return str(info.value)


def test_a_manifest_is_refused_naming_the_file_and_what_is_wrong(tmp_path):
    path = tmp_path / MANIFEST
    assert _refusal(tmp_path, "{not json").startswith(f"{KEY}: {path} is not JSON (Expecting property name")
    base = {"format": FORMAT, "embed_dim": 2, "logit_scale": 10.0}
    for drop in ("format", "embed_dim", "logit_scale"):
        manifest = {k: v for k, v in base.items() if k != drop}
        assert _refusal(tmp_path, json.dumps(manifest)) == (
            f"{KEY}: {path} is not a {FORMAT} manifest with embed_dim and logit_scale")
    assert _refusal(tmp_path, json.dumps({**base, "format": "mmssl-teacher-embeddings/2"})).endswith(
        "is not a mmssl-teacher-embeddings/1 manifest with embed_dim and logit_scale")
    for dim in (0, 2.0):
        assert _refusal(tmp_path, json.dumps({**base, "embed_dim": dim})) == (
            f"{KEY}: {path}: embed_dim must be a positive integer, got {dim!r}")
    assert _refusal(tmp_path, json.dumps({**base, "logit_scale": None})) == (
        f"{KEY}: {path}: logit_scale must be a finite number, got None")
    assert _refusal(tmp_path, '{"format": "%s", "embed_dim": 2, "logit_scale": Infinity}' % FORMAT).endswith(
        "logit_scale must be a finite number, got inf")
    path.write_text(json.dumps({**base, "embed_dim": 1, "logit_scale": 20}))  # the smallest width, an int scale
    assert read_manifest(str(tmp_path))["logit_scale"] == 20


def test_a_missing_manifest_names_the_folder_set_aside_by_an_interrupted_overwrite(tmp_path):
    emb = tmp_path / "emb"
    with pytest.raises(FileNotFoundError) as info:
        read_manifest(str(emb))
    assert str(info.value) == f"{KEY}: no {MANIFEST} in {str(emb)!r} (tools/teacher_embeddings.py writes one)"
    for name in (".emb.old.111", ".emb.old.333", ".emb.old.222", ".other.old.444"):
        (tmp_path / name).mkdir()
    with pytest.raises(FileNotFoundError) as info:
        read_manifest(str(emb))
    assert str(info.value).endswith(
        f"(tools/teacher_embeddings.py writes one); an interrupted --overwrite set the earlier folder aside as "
        f"{str(tmp_path / '.emb.old.333')!r}: rename it back, or run tools/teacher_embeddings.py again")
    emb.mkdir()  # the folder is there, only its manifest is not: nothing was set aside
    with pytest.raises(FileNotFoundError) as info:
        read_manifest(str(emb))
    assert str(info.value).endswith("writes one)")
    with pytest.raises(FileNotFoundError) as info:  # no parent folder to look in
        read_manifest(str(tmp_path / "none" / "emb"))
    assert str(info.value).endswith("writes one)")


def test_a_shards_identity_is_its_size_and_the_hash_of_its_leading_bytes(tmp_path):
    head = os.urandom(HEAD_BYTES)
    a, b = tmp_path / "a.tar", tmp_path / "b.tar"
    a.write_bytes(head + b"x" * 100)
    b.write_bytes(head + b"y" * 100)  # differs only past the leading bytes
    want = {"bytes": HEAD_BYTES + 100, "head_sha256": hashlib.sha256(head).hexdigest()}
    assert shard_identity(str(a)) == shard_identity(str(b)) == want
    assert HEAD_BYTES == 1 << 14
    assert shard_identity(str(tmp_path / "missing.tar")) is None
    assert shard_identity("https://host/a.tar") is None and shard_identity(f"pipe:cat {a}") is None


def test_training_shards_are_checked_against_the_recorded_ones(tmp_path, caplog):
    shards = tmp_path / "shards"
    shards.mkdir()
    for name, data in (("0.tar", b"0" * 50), ("1.tar", b"1" * 60)):
        (shards / name).write_bytes(data)
    urls = [str(shards / "0.tar"), str(shards / "1.tar")]
    folder = tmp_path / "emb"
    _manifest(folder)
    with caplog.at_level(logging.WARNING, logger="mmssl.data.teacher_embeddings"):
        check_shards(str(folder), urls)
    assert caplog.messages == [f"{KEY}: {folder / MANIFEST} records no shard identities (written by an older "
                               "tools/teacher_embeddings.py): the training shards are joined to its embeddings by "
                               "file name and key unchecked"]
    recorded = {"0.tar": shard_identity(urls[0]), "1.tar": shard_identity(urls[1]), "BOX": {"bytes": 1}}
    _manifest(folder, shards=recorded)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mmssl.data.teacher_embeddings"):
        check_shards(str(folder), [*urls, str(shards / "2.tar")])  # a shard it does not name: no side file, no check
        check_shards(str(folder), [urls[0], "https://host/1.tar", "pipe:cat /x/1.tar", "https://host/1.tar/",
                                   "https://host/BOX"])
    assert caplog.messages == [f"{KEY}: 4 shards are remote or not files, so not checked against "
                               f"{folder / MANIFEST} (joined by name and key)"]
    (shards / "1.tar").write_bytes(b"2" * 60)  # the same name and size, other bytes
    want = recorded["1.tar"]
    have = shard_identity(urls[1])
    with pytest.raises(ValueError) as info:
        check_shards(str(folder), [str(shards / "9.tar"), *urls])  # one it does not name first
    assert str(info.value) == (
        f"{KEY}: {folder / MANIFEST} holds embeddings of another shard named '1.tar' (60 bytes, leading bytes "
        f"SHA-256 {want['head_sha256'][:12]}), not of {urls[1]} (60 bytes, {have['head_sha256'][:12]}): run "
        "tools/teacher_embeddings.py on these shards")
    (shards / "1.tar").write_bytes(b"1" * 61)  # the same leading bytes, another size
    with pytest.raises(ValueError, match="another shard named '1.tar' \\(60 bytes.*\\(61 bytes"):
        check_shards(str(folder), urls)


def test_a_side_file_is_written_atomically_as_float32(tmp_path):
    path = str(tmp_path / "0.npz")
    write_side_file(path, ["a", "b"], np.ones((2, 3), dtype=np.float64), np.zeros((2, 3), dtype=np.float16))
    assert os.listdir(tmp_path) == ["0.npz"]  # no partial file left
    with np.load(path, allow_pickle=False) as f:
        assert f["keys"].tolist() == ["a", "b"] and f["image"].dtype == f["text"].dtype == np.float32
        assert f["image"].tolist() == [[1.0] * 3] * 2


def _write(folder, url: str, keys: list[str], width: int = 2) -> None:
    rows = np.arange(len(keys) * width, dtype=np.float32).reshape(len(keys), width)
    write_side_file(side_file(str(folder), url), keys, rows, -rows)


def test_a_worker_keeps_the_last_four_shards_and_pickles_without_them(tmp_path):
    folder = tmp_path / "emb"
    _manifest(folder)
    urls = [f"/data/{i}.tar" for i in range(5)]
    for url in urls:
        _write(folder, url, ["k"])
    join = TeacherEmbeddings(str(folder))
    for i in (0, 1, 2, 3, 0, 4):  # 0 used again before 4 comes: 1 is the least recently used
        assert join.lookup({"__url__": urls[i], "__key__": "k"})[0].tolist() == [0.0, 1.0]
    copy = pickle.loads(pickle.dumps(join))  # as a loader worker gets it
    for i in range(5):
        os.remove(side_file(str(folder), urls[i]))
    for i in (0, 2, 3, 4):  # still open in this worker
        assert join.lookup({"__url__": urls[i], "__key__": "k"})[1].tolist() == [-0.0, -1.0]
    with pytest.raises(BadSample, match=f"^no teacher embeddings file {re.escape(side_file(str(folder), urls[1]))}$"):
        join.lookup({"__url__": urls[1], "__key__": "k"})
    assert copy.embed_dim == 2 and copy.folder == str(folder)
    with pytest.raises(BadSample, match="no teacher embeddings file"):  # the copy opens its own files
        copy.lookup({"__url__": urls[0], "__key__": "k"})


def test_bad_side_files_and_rows_are_bad_samples_named_with_the_file(tmp_path):
    folder = tmp_path / "emb"
    _manifest(folder)
    path = side_file(str(folder), "/data/0.tar")
    join = TeacherEmbeddings(str(folder))
    _write(folder, "/data/0.tar", ["a", "b"], width=3)
    with pytest.raises(BadSample) as info:
        join.lookup({"__url__": "/data/0.tar", "__key__": "a"})
    assert str(info.value) == f"teacher embeddings of width (3,) / (3,) in {path}, the manifest says 2"
    with pytest.raises(BadSample) as info:
        join.lookup({"__url__": "/data/0.tar", "__key__": "c"})
    assert str(info.value) == f"no teacher embeddings for key 'c' in {path}"
    for url, image, text, says in (("/data/1a.tar", np.ones(2), np.ones((2, 2)), "() / (2,)"),  # 1-D rows
                                   ("/data/1b.tar", np.ones((2, 2)), np.ones(2), "(2,) / ()"),
                                   ("/data/1c.tar", np.ones((2, 3)), np.ones((2, 2)), "(3,) / (2,)"),  # one side
                                   ("/data/1d.tar", np.ones((2, 2)), np.ones((2, 3)), "(2,) / (3,)")):
        np.savez(side_file(str(folder), url), keys=np.array(["a", "b"]), image=image, text=text)
        with pytest.raises(BadSample, match=f"^teacher embeddings of width {re.escape(says)} in "):
            join.lookup({"__url__": url, "__key__": "a"})
    np.savez(side_file(str(folder), "/data/2.tar"), keys=np.array(["a"]), image=np.ones((1, 2), dtype=np.float32))
    with pytest.raises(BadSample) as info:
        join.lookup({"__url__": "/data/2.tar", "__key__": "a"})
    assert str(info.value).startswith(f"unreadable teacher embeddings file {side_file(str(folder), '/data/2.tar')} "
                                      "(KeyError: ")
    with open(side_file(str(folder), "/data/3.tar"), "wb") as f:
        f.write(b"PK\x03\x04 not a zip")
    with pytest.raises(BadSample, match=r"^unreadable teacher embeddings file .*3\.npz \(BadZipFile: "):
        join.lookup({"__url__": "/data/3.tar", "__key__": "a"})
    np.savez(side_file(str(folder), "/data/4.tar"), keys=np.array(["a", "b"]),
             image=np.ones((2, 2), dtype=np.float16), text=np.array([[1, 2], [np.inf, 0]], dtype=np.float64))
    image, text = join.lookup({"__url__": "/data/4.tar", "__key__": "a"})
    assert image.dtype == text.dtype == np.float32 and text.tolist() == [1.0, 2.0]
    with pytest.raises(BadSample) as info:  # a non-finite text row
        join.lookup({"__url__": "/data/4.tar", "__key__": "b"})
    assert str(info.value) == f"non-finite teacher embeddings for key 'b' in {side_file(str(folder), '/data/4.tar')}"
    keys = np.array([["a", "b"]])  # 2-D keys: fewer rows than keys is not the only misfit
    np.savez(side_file(str(folder), "/data/5.tar"), keys=keys, image=np.ones((1, 2)), text=np.ones((1, 2)))
    with pytest.raises(BadSample, match=r"holds 1 keys but 1 image and 1 text rows"):
        join.lookup({"__url__": "/data/5.tar", "__key__": "['a' 'b']"})
    np.savez(side_file(str(folder), "/data/6.tar"), keys=np.array(["a", "b"]), image=np.ones((2, 2)),
             text=np.ones((1, 2)))  # the text rows short only
    with pytest.raises(BadSample, match=r"holds 2 keys but 2 image and 1 text rows$"):
        join.lookup({"__url__": "/data/6.tar", "__key__": "a"})
    # Object arrays are pickles: never loaded (a side file carries no code).
    np.savez(side_file(str(folder), "/data/7.tar"), keys=np.array(["a"], dtype=object), image=np.ones((1, 2)),
             text=np.ones((1, 2)))
    with pytest.raises(BadSample, match=r"^unreadable teacher embeddings file .*7\.npz \(ValueError: Object arrays"):
        join.lookup({"__url__": "/data/7.tar", "__key__": "a"})


def test_the_shards_without_a_side_file_are_listed(tmp_path):
    folder = tmp_path / "emb"
    _manifest(folder)
    _write(folder, "/data/0.tar", ["a"])
    assert missing_side_files(str(folder), ["/data/0.tar", "/data/1.tar", "https://h/2.tar"]) == [
        "/data/1.tar", "https://h/2.tar"]
    assert missing_side_files(None, ["/data/1.tar"]) == []
