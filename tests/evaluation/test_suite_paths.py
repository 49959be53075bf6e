"""The shipped eval suites find the demo where it is written: ``$XDG_CACHE_HOME/mmssl/demo``, else
``~/.cache/mmssl/demo`` (mmssl.data.demo), through ``${VAR-default}`` in suite paths."""

from __future__ import annotations

import os

import pytest

from mmssl.evaluation.suite import SuiteError, expand_path, load_suite
from tests.conftest import REPO


@pytest.mark.parametrize("suite", ["demo", "project"])
def test_the_shipped_suites_follow_xdg_cache_home(tmp_path, monkeypatch, tiny_demo, suite):
    (tmp_path / "mmssl").mkdir()
    os.symlink(tiny_demo.root, tmp_path / "mmssl" / "demo")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("HOME", str(tmp_path / "nobody"))  # no demo under ~/.cache: the variable must be read
    if suite == "project":
        monkeypatch.chdir(tmp_path)  # its other sets are relative paths: refused after the demo's are read
        with pytest.raises(SuiteError) as raised:
            load_suite(str(REPO / "configs/eval/project.yaml"))
        assert "sets.demo" not in str(raised.value)
        return
    demo = next(s for s in load_suite(str(REPO / "configs/eval/demo.yaml")).sets if s.name == "demo")
    assert demo.test.startswith(str(tmp_path)) and demo.train.startswith(str(tmp_path))


def test_variables_expand_shell_style_and_an_unset_one_without_default_is_named(monkeypatch):
    monkeypatch.setenv("HOME", "/home/u")
    monkeypatch.delenv("MMSSL_UNSET", raising=False)
    monkeypatch.setenv("MMSSL_EMPTY", "")
    assert expand_path("${MMSSL_UNSET-~/.cache}/x") == "/home/u/.cache/x"
    assert expand_path("${MMSSL_EMPTY-~/.cache}/x") == "/x"  # set, though empty: as mmssl.data.demo reads it
    assert expand_path("${MMSSL_EMPTY:-~/.cache}/x") == "/home/u/.cache/x"
    monkeypatch.setenv("MMSSL_SET", "/data")
    assert expand_path("${MMSSL_SET}/x") == expand_path("${MMSSL_SET-/y}/x") == "/data/x"
    with pytest.raises(SuiteError, match="sets.a.test: .*MMSSL_UNSET, which is not set"):
        expand_path("${MMSSL_UNSET}/x", "sets.a.test")
