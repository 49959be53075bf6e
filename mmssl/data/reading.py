"""Reading raw samples from tar shards (or an image folder's virtual shards, :mod:`mmssl.data.folders`),
with bad input counted: whole shards, or pieces of them.

webdataset's ``tarfile_samples`` does the reading (URLs and ``pipe:`` work); a piece that starts
inside a local tar is entered by seeking to its first sample instead of reading the ones before it.
"""

from __future__ import annotations

import functools
import logging
import re
import tarfile
from typing import Iterator, Optional, Sequence

import webdataset as wds
from webdataset.tariterators import base_plus_ext, group_by_keys, tar_file_expander

from mmssl.data.folders import folder_samples, is_folder_url
from mmssl.data.plan import Piece
from mmssl.data.sources import is_local

log = logging.getLogger("mmssl.data")

# Judge the bad fraction only once a worker has seen this many samples, so that one bad sample
# among the first few does not stop a run.
MIN_SEEN_FOR_FRACTION = 64
# Tar members webdataset skips (its ``tar_file_iterator`` default), skipped when counting samples too.
WDS_SKIP_META = r"__[^/]*__($|/)"


class Health:
    """Counts and reports bad input inside one worker."""

    def __init__(self, max_bad_fraction: float) -> None:
        self.max_bad_fraction = max_bad_fraction
        self.seen = self.bad = self.pending = self.raw = 0
        self.muted = False  # while skipping already-served samples after a resume
        self.errors: list[str] = []

    def sample_failed(self, sample: dict, reason: str) -> None:
        self.seen += 1
        self.bad += 1
        self.pending += 1
        self._report(f"skipped sample {sample.get('__key__')!r} in {sample.get('__url__')}: {reason}")
        if self.seen >= MIN_SEEN_FOR_FRACTION and self.bad > self.max_bad_fraction * self.seen:
            raise RuntimeError(
                f"{self.bad} of {self.seen} samples were bad, more than data.max_bad_fraction="
                f"{self.max_bad_fraction}; last problems: {self.errors[-3:]}")

    def tar_failed(self, url: str, exn: Exception) -> bool:
        """webdataset handler: count and warn, then continue with the next member or shard."""
        if not self.muted:
            self.pending += 1
            detail = exn.args[0] if exn.args else type(exn).__name__
            self._report(f"skipped unreadable data in shard {url}: {type(exn).__name__}: {detail}")
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
        with open(url, "rb") as stream:
            stream.seek(start[0])
            samples = group_by_keys(tar_file_expander([{"url": url, "stream": stream}], handler=handler), handler=handler)
            head = next(samples, None)
            if head is not None and head["__key__"] == start[1]:
                yield first, head
                yield from enumerate(samples, start=first + 1)
                return
    for offset, sample in enumerate(_tar(url, health)):
        if offset >= first:
            yield offset, sample


def read_pieces(urls: Sequence[str], pieces: Sequence[Piece], health: Health) -> Iterator[dict]:
    """Raw samples of each piece in turn; samples outside it are not decoded (see :func:`_shard_samples`)."""
    for piece in pieces:
        wanted = set(piece.offsets) if piece.offsets else None
        for offset, sample in _shard_samples(urls[piece.shard], piece.lo, health):
            if offset >= piece.hi:
                break
            if wanted is None or offset in wanted:
                health.raw += 1
                yield sample
