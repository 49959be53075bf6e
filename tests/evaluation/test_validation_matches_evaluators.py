"""One figure per model: a CLIP's validation retrieval equals ``tools/evaluate.py``'s and plain
open_clip's on the same weights and held-out pairs, count for count.

The held-out JPEGs are 256 px for a 32 px model, so a reduced (libjpeg DCT-scaled, Pillow
``draft``) decode would read them at 1/8 scale and feed the model other pixels than open_clip's
preprocess does (full decode, bicubic resize). Captions repeat and two images are stored twice,
so the tie convention (mmssl.retrieval) is exercised too. Nothing is trained.
"""

from __future__ import annotations

import io
import json
import runpy
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import open_clip
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from mmssl.data.datamodule import ImageTextDataModule
from mmssl.data.decode import draft_size, open_image
from tests.data.shard_helpers import write_tar

REPO = Path(__file__).resolve().parents[2]
N, PER_SHARD, SIDE, CAPTIONS = 40, 20, 256, 12
KS = (1, 5, 10)


def _jpeg(rng: np.random.Generator) -> bytes:
    """A smooth random picture with fine noise: what a reduced decode reads differently."""
    coarse = Image.fromarray(rng.integers(0, 256, (6, 6, 3), dtype=np.uint8)).resize((SIDE, SIDE), Image.BILINEAR)
    pixels = np.asarray(coarse, dtype=np.int16) + rng.integers(-40, 41, (SIDE, SIDE, 3))
    buf = io.BytesIO()
    Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> tuple[str, list[tuple[bytes, str]]]:
    """Held-out shards of N pairs (captions repeat every 12; the last two images repeat the first two)."""
    rng = np.random.default_rng(0)
    images = [_jpeg(rng) for _ in range(N - 2)]
    images += images[:2]
    samples = [(images[i], f"a photo of thing {i % CAPTIONS}") for i in range(N)]
    folder = tmp_path_factory.mktemp("heldout") / "val"
    folder.mkdir()
    for s in range(N // PER_SHARD):
        members = []
        for i in range(s * PER_SHARD, (s + 1) * PER_SHARD):
            members += [(f"{i:05d}.jpg", samples[i][0]), (f"{i:05d}.txt", samples[i][1].encode()),
                        (f"{i:05d}.cls", b"0")]
        write_tar(folder / f"{s:05d}.tar", members)
    return str(folder), samples


@pytest.fixture(scope="module")
def clip(tiny_clip_json):
    from mmssl.models.clip import CLIP

    torch.manual_seed(3)
    return CLIP(model_name=tiny_clip_json).eval()


def _counts(places: torch.Tensor) -> dict[int, int]:
    return {k: int((places < k).sum()) for k in KS}


def _stable_places(scores: torch.Tensor) -> torch.Tensor:
    """(N, N) scores, pair i the own candidate of query i -> its place in a stable descending sort."""
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices  # (N, N)
    return (order == torch.arange(scores.shape[0])[:, None]).int().argmax(dim=1)


def _open_clip_counts(clip, samples, decode) -> dict[str, dict[int, int]]:
    """Plain open_clip: its own model, preprocess and tokenizer, exact ranks of the whole set."""
    name = clip._model_config_name
    model, _, preprocess = open_clip.create_model_and_transforms(name)
    model.load_state_dict(clip.model.state_dict())
    model.eval()
    images = torch.stack([preprocess(decode(data)) for data, _ in samples])  # (N, 3, 32, 32)
    with torch.no_grad():
        image = F.normalize(model.encode_image(images), dim=-1)
        text = F.normalize(model.encode_text(open_clip.get_tokenizer(name)([t for _, t in samples])), dim=-1)
    scores = image @ text.T  # (N images, N captions)
    return {"i2t": _counts(_stable_places(scores)), "t2i": _counts(_stable_places(scores.T))}


def _full(data: bytes) -> Image.Image:
    return Image.open(io.BytesIO(data)).convert("RGB")


def _validation_counts(clip, data: str) -> dict[str, dict[int, int]]:
    dm = ImageTextDataModule(train_data=data, val_data=data, batch_size=16, num_workers=0,
                             image_size=clip.image_size, image_mean=clip.image_mean, image_std=clip.image_std,
                             tokenizer=clip.tokenizer)
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False)
    logged = trainer.validate(clip, datamodule=dm, verbose=False)[0]
    return {d: {k: _exact_count(logged[f"val/{d}_R@{k}"]) for k in KS} for d in ("i2t", "t2i")}


def _exact_count(recall: float) -> int:
    count = round(recall * N)
    assert abs(recall * N - count) < 1e-3, recall  # a mean of N 0/1 hits
    return count


def _evaluate_counts(clip, model_json: str, data: str, tmp_path: Path) -> tuple[dict[str, dict[int, int]], dict]:
    ckpt = tmp_path / "clip.pt"
    torch.save(clip.model.state_dict(), ckpt)
    suite = tmp_path / "suite.yaml"
    suite.write_text(f"resamples: 10\nsets:\n  heldout:\n    test: {data}\n    tasks:\n"
                     "      retrieval: {recall_k: [1, 5, 10]}\n")
    main = runpy.run_path(str(REPO / "tools" / "evaluate.py"), run_name="not_main")["main"]
    out = tmp_path / "out"
    assert main(["--ckpt", str(ckpt), "--model", model_json, "--suite", str(suite), "--output", str(out),
                 "--batch-size", "7"]) == 0
    result = json.loads((out / "heldout_retrieval_clip.json").read_text())
    metrics = result["metrics"]
    # One caption per image: CLIP_benchmark's text (image) retrieval is validation's i2t (t2i).
    counts = {"i2t": {k: _exact_count(metrics[f"text_retrieval_recall@{k}"]) for k in KS},
              "t2i": {k: _exact_count(metrics[f"image_retrieval_recall@{k}"]) for k in KS}}
    return counts, result["settings"]


def test_validation_retrieval_equals_evaluate_and_plain_open_clip(pairs, clip, tiny_clip_json, tmp_path):
    data, samples = pairs
    reference = _open_clip_counts(clip, samples, _full)
    drafted = _open_clip_counts(clip, samples, lambda b: open_image(b, draft_size(clip.image_size)))
    assert drafted != reference  # the set has teeth: a reduced decode of these images moves the figures
    assert _validation_counts(clip, data) == reference
    evaluated, settings = _evaluate_counts(clip, tiny_clip_json, data, tmp_path)
    assert evaluated == reference
    # 40 captions from 12 phrasings all repeat; images 0 and 1 are stored twice.
    assert (settings["tied_captions"], settings["tied_images"]) == (N, 4)


def test_the_reduced_decode_is_for_training_streams_only():
    dm = ImageTextDataModule(train_data="unused", image_size=32, crop_scale=(0.25, 1.0), eval_crop_pct=0.875)
    assert dm._decoder(True).min_size == draft_size(32, 0.25)
    assert dm._decoder(False).min_size is None  # validation, and so `mmssl validate`, decode in full
