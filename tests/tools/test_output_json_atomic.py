"""``--output-json`` of the scoring tools (zero-shot, probe, masked-words, caption: ``emit_report``;
evaluate) replaces the previous results whole or not at all: a kill mid-write keeps them."""

from __future__ import annotations

import json
import os

import pytest

import mmssl.evaluation.report as report_module
from mmssl.evaluation.offline import emit_report
from mmssl.evaluation.report import write_json


class Killed(BaseException):
    """What a SIGINT or a SIGTERM handler raises in the middle of a write."""


def _previous(tmp_path):
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"top1": 0.5}))
    return path


def test_a_report_that_fails_while_being_written_leaves_the_previous_results(tmp_path):
    path = _previous(tmp_path)
    with pytest.raises(TypeError):  # json meets a value it cannot write after the first keys
        emit_report({"top1": 0.7, "top5": 0.9, "model": object()}, "zero-shot of x", str(path))
    assert json.loads(path.read_text()) == {"top1": 0.5}
    assert os.listdir(tmp_path) == ["results.json"]


def test_a_kill_during_the_write_leaves_the_previous_results_and_no_temporary_file(tmp_path, monkeypatch):
    path = _previous(tmp_path)

    def killed(*args):
        raise Killed

    monkeypatch.setattr(report_module.os, "fsync", killed)
    with pytest.raises(Killed):
        emit_report({"top1": 0.7}, "linear probe of x", str(path))
    assert json.loads(path.read_text()) == {"top1": 0.5}
    assert os.listdir(tmp_path) == ["results.json"]
    monkeypatch.undo()
    emit_report({"top1": 0.7}, "linear probe of x", str(path))
    assert json.loads(path.read_text()) == {"top1": 0.7}
    assert os.listdir(tmp_path) == ["results.json"]


def test_the_written_file_has_the_permissions_of_a_plain_open(tmp_path):
    mask = os.umask(0o022)
    try:
        write_json(str(tmp_path / "a.json"), {"a": 1})
    finally:
        os.umask(mask)
    assert (tmp_path / "a.json").stat().st_mode & 0o777 == 0o644


def test_every_scoring_tool_writes_its_json_through_the_atomic_writer():
    from tests.conftest import REPO

    for tool in ("zero_shot", "linear_probe", "masked_words", "caption"):
        text = (REPO / "tools" / f"{tool}.py").read_text()
        assert "emit_report(" in text and "open(args.output_json" not in text, tool
    evaluate = (REPO / "tools" / "evaluate.py").read_text()
    assert "write_json(args.output_json" in evaluate and "json.dump(" not in evaluate



def test_a_replaced_file_keeps_its_permissions(tmp_path):
    path = tmp_path / "results.json"
    path.write_text("{}")
    path.chmod(0o640)  # a results file made group-readable, not world-readable
    write_json(str(path), {"a": 1})
    assert path.stat().st_mode & 0o777 == 0o640 and json.loads(path.read_text()) == {"a": 1}


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="the umask is read from /proc")
def test_the_umask_is_read_without_changing_it(tmp_path, monkeypatch):
    def no_umask(mask):  # os.umask(0) to read it, even for a moment: another thread's new file is 0o666
        raise AssertionError(f"os.umask({mask:#o}) called while writing")

    mask = os.umask(0o027)
    try:
        monkeypatch.setattr(os, "umask", no_umask)
        write_json(str(tmp_path / "new.json"), {"a": 1})
    finally:
        monkeypatch.undo()
        os.umask(mask)
    assert (tmp_path / "new.json").stat().st_mode & 0o777 == 0o640
