"""WiSE-FT: state-dict interpolation (refusals naming the first mismatch), the curve and export of
tools/wise_ft.py on two CLIPs, and a CLIP start against an ImageClassifier fine-tuned from it with
the zero-shot head, compared as classifiers."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import pytest
import torch

from mmssl.checkpoints.interpolate import architecture_mismatch, check_alphas, interpolate_state
from mmssl.checkpoints.load import load_lightning
from mmssl.evaluation.wise_ft import Pair, wise_ft_curve, zero_shot_top1
from mmssl.models.classifier import ImageClassifier
from mmssl.models.clip import CLIP

REPO = Path(__file__).resolve().parents[2]
CLIP_PATH = "mmssl.models.clip.CLIP"


def _main():
    return runpy.run_path(str(REPO / "tools" / "wise_ft.py"), run_name="not_main")["main"]


def _save(module, path: Path, class_path: str) -> Path:
    torch.save({"state_dict": module.state_dict(),
                "hyper_parameters": {**dict(module.hparams), "_class_path": class_path}}, path)
    return path


def test_interpolation_is_the_weighted_mean_and_refuses_what_differs():
    a = {"w": torch.zeros(2, 3), "b": torch.ones(3), "n": torch.tensor(1)}
    b = {"w": torch.ones(2, 3), "b": torch.full((3,), 3.0), "n": torch.tensor(5)}
    mixed = interpolate_state(a, b, 0.25)
    torch.testing.assert_close(mixed["w"], torch.full((2, 3), 0.25))
    torch.testing.assert_close(mixed["b"], torch.full((3,), 1.5))
    assert int(mixed["n"]) == 5 and int(interpolate_state(a, b, 0.0)["n"]) == 1  # integers are not mixed
    assert torch.equal(interpolate_state(a, b, 0.0)["w"], a["w"]) and torch.equal(
        interpolate_state(a, b, 1.0)["w"], b["w"]
    )
    with pytest.raises(ValueError, match="key 'extra' is in the end checkpoint only"):
        interpolate_state(a, {**b, "extra": torch.ones(1)}, 0.5)
    with pytest.raises(ValueError, match=r"key 'b' has shape \(3,\) in the start and \(4,\) in the end"):
        interpolate_state(a, {**b, "b": torch.ones(4)}, 0.5)
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="outside \\[0, 1\\]"):
            check_alphas([0.5, bad])
    start = {"state_dict": a, "hyper_parameters": {"_class_path": CLIP_PATH, "model_name": "ViT-B-32"}}
    other = {"state_dict": b, "hyper_parameters": {"_class_path": CLIP_PATH, "model_name": "ViT-B-16"}}
    assert "hyper-parameter 'model_name' is 'ViT-B-32' in the start and 'ViT-B-16'" in architecture_mismatch(
        start, other
    )
    classifier = {"state_dict": b, "hyper_parameters": {"_class_path": "mmssl.models.classifier.ImageClassifier"}}
    assert (
        architecture_mismatch(start, classifier) == "the start is a CLIP checkpoint and the end a ImageClassifier one"
    )


def test_the_tool_scores_plots_and_exports_a_checkpoint_every_tool_reads(tiny_clip_json, tiny_demo, tmp_path):
    torch.manual_seed(0)
    start_module = CLIP(tiny_clip_json).eval()
    end_module = CLIP(tiny_clip_json).eval()  # another random init stands for the fine-tuned end
    start = _save(start_module, tmp_path / "start.ckpt", CLIP_PATH)
    end = _save(end_module, tmp_path / "end.ckpt", CLIP_PATH)
    sets = [tiny_demo.eval_dir]
    argv = ["--start", str(start), "--end", str(end), "--alphas", "0", "0.5", "1", "--target", *sets, "--keep", *sets,
            "--batch-size", "16", "--device", "cpu", "--output-json", str(tmp_path / "w.json"),
            "--plot", str(tmp_path / "w.png"), "--export-alpha", "0.5", "--output", str(tmp_path / "mix.ckpt")]
    assert _main()(argv) == 0
    report = json.loads((tmp_path / "w.json").read_text())
    assert [p["alpha"] for p in report["points"]] == [0.0, 0.5, 1.0]
    for point, module in ((report["points"][0], start_module), (report["points"][2], end_module)):
        assert point["target"][sets[0]] == pytest.approx(zero_shot_top1(module, sets[0], 16))
    assert (tmp_path / "w.png").read_bytes()[:4] == b"\x89PNG"
    mixed = load_lightning(str(tmp_path / "mix.ckpt"))  # what every tool reads
    assert isinstance(mixed, CLIP)
    key = "model.visual.conv1.weight"
    torch.testing.assert_close(
        mixed.state_dict()[key], 0.5 * (start_module.state_dict()[key] + end_module.state_dict()[key])
    )
    # Refusals: an existing output, an alpha outside [0, 1], another architecture (named).
    assert _main()(argv) == 1
    assert _main()([*argv[:4], "--keep", *sets, "--alphas", "1.2"]) == 1
    other = json.loads(Path(tiny_clip_json).read_text())
    other["vision_cfg"]["width"] = 48
    (tmp_path / "wider.json").write_text(json.dumps(other))
    wider = _save(CLIP(str(tmp_path / "wider.json")), tmp_path / "wider.ckpt", CLIP_PATH)
    with pytest.raises(ValueError, match="hyper-parameter 'model_name'"):
        Pair(str(start), str(wider))


def test_a_clip_and_the_classifier_fine_tuned_from_it_are_compared_as_classifiers(tiny_demo, tmp_path):
    torch.manual_seed(0)
    clip = CLIP(str(REPO / "configs/models/clip_micro_timm.json"), init_logit_scale=2.0).eval()
    start = _save(clip, tmp_path / "clip.ckpt", CLIP_PATH)
    names = str(Path(tiny_demo.root) / "classnames.txt")
    classifier = ImageClassifier(
        num_classes=len(tiny_demo.classnames), model_name="test_vit", image_size=160, global_pool="token",
        drop_path_rate=0.0, mixup=0.0, cutmix=0.0, init_encoder=str(start), zero_shot_head=str(start),
        head_classnames=names, image_mean=clip.image_mean, image_std=clip.image_std)
    with torch.no_grad():  # stands for fine-tuning
        for p in classifier.parameters():
            p.add_(0.01 * torch.randn_like(p))
    end = _save(classifier, tmp_path / "ft.ckpt", "mmssl.models.classifier.ImageClassifier")
    pair = Pair(str(start), str(end))
    step_zero = pair.mix(0.0)
    assert isinstance(step_zero, ImageClassifier)
    from mmssl.evaluation.wise_ft import top1

    # At alpha 0 the classifier's top-1 is the CLIP's zero-shot top-1, and the kept model is the CLIP.
    data = tiny_demo.eval_dir
    assert top1(step_zero, data, 16) == pytest.approx(zero_shot_top1(clip, data, 16))
    assert zero_shot_top1(pair.keep_model(step_zero), data, 16) == pytest.approx(zero_shot_top1(clip, data, 16))
    assert torch.equal(pair.mix(1.0).model.head.weight, classifier.model.head.weight)
    assert not torch.equal(pair.keep_model(pair.mix(1.0)).model.visual.trunk.blocks[0].attn.qkv.weight,
                           clip.model.visual.trunk.blocks[0].attn.qkv.weight)


def test_gain_is_measured_against_the_end_and_against_a_reference():
    from mmssl.evaluation.wise_ft import _add_fractions

    points = [{"alpha": a, "target_mean": t, "keep_mean": k} for a, t, k in ((0.0, 0.1, 0.5), (0.5, 0.3, 0.45),
                                                                           (1.0, 0.4, 0.3))]
    reference = {"target_mean": 0.6, "keep_mean": 0.1}
    _add_fractions(points, reference)
    assert [p["kept_fraction"] for p in points] == pytest.approx([1.0, 0.9, 0.6])
    assert [p["gain_fraction"] for p in points] == pytest.approx([0.0, 2 / 3, 1.0])
    assert [p["reference_gain_fraction"] for p in points] == pytest.approx([0.0, 0.4, 0.6])
    assert reference["kept_fraction"] == pytest.approx(0.2) and "reference_gain_fraction" not in reference
    _add_fractions(alone := [{"alpha": 0.5, "target_mean": 0.3, "keep_mean": 0.4}], reference)  # no alpha 0
    assert set(alone[0]) == {"alpha", "target_mean", "keep_mean"}


def test_the_tool_scores_a_reference_fine_tune_once_and_refuses_another_architecture(tiny_clip_json, tiny_demo,
                                                                                       tmp_path):
    torch.manual_seed(1)
    modules = [CLIP(tiny_clip_json).eval() for _ in range(3)]  # start, end, reference (a full fine-tune)
    start, end, ref = (_save(m, tmp_path / f"{n}.ckpt", CLIP_PATH) for m, n in zip(modules, ("start", "end", "ref")))
    data = tiny_demo.eval_dir
    argv = ["--start", str(start), "--end", str(end), "--alphas", "0", "1", "--target", data, "--keep", data,
            "--batch-size", "16", "--device", "cpu", "--output-json", str(tmp_path / "w.json"),
            "--plot", str(tmp_path / "w.png")]
    assert _main()([*argv, "--reference", str(ref)]) == 0
    report = json.loads((tmp_path / "w.json").read_text())
    reference, zero = report["reference"], report["points"][0]
    assert reference["path"] == str(ref)
    assert reference["target"][data] == pytest.approx(zero_shot_top1(modules[2], data, 16))
    assert reference["kept_fraction"] == pytest.approx(reference["keep_mean"] / zero["keep_mean"])
    assert reference["target_mean"] != zero["target_mean"]  # seed 1's inits differ on the target
    for p in report["points"]:
        assert p["reference_gain_fraction"] == pytest.approx(
                (p["target_mean"] - zero["target_mean"]) / (reference["target_mean"] - zero["target_mean"]))
    assert (tmp_path / "w.png").read_bytes()[:4] == b"\x89PNG"
    other = json.loads(Path(tiny_clip_json).read_text())
    other["vision_cfg"]["width"] = 48
    (tmp_path / "wider.json").write_text(json.dumps(other))
    wider = _save(CLIP(str(tmp_path / "wider.json")), tmp_path / "wider.ckpt", CLIP_PATH)
    with pytest.raises(ValueError, match="hyper-parameter 'model_name'"):  # before any set is scored
        wise_ft_curve(Pair(str(start), str(end)), [0.0], [data], [], 16, reference=str(wider))
    assert _main()([*argv[:6], "--keep", data, "--reference", str(ref)]) == 1  # a reference needs a target set


def test_two_mae_checkpoints_are_mixed_but_not_scored(tiny_demo, tmp_path, capsys):
    """#44 item 10: two MAE checkpoints were mixed, then the scoring crashed in encode_text; the
    tool now refuses before any set is read, naming the file, and still exports their mix."""
    from mmssl.models.mae import MAE

    kwargs = dict(image_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2, decoder_embed_dim=32,
                  decoder_depth=1, decoder_num_heads=2)
    torch.manual_seed(0)
    a = _save(MAE(**kwargs), tmp_path / "a.ckpt", "mmssl.models.mae.MAE")
    b = _save(MAE(**kwargs), tmp_path / "b.ckpt", "mmssl.models.mae.MAE")
    main = _main()
    assert main(["--start", str(a), "--end", str(b), "--target", tiny_demo.eval_dir]) == 1
    assert f"{b}: WiSE-FT scores a CLIP zero-shot" in capsys.readouterr().err
    mix = tmp_path / "mix.ckpt"
    assert main(["--start", str(a), "--end", str(b), "--export-alpha", "0.5", "--output", str(mix)]) == 0
    mixed = torch.load(mix, weights_only=True)["state_dict"]
    wa, wb = torch.load(a, weights_only=True)["state_dict"], torch.load(b, weights_only=True)["state_dict"]
    key = "encoder.blocks.0.attn.qkv.weight"
    torch.testing.assert_close(mixed[key], (wa[key] + wb[key]) / 2)
