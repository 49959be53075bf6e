"""tools/make_shards.py refuses bad input naming the file and line (a table that is not UTF-8, a
label that is no class index, an empty caption), a caption template with another field than {c},
and class folders that differ only in case; nothing is written then."""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image

from tests.tools.test_make_shards import _images, _run


def _table(tmp_path: Path, rows: bytes) -> Path:
    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    table = tmp_path / "pairs.csv"
    table.write_bytes(b"path,caption,label\na.png,a cat,0\n" + rows)
    return table


@pytest.mark.parametrize("row,said", [
    (b"a.png,caf\xe9,1\n", "pairs.csv:3: not UTF-8 text (invalid continuation byte at byte 42): save it as UTF-8"),
    (b"a.png,a dog,notanint\n", "pairs.csv:3: label is not an integer: 'notanint' (a class index in [0, 2**63))"),
    (b"a.png,a dog,-4\n", "pairs.csv:3: label is negative: -4"),
    (b"a.png,a dog,1e23\n", "pairs.csv:3: label is not an integer: '1e23'"),
    (b"a.png,a dog,100000000000000000000000\n", "pairs.csv:3: label overflows int64: 100000000000000000000000"),
    (b"a.png, ,1\n", "pairs.csv:3: empty caption for 'a.png'"),
    (b'a.png,"two\nlines",1\na.png,,1\n', "pairs.csv:5: empty caption for 'a.png'"),
])
def test_a_bad_table_row_is_refused_naming_the_file_and_line(tmp_path, capsys, row, said):
    table = _table(tmp_path, row)
    assert _run("make_shards.py", "--data", str(table), "--output", str(tmp_path / "out")) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"make_shards: {tmp_path / said}") and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


def test_a_template_with_another_field_is_a_usage_error(tmp_path, capsys):
    _images(tmp_path / "imgs")
    for template, field in (("a {d} photo of a {c}.", "KeyError: 'd'"), ("{c} {}", "IndexError"),
                            ("{c} {", "ValueError")):
        with pytest.raises(SystemExit) as exit_info:
            _run_main(["--data", str(tmp_path / "imgs"), "--output", str(tmp_path / "out"), "--template", template])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert f"--template {template!r}: only '{{c}}' is filled in" in err and field in err, err
    assert not (tmp_path / "out").exists()


def _run_main(argv: list[str]) -> int:
    import runpy

    from tests.tools.test_make_shards import TOOLS

    return runpy.run_path(str(TOOLS / "make_shards.py"), run_name="test")["main"](argv)


def test_class_folders_differing_only_in_case_are_refused(tmp_path, capsys):
    _images(tmp_path / "imgs")
    (tmp_path / "imgs" / "red_car").rename(tmp_path / "imgs" / "Blue_Boat")
    assert _run("make_shards.py", "--data", str(tmp_path / "imgs"), "--output", str(tmp_path / "out")) == 1
    err = capsys.readouterr().err
    said = f"--data '{tmp_path / 'imgs'}': the class names 'Blue Boat' and 'blue boat' of its folders differ only"
    assert said in err, err
    assert not (tmp_path / "out").exists()
