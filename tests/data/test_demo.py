import hashlib
from pathlib import Path

import pytest
import webdataset as wds

from mmssl.data.demo import demo_classnames, ensure_demo_data
from mmssl.data.label_files import read_classnames, read_templates


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_demo_generation_is_deterministic(tmp_path):
    a = ensure_demo_data(str(tmp_path / "a"), num_train=20, num_val=10, shard_size=8, image_size=32)
    b = ensure_demo_data(str(tmp_path / "b"), num_train=20, num_val=10, shard_size=8, image_size=32)
    assert _digest(Path(a.root)) == _digest(Path(b.root))
    c = ensure_demo_data(str(tmp_path / "c"), num_train=20, num_val=10, shard_size=8, image_size=32, seed=1)
    assert _digest(Path(a.root)) != _digest(Path(c.root))


def test_demo_shards_read_back_in_img2dataset_layout(tiny_demo):
    samples = list(wds.WebDataset(tiny_demo.train, shardshuffle=False).decode("pil"))
    assert len(samples) == 64
    first = samples[0]
    assert {"jpg", "txt", "cls", "json"} <= set(first)
    assert first["jpg"].size == (32, 32)
    attrs = first["json"]
    # The caption names every attribute and the label is the colour-shape class.
    for value in attrs.values():
        assert value in first["txt"]
    assert demo_classnames()[first["cls"]] == f"{attrs['color']} {attrs['shape']}"


def test_demo_eval_split_has_clip_benchmark_layout(tiny_demo):
    assert read_classnames(tiny_demo.eval_dir) == list(demo_classnames())
    assert all("{c}" in t for t in read_templates(tiny_demo.eval_dir))
    labels = [s["cls"] for s in wds.WebDataset(tiny_demo.val, shardshuffle=False).decode()]
    assert len(labels) == 32 and len(set(labels)) > 5


def test_existing_demo_is_reused_and_changed_settings_regenerate(tmp_path):
    root = str(tmp_path / "d")
    ensure_demo_data(root, num_train=8, num_val=4, shard_size=4, image_size=32)
    marker = Path(root) / "train" / "0.tar"
    before = marker.stat().st_mtime_ns
    ensure_demo_data(root, num_train=8, num_val=4, shard_size=4, image_size=32)
    assert marker.stat().st_mtime_ns == before
    again = ensure_demo_data(root, num_train=12, num_val=4, shard_size=4, image_size=32)
    assert again.train.endswith("{0..2}.tar")


def test_demo_generator_refuses_a_users_folder_and_deletes_nothing(tmp_path):
    from shard_helpers import write_dataset

    from mmssl.data.demo import demo_data

    user = tmp_path / "mine"
    write_dataset(user / "train", [3])
    write_dataset(user / "val", [2])
    (user / "train" / "0.tar").write_bytes((user / "train" / "00000.tar").read_bytes())  # a demo shard's name
    before = _digest(user)
    for generate in (lambda: ensure_demo_data(str(user), num_train=8, num_val=4, shard_size=4, image_size=32),
                     lambda: demo_data(str(user))):
        with pytest.raises(FileExistsError, match=f"{user}.*not empty.*no demo marker.*data.init_args.demo_dir"):
            generate()
        assert _digest(user) == before  # every file byte-identical, none added


def test_regenerating_a_demo_folder_deletes_only_what_the_generator_wrote(tmp_path):
    root = tmp_path / "d"
    ensure_demo_data(str(root), num_train=12, num_val=4, shard_size=4, image_size=32)
    (root / "notes.txt").write_text("mine")
    (root / "train" / "extra.json").write_text("{}")
    again = ensure_demo_data(str(root), num_train=8, num_val=4, shard_size=4, image_size=32)
    assert again.train.endswith("{0..1}.tar") and not (root / "train" / "2.tar").exists()  # its own old shard goes
    assert (root / "notes.txt").read_text() == "mine" and (root / "train" / "extra.json").exists()
    # A folder whose marker is not a demo marker is not a demo folder.
    (root / "done.json").write_text("not json")
    with pytest.raises(FileExistsError, match="done.json"):
        ensure_demo_data(str(root), num_train=8, num_val=4, shard_size=4, image_size=32)
