"""The embedded demo data set: procedurally drawn scenes with attribute-rich captions.

A user with no data of their own gets a real, learnable image-text set on first use. Each image
shows one shape of a given colour and size at a position on a background; its caption names these
attributes in one of several phrasings, so a CLIP model must bind words to visual attributes, and
an MAE must model shapes, colours and backgrounds. Generation is deterministic: the same seed and
sizes give byte-identical shards (fixed tar mtime, fixed JPEG settings, one seeded RNG).

Written in the img2dataset layout (``{key}.jpg``, ``{key}.txt``, ``{key}.cls``) as webdataset
shards, the whole folder laid out as clip_benchmark's ``wds/`` sets (``train/`` and ``val/``
splits of ``0.tar ..`` with ``nshards.txt``; ``classnames.txt`` and
``zeroshot_classification_templates.txt`` at the root), so the zero-shot callback and
``clip_benchmark eval --dataset wds/demo --dataset_root ROOT --split val`` both read it.
"""

from __future__ import annotations

import io
import json
import math
import os
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from mmssl.data.label_files import CLASSNAMES_FILE, NSHARDS_FILE, TEMPLATES_FILE
from mmssl.data.shards import clip_benchmark_shard_pattern, write_clip_benchmark_files, write_samples

SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "star", "cross", "diamond")
# The per-pixel classes of a scene (render_mask, dense_demo_set): 0 the background, 1 + i SHAPES[i].
DENSE_CLASSES: tuple[str, ...] = ("background", *SHAPES)
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (235, 210, 40),
    "purple": (140, 60, 180),
    "orange": (245, 140, 30),
}
SIZES: dict[str, float] = {"small": 0.25, "large": 0.4}  # radius as a fraction of the image side
POSITIONS: dict[str, tuple[float, float]] = {
    "in the top left": (0.3, 0.3),
    "in the top right": (0.7, 0.3),
    "in the bottom left": (0.3, 0.7),
    "in the bottom right": (0.7, 0.7),
    "in the center": (0.5, 0.5),
}
BACKGROUNDS: dict[str, tuple[int, int, int]] = {
    "white": (245, 245, 245),
    "black": (20, 20, 20),
    "gray": (128, 128, 128),
}
CAPTION_TEMPLATES: tuple[str, ...] = (
    "a {size} {color} {shape} {position} on a {background} background",
    "a drawing of a {size} {color} {shape} {position}, {background} background",
    "{background} background with a {color} {shape} {position}, {size}",
    "a picture of a {color} {shape}, {size}, {position} on {background}",
)
# Zero-shot prompts, in the spirit of CLIP's "a photo of a {}." but for drawings.
ZERO_SHOT_TEMPLATES: tuple[str, ...] = (
    "a {c}.",
    "a drawing of a {c}.",
    "a picture of a {c}.",
    "a small {c}.",
    "a large {c}.",
)
DEFAULT_DEMO_DIR = os.path.join(
    os.environ.get("XDG_CACHE_HOME", os.path.join(os.path.expanduser("~"), ".cache")), "mmssl", "demo"
)
# Bump when the generator's output changes, so stale caches are not reused.
DEMO_VERSION = 3
# The marker of a demo folder: generation settings, whether it finished, the files it wrote.
MARKER_FILE = "done.json"


@dataclass(frozen=True)
class DemoData:
    """Where the generated demo set lies.

    Attributes:
        root: the folder holding everything below.
        train: brace pattern of the training shards.
        val: brace pattern of the held-out image-text shards (also labelled with ``.cls``).
        eval_dir: the labelled held-out split, ``root/val``: a clip_benchmark ``wds/`` split
            (shards ``0.tar ..`` + ``nshards.txt``; class names and templates at ``root``); the
            zero-shot and probe callbacks read it.
        classnames: class names, in label order.
    """

    root: str
    train: str
    val: str
    eval_dir: str
    classnames: tuple[str, ...]


def demo_classnames() -> tuple[str, ...]:
    """Class names of the demo set: every colour-shape pair ("red circle", ...), 36 classes."""
    return tuple(f"{c} {s}" for c in COLORS for s in SHAPES)


def _polygon(shape: str, cx: float, cy: float, r: float, rot: float) -> list[tuple[float, float]]:
    """Vertices of a polygonal shape centred at (cx, cy) with outer radius r, rotated by rot."""
    if shape == "square":
        angles, radii = [rot + math.pi / 4 + k * math.pi / 2 for k in range(4)], [r] * 4
    elif shape == "diamond":
        angles, radii = [rot + k * math.pi / 2 for k in range(4)], [r, 0.6 * r] * 2
    elif shape == "triangle":
        angles, radii = [rot - math.pi / 2 + k * 2 * math.pi / 3 for k in range(3)], [r] * 3
    elif shape == "star":
        angles = [rot - math.pi / 2 + k * math.pi / 5 for k in range(10)]
        radii = [r if k % 2 == 0 else 0.45 * r for k in range(10)]
    elif shape == "cross":
        w = 0.35 * r  # half-width of each bar
        pts = [(w, r), (w, w), (r, w), (r, -w), (w, -w), (w, -r),
               (-w, -r), (-w, -w), (-r, -w), (-r, w), (-w, w), (-w, r)]  # fmt: skip
        c, s = math.cos(rot), math.sin(rot)
        return [(cx + x * c - y * s, cy + x * s + y * c) for x, y in pts]
    else:
        raise ValueError(f"unknown shape {shape!r}")
    return [(cx + rr * math.cos(a), cy + rr * math.sin(a)) for a, rr in zip(angles, radii)]


@dataclass(frozen=True)
class Scene:
    """One scene's attributes and geometry: everything :func:`draw_scene` draws, drawn once.

    Attributes:
        attrs: ``shape``, ``color``, ``size``, ``position``, ``background``.
        image_size: side of the square image in pixels.
        background: the background's RGB (jittered).
        fill: the shape's RGB (jittered).
        cx, cy, r: the shape's centre and outer radius in pixels.
        rot: the polygon's rotation in radians (``None`` for a circle, which draws none).
    """

    attrs: dict[str, str]
    image_size: int
    background: tuple[int, ...]
    fill: tuple[int, ...]
    cx: float
    cy: float
    r: float
    rot: float | None


def draw_geometry(rng: random.Random, image_size: int = 64) -> Scene:
    """Draw one scene's attributes and geometry from ``rng``: every random draw of a scene.

    The draws come in one fixed order (attributes, background jitter, centre, radius, fill, then the
    rotation of a polygon), the order the demo shards were generated in: changing it would change
    every shard and every figure drawn from them.
    """
    attrs = {
        "shape": rng.choice(SHAPES),
        "color": rng.choice(list(COLORS)),
        "size": rng.choice(list(SIZES)),
        "position": rng.choice(list(POSITIONS)),
        "background": rng.choice(list(BACKGROUNDS)),
    }
    bg = tuple(min(255, max(0, v + rng.randint(-12, 12))) for v in BACKGROUNDS[attrs["background"]])
    fx, fy = POSITIONS[attrs["position"]]
    jitter = 0.05 * image_size
    cx = fx * image_size + rng.uniform(-jitter, jitter)
    cy = fy * image_size + rng.uniform(-jitter, jitter)
    r = SIZES[attrs["size"]] * image_size * rng.uniform(0.85, 1.1) * (0.75 if fx != 0.5 else 1.0)
    fill = tuple(min(255, max(0, v + rng.randint(-20, 20))) for v in COLORS[attrs["color"]])
    rot = None if attrs["shape"] == "circle" else rng.uniform(-0.25, 0.25)
    return Scene(attrs, image_size, bg, fill, cx, cy, r, rot)


def _paint(scene: Scene, mode: str, background: int | tuple[int, ...], fill: int | tuple[int, ...]) -> Image.Image:
    """``scene``'s shape in ``fill`` on ``background``, in PIL ``mode``: one rasterisation for the
    image and its mask, so both cover the same pixels."""
    img = Image.new(mode, (scene.image_size, scene.image_size), background)
    draw = ImageDraw.Draw(img)
    cx, cy, r = scene.cx, scene.cy, scene.r
    if scene.rot is None:
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
    else:
        draw.polygon(_polygon(scene.attrs["shape"], cx, cy, r, scene.rot), fill=fill)
    return img


def render_scene(scene: Scene) -> Image.Image:
    """The RGB image of ``scene``."""
    return _paint(scene, "RGB", scene.background, scene.fill)


def render_mask(scene: Scene) -> Image.Image:
    """The per-pixel class map of ``scene`` as an ``"L"`` image: 0 for the background, ``1 +
    SHAPES.index(shape)`` for the shape's pixels (the labels of :func:`dense_demo_set`)."""
    return _paint(scene, "L", 0, 1 + SHAPES.index(scene.attrs["shape"]))


def draw_scene(
    rng: random.Random, image_size: int = 64
) -> tuple[Image.Image, dict[str, str]]:
    """Draw one random scene.

    Args:
        rng: the random source (all randomness comes from it, for determinism).
        image_size: side of the square RGB image in pixels.

    Returns:
        The image and its attributes (``shape``, ``color``, ``size``, ``position``,
        ``background``).
    """
    scene = draw_geometry(rng, image_size)
    return render_scene(scene), scene.attrs


def dense_demo_set(n: int, image_size: int = 64, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``n`` demo scenes with their per-pixel shape classes, in memory (no shards): the labelled set
    of the dense probe (:mod:`mmssl.evaluation.dense`).

    The classes are ``("background", *SHAPES)``: 0 is the background, ``1 + i`` the pixels of
    ``SHAPES[i]`` (:data:`DENSE_CLASSES`). Each scene is drawn as the demo shards draw theirs
    (:func:`draw_geometry`), from one ``random.Random(seed)``: the same seed gives the same set (not
    a shard split's images: a split also draws each caption from its source).

    Args:
        n: number of scenes.
        image_size: side of the square images in pixels (the model's input size).
        seed: seeds the one random source.

    Returns:
        ``images`` (N, H, W, 3) uint8 RGB and ``masks`` (N, H, W) int64 class ids.
    """
    if n < 0 or image_size < 1:
        raise ValueError(f"dense_demo_set needs n >= 0 and image_size >= 1, got n={n}, image_size={image_size}")
    rng = random.Random(seed)
    images = np.zeros((n, image_size, image_size, 3), dtype=np.uint8)
    masks = np.zeros((n, image_size, image_size), dtype=np.int64)
    for i in range(n):
        scene = draw_geometry(rng, image_size)
        images[i] = np.asarray(render_scene(scene))
        masks[i] = np.asarray(render_mask(scene))
    return images, masks


def caption(attrs: dict[str, str], rng: random.Random) -> str:
    """A caption naming every attribute, in one of several phrasings."""
    return rng.choice(CAPTION_TEMPLATES).format(**attrs)


def _write_split(
    pattern: str, num_samples: int, shard_size: int, seed: int, image_size: int, prefix: str
) -> dict[str, int]:
    """Write ``num_samples`` scenes as shards and their ``sizes.json``; returns samples per shard."""
    rng = random.Random(seed)
    classes = {name: i for i, name in enumerate(demo_classnames())}

    def samples():
        for i in range(num_samples):
            img, attrs = draw_scene(rng, image_size)
            buf = io.BytesIO()
            img.save(buf, format="JPEG", quality=90)
            yield {
                "__key__": f"{prefix}{i:07d}",
                "jpg": buf.getvalue(),
                "txt": caption(attrs, rng),
                "cls": str(classes[f"{attrs['color']} {attrs['shape']}"]),
                "json": json.dumps(attrs, sort_keys=True),
            }

    return write_samples(samples(), pattern, shard_size)


def ensure_demo_data(
    root: str | None = None,
    num_train: int = 10000,
    num_val: int = 1000,
    shard_size: int = 2000,
    image_size: int = 64,
    seed: int = 0,
) -> DemoData:
    """Generate the demo set into ``root`` unless it is already there, and say where it is.

    A ``done.json`` marker records the generation settings and the files written; a folder whose
    marker differs (other sizes, an older generator) is regenerated, so a cache never silently
    serves stale data. Only a new or empty folder, or one holding a demo marker, is written to, and
    regeneration deletes only the files the marker says the generator wrote: a user's own files
    are never deleted.

    Args:
        root: cache folder; default ``~/.cache/mmssl/demo`` (honours ``XDG_CACHE_HOME``).
        num_train: training image-text pairs.
        num_val: held-out pairs (with labels), used for validation loss and zero-shot.
        shard_size: samples per tar shard.
        image_size: side of the generated images in pixels.
        seed: generation seed; the held-out split uses ``seed + 1``.

    Returns:
        The paths of the generated splits.

    Raises:
        FileExistsError: ``root`` is a non-empty folder without a demo marker.
    """
    root_path = Path(root or DEFAULT_DEMO_DIR).expanduser()
    settings = dict(version=DEMO_VERSION, num_train=num_train, num_val=num_val,
                    shard_size=shard_size, image_size=image_size, seed=seed)  # fmt: skip
    marker = _read_marker(root_path)
    if marker is None or not marker.get("complete", True) or {k: marker.get(k) for k in settings} != settings:
        # Claim the folder before writing into it: an interrupted generation is still a demo folder.
        files = sorted(set(_written_files(root_path, marker)) | set(_files_of(settings)))
        _write_marker(root_path, {**settings, "complete": False, "files": files})
        for name in _written_files(root_path, marker):
            (root_path / name).unlink(missing_ok=True)  # the previous generation's files, stale names included
        for split, count, split_seed, prefix in (("train", num_train, seed, "t"), ("val", num_val, seed + 1, "v")):
            (root_path / split).mkdir(parents=True, exist_ok=True)
            pattern = clip_benchmark_shard_pattern(str(root_path), split)
            _write_split(pattern, count, shard_size, split_seed, image_size, prefix)
            write_clip_benchmark_files(str(root_path), split, demo_classnames(), ZERO_SHOT_TEMPLATES)
        _write_marker(root_path, {**settings, "complete": True, "files": _files_of(settings)})
    n_train, n_val = math.ceil(num_train / shard_size), math.ceil(num_val / shard_size)
    return DemoData(
        root=str(root_path),
        train=str(root_path / "train" / f"{{0..{n_train - 1}}}.tar"),
        val=str(root_path / "val" / f"{{0..{n_val - 1}}}.tar"),
        eval_dir=str(root_path / "val"),
        classnames=demo_classnames(),
    )


def _files_of(settings: dict) -> list[str]:
    """Paths (relative to the folder) that a generation with ``settings`` writes."""
    files = [MARKER_FILE, CLASSNAMES_FILE, TEMPLATES_FILE]
    for split, count in (("train", settings["num_train"]), ("val", settings["num_val"])):
        n = math.ceil(count / settings["shard_size"])
        files += [f"{split}/{i}.tar" for i in range(n)] + [f"{split}/sizes.json", f"{split}/{NSHARDS_FILE}"]
    return files


def _written_files(root: Path, marker: dict | None) -> list[str]:
    """Files an earlier generation wrote into ``root``, the marker excluded: those the marker
    lists, else (older generators' markers) the shards their ``sizes.json`` list and the side files."""
    if marker is None:
        return []
    if "files" in marker:
        return [f for f in marker["files"]  # inside the folder only, whatever the marker says
                if isinstance(f, str) and f != MARKER_FILE and not Path(f).is_absolute() and ".." not in Path(f).parts]
    files = [CLASSNAMES_FILE, TEMPLATES_FILE]
    for split in ("train", "val"):
        try:
            listed = json.loads((root / split / "sizes.json").read_text())
        except (OSError, ValueError):
            listed = {}
        names = [n for n in listed if isinstance(n, str) and n.endswith(".tar") and "/" not in n]
        files += [f"{split}/{n}" for n in names] + [f"{split}/sizes.json", f"{split}/{NSHARDS_FILE}"]
    return files


def _read_marker(root: Path) -> dict | None:
    """The demo marker of ``root``; ``None`` for a new or empty folder.

    Raises:
        FileExistsError: ``root`` is not empty and holds no demo marker (or one that is not).
    """
    if not root.exists() or (root.is_dir() and not any(root.iterdir())):
        return None
    path = root / MARKER_FILE
    try:
        marker = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        found = "no demo marker" if not path.exists() else f"no demo marker ({path} is not one: {err})"
        raise FileExistsError(
            f"{root} is not empty and holds {found}: mmssl writes its demo set only into a new or empty "
            f"folder, or one it generated before, and deletes no file it did not write. Set "
            f"data.init_args.demo_dir to another folder, or set data.init_args.train_data to train on "
            f"your own shards") from None
    if not isinstance(marker, dict) or not {"version", "num_train", "num_val", "shard_size"} <= set(marker):
        raise FileExistsError(f"{root} is not empty and {path} is no demo marker (not mmssl's): mmssl writes its "
                              "demo set only into a new or empty folder, or one it generated before; set "
                              "data.init_args.demo_dir to another folder")
    return marker


def _write_marker(root: Path, content: dict) -> None:
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{MARKER_FILE}.tmp"
    tmp.write_text(json.dumps(content))
    os.replace(tmp, root / MARKER_FILE)


def demo_data(root: str | None = None) -> DemoData:
    """The demo set in ``root`` as it is, whatever sizes it was generated with; else generate it.

    The data module calls this: a folder a user (or a test) generated with other sizes is used,
    not overwritten with the defaults.
    """
    marker = _read_marker(Path(root or DEFAULT_DEMO_DIR).expanduser())
    if marker is not None:
        # An older generator's folder is redrawn at the same sizes.
        keys = ("num_train", "num_val", "shard_size", "image_size", "seed")
        return ensure_demo_data(root, **{k: marker[k] for k in keys if k in marker})
    return ensure_demo_data(root)
