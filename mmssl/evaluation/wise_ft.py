"""WiSE-FT curves (Wortsman et al. 2022): mix a start and a fine-tuned checkpoint at several alphas
and score each mix on the target set and on the sets whose accuracy must be kept.

Two pairs are supported:

* **the same kind** (CLIP and CLIP, ImageClassifier and ImageClassifier): the state dicts are
  mixed as they are (:mod:`mmssl.checkpoints.interpolate`); a CLIP is scored zero-shot on every
  set, a classifier by its head's top-1.
* **a LoRA checkpoint** (``model.lora``: adapters and a reference to its base) at either end: its
  adapters are merged into the base first (:func:`mmssl.export.merge.merged_checkpoint`, what every
  export does), so the mix is of plain weights and alpha scales the adapters' update.
* **a CLIP start and an ImageClassifier end** fine-tuned from it with the zero-shot head
  (``ImageClassifier(init_encoder=CLIP, zero_shot_head=CLIP)``): both are compared as
  classifiers. The start is the classifier at step 0, rebuilt from the end's hyper-parameters with
  the CLIP as ``init_encoder`` and ``zero_shot_head`` (predicting exactly the CLIP's zero-shot
  classes, tests/models/test_zero_shot_head.py), and the mix is a classifier. The target set is
  scored by its head; a kept set (other classes) is scored zero-shot by the start CLIP whose timm
  trunk is replaced by the mix's encoder (its projection and text tower stay the start's: a
  fine-tuned classifier has none of its own).
"""

from __future__ import annotations

import copy
import time
from typing import Any, Optional, Sequence

import torch
from torch import nn

from mmssl.checkpoints.interpolate import interpolate_checkpoints
from mmssl.checkpoints.layouts import MODEL, strip_prefix
from mmssl.checkpoints.load import build_from_args, build_module, checkpoint_kind, read_lightning
from mmssl.data.label_files import read_classnames, read_templates
from mmssl.data.labeled import labeled_loader
from mmssl.data.transforms import eval_transform
from mmssl.evaluation.zero_shot import zero_shot_evaluate
from mmssl.export.merge import merged_checkpoint


class Pair:
    """The two ends of a WiSE-FT curve, read once; :meth:`mix` builds the module at an alpha.

    Args:
        start: the start checkpoint (alpha 0): a CLIP, or the same kind as ``end``.
        end: the fine-tuned checkpoint (alpha 1).
        ema: mix both checkpoints' EMA of the weights (``mmssl.callbacks.EMA``) instead of their raw
            weights (:func:`mmssl.checkpoints.load.read_lightning`); each must hold one.

    Raises:
        ValueError: checkpoints that cannot be mixed (the first mismatch named); ``ema`` for a
            checkpoint without an average, or for a CLIP start with a classifier end (whose step 0 is
            rebuilt from the CLIP file's raw weights).
    """

    def __init__(self, start: str, end: str, ema: bool = False) -> None:
        self.paths, self.ema = (start, end), ema
        self.start_ckpt, self.end_ckpt = read_lightning(start, ema), read_lightning(end, ema)
        start_kind = checkpoint_kind(start, self.start_ckpt)
        self.kind = checkpoint_kind(end, self.end_ckpt)
        if ema and start_kind.name == "CLIP" and self.kind.name == "ImageClassifier":
            raise ValueError(f"--ema: {end} is a classifier fine-tuned from the CLIP {start}, whose step 0 is rebuilt "
                             "from the CLIP file's raw weights (model.init_encoder); mix raw weights, or export the "
                             "averages first (tools/export.py --ema)")
        # A LoRA checkpoint holds only its adapters: mix the merged weights, as every export would.
        self.start_ckpt = merged_checkpoint(start, self.start_ckpt, start_kind)
        self.end_ckpt = merged_checkpoint(end, self.end_ckpt, self.kind)
        self.clip: Optional[nn.Module] = None  # the start CLIP of a CLIP -> classifier pair
        if start_kind.name == "CLIP" and self.kind.name == "ImageClassifier":
            self.clip = build_module(start, self.start_ckpt, start_kind)
            self.start_ckpt = {"state_dict": self._step_zero(start).state_dict(),
                               "hyper_parameters": self.end_ckpt.get("hyper_parameters", {})}
            start_kind = self.kind  # the classifier at step 0
        self.kinds = (start_kind.name, self.kind.name)
        # Refuse another architecture now, before any set is read.
        interpolate_checkpoints(self.start_ckpt, self.end_ckpt, 0.0, self.paths, self.kinds)

    def _step_zero(self, clip_path: str) -> nn.Module:
        """The end classifier's step 0: built from its hyper-parameters with the CLIP as encoder and head."""
        hparams = self.end_ckpt.get("hyper_parameters") or {}
        if not hparams.get("head_classnames"):
            raise ValueError(f"{self.paths[1]}: an ImageClassifier without a zero-shot head (model.zero_shot_head, "
                             f"model.head_classnames) did not start from {clip_path}'s zero-shot classifier; WiSE-FT "
                             "from a CLIP needs one")
        return build_from_args(self.kind, hparams, self.paths[1], init_encoder=clip_path,
                               zero_shot_head=clip_path).eval()

    def checkpoint(self, alpha: float) -> dict[str, Any]:
        """The mixed Lightning checkpoint (the end's kind) at ``alpha``."""
        return interpolate_checkpoints(self.start_ckpt, self.end_ckpt, alpha, self.paths, self.kinds)

    def mix(self, alpha: float) -> nn.Module:
        """The mixed module at ``alpha``, on the CPU, in eval mode."""
        return build_module(f"{self.paths[1]} (alpha {alpha})", self.checkpoint(alpha), self.kind)

    def keep_model(self, mixed: nn.Module) -> nn.Module:
        """What scores a kept set: the mix itself, or for a CLIP -> classifier pair the start
        CLIP with the mix's encoder as its timm trunk."""
        if self.clip is None:
            return mixed
        clip = copy.deepcopy(self.clip)
        trunk = {k: v for k, v in strip_prefix(mixed.state_dict(), MODEL).items() if not k.startswith("head.")}
        clip.model.visual.trunk.load_state_dict(trunk)
        return clip.eval()


def _loader(model: nn.Module, data: str, batch_size: int, num_workers: int, limit: Optional[int]):
    transform = eval_transform(model.image_size, model.image_mean, model.image_std)
    return labeled_loader(data, transform, batch_size, num_workers, limit=limit)


@torch.no_grad()
def top1(model: nn.Module, data: str, batch_size: int = 256, num_workers: int = 0, limit: Optional[int] = None,
         device: Optional[torch.device] = None) -> float:
    """Top-1 of a classifier's head (``model(images)`` -> (B, C) logits) on a labelled set."""
    device = device or torch.device("cpu")
    correct = seen = 0
    model.to(device)
    for batch in _loader(model, data, batch_size, num_workers, limit):
        if len(batch["label"]) == 0:
            continue
        logits = model(batch["image"].to(device))  # (B, C)
        correct += int((logits.argmax(dim=1).cpu() == batch["label"]).sum())
        seen += len(batch["label"])
    if not seen:
        raise ValueError(f"labelled set {data!r}: no readable sample")
    return correct / seen


def zero_shot_top1(model: nn.Module, data: str, batch_size: int = 256, num_workers: int = 0,
                   limit: Optional[int] = None, device: Optional[torch.device] = None) -> float:
    """Zero-shot top-1 of a CLIP on a labelled set (its ``classnames.txt`` and templates)."""
    device = device or torch.device("cpu")
    model.to(device)
    names, prompts = read_classnames(data), read_templates(data)
    out = zero_shot_evaluate(model, _loader(model, data, batch_size, num_workers, limit), names, prompts, device)
    return float(out["top1"])


def _score(pair: Pair, mixed: nn.Module, targets: Sequence[str], keep: Sequence[str], batch_size: int,
           num_workers: int, limit: Optional[int], device: Optional[torch.device]) -> dict[str, Any]:
    """One mix of ``pair`` scored on every set: ``target`` / ``keep`` per set and their means."""
    classifier = pair.kind.name == "ImageClassifier"
    score = top1 if classifier else zero_shot_top1
    target = {d: score(mixed, d, batch_size, num_workers, limit, device) for d in targets}
    keeper = pair.keep_model(mixed)
    kept_score = top1 if classifier and pair.clip is None else zero_shot_top1
    kept = {d: kept_score(keeper, d, batch_size, num_workers, limit, device) for d in keep}
    return {"target": target, "keep": kept, "target_mean": sum(target.values()) / max(1, len(target)),
            "keep_mean": sum(kept.values()) / len(kept) if kept else None}


# Kinds a mix can be scored as: zero-shot through their text tower, or by their classifier head.
SCORED_KINDS = ("CLIP", "CoCa", "ImageClassifier")


def wise_ft_curve(pair: Pair, alphas: Sequence[float], targets: Sequence[str], keep: Sequence[str],
                  batch_size: int = 256, num_workers: int = 0, limit: Optional[int] = None,
                  device: Optional[torch.device] = None, reference: Optional[str] = None) -> dict[str, Any]:
    """Score the mix at every alpha.

    Args:
        pair: the two checkpoints.
        alphas: mixing coefficients in [0, 1] (checked by the mixing).
        targets: labelled sets the fine-tune is for.
        keep: labelled sets whose accuracy must be kept.
        batch_size, num_workers: the loaders'.
        limit: score only the first ``limit`` samples of each set.
        device: where to score (default: CPU).
        reference: another fine-tune of the same start (a full fine-tune, say), scored once; each
            mix's target gain is then also given as a share of the reference's.

    Returns:
        A JSON-ready dict: ``points`` (per alpha: ``alpha``, ``target`` and ``keep`` per set,
        their means ``target_mean`` / ``keep_mean``, ``kept_fraction`` = keep_mean / keep_mean at
        alpha 0 and ``gain_fraction`` = the share of the end's target gain reached, when the
        alphas include 0 and 1; ``reference_gain_fraction`` = the share of the reference's target
        gain, when the alphas include 0) and, with a reference, ``reference`` (its scores and
        ``kept_fraction``).

    Raises:
        ValueError: a reference that is not a fine-tune of the start's architecture (the first
            mismatch named); a kind that has no scoring here (an MAE: no text tower, no head).
    """
    if pair.kind.name not in SCORED_KINDS:
        raise ValueError(f"{pair.paths[1]}: WiSE-FT scores a CLIP zero-shot and a classifier by its head; a "
                         f"{pair.kind.name} checkpoint has neither: mix it with --export-alpha and --output, then "
                         "score the mix with tools/linear_probe.py")
    ref_pair = Pair(pair.paths[0], reference, pair.ema) if reference else None  # refused here, before any scoring
    points = []
    for alpha in alphas:
        start = time.perf_counter()
        points.append({"alpha": alpha, **_score(pair, pair.mix(alpha), targets, keep, batch_size, num_workers, limit,
                                                device), "seconds": round(time.perf_counter() - start, 2)})
    ref = None
    if ref_pair is not None:
        ref = {"path": reference, **_score(ref_pair, ref_pair.mix(1.0), targets, keep, batch_size, num_workers, limit,
                                           device)}
    _add_fractions(points, ref)
    out = {"start": pair.paths[0], "end": pair.paths[1], "kind": pair.kind.name, "targets": list(targets),
           "keep": list(keep), "limit": limit, "points": points}
    if ref is not None:
        out["reference"] = ref
    return out


def _add_fractions(points: list[dict[str, Any]], reference: Optional[dict[str, Any]] = None) -> None:
    """``kept_fraction`` and ``gain_fraction`` per point, relative to alphas 0 and 1 when scored;
    ``reference_gain_fraction`` relative to alpha 0 and the reference (and its ``kept_fraction``)."""
    by_alpha = {p["alpha"]: p for p in points}
    zero, one = by_alpha.get(0.0), by_alpha.get(1.0)
    for p in [*points, *([reference] if reference else [])]:
        if zero is not None and zero["keep_mean"]:
            p["kept_fraction"] = p["keep_mean"] / zero["keep_mean"]
    if zero is None:
        return
    for p in points:
        if one is not None and one["target_mean"] != zero["target_mean"]:
            p["gain_fraction"] = (p["target_mean"] - zero["target_mean"]) / (one["target_mean"] - zero["target_mean"])
        if reference is not None and reference["target_mean"] != zero["target_mean"]:
            p["reference_gain_fraction"] = ((p["target_mean"] - zero["target_mean"])
                                            / (reference["target_mean"] - zero["target_mean"]))


def plot_wise_ft(report: dict[str, Any], path: str, size: tuple[int, int] = (640, 480)) -> str:
    """Draw target accuracy against kept accuracy, one point per alpha (labelled), as a PNG.

    Args:
        report: :func:`wise_ft_curve`'s output, with kept sets.
        path: the PNG to write.
        size: (width, height) in pixels.

    Returns:
        ``path``.
    """
    from mmssl.visualize.figures import new_figure, save_png

    points = [p for p in report["points"] if p["keep_mean"] is not None]
    dpi = 100
    figure = new_figure(size[0] / dpi, size[1] / dpi, dpi=dpi)
    ax = figure.add_subplot()
    xs, ys = [p["keep_mean"] for p in points], [p["target_mean"] for p in points]
    ax.plot(xs, ys, marker="o", label="mixes (alpha)")
    for p, x, y in zip(points, xs, ys):
        ax.annotate(f"{p['alpha']:g}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ref = report.get("reference")
    if ref is not None and ref["keep_mean"] is not None:
        ax.plot([ref["keep_mean"]], [ref["target_mean"]], marker="*", markersize=12, linestyle="none",
                label=f"reference: {ref['path']}")
        ax.legend(fontsize=7)
    ax.set_xlabel(f"kept top-1 ({', '.join(report['keep'])})", fontsize=8)
    ax.set_ylabel(f"target top-1 ({', '.join(report['targets'])})", fontsize=8)
    ax.set_title("WiSE-FT: alpha 0 = start, 1 = fine-tuned", fontsize=10)
    ax.grid(True, alpha=0.3)
    figure.tight_layout()
    return save_png(figure, path)
