"""Zero-shot scoring on a model whose towers are wired to agree: exact figures, on 1 and 2 ranks."""

import io
import os
import re
import socket
import tarfile

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from PIL import Image
from torch import nn

from mmssl.data.label_files import read_templates
from mmssl.data.labeled import labeled_loader
from mmssl.data.transforms import eval_transform
from mmssl.evaluation.features import FeatureSet, gather_feature_set
from mmssl.evaluation.zero_shot import zero_shot_evaluate

CLASSNAMES = ["zero", "one", "two", "three"]
LEVELS = torch.tensor([0.1, 0.35, 0.6, 0.85])  # gray level of each class's images


class AgreeingCLIP(nn.Module):
    """Image tower: which class level the mean pixel is nearest; text tower: which class is named."""

    image_size, image_mean, image_std = 8, (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)

    def encode_image(self, images):
        level = images.mean(dim=(1, 2, 3))  # (B,)
        return -(level[:, None] - LEVELS[None]).abs()  # (B, C): largest for the nearest level

    def tokenizer(self, prompts):
        return torch.tensor([next(i for i, c in enumerate(CLASSNAMES) if re.search(rf"\b{c}\b", p)) for p in prompts])

    def encode_text(self, tokens):
        return F.one_hot(tokens, len(CLASSNAMES)).float()


def write_set(folder, wrong_in_second_shard: int = 0, out_of_range: bool = False) -> str:
    """Two shards of 8 constant-gray images (2 per class); optionally some wrong labels, or (in
    the second shard only, so rank 1 alone holds it) one label beyond the class list."""
    os.makedirs(folder, exist_ok=True)
    for shard in range(2):
        with tarfile.open(os.path.join(folder, f"{shard:05d}.tar"), "w") as tar:
            for i in range(8):
                label = i % 4
                buf = io.BytesIO()
                Image.new("RGB", (8, 8), (int(255 * LEVELS[label]),) * 3).save(buf, format="PNG")
                if shard == 1 and i < wrong_in_second_shard:
                    label = (label + 1) % 4
                if shard == 1 and i == 0 and out_of_range:
                    label = len(CLASSNAMES)
                for ext, data in (("png", buf.getvalue()), ("cls", str(label).encode())):
                    info = tarfile.TarInfo(f"{shard}_{i:03d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    with open(os.path.join(folder, "classnames.txt"), "w") as f:
        f.write("\n".join(CLASSNAMES) + "\n")
    return folder


def _score(folder: str, rank: int = 0, world: int = 1) -> dict:
    model = AgreeingCLIP()
    transform = eval_transform(model.image_size, model.image_mean, model.image_std)
    batches = labeled_loader(folder, transform, batch_size=3, rank=rank, world_size=world)
    out = zero_shot_evaluate(model, batches, CLASSNAMES, read_templates(folder), torch.device("cpu"))
    return {k: float(v) for k, v in out.items()}


def test_builtin_templates_are_clips_80():
    from mmssl.data.label_files import OPENAI_IMAGENET_TEMPLATES

    assert len(OPENAI_IMAGENET_TEMPLATES) == 80 and OPENAI_IMAGENET_TEMPLATES[0] == "a bad photo of a {c}."
    assert all("{c}" in t for t in OPENAI_IMAGENET_TEMPLATES)


@pytest.mark.parametrize("wrong,expected", [(0, 1.0), (4, 0.75)])
def test_agreeing_towers_score_exactly(tmp_path, wrong, expected):
    result = _score(write_set(str(tmp_path / "set"), wrong))
    assert result["top1"] == pytest.approx(expected) and result["num_samples"] == 16
    assert "top5" not in result  # top-k is skipped for k above the number of classes

def _worker(rank: int, port: int, clean: str, noisy: str, out: str) -> None:
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    results = {"clean": _score(clean, rank, 2), "noisy": _score(noisy, rank, 2)}
    try:  # a label out of range on rank 1 only: every rank must raise, none may wait
        _score(os.path.join(out, "out_of_range"), rank, 2)
        results["out_of_range"] = None
    except ValueError as err:
        results["out_of_range"] = str(err)

    def all_gather(t):
        parts = [torch.empty_like(t) for _ in range(2)]
        torch.distributed.all_gather(parts, t.contiguous())
        return torch.stack(parts)

    # Uneven parts, one empty: the gather must drop the padding and keep rank order.
    local = FeatureSet([torch.full((3, 2), 1.0), torch.full((3, 5), 2.0)], torch.tensor([0, 1, 2])) if rank == 0 \
        else FeatureSet([], torch.zeros(0, dtype=torch.long))
    gathered = gather_feature_set(local, all_gather, 2)
    results["gathered"] = [len(gathered), [tuple(f.shape) for f in gathered.features], gathered.labels.tolist()]
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    torch.distributed.destroy_process_group()


def test_two_ranks_give_the_one_rank_figures(tmp_path):
    clean = write_set(str(tmp_path / "clean"))
    noisy = write_set(str(tmp_path / "noisy"), wrong_in_second_shard=4)
    write_set(str(tmp_path / "out_of_range"), out_of_range=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(port, clean, noisy, str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        results = torch.load(tmp_path / f"rank{rank}.pt")
        # Rank 1 alone would score 0.5 on the noisy set: the figure is reduced over both ranks.
        assert results["clean"] == {"top1": 1.0, "num_samples": 16.0, "skipped": 0.0}
        assert results["noisy"]["top1"] == pytest.approx(_score(noisy)["top1"]) == pytest.approx(0.75)
        assert results["noisy"]["num_samples"] == 16
        assert results["gathered"] == [3, [(3, 2), (3, 5)], [0, 1, 2]]
        assert "1 labels outside [0, 4)" in results["out_of_range"]
