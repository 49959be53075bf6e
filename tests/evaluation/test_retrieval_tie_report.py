"""The held-out set's tie report and the tie-aware places of :mod:`mmssl.retrieval`.

Rank 0 logs, once per distinct set, how many pairs there are and how many of their captions and
of their images repeat another pair's exactly, each figure in its place; an empty set reports
nothing and counts no ties. Each query's place is computed on the device of its scores (the meta
device stands in for a GPU here).
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from mmssl import retrieval
from mmssl.retrieval import distributed_retrieval_hits, places, tied_rows


@pytest.fixture
def lightning_log(caplog, monkeypatch):
    """Lightning's console messages (its logger does not propagate to the root), none reported yet."""
    monkeypatch.setattr(retrieval, "_reported", set())
    log = logging.getLogger("lightning.pytorch")
    log.addHandler(caplog.handler)
    with caplog.at_level("INFO"):
        yield caplog
    log.removeHandler(caplog.handler)


def _reports(caplog) -> list[str]:
    """Each report once (a record may reach the capture handler through two loggers)."""
    records = {id(r): r for r in caplog.records}.values()
    return [r.getMessage() for r in records if r.getMessage().startswith("retrieval: of ")]


def test_the_report_names_pairs_tied_captions_and_tied_images_each_in_its_place(lightning_log):
    e = torch.eye(6)
    image = e[:5]  # five distinct images
    text = torch.stack([e[0], e[1], e[1], e[1], e[4]])  # captions 1, 2 and 3 identical
    distributed_retrieval_hits(image, text)
    assert _reports(lightning_log) == [
        "retrieval: of 5 held-out pairs, 3 captions and 0 images repeat another pair's exactly; "
        "a tie ranks the lower index first (mmssl.retrieval)"]


def test_a_set_without_ties_is_reported_too_and_each_set_once(lightning_log):
    image = text = F.normalize(torch.eye(4), dim=-1)
    distributed_retrieval_hits(image, text)
    distributed_retrieval_hits(image, text)  # the next validation of the same set: not again
    assert _reports(lightning_log) == [
        "retrieval: of 4 held-out pairs, 0 captions and 0 images repeat another pair's exactly; "
        "a tie ranks the lower index first (mmssl.retrieval)"]


def test_an_empty_set_reports_nothing_and_counts_no_ties(lightning_log):
    empty = torch.zeros(0, 4)
    hits = distributed_retrieval_hits(empty, empty)
    assert all(h.numel() == 0 for h in hits.values())
    assert _reports(lightning_log) == []
    assert tied_rows(empty) == 0


def test_places_are_computed_on_the_device_of_the_scores():
    scores = torch.zeros(2, 3, device="meta")
    assert places(scores, torch.zeros(2, dtype=torch.long, device="meta")).device.type == "meta"
