"""The sample decoder at its edges: the pixel limit's boundary, images that are not RGB, the
defaults a user's img2dataset shards rely on, the teacher joins and class captions, the token
trim. ``tests/data/test_bad_sample_reasons.py`` holds one bad sample per reason; this file the
good samples' exact outputs and the messages' exact wording."""

from __future__ import annotations

import io
import random

import numpy as np
import pytest
import torch
from PIL import Image

from mmssl.data.captions import ClassCaptions
from mmssl.data.decode import REDUCED_FROM, BadSample, SampleDecoder, draft_size, open_image, trim_text_padding


def _encoded(image: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt)
    return buf.getvalue()


def _to_tensor(image: Image.Image) -> torch.Tensor:
    return torch.from_numpy(np.asarray(image, dtype=np.float32).copy()).permute(2, 0, 1)


def _tokens(captions: list[str]) -> torch.Tensor:
    return torch.tensor([[len(c), 1] for c in captions])


def test_the_pixel_limit_decodes_an_image_at_it_and_names_one_above_it():
    data = _encoded(Image.new("RGB", (4, 3)))
    assert open_image(data, max_pixels=12).size == (4, 3)
    with pytest.raises(BadSample) as err:
        open_image(data, max_pixels=11)
    assert str(err.value) == "4x3 image (12 pixels) is above max_image_pixels=11: not decoded"


@pytest.mark.parametrize("mode, value", [("L", 100), ("RGBA", (10, 20, 30, 255)), ("P", 7)])
def test_images_in_other_modes_come_out_rgb(mode, value):
    image = Image.new(mode, (5, 4), value)
    if mode == "P":
        image.putpalette([0, 0, 0] * 7 + [40, 50, 60] + [0, 0, 0] * 248)
    out = open_image(_encoded(image))
    assert out.mode == "RGB" and out.size == (5, 4)
    assert out.getpixel((0, 0)) == {"L": (100, 100, 100), "RGBA": (10, 20, 30), "P": (40, 50, 60)}[mode]


def test_the_draft_side_keeps_a_full_resolution_crop():
    assert draft_size(224) == 224  # eval: resize + centre crop
    assert draft_size(224, 0.25) == 448  # a crop of a quarter of the area spans half the side
    assert draft_size(10, 0.0) == 317  # scale 0 is floored at 1e-3


def test_a_decoder_with_defaults_reads_img2dataset_keys():
    decoder = SampleDecoder(_to_tensor, _tokens)
    raw = {
        "__key__": "k",
        "jpg": _encoded(Image.new("RGB", (6, 6), (1, 2, 3)), "JPEG"),
        "txt": b" a cat \n",
        "cls": b"3",
    }
    out = decoder(raw)
    assert (out["text"], out["label"], tuple(out["image"].shape)) == ("a cat", 3, (3, 6, 6))
    assert decoder.output_keys(raw) == {"image", "text", "label"}
    assert decoder.output_keys({"jpg": b""}) == {"image", "text"}  # no .cls: no label promised
    assert SampleDecoder(_to_tensor, None).output_keys({"jpg": b""}) == {"image"}  # MAE: images only
    with pytest.raises(BadSample, match=r"^no image \(looked for jpg, webp\)$"):
        SampleDecoder(_to_tensor, _tokens, image_keys=("jpg", "webp"))({"txt": b"x"})


def test_the_decoder_hands_its_limits_to_the_image_decode():
    big = _encoded(Image.new("RGB", (64, 48), (9, 9, 9)), "JPEG")
    reduced = SampleDecoder(lambda im: im, None, min_size=16)({"jpg": big})["image"]
    assert reduced.size == (32, 24) and reduced.info[REDUCED_FROM] == (64, 48, 2.0)  # both sides stay >= 16
    with pytest.raises(
        BadSample, match=r"^jpg: 64x48 image \(3072 pixels\) is above max_image_pixels=3000: not decoded$"
    ):
        SampleDecoder(lambda im: im, None, max_pixels=3000)({"jpg": big})
    with pytest.raises(BadSample, match=r"^unreadable png \(UnidentifiedImageError: cannot identify image file"):
        SampleDecoder(lambda im: im, None)({"png": b"not an image"})


class _Teacher:
    """Stored teacher embeddings for the keys it holds (the real join reads side files by shard:
    tests/models/test_distill.py)."""

    def __init__(self):
        self.asked: list[str] = []

    def lookup(self, raw):
        self.asked.append(raw["__key__"])
        return np.full(2, 1.0, np.float32), np.full(2, 2.0, np.float32)


def test_teacher_features_and_tokens_come_with_each_sample_and_batch():
    teacher = _Teacher()
    decoder = SampleDecoder(_to_tensor, _tokens, teacher_tokenizer=lambda c: torch.tensor([[7] * len(c)]),
                            teacher_embeddings=teacher)
    raws = [{"__key__": f"k{i}", "png": _encoded(Image.new("RGB", (2, 2))), "txt": b"ab" * (i + 1)} for i in range(2)]
    assert decoder.output_keys(raws[0]) == {"image", "text", "teacher_image_features", "teacher_text_features"}
    samples = [decoder(r) for r in raws]
    assert teacher.asked == ["k0", "k1"]
    batch = decoder.collate(samples)
    assert sorted(batch) == ["image", "teacher_image_features", "teacher_text_features", "teacher_tokens", "text"]
    assert batch["text"].tolist() == [[2, 1], [4, 1]] and batch["teacher_tokens"].tolist() == [[7, 7]]
    assert batch["teacher_image_features"].tolist() == [[1.0, 1.0]] * 2
    assert batch["teacher_text_features"].tolist() == [[2.0, 2.0]] * 2


def test_class_captions_follow_the_samples_rng_in_training_and_its_key_in_validation():
    captions = ClassCaptions(["cat", "dog"], [f"template {i} of a {{c}}" for i in range(50)])
    decoder = SampleDecoder(lambda im, rng=None: 0, _tokens, captions=captions)
    raw = {"__key__": "000123", "png": _encoded(Image.new("RGB", (2, 2))), "cls": b"1"}
    assert decoder(raw)["text"] == captions.caption(1, None, "000123")  # validation: fixed by the key
    assert decoder(raw)["text"] != captions.caption(1, None, None)
    assert decoder(raw, random.Random(5))["text"] == captions.caption(1, random.Random(5))


def test_trim_keeps_through_the_last_column_any_row_uses():
    tokens = torch.tensor([[5, 6, 7, 0, 0], [5, 0, 0, 0, 0]])
    assert trim_text_padding(tokens).tolist() == [[5, 6, 7], [5, 0, 0]]
    assert trim_text_padding(torch.zeros(2, 4, dtype=torch.long)).shape == (2, 1)  # all padding: one column
