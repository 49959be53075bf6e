"""Where a labelled set's class names, templates and shards are found, and each refusal's exact
words (mmssl.data.label_files): the side files beside a pattern's first shard without opening any
shard, a split's root consulted for a clip_benchmark split only, an image folder's own templates
file, and every message naming the file or folder at fault and the way out."""

from __future__ import annotations

import pytest

from mmssl.data.label_files import classnames_problem, read_classnames, read_templates, resolve_labeled, shard_urls
from tests.data.image_helpers import write_image_folder
from tests.data.shard_helpers import sample_members, write_tar


def _split(root, name: str, shards: int = 1):
    split = root / name
    split.mkdir(parents=True)
    for i in range(shards):
        write_tar(split / f"{i}.tar", sample_members(i))
    (split / "nshards.txt").write_text(f"{shards}\n")
    return split


def test_a_root_without_the_test_split_names_one_to_pass(tmp_path):
    _split(tmp_path, "val")
    _split(tmp_path, "train")
    with pytest.raises(FileNotFoundError) as info:
        resolve_labeled(str(tmp_path))
    assert str(info.value) == (f"labelled set {str(tmp_path)!r} is a clip_benchmark wds/ folder without a 'test' "
                               f"split (it has ['train', 'val']): pass {str(tmp_path / 'train')!r} or another split "
                               "folder")
    assert resolve_labeled(str(tmp_path), "val") == str(tmp_path / "val")


@pytest.mark.parametrize("text", ["ten", "0", "x" * 25])
def test_an_nshards_file_without_a_positive_count_is_refused_naming_it(tmp_path, text):
    split = _split(tmp_path, "test")
    (split / "nshards.txt").write_text(text)
    with pytest.raises(ValueError) as info:
        shard_urls(str(split))
    assert str(info.value) == f"{split / 'nshards.txt'}: expected the number of shards, found {text[:20]!r}"


def test_missing_shards_of_an_nshards_file_are_named_three_at_most(tmp_path):
    split = _split(tmp_path, "test")
    (split / "nshards.txt").write_text("5")
    with pytest.raises(FileNotFoundError) as info:
        shard_urls(str(split))
    missing = [str(split / f"{i}.tar") for i in (1, 2, 3)]
    assert str(info.value) == f"{split / 'nshards.txt'} says 5 shards (0.tar .. 4.tar), but {missing} are missing"


def test_side_files_sit_beside_a_patterns_first_shard_which_is_not_opened(tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    for folder, i in ((first, 0), (second, 1)):
        folder.mkdir()
        write_tar(folder / f"{i}.tar", sample_members(i))
    (first / "classnames.txt").write_text("cat\ndog\n")
    (first / "zeroshot_classification_templates.txt").write_text("a {c}.\n")
    joined = f"{first / '0.tar'}::{second / '1.tar'}"
    assert read_classnames(joined) == ["cat", "dog"] and read_templates(joined) == ["a {c}."]
    # Class names without the shards: a pattern whose later shards are not there yet.
    assert read_classnames(str(first / "{0..3}.tar")) == ["cat", "dog"]
    with pytest.raises(FileNotFoundError) as info:
        read_classnames(str(second / "1.tar"))
    assert str(info.value) == (f"labelled set {str(second / '1.tar')!r} has no classnames.txt (looked for "
                               f"{str(second / 'classnames.txt')!r})")


def test_a_splits_root_is_read_for_a_clip_benchmark_split_only(tmp_path):
    (tmp_path / "classnames.txt").write_text("cat\ndog\n")
    split = _split(tmp_path, "test")
    assert read_classnames(str(split)) == ["cat", "dog"]
    shards = tmp_path / "shards"  # a plain shard folder: its parent's files are someone else's
    shards.mkdir()
    write_tar(shards / "0.tar", sample_members(0))
    with pytest.raises(FileNotFoundError, match="looked for '[^']*shards/classnames.txt'\\)$"):
        read_classnames(str(shards))
    (tmp_path / "classnames.txt").unlink()
    with pytest.raises(FileNotFoundError) as info:
        read_classnames(str(split))
    assert str(info.value) == (f"labelled set {str(split)!r} has no classnames.txt (looked for "
                               f"{str(split / 'classnames.txt')!r} and {str(tmp_path / 'classnames.txt')!r})")


def test_an_image_folders_templates_file_is_its_own(tmp_path, monkeypatch):
    folder = write_image_folder(tmp_path / "set", ["cat", "dog"], 1)
    assert read_templates(str(folder))[0] == "a bad photo of a {c}."  # none: CLIP's 80
    (folder / "zeroshot_classification_templates.txt").write_text("a {c}.\nthe {c}!\n")
    monkeypatch.chdir(tmp_path)  # not read from the working folder
    (tmp_path / "zeroshot_classification_templates.txt").write_text("wrong {c}\n")
    assert read_templates(str(folder)) == ["a {c}.", "the {c}!"]


def test_explicit_side_files_and_unreadable_ones_are_named(tmp_path):
    folder = write_image_folder(tmp_path / "set", ["cat", "dog"], 1)
    with pytest.raises(FileNotFoundError) as info:
        read_classnames(str(folder), str(tmp_path / "names.txt"))
    assert str(info.value) == f"no class-names file at {str(tmp_path / 'names.txt')!r}"
    with pytest.raises(FileNotFoundError) as info:
        read_templates(str(folder), str(tmp_path / "templates.txt"))
    assert str(info.value) == f"no templates file at {str(tmp_path / 'templates.txt')!r}"
    (tmp_path / "names.txt").write_bytes(b"cat\n\xff\xfedog\n")
    with pytest.raises(ValueError) as info:
        read_classnames(str(folder), str(tmp_path / "names.txt"))
    assert str(info.value) == f"{tmp_path / 'names.txt'} is not UTF-8 (invalid start byte at byte 4)"
    (tmp_path / "templates.txt").write_text("a {c} of {d}\n")
    with pytest.raises(ValueError) as info:
        read_templates(str(folder), str(tmp_path / "templates.txt"))
    assert str(info.value) == (f"{tmp_path / 'templates.txt'}, line 1: 'a {{c}} of {{d}}' cannot be filled with a "
                               "class name alone (KeyError: 'd'); write a literal brace as {{ or }}")


def test_a_class_list_is_refused_for_the_first_name_that_breaks_it():
    assert classnames_problem([]) == (0, "no class names")
    assert classnames_problem(["cat", "red\nfox"]) == (1, "class name 'red\\nfox' holds a line break")
    assert classnames_problem(["red\rfox"]) == (0, "class name 'red\\rfox' holds a line break")
    assert classnames_problem(["Red fox", "cat", "red  Fox"]) == (2, (
        "class name 'red  Fox' differs from line 1 ('Red fox') only in case or spacing: the tokenizer lower-cases "
        "prompts, so both classes would be one text; rename one"))
    # Lower-casing, as the tokenizer does: "straße" and "strasse" stay two texts (upper-casing would merge them).
    assert classnames_problem(["straße", "strasse", "red fox", "red\tfox x"]) is None

