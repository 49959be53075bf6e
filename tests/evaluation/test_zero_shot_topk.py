"""Zero-shot top-1 and top-5 over more than 5 classes, against figures counted by hand."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mmssl.evaluation.zero_shot import zero_shot_evaluate, zero_shot_metrics

CLASSNAMES = ["c0", "c1", "c2", "c3", "c4", "c5", "c6", "c7"]
# The place (0 = best) of each image's true class among the 8 scores it gets.
TRUE_PLACE = [0, 1, 4, 5, 7, 2, 0, 6]  # top-1: places < 1 -> 2 of 8; top-5: places < 5 -> 5 of 8


class IdentityCLIP(nn.Module):
    """Text tower: prompt -> one-hot of the class it names, so the zero-shot classifier is the
    identity and an image's logits are its own (normalised) 8 scores; image tower: identity."""

    def tokenizer(self, prompts: list[str]) -> torch.Tensor:
        return torch.tensor([CLASSNAMES.index(p.split()[-1]) for p in prompts])

    def encode_text(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.one_hot(tokens, len(CLASSNAMES)).float()

    def encode_image(self, images: torch.Tensor) -> torch.Tensor:
        return images


def _scores(label: int, place: int) -> torch.Tensor:
    """8 distinct positive scores with ``label`` at ``place`` in descending order."""
    order = [c for c in range(8) if c != label]
    order.insert(place, label)  # order[i] is the class with the i-th largest score
    scores = torch.empty(8)
    scores[torch.tensor(order)] = torch.linspace(1.0, 0.3, 8)
    return scores


def test_top5_over_eight_classes_is_the_hand_count():
    labels = [3, 0, 7, 5, 1, 6, 2, 4]
    images = torch.stack([_scores(y, p) for y, p in zip(labels, TRUE_PLACE)])
    batches = [{"image": images[:5], "label": torch.tensor(labels[:5])},
               {"image": images[5:], "label": torch.tensor(labels[5:])}]
    out = zero_shot_evaluate(IdentityCLIP(), batches, CLASSNAMES, ["a photo of {c}"], torch.device("cpu"))
    assert float(out["top1"]) == pytest.approx(2 / 8)
    assert float(out["top5"]) == pytest.approx(5 / 8)
    assert float(out["num_samples"]) == 8


def test_accuracy_is_over_samples_not_averaged_over_classes():
    # 4 images of class 0, all right, and one of class 1, wrong: 4 of 5 samples right (micro),
    # where the mean of per-class accuracies (macro) would say 50%.
    labels = [0, 0, 0, 0, 1]
    images = torch.stack([_scores(0, 0)] * 4 + [_scores(1, 3)])
    out = zero_shot_evaluate(IdentityCLIP(), [{"image": images, "label": torch.tensor(labels)}], CLASSNAMES,
                             ["a photo of {c}"], torch.device("cpu"))
    assert float(out["top1"]) == pytest.approx(4 / 5) and float(out["top5"]) == pytest.approx(1.0)


@pytest.mark.parametrize("classes, keys", [(4, ["top1"]), (5, ["top1", "top5"]), (8, ["top1", "top5"])])
def test_top5_is_reported_from_five_classes_on(classes, keys):
    assert sorted(zero_shot_metrics(classes, torch.device("cpu"))) == keys


def test_metrics_live_on_the_requested_device():
    # The meta device stands in for a GPU: the metrics' states must follow the model's device.
    assert {m.device.type for m in zero_shot_metrics(8, torch.device("meta")).values()} == {"meta"}


def test_prompt_ensembling_averages_each_prompts_unit_embedding():
    """CLIP's recipe: normalise each prompt's embedding, average per class, normalise again, so a
    prompt whose raw embedding is long does not outvote the others."""
    from mmssl.evaluation.zero_shot import build_zero_shot_classifier

    vectors = {"long {c}": [10.0, 0.0, 0.0], "short {c}": [0.0, 1.0, 0.0]}
    offsets = {"cat": 0.0, "dog": 1.0}

    def tokenizer(prompts):  # a prompt's "tokens" are its embedding: the tower is the identity
        return torch.tensor([[*vectors[p.split()[0] + " {c}"][:2], offsets[p.split()[1]]] for p in prompts])

    classifier = build_zero_shot_classifier(lambda t: t, tokenizer, ["cat", "dog"], list(vectors), torch.device("cpu"))
    unit = torch.nn.functional.normalize
    expected = torch.stack(
        [
            unit(unit(torch.tensor([10.0, 0, o]), dim=0) + unit(torch.tensor([0, 1.0, o]), dim=0), dim=0)
            for o in offsets.values()
        ],
        dim=1,
    )  # (D, C)
    torch.testing.assert_close(classifier, expected)
