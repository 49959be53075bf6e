"""The demo renderer's pixel labels (``render_mask``, ``dense_demo_set``) and the promise that
giving them changed no image: the demo shards and every figure in the docs are drawn from
``draw_scene``, so its pixels and its random draws stay what they were before the masks."""

from __future__ import annotations

import hashlib
import math
import random
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageDraw

from mmssl.data import demo
from mmssl.data.demo import (
    BACKGROUNDS,
    COLORS,
    DENSE_CLASSES,
    POSITIONS,
    SHAPES,
    SIZES,
    _polygon,
    dense_demo_set,
    draw_geometry,
    draw_scene,
    ensure_demo_data,
    render_mask,
    render_scene,
)

# sha256 (first 16 hex digits) of ``img.tobytes()`` for six scenes drawn in a row from
# ``random.Random(seed)`` at ``image_size``, and the source's next ``random()`` after them: taken
# with draw_scene as it was before the masks were added (Pillow 13.0).
BEFORE = {
    (0, 64): (["e7969691aa8d54fe", "c7011be3e7d109b7", "b8a1959061ffe276", "337b8d5154cef5f6",
               "e502d4ea23f45b72", "0f8a00b637484fed"], 0.26005620864429313),
    (1, 64): (["2d6ad2d4d216d5d5", "acd94af2fadaeadf", "f05eee2a43b76fef", "80ac894a5ae1fe71",
               "bb9651b7a10539c6", "ddd1f227c9cab9d9"], 0.703382088603836),
    (7, 32): (["90ea86e735a32597", "5073802794b11279", "302962f1082fc4a3", "485956c0f82569fb",
               "58b862e43d38ff4a", "31b115d45ee46702"], 0.6952953662736593),
    (3, 224): (["80e29325e0fb200a", "32284b7d2ac08113", "f245d5c985aba41e", "8bc31660367b99ca",
                "b5de7df558f17a83", "df45202d220643ed"], 0.02012535403587845),
}


def _draw_scene_before(rng: random.Random, image_size: int = 64) -> tuple[Image.Image, dict[str, str]]:
    """``draw_scene`` verbatim as it was before the masks: the reference its output must equal."""
    attrs = {
        "shape": rng.choice(SHAPES),
        "color": rng.choice(list(COLORS)),
        "size": rng.choice(list(SIZES)),
        "position": rng.choice(list(POSITIONS)),
        "background": rng.choice(list(BACKGROUNDS)),
    }
    bg = tuple(min(255, max(0, v + rng.randint(-12, 12))) for v in BACKGROUNDS[attrs["background"]])
    img = Image.new("RGB", (image_size, image_size), bg)
    draw = ImageDraw.Draw(img)
    fx, fy = POSITIONS[attrs["position"]]
    jitter = 0.05 * image_size
    cx = fx * image_size + rng.uniform(-jitter, jitter)
    cy = fy * image_size + rng.uniform(-jitter, jitter)
    r = SIZES[attrs["size"]] * image_size * rng.uniform(0.85, 1.1) * (0.75 if fx != 0.5 else 1.0)
    fill = tuple(min(255, max(0, v + rng.randint(-20, 20))) for v in COLORS[attrs["color"]])
    if attrs["shape"] == "circle":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
    else:
        rot = rng.uniform(-0.25, 0.25)
        draw.polygon(_polygon(attrs["shape"], cx, cy, r, rot), fill=fill)
    return img, attrs


@pytest.mark.parametrize("seed, image_size", sorted(BEFORE))
def test_draw_scene_draws_the_same_pixels_and_random_draws_as_before(seed, image_size):
    rng = random.Random(seed)
    digests = [hashlib.sha256(draw_scene(rng, image_size)[0].tobytes()).hexdigest()[:16] for _ in range(6)]
    assert (digests, rng.random()) == BEFORE[(seed, image_size)]


def test_draw_scene_equals_the_function_before_the_masks_on_many_scenes():
    for seed in range(4):
        new, old = random.Random(seed), random.Random(seed)
        for _ in range(50):  # every shape, position and size turns up
            (img, attrs), (ref, ref_attrs) = draw_scene(new, 48), _draw_scene_before(old, 48)
            assert attrs == ref_attrs and img.tobytes() == ref.tobytes()
        assert new.getstate() == old.getstate()


def test_demo_shards_are_byte_identical_to_those_of_the_function_before(tmp_path, monkeypatch):
    def digest(root: str) -> dict[str, str]:
        return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
                for p in sorted(Path(root).rglob("*")) if p.is_file() and p.name != "done.json"}

    now = ensure_demo_data(str(tmp_path / "now"), num_train=20, num_val=10, shard_size=8, image_size=32)
    monkeypatch.setattr(demo, "draw_scene", _draw_scene_before)
    before = ensure_demo_data(str(tmp_path / "before"), num_train=20, num_val=10, shard_size=8, image_size=32)
    assert digest(now.root) == digest(before.root) and len(digest(now.root)) >= 5


def test_the_mask_labels_exactly_the_pixels_of_the_shape():
    rng = random.Random(0)
    shapes = set()
    for _ in range(60):
        scene = draw_geometry(rng, 40)
        image, mask = np.asarray(render_scene(scene)), np.asarray(render_mask(scene))
        assert mask.shape == (40, 40) and mask.dtype == np.uint8
        label = 1 + SHAPES.index(scene.attrs["shape"])
        assert set(np.unique(mask)) == {0, label}  # the background and the one shape
        # The shape's colour is never its background's (the palettes differ by far more than the
        # jitter): the painted pixels are the labelled ones, pixel for pixel.
        painted = (image != np.array(scene.background, dtype=np.uint8)).any(axis=-1)
        np.testing.assert_array_equal(painted, mask == label)
        shapes.add(scene.attrs["shape"])
    assert shapes == set(SHAPES)
    assert DENSE_CLASSES == ("background", *SHAPES)


def test_dense_demo_set_is_seeded_and_its_images_are_draw_scenes():
    images, masks = dense_demo_set(12, image_size=24, seed=5)
    assert images.shape == (12, 24, 24, 3) and images.dtype == np.uint8
    assert masks.shape == (12, 24, 24) and masks.dtype == np.int64
    assert 0 <= masks.min() and masks.max() <= len(SHAPES)
    again, again_masks = dense_demo_set(12, image_size=24, seed=5)
    np.testing.assert_array_equal(images, again)
    np.testing.assert_array_equal(masks, again_masks)
    other, _ = dense_demo_set(12, image_size=24, seed=6)
    assert not np.array_equal(images, other)
    rng = random.Random(5)
    for i in range(12):
        img, attrs = draw_scene(rng, 24)
        np.testing.assert_array_equal(images[i], np.asarray(img))
        assert set(np.unique(masks[i])) == {0, 1 + SHAPES.index(attrs["shape"])}
    # The shape covers a fraction of the image that its size promises: 0.4 of the side is a large radius.
    area = (masks > 0).mean(axis=(1, 2))
    assert (area > 0.02).all() and (area < math.pi * 0.44**2).all()
    assert dense_demo_set(0, 8)[0].shape == (0, 8, 8, 3)
    with pytest.raises(ValueError, match="n >= 0"):
        dense_demo_set(-1, 8)
