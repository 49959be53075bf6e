"""Masked attribute words with the true image and a blank one (mmssl.evaluation.masked_words):
stub models whose answer is known (one reads the image's colour, one ignores it), the attribute
positions in the demo's captions, the blank image, and the two models' ``predict_masked_tokens``."""

from __future__ import annotations

import random

import pytest
import torch
from open_clip.tokenizer import SimpleTokenizer
from PIL import Image
from torch import nn

from mmssl.data.demo import CAPTION_TEMPLATES, COLORS, SHAPES, caption, draw_scene
from mmssl.data.transforms import IMAGENET_MEAN, IMAGENET_STD, eval_transform
from mmssl.evaluation.masked_words import attribute_positions, masked_word_accuracy, word_ids
from mmssl.models.clip_mlm import CLIPMLM
from mmssl.models.m3ae import M3AE
from tests.models.test_clip_mlm import _json
from tests.models.test_m3ae import TINY

TOKENIZER = SimpleTokenizer(context_length=32)
MEAN, STD = torch.tensor(IMAGENET_MEAN).view(3, 1, 1), torch.tensor(IMAGENET_STD).view(3, 1, 1)


def _scenes(n: int = 60, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, list[dict[str, str]]]:
    """n demo captions, each with an image filled with its colour (normalised)."""
    rng = random.Random(seed)
    attrs = [draw_scene(rng, 16)[1] for _ in range(n)]
    captions = [caption(a, rng) for a in attrs]
    images = torch.stack([(torch.tensor(COLORS[a["color"]]).view(3, 1, 1).expand(3, 8, 8) / 255 - MEAN) / STD
                          for a in attrs])  # (N, 3, 8, 8)
    return images, TOKENIZER(captions), attrs


class ColourStub(nn.Module):
    """Answers the masked word from the image: the demo colour nearest its mean pixel ("circle" for
    shapes, whatever the image); with ``reads_image=False`` always "red". Records the images seen."""

    def __init__(self, reads_image: bool = True) -> None:
        super().__init__()
        self.tokenizer, self.reads_image, self.seen = TOKENIZER, reads_image, []
        self.colour_ids = torch.tensor(word_ids(TOKENIZER, list(COLORS)))
        self.rgb = torch.tensor(list(COLORS.values()), dtype=torch.float32) / 255  # (6, 3)

    def predict_masked_tokens(self, images, tokens, positions):
        self.seen.append(images.clone())
        logits = torch.zeros(images.shape[0], TOKENIZER.vocab_size)
        pixel = (images.mean(dim=(2, 3)) * STD.view(1, 3) + MEAN.view(1, 3))  # (B, 3) in [0, 1]
        nearest = torch.cdist(pixel, self.rgb).argmin(dim=1) if self.reads_image else torch.zeros_like(positions)
        is_colour = torch.isin(tokens[torch.arange(len(positions)), positions], self.colour_ids)
        answer = torch.where(is_colour, self.colour_ids[nearest], word_ids(TOKENIZER, ["circle"])[0])
        logits[torch.arange(len(positions)), answer] = 1.0
        return logits


def test_a_model_reading_the_image_shows_a_gap_and_one_ignoring_it_none():
    images, tokens, attrs = _scenes()
    report = masked_word_accuracy(ColourStub(), images, tokens, batch_size=16)
    blank_colour = list(COLORS)[int(torch.cdist(MEAN.view(1, 3), ColourStub().rgb).argmin())]
    share = sum(a["color"] == blank_colour for a in attrs) / len(attrs)
    assert report["color"]["count"] == len(attrs)
    assert report["color"]["top1_image"] == 1.0 and report["color"]["top1_image_vocab"] == 1.0
    assert report["color"]["top1_blank"] == pytest.approx(share)
    assert report["color"]["gap"] == pytest.approx(1.0 - share) and report["color"]["gap"] > 0
    circles = sum(a["shape"] == "circle" for a in attrs) / len(attrs)
    assert report["shape"]["top1_image"] == pytest.approx(circles) == report["shape"]["top1_blank"]
    assert report["shape"]["gap"] == 0 and report["shape"]["chance"] == 1 / len(SHAPES)

    ignoring = masked_word_accuracy(ColourStub(reads_image=False), images, tokens)
    reds = sum(a["color"] == "red" for a in attrs) / len(attrs)
    assert ignoring["color"]["top1_image"] == pytest.approx(reds) == ignoring["color"]["top1_blank"]
    assert ignoring["color"]["gap"] == 0


def test_the_blank_image_is_the_mean_colour_normalised_and_only_the_blank_pass_sees_it():
    images, tokens, _ = _scenes(8)
    stub = ColourStub()
    masked_word_accuracy(stub, images, tokens, attributes={"color": list(COLORS)})
    assert torch.equal(stub.seen[0], images) and len(stub.seen) == 2
    assert torch.count_nonzero(stub.seen[1]) == 0 and stub.seen[1].shape == images.shape
    mean_colour = Image.new("RGB", (16, 16), tuple(round(255 * m) for m in IMAGENET_MEAN))
    assert eval_transform(16, IMAGENET_MEAN, IMAGENET_STD)(mean_colour).abs().max() < 0.01  # = the blank


@pytest.mark.parametrize("template", CAPTION_TEMPLATES)
def test_attribute_positions_name_the_colour_and_shape_words_of_every_demo_caption(template):
    attrs = {"size": "small", "color": "purple", "shape": "diamond", "position": "in the top left",
             "background": "black"}
    tokens = TOKENIZER([template.format(**attrs), "a caption without either word"])
    for name, words in (("color", list(COLORS)), ("shape", SHAPES)):
        positions = attribute_positions(tokens, word_ids(TOKENIZER, words))
        assert TOKENIZER.decode([int(tokens[0, positions[0]])]).strip() == attrs[name]
        assert int(positions[1]) == -1


def test_refusals_name_the_cause():
    images, tokens, _ = _scenes(4)
    with pytest.raises(ValueError, match="predict_masked_tokens"):
        masked_word_accuracy(nn.Linear(1, 1), images, tokens)
    with pytest.raises(ValueError, match="'light blue' is 2 tokens"):
        masked_word_accuracy(ColourStub(), images, tokens, attributes={"color": ["light blue"]})
    with pytest.raises(ValueError, match="4 images but 3 captions"):
        masked_word_accuracy(ColourStub(), images, tokens[:3])


def test_m3ae_predicts_the_dropped_word_from_the_image_and_the_rest_of_the_caption_only():
    torch.manual_seed(0)
    model = M3AE(**TINY).eval()
    tokens = model.tokenizer(["a small red square in the top left on a white background", "a blue star"])
    positions = attribute_positions(tokens, word_ids(model.tokenizer, list(COLORS)))
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model.predict_masked_tokens(images, tokens, positions)
        other_word = tokens.clone()
        other_word[torch.arange(2), positions] = 4481  # "yellow": the removed token is never seen
        assert torch.allclose(model.predict_masked_tokens(images, other_word, positions), logits, atol=1e-6)
        assert not torch.allclose(model.predict_masked_tokens(torch.zeros_like(images), tokens, positions), logits)
        shorter = tokens.clone()
        shorter[0, 2] = 1746  # another context word changes the answer
        assert not torch.allclose(model.predict_masked_tokens(images, shorter, positions)[0], logits[0])
    assert logits.shape == (2, model.text_pred.out_features)
    report = masked_word_accuracy(model, images, tokens)
    assert report["color"]["count"] == 2 and report["shape"]["count"] == 2
    with pytest.raises(ValueError, match="padding"):
        model.predict_masked_tokens(images, tokens, torch.tensor([15, 15]))


def test_clip_mlm_masks_the_word_and_its_text_head_does_not_see_the_image(tmp_path):
    torch.manual_seed(0)
    model = CLIPMLM(model_name=_json(tmp_path), warmup_steps=0).eval()
    tokens = model.tokenizer(["a small red square", "a blue star on white"])
    positions = attribute_positions(tokens, word_ids(model.tokenizer, list(COLORS)))
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        logits = model.predict_masked_tokens(images, tokens, positions)
        other_word = tokens.clone()
        other_word[torch.arange(2), positions] = 4481
        assert torch.allclose(model.predict_masked_tokens(images, other_word, positions), logits, atol=1e-6)
        assert torch.equal(model.predict_masked_tokens(torch.zeros_like(images), tokens, positions), logits)
    assert masked_word_accuracy(model, images, tokens)["color"]["gap"] == 0
