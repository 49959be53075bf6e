"""Run a distillation teacher once over shards and store its image and text embeddings.

    python tools/teacher_embeddings.py --ckpt runs/fm_clip_teacher/version_0/checkpoints/last.ckpt \
        --data data/fashion_mnist/train --output emb/fm_teacher --output-json emb.json

Writes ``OUTPUT/<shard>.npz`` per shard (``keys``, ``image`` and ``text``: (N, D) float32,
L2-normalised) and ``OUTPUT/teacher.json`` last (teacher file and SHA-256, width, logit scale,
image size and normalisation, and each local shard's size and a hash of its leading bytes, so
that training refuses other shards of the same names), into a new folder beside ``OUTPUT`` that
is renamed into place when whole: an interrupted run, ``--overwrite`` included, leaves ``OUTPUT``
as it was or (killed between the two renames of the swap) absent, never the side files of two
teachers under one manifest. These are the side files :mod:`mmssl.data.teacher_embeddings` joins
to the shards by sample key: train a student with ``--model.init_args.teacher_embeddings OUTPUT`` instead
of ``--model.init_args.teacher FILE``. Images are seen as the teacher's eval transform shows them
(resize, centre crop, its normalisation), captions through its own tokenizer. Samples that cannot
be decoded are skipped, named and counted (the loader skips them too). ``--ckpt`` takes every
teacher ``model.teacher`` takes (``--model NAME`` for an open_clip state dict, ``--tokenizer DIR``
for a Hugging Face tokenizer). Of a checkpoint trained with ``mmssl.callbacks.EMA`` the raw weights
are read, as ``model.teacher`` reads them, or with ``--ema`` the average (``teacher.json`` records
which: ``ema``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Iterator, Optional

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from mmssl.checkpoints import read_checkpoint
from mmssl.data.decode import BadSample, SampleDecoder
from mmssl.data.reading import Health, read_shards
from mmssl.data.sources import expand_urls
from mmssl.data.teacher_embeddings import FORMAT, MANIFEST, shard_identity, side_file, write_side_file
from mmssl.data.transforms import eval_transform
from mmssl.evaluation.encoders import add_ema_argument
from mmssl.export.paths import write_folder
from mmssl.models.lora import LORA_BASE
from mmssl.models.teacher import Teacher, load_teacher
from mmssl.tools._common import add_loader_arguments, add_output_json, run


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", required=True, help="the teacher: mmssl CLIP .ckpt, open_clip state dict (with --model), "
                                                 "open_clip_hf or transformers folder")
    p.add_argument("--model", help="open_clip model name or .json config of a state-dict --ckpt")
    p.add_argument("--tokenizer", help="local folder of the teacher's Hugging Face tokenizer, if its config names one")
    add_ema_argument(p)
    p.add_argument("--data", required=True, help="shards: folder, brace pattern or ::-joined specs")
    p.add_argument(
        "--output", required=True, help="folder to write (new or empty; --overwrite replaces an earlier one)"
    )
    p.add_argument("--overwrite", action="store_true", help="replace the side files of an earlier run in --output")
    p.add_argument("--image-key", default="jpg;jpeg;png;webp", help="sample extensions holding the image")
    p.add_argument("--text-key", default="txt", help="sample extension holding the caption")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="where the teacher runs")
    add_loader_arguments(p, batch_size=256, num_workers=2)
    add_output_json(p)
    return p.parse_args(argv)


def check_output(output: str, overwrite: bool) -> None:
    """Refuse a non-empty ``output`` unless ``overwrite`` and it holds only an earlier run's files."""
    if os.path.lexists(output) and not os.path.isdir(output):
        raise NotADirectoryError(f"--output {output!r} is a file; this tool writes a folder")
    entries = sorted(os.listdir(output)) if os.path.isdir(output) else []
    if entries and not overwrite:
        raise FileExistsError(f"--output {output!r} is not empty ({', '.join(entries[:5])}): name a new or empty "
                              "folder, or pass --overwrite")
    foreign = [e for e in entries if e != MANIFEST and not e.endswith(".npz")]
    if foreign:
        raise FileExistsError(f"--output {output!r} holds {foreign[:5]}, which this tool does not write")


class ShardBatches(IterableDataset):
    """Each worker's shards (``urls[worker::workers]``) as batches ``(url, keys, images, tokens, last)``."""

    def __init__(self, urls: list[str], decoder: SampleDecoder, batch_size: int) -> None:
        self.urls, self.decoder, self.batch_size = urls, decoder, batch_size

    def __iter__(self) -> Iterator[tuple[str, list[str], Any, Any, bool, int]]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        for url in self.urls[worker::workers]:
            yield from self._shard(url)

    def _shard(self, url: str) -> Iterator[tuple[str, list[str], Any, Any, bool, int]]:
        health = Health(max_bad_fraction=1.0)  # this tool never stops: every bad sample is named and counted
        samples: list[tuple[str, dict]] = []
        for raw in read_shards(iter([url]), health, None):
            try:
                samples.append((str(raw["__key__"]), self.decoder(raw)))
            except BadSample as exn:
                health.sample_failed(raw, str(exn))
            if len(samples) == self.batch_size:
                yield self._batch(url, samples, False, 0)
                samples = []
        yield self._batch(url, samples, True, health.bad + health.unreadable)

    def _batch(self, url: str, samples: list, last: bool, bad: int) -> tuple:
        if not samples:
            return url, [], None, None, last, bad
        batch = self.decoder.collate([s for _, s in samples])
        return url, [k for k, _ in samples], batch["image"], batch["text"], last, bad


def embed(teacher: Teacher, urls: list[str], output: str, args: argparse.Namespace) -> dict[str, Any]:
    """Embed every sample of ``urls`` and write the side files; the counts and the speed."""
    decoder = SampleDecoder(eval_transform(teacher.image_size, teacher.image_mean, teacher.image_std),
                            teacher.tokenizer, args.image_key.split(";"), args.text_key)
    loader = DataLoader(ShardBatches(urls, decoder, args.batch_size), batch_size=None,
                        num_workers=min(args.num_workers, len(urls)))
    teacher.to(args.device)
    parts: dict[str, list] = {}
    samples = bad = 0
    start = time.perf_counter()
    with torch.no_grad():
        for url, keys, images, tokens, last, skipped in loader:
            if keys:
                image = teacher.encode_image(images.to(args.device)).float().cpu().numpy()  # (b, D)
                text = teacher.encode_text(tokens.to(args.device)).float().cpu().numpy()
                parts.setdefault(url, []).append((keys, image, text))
                samples += len(keys)
            if last:
                got = parts.pop(url, [])
                width = teacher.embed_dim
                write_side_file(side_file(output, url), [k for p in got for k in p[0]],
                                np.concatenate([p[1] for p in got]) if got else np.zeros((0, width), np.float32),
                                np.concatenate([p[2] for p in got]) if got else np.zeros((0, width), np.float32))
                bad += skipped
    seconds = time.perf_counter() - start
    return {"samples": samples, "skipped": bad, "shards": len(urls), "seconds": round(seconds, 2),
            "samples_per_s": round(samples / seconds, 1) if seconds > 0 else None}


def _body(args: argparse.Namespace) -> None:
    if not os.path.exists(args.ckpt):
        raise FileNotFoundError(f"--ckpt: no teacher file or folder at {args.ckpt!r}")
    check_output(args.output, args.overwrite)
    urls = expand_urls(args.data)
    stems = [side_file(args.output, u) for u in urls]
    if len(set(stems)) != len(stems):
        raise ValueError(f"--data {args.data!r}: two shards share a file name, so their side files would collide")
    try:
        teacher = load_teacher(args.ckpt, args.model, args.tokenizer, args.ema)
    except ValueError:
        _refuse_lora(args.ckpt)
        raise
    manifest = write_folder(args.output, lambda folder: _write(teacher, urls, folder, args))
    print(f"teacher_embeddings: {manifest['samples']} samples ({manifest['skipped']} skipped) of {len(urls)} shards "
          f"in {manifest['seconds']} s, {manifest['samples_per_s']} samples/s -> {args.output}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(manifest, f, indent=1)


def _refuse_lora(ckpt: str) -> None:
    """Name the way out for a LoRA checkpoint, which a teacher does not read (its weights are
    adapters over base files): the teacher loader's own message points at the model name."""
    try:
        lora = os.path.isfile(ckpt) and bool(read_checkpoint(ckpt).get(LORA_BASE))
    except Exception:  # the teacher loader's error stands
        return
    if lora:
        raise ValueError(f"--ckpt {ckpt!r} is a LoRA checkpoint (adapters over a base model), which a teacher does "
                         f"not read: merge it into a folder with tools/export.py --ckpt {ckpt} --format open_clip_hf "
                         "--output DIR, and pass --ckpt DIR") from None


def _write(teacher: Teacher, urls: list[str], folder: str, args: argparse.Namespace) -> dict[str, Any]:
    """The side files and the manifest (last) in ``folder``, a new one that replaces ``--output`` when
    whole (:func:`mmssl.export.paths.write_folder`); the manifest."""
    report = embed(teacher, urls, folder, args)
    manifest = {"format": FORMAT, "teacher": os.path.abspath(args.ckpt), "sha256": teacher.sha256, "ema": args.ema,
                "embed_dim": teacher.embed_dim, "logit_scale": float(teacher.logit_scale),
                "image_size": teacher.image_size, "image_mean": list(teacher.image_mean),
                "image_std": list(teacher.image_std), "data": args.data, **report,
                "shards": {os.path.basename(u): i for u in urls if (i := shard_identity(u)) is not None}}
    with open(os.path.join(folder, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)
    return manifest


def main(argv: Optional[list[str]] = None) -> int:
    """Write the side files and the manifest; the exit status."""
    args = parse_args(argv)
    return run("teacher_embeddings", lambda: _body(args))


if __name__ == "__main__":
    sys.exit(main())
