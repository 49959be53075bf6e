"""``mmssl configs`` and the run arguments' checks (mmssl.commands), in-process without torch."""

from __future__ import annotations

import os

import pytest

from mmssl.commands import dispatch


def _exit(args: list[str], capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as info:
        dispatch(args)
    return info.value.code, capsys.readouterr().err


@pytest.mark.parametrize("into_folder", [False, True])
def test_configs_copy_refuses_a_dangling_link_and_writes_nothing_through_it(tmp_path, capsys, into_folder):
    elsewhere = tmp_path / "elsewhere" / "clip.yaml"
    elsewhere.parent.mkdir()
    link = tmp_path / "out" / "clip.yaml"
    link.parent.mkdir()
    link.symlink_to(elsewhere)
    code, err = _exit(["configs", "--copy", "demo/clip", str(link.parent if into_folder else link)], capsys)
    assert code == 1 and f"{link} is a link" in err and len(err.splitlines()) == 1, err
    assert not os.path.lexists(elsewhere) and os.path.islink(link)


def test_configs_copy_writes_a_new_file(tmp_path, capsys):
    code, _ = _exit(["configs", "--copy", "demo/clip", str(tmp_path / "mine.yaml")], capsys)
    assert code == 0 and (tmp_path / "mine.yaml").read_text().startswith("#")
