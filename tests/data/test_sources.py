"""Shard specs as a config writes them: a local path starting with ``~`` names the user's home, as
a shell would expand it (a YAML value reaches mmssl unexpanded); URLs are left as they are."""

from __future__ import annotations

import pytest

from mmssl.data.sources import expand_urls, parse_sources


def test_a_tilde_in_a_shard_spec_is_the_home_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "shards").mkdir()
    for i in range(2):
        (tmp_path / "shards" / f"{i}.tar").write_bytes(b"")
    expected = [str(tmp_path / "shards" / f"{i}.tar") for i in range(2)]
    assert expand_urls("~/shards/{0..1}.tar") == expected
    assert expand_urls("~/shards::~/shards/0.tar") == [*expected, expected[0]]  # a folder, then one shard
    mixed = parse_sources([{"data": "~/shards/0.tar", "weight": 3}, {"data": "~/shards", "weight": 1}])
    assert [s.urls for s in mixed] == [(expected[0],), tuple(expected)]
    assert mixed[0].spec == "~/shards/0.tar"  # errors name what the user wrote
    assert expand_urls("pipe:cat ~/x.tar", must_exist=False) == ["pipe:cat ~/x.tar"]  # a command's own business
    with pytest.raises(FileNotFoundError, match="do not exist"):
        expand_urls("~/shards/{0..2}.tar")
