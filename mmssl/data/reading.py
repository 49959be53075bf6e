"""Reading raw samples from tar shards (or an image folder's virtual shards, :mod:`mmssl.data.folders`),
with bad input counted: whole shards, or pieces of them.

webdataset's ``tarfile_samples`` does the reading (URLs and ``pipe:`` work); a piece that starts
inside a local tar is entered by seeking to its first sample instead of reading the ones before it.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import tarfile
from typing import Iterator, Optional, Sequence

import webdataset as wds
from webdataset.tariterators import base_plus_ext, group_by_keys, tar_file_expander

from mmssl.data.folders import folder_samples, is_folder_url
from mmssl.data.plan import Piece
from mmssl.data.sources import count_tar, is_local
from mmssl.errors import DataError

log = logging.getLogger("mmssl.data")

# Judge the bad fraction only once a worker has seen this many samples, so that one bad sample
# among the first few does not stop a run (and finally once it has met all its planned samples).
MIN_SEEN_FOR_FRACTION = 64
# Tar members webdataset skips (its ``tar_file_iterator`` default), skipped when counting samples too.
WDS_SKIP_META = r"__[^/]*__($|/)"


class Health:
    """Counts and reports bad input inside one worker.

    Bad samples are those that fail to decode and, in exact epochs, the planned samples a shard did
    not give (it vanished, became unreadable, or holds fewer than its ``sizes.json`` lists) and the
    samples a shard holds beyond what its ``sizes.json`` lists (the plan does not read them).
    """

    def __init__(self, max_bad_fraction: float) -> None:
        self.max_bad_fraction = max_bad_fraction
        self.seen = self.bad = self.pending = self.raw = 0
        self.muted = False  # while skipping already-served samples after a resume
        self.errors: list[str] = []
        self.failures = 0  # unreadable data met (muted or not)
        self.unreadable = 0  # of which counted in ``pending``
        self.last_failure = ""

    def sample_failed(self, sample: dict, reason: str) -> None:
        self.seen += 1
        self.bad += 1
        self.pending += 1
        self._report(f"skipped sample {sample.get('__key__')!r} in {sample.get('__url__')}: {reason}")
        self.check()

    def samples_lost(self, count: int, line: str, counted: int = 0) -> None:
        """``count`` samples of the plan that could not be read as planned: bad, reported by ``line``.

        ``counted``: unreadable-data events already in ``pending`` for them (:meth:`tar_failed`), so
        that a vanished shard's samples are skipped once in ``data/skipped``, not once more.
        """
        if self.muted:
            return
        self.seen += count
        self.bad += count
        self.pending += max(0, count - counted)
        self._report(line)
        self.check()

    def check(self, final: bool = False) -> None:
        """Stop past ``max_bad_fraction``; judged once ``MIN_SEEN_FOR_FRACTION`` samples are seen, or
        ``final``ly, when the worker's planned samples have all been met."""
        if (final or self.seen >= MIN_SEEN_FOR_FRACTION) and self.bad > self.max_bad_fraction * self.seen:
            raise DataError(
                f"{self.bad} of {self.seen} samples were bad or missing, more than data.max_bad_fraction="
                f"{self.max_bad_fraction}; last problems: {self.errors[-3:]}")

    def tar_failed(self, url: str, exn: Exception) -> bool:
        """webdataset handler: count and warn, then continue with the next member or shard."""
        # webdataset appends the URL to ``args``; an OSError's first is its errno.
        detail = exn.strerror if isinstance(exn, OSError) and exn.strerror else (exn.args[0] if exn.args else "")
        self.failures += 1
        self.last_failure = f"{type(exn).__name__}: {detail}"
        if not self.muted:
            self.pending += 1
            self.unreadable += 1
            self._report(f"skipped unreadable data in shard {url}: {self.last_failure}")
        return True

    def _report(self, line: str) -> None:
        self.errors = self.errors[-9:] + [line]
        log.warning(line)

    def take_pending(self) -> int:
        pending, self.pending = self.pending, 0
        return pending


def _tar(url: str, health: Health) -> Iterator[dict]:
    if is_folder_url(url):
        return (sample for _, sample in folder_samples(url, 0, health.tar_failed))
    return wds.tarfile_samples([{"url": url}], handler=functools.partial(health.tar_failed, url))


def read_shards(urls: Iterator[str], health: Health, give_up_after: Optional[int]) -> Iterator[dict]:
    """Raw samples of each shard in turn; unreadable shards or members are skipped and counted."""
    empty_in_row = 0
    for url in urls:
        got = 0
        for sample in _tar(url, health):
            got += 1
            health.raw += 1
            yield sample
        empty_in_row = 0 if got else empty_in_row + 1
        if give_up_after and empty_in_row >= give_up_after:
            raise RuntimeError(f"{empty_in_row} shard draws in a row gave no sample; last problems: "
                               f"{health.errors[-3:]}")


def _sample_start(path: str, first: int) -> Optional[tuple[int, str]]:
    """Byte offset and key of the ``first``-th sample of a local tar, reading member headers only.

    Samples are counted as webdataset groups them (regular files, metadata skipped, consecutive
    members sharing ``base_plus_ext``'s key); ``None`` when the tar cannot be scanned this way.
    """
    try:
        with tarfile.open(path, "r:") as tar:  # random access: the scan seeks over member data
            key, count = None, -1
            for member in tar:
                name = member.name
                if not member.isreg() or re.match(WDS_SKIP_META, name):
                    continue
                prefix, _ = base_plus_ext(name)
                if prefix is not None and prefix != key:
                    key, count = prefix, count + 1
                    if count == first:
                        return member.offset, prefix
    except (tarfile.TarError, OSError):
        pass
    return None


def _shard_samples(url: str, first: int, health: Health) -> Iterator[tuple[int, dict]]:
    """``(offset, raw sample)`` of a shard from sample ``first`` on.

    A local ``.tar`` is entered at that sample's header (``seek``), so the samples before a slot's
    range cost a header scan, not a read; other URLs are read from the start and the samples before
    ``first`` dropped undecoded.
    """
    if is_folder_url(url):
        yield from folder_samples(url, first, health.tar_failed)  # random access: no scan
        return
    start = _sample_start(url, first) if first > 0 and is_local(url) and url.endswith(".tar") else None
    if start is not None:
        handler = functools.partial(health.tar_failed, url)
        try:
            stream = open(url, "rb")
        except OSError as exn:  # vanished since the scan
            handler(exn)
            return
        with stream:
            stream.seek(start[0])
            samples = group_by_keys(
                tar_file_expander([{"url": url, "stream": stream}], handler=handler), handler=handler
            )
            head = next(samples, None)
            if head is not None and head["__key__"] == start[1]:
                yield first, head
                yield from enumerate(samples, start=first + 1)
                return
    for offset, sample in enumerate(_tar(url, health)):
        if offset >= first:
            yield offset, sample


def read_pieces(urls: Sequence[str], pieces: Sequence[Piece], health: Health,
                sizes: Optional[Sequence[int]] = None) -> Iterator[dict]:
    """Raw samples of each piece in turn; samples outside it are not decoded (see :func:`_shard_samples`).

    With ``sizes`` (what the plan was made from), every piece is checked against what is read: the
    planned samples a shard does not give (vanished, unreadable, fewer than listed) and, at a piece
    that ends its shard, samples beyond the listed size are counted bad (:meth:`Health.samples_lost`)
    and named. The last sample of a piece is handed on only after the check, so that the count is
    in before the worker's last batch.

    Args:
        urls: the stream's shard URLs.
        pieces: what to read, in order.
        health: the worker's counters.
        sizes: samples per shard (one per URL) the plan assumed; ``None`` checks nothing.
    """
    for piece in pieces:
        url, wanted = urls[piece.shard], set(piece.offsets) if piece.offsets else None
        listed = sizes[piece.shard] if sizes is not None else None
        ends_shard = listed is not None and not piece.offsets and piece.hi == listed
        failures, got, held, extra = (health.failures, health.unreadable), 0, None, 0
        samples = _shard_samples(url, piece.lo, health)
        for offset, sample in samples:
            if offset >= piece.hi:
                extra = 1 + sum(1 for _ in samples) if ends_shard else 0
                break
            if wanted is None or offset in wanted:
                if held is not None:
                    health.raw += 1
                    yield held
                held, got = sample, got + 1
        if sizes is not None:
            failed = health.failures > failures[0]
            _check_piece(url, piece, listed, got, extra, health.last_failure if failed else "", health,
                         health.unreadable - failures[1])
        if held is not None:
            health.raw += 1
            yield held


def _samples(n: int) -> str:
    return f"{n} bad sample{'s' if n != 1 else ''}"


def _check_piece(url: str, piece: Piece, listed: int, got: int, extra: int, failure: str, health: Health,
                 counted: int) -> None:
    """Count and name what a piece lacked (or its shard held beyond ``listed``); ``counted``: skips
    already counted for its unreadable data."""
    missing = len(piece) - got
    if missing and failure:
        health.samples_lost(missing, f"shard {url} gave {got} of the {len(piece)} samples planned from it "
                                     f"({failure}): counted as {_samples(missing)}", counted)
    elif missing:
        held = _held_samples(url)
        health.samples_lost(
            missing,
            f"shard {url} holds {held if held is not None else 'fewer'} samples, {_listing(url)} "
            f"{listed}: {got} of the {len(piece)} samples planned from it were read, "
            f"counted as {_samples(missing)}",
        )
    if extra:
        health.samples_lost(
            extra,
            f"shard {url} holds {listed + extra} samples, {_listing(url)} {listed}: the exact-epoch "
            f"plan reads the {listed} listed, {extra} not read this epoch are counted as "
            f"{_samples(extra)} (correct the count; tools/inspect_shards.py checks every shard)",
        )


def _listing(url: str) -> str:
    """Where the plan's size of a shard came from (:func:`~mmssl.data.sources.shard_sizes`), for messages."""
    if is_folder_url(url):
        return "the folder's listing had"
    if is_local(url) and os.path.exists(os.path.join(os.path.dirname(url), "sizes.json")):
        return "its sizes.json lists"
    return "the start-up count was"


def _held_samples(url: str) -> Optional[int]:
    """Samples in a local tar (headers only), ``None`` when it cannot be counted."""
    if not (is_local(url) and url.endswith(".tar")):
        return None
    try:
        return count_tar(url)
    except (tarfile.TarError, OSError):
        return None
