"""How often CLIP + MLM's image-text matching negatives are false: captions of the image's own class.

    python benchmarks/itm_negatives.py --ckpt runs/fashion_mnist_clip_mlm/version_0/checkpoints/last.ckpt \
        --data data/fashion_mnist/train/0.tar --batches 20 --batch-size 128

On class-prompt captions ("a photo of a ankle boot." in six templates) another pair's caption often
names the image's own class: as an ITM negative it is labelled "no match" though it matches. This
draws batches of labelled samples (``.cls``) from one shard, embeds them with the checkpoint's
towers, picks each pair's negative as training does (:func:`mmssl.models.clip_mlm.pick_negatives`:
ALBEF's draw from the softmaxed similarities, identical captions excluded) and prints the share of
negatives of the same class, drawn and hardest, and the best ITM accuracy a head can reach on such
labels (:func:`best_itm_accuracy`). A sketch of the training batch: evaluation transform, one
process, no masking; the same checkpoint and shard give the same figures (seeded).
"""

from __future__ import annotations

import argparse
import io
import json
import random
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))


def best_itm_accuracy(same_class_share: float) -> float:
    """The best accuracy on ITM's 1 positive : 2 negatives when the image tells only its class.

    A pair of the same class is a positive (1/3 of the pairs) or a same-class negative
    (2/3 x ``same_class_share``), which no head can tell apart; a pair of two classes is a
    negative. Saying "match" for every same-class pair scores 1/3 + 2/3 (1 - share), "no match" for
    every pair 2/3: the better of the two.
    """
    if not 0.0 <= same_class_share <= 1.0:
        raise ValueError(f"same_class_share must be in [0, 1], got {same_class_share}")
    return max(2.0 / 3.0, 1.0 / 3.0 + 2.0 / 3.0 * (1.0 - same_class_share))


def read_shard(path: str, image_key: str = "png") -> list[tuple[bytes, str, int]]:
    """(image bytes, caption, class) of every sample of a webdataset tar with .cls labels."""
    import webdataset as wds

    samples = list(wds.WebDataset(path, shardshuffle=False, empty_check=False))
    missing = [s["__key__"] for s in samples if not {image_key, "txt", "cls"} <= set(s)]
    if missing:
        raise ValueError(f"{path}: {len(missing)} samples without .{image_key}, .txt and .cls (e.g. {missing[0]})")
    return [(s[image_key], s["txt"].decode(), int(s["cls"])) for s in samples]


def main(argv: list[str] | None = None) -> dict:
    from PIL import Image

    from mmssl.checkpoints.load import load_lightning
    from mmssl.data.transforms import OPENAI_MEAN, OPENAI_STD, eval_transform
    from mmssl.models.clip_mlm import pick_negatives

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", required=True, help="a CLIP or CLIP + MLM checkpoint")
    parser.add_argument("--data", required=True, help="a webdataset tar whose samples carry .cls labels")
    parser.add_argument("--image-key", default="png")
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    module = load_lightning(args.ckpt).eval()
    samples = read_shard(args.data, args.image_key)
    if len(samples) < args.batch_size:
        raise ValueError(f"--data {args.data}: {len(samples)} samples, fewer than --batch-size {args.batch_size}")
    visual = module.model.visual
    cfg = getattr(visual, "preprocess_cfg", {})
    transform = eval_transform(visual.image_size[0] if isinstance(visual.image_size, (tuple, list))
                               else visual.image_size, cfg.get("mean", OPENAI_MEAN), cfg.get("std", OPENAI_STD))
    rng, gen = random.Random(args.seed), torch.Generator().manual_seed(args.seed)
    drawn, hardest = [], []
    with torch.no_grad():
        for _ in range(args.batches):
            batch = rng.sample(samples, args.batch_size)
            images = torch.stack([transform(Image.open(io.BytesIO(b[0]))) for b in batch])
            tokens = module.tokenizer([b[1] for b in batch])
            classes = torch.tensor([b[2] for b in batch])
            image = F.normalize(module.model.encode_image(images), dim=-1)
            text = F.normalize(module.model.encode_text(tokens), dim=-1)
            logits = module.model.logit_scale.exp() * image @ text.T  # (B, B): image -> caption
            valid = (tokens.unsqueeze(1) != tokens.unsqueeze(0)).any(dim=-1)  # training's same-text rule
            for rows in (logits, logits.T):  # image -> negative caption, caption -> negative image
                pick, _ = pick_negatives(rows, valid, torch.rand(rows.shape, generator=gen))
                drawn.append((classes[pick] == classes).float().mean().item())
            pick, _ = pick_negatives(logits, valid, None)
            hardest.append((classes[pick] == classes).float().mean().item())
    share = sum(drawn) / len(drawn)
    result = {"checkpoint": args.ckpt, "batches": args.batches, "batch_size": args.batch_size,
              "same_class_drawn": round(share, 4), "same_class_hardest": round(sum(hardest) / len(hardest), 4),
              "best_itm_accuracy": round(best_itm_accuracy(share), 4)}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
