"""WiSE-FT curves (mmssl.evaluation.wise_ft) in process, past what the tool's tests read: the refusals'
messages, which scorer reads each set of each kind of pair and with which arguments, the report's
entries and means, the fractions' edge cases, a kept model that leaves the start CLIP untouched, and
the plot's axes, labels and size."""

from __future__ import annotations

import types
import warnings
from pathlib import Path

import pytest
import torch

import mmssl.evaluation.wise_ft as wise_ft
from mmssl.evaluation.wise_ft import Pair, _add_fractions, plot_wise_ft, wise_ft_curve
from mmssl.models.clip import CLIP

CLIP_PATH = "mmssl.models.clip.CLIP"
CLASSIFIER_PATH = "mmssl.models.classifier.ImageClassifier"


def _save(module, path: Path, class_path: str, **extra) -> str:
    torch.save({"state_dict": module.state_dict(),
                "hyper_parameters": {**dict(module.hparams), "_class_path": class_path}, **extra}, path)
    return str(path)


class _Scores:
    """Stands for top1 / zero_shot_top1: records each call and scores (model, set) from a table."""

    def __init__(self, name: str, table: dict) -> None:
        self.name, self.table, self.calls = name, table, []

    def __call__(self, model, data, batch_size, num_workers, limit, device):
        self.calls.append((model, data, batch_size, num_workers, limit, device))
        return self.table[(model, data)]


class _FakePair:
    def __init__(self, kind: str, clip=None, paths=("start.ckpt", "end.ckpt")) -> None:
        self.kind, self.clip, self.paths, self.ema = types.SimpleNamespace(name=kind), clip, paths, False
        self.mixes = []

    def mix(self, alpha: float):
        self.mixes.append(alpha)
        return f"mix{alpha:g}"

    def keep_model(self, mixed):
        return mixed if self.clip is None else f"clip+{mixed}"


def _scorers(monkeypatch, table):
    head, zero_shot = _Scores("top1", table), _Scores("zero_shot_top1", table)
    monkeypatch.setattr(wise_ft, "top1", head)
    monkeypatch.setattr(wise_ft, "zero_shot_top1", zero_shot)
    return head, zero_shot


def test_a_clip_pairs_sets_are_scored_zero_shot_with_the_callers_arguments(monkeypatch):
    table = {(f"mix{a:g}", d): v for a, vals in ((0.0, (0.2, 0.6, 0.8)), (0.5, (0.4, 0.5, 0.7)), (1.0, (0.6, 0.3, 0.5)))
             for d, v in zip(("t1", "k1", "k2"), vals)}
    table.update({("mix0", "t2"): 0.4, ("mix0.5", "t2"): 0.6, ("mix1", "t2"): 1.0})
    head, zero_shot = _scorers(monkeypatch, table)
    pair = _FakePair("CLIP")
    device = torch.device("cpu")
    report = wise_ft_curve(pair, [0.0, 0.5, 1.0], ["t1", "t2"], ["k1", "k2"], batch_size=7, num_workers=3, limit=11,
                           device=device)
    assert head.calls == [] and pair.mixes == [0.0, 0.5, 1.0]
    assert {c[2:] for c in zero_shot.calls} == {(7, 3, 11, device)}
    assert [(c[0], c[1]) for c in zero_shot.calls[:4]] == [("mix0", "t1"), ("mix0", "t2"), ("mix0", "k1"),
                                                          ("mix0", "k2")]
    assert {k: v for k, v in report.items() if k != "points"} == {
        "start": "start.ckpt", "end": "end.ckpt", "kind": "CLIP", "targets": ["t1", "t2"], "keep": ["k1", "k2"],
        "limit": 11}
    middle = report["points"][1]
    assert middle["alpha"] == 0.5 and middle["target"] == {"t1": 0.4, "t2": 0.6} and middle["keep"] == {
        "k1": 0.5, "k2": 0.7}
    assert middle["target_mean"] == pytest.approx(0.5) and middle["keep_mean"] == pytest.approx(0.6)
    assert middle["kept_fraction"] == pytest.approx(0.6 / 0.7)  # keep_mean at alpha 0: 0.7
    assert middle["gain_fraction"] == pytest.approx((0.5 - 0.3) / (0.8 - 0.3))
    assert isinstance(middle["seconds"], float) and middle["seconds"] >= 0
    assert "reference" not in report and "reference_gain_fraction" not in middle


def test_a_classifier_pair_is_scored_by_its_head_and_its_kept_sets_as_the_pair_says(monkeypatch):
    table = {("mix1", "t"): 0.9, ("mix1", "k"): 0.4, ("clip+mix1", "k"): 0.3}
    head, zero_shot = _scorers(monkeypatch, table)
    report = wise_ft_curve(_FakePair("ImageClassifier"), [1.0], ["t"], ["k"])
    assert [c[:2] for c in head.calls] == [("mix1", "t"), ("mix1", "k")] and zero_shot.calls == []
    assert head.calls[0][2:] == (256, 0, None, None)  # the defaults
    assert report["points"][0]["keep"] == {"k": 0.4}
    head.calls.clear()
    # A CLIP -> classifier pair: the target by the head, a kept set zero-shot by the start CLIP.
    report = wise_ft_curve(_FakePair("ImageClassifier", clip="the CLIP"), [1.0], ["t"], ["k"])
    assert [c[:2] for c in head.calls] == [("mix1", "t")] and [c[:2] for c in zero_shot.calls] == [("clip+mix1", "k")]
    assert report["points"][0]["keep"] == {"k": 0.3}
    # No kept set: no keep mean, no kept fraction; no target set: a target mean of 0.
    report = wise_ft_curve(_FakePair("ImageClassifier"), [1.0], ["t"], [])
    assert report["points"][0]["keep_mean"] is None and "kept_fraction" not in report["points"][0]
    assert wise_ft_curve(_FakePair("ImageClassifier"), [1.0], [], ["k"])["points"][0]["target_mean"] == 0


def test_a_kind_without_a_scoring_is_refused_naming_the_file(monkeypatch):
    _scorers(monkeypatch, {})
    with pytest.raises(ValueError) as err:
        wise_ft_curve(_FakePair("MAE", paths=("a.ckpt", "b.ckpt")), [0.5], ["t"], [])
    assert str(err.value) == ("b.ckpt: WiSE-FT scores a CLIP zero-shot and a classifier by its head; a MAE checkpoint "
                              "has neither: mix it with --export-alpha and --output, then score the mix with "
                              "tools/linear_probe.py")
    for kind in ("CLIP", "CoCa", "ImageClassifier"):
        wise_ft_curve(_FakePair(kind), [], [], [])


def test_a_reference_is_paired_with_the_start_and_scored_at_alpha_one(monkeypatch):
    table = {("mix0", "t"): 0.2, ("mix0", "k"): 0.8, ("mix1", "t"): 0.6, ("mix1", "k"): 0.4, ("ref1", "t"): 1.0,
             ("ref1", "k"): 0.2}
    _scorers(monkeypatch, table)
    made = []

    class RefPair(_FakePair):
        def __init__(self, start, end, ema):
            super().__init__("CLIP", paths=(start, end))
            made.append((start, end, ema))

        def mix(self, alpha):
            assert alpha == 1.0
            return "ref1"

    monkeypatch.setattr(wise_ft, "Pair", RefPair)
    pair = _FakePair("CLIP")
    pair.ema = True
    report = wise_ft_curve(pair, [0.0, 1.0], ["t"], ["k"], reference="ref.ckpt")
    assert made == [("start.ckpt", "ref.ckpt", True)]
    ref = report["reference"]
    assert ref["path"] == "ref.ckpt" and ref["target"] == {"t": 1.0} and ref["keep_mean"] == 0.2
    assert ref["kept_fraction"] == pytest.approx(0.25)
    assert report["points"][1]["reference_gain_fraction"] == pytest.approx(0.5)


def test_fractions_are_left_out_where_they_would_divide_by_zero():
    points = [{"alpha": 0.0, "target_mean": 0.3, "keep_mean": 0.0}, {"alpha": 1.0, "target_mean": 0.3,
                                                                      "keep_mean": 0.5}]
    reference = {"target_mean": 0.3, "keep_mean": 0.1}
    _add_fractions(points, reference)
    assert all(set(p) == {"alpha", "target_mean", "keep_mean"} for p in points)  # kept 0 at alpha 0; no gain
    assert set(reference) == {"target_mean", "keep_mean"}
    points = [{"alpha": 0.0, "target_mean": 0.2, "keep_mean": 0.5}, {"alpha": 0.5, "target_mean": 0.4,
                                                                      "keep_mean": 0.5}]
    _add_fractions(points)  # no alpha 1: kept fractions only
    assert [set(p) - {"alpha", "target_mean", "keep_mean"} for p in points] == [{"kept_fraction"}] * 2


def test_pair_refusals_name_the_files(tiny_clip_json, tmp_path):
    torch.manual_seed(0)
    clip = CLIP(tiny_clip_json).eval()
    start = _save(clip, tmp_path / "clip.ckpt", CLIP_PATH)
    hparams = {"_class_path": CLASSIFIER_PATH, "num_classes": 2, "model_name": "test_vit"}
    end = tmp_path / "ft.ckpt"
    torch.save({"state_dict": {}, "current_model_state": {}, "averaging_state": {"n_averaged": torch.tensor(3)},
                "hyper_parameters": hparams}, end)
    with pytest.raises(ValueError) as err:
        Pair(start, str(end))
    assert str(err.value) == (f"{end}: an ImageClassifier without a zero-shot head (model.zero_shot_head, "
                              f"model.head_classnames) did not start from {start}'s zero-shot classifier; WiSE-FT "
                              "from a CLIP needs one")
    ema_start = _save(clip, tmp_path / "clip_ema.ckpt", CLIP_PATH, current_model_state=clip.state_dict(),
                      averaging_state={"n_averaged": torch.tensor(3)})
    with pytest.raises(ValueError) as err:
        Pair(ema_start, str(end), ema=True)
    assert str(err.value) == (f"--ema: {end} is a classifier fine-tuned from the CLIP {ema_start}, whose step 0 is "
                              "rebuilt from the CLIP file's raw weights (model.init_encoder); mix raw weights, or "
                              "export the averages first (tools/export.py --ema)")


def test_a_clip_pairs_mix_is_its_own_kept_model_and_zero_shot_top1_reads_the_set(tiny_clip_json, tiny_demo,
                                                                                  tmp_path, monkeypatch):
    torch.manual_seed(0)
    a, b = CLIP(tiny_clip_json).eval(), CLIP(tiny_clip_json).eval()
    pair = Pair(_save(a, tmp_path / "a.ckpt", CLIP_PATH), _save(b, tmp_path / "b.ckpt", CLIP_PATH))
    assert pair.clip is None and pair.kinds == ("CLIP", "CLIP")
    mixed = pair.mix(0.25)
    assert pair.keep_model(mixed) is mixed and not mixed.training
    key = "model.visual.conv1.weight"
    torch.testing.assert_close(mixed.state_dict()[key], 0.75 * a.state_dict()[key] + 0.25 * b.state_dict()[key])
    seen = {}

    def evaluate(model, batches, names, prompts, device):
        batch = next(iter(batches))
        seen.update(model=model, names=names, prompts=prompts, device=device, images=batch["image"])
        return {"top1": torch.tensor(0.375)}

    monkeypatch.setattr(wise_ft, "zero_shot_evaluate", evaluate)
    assert wise_ft.zero_shot_top1(mixed, tiny_demo.eval_dir, batch_size=5, limit=7) == 0.375
    assert seen["model"] is mixed and seen["device"] == torch.device("cpu")
    assert list(seen["names"]) == list(tiny_demo.classnames) and len(seen["prompts"]) >= 1
    assert seen["images"].shape == (5, 3, a.image_size, a.image_size)
    from mmssl.data.labeled import labeled_loader
    from mmssl.data.transforms import eval_transform

    want = next(iter(labeled_loader(tiny_demo.eval_dir, eval_transform(a.image_size, a.image_mean, a.image_std), 5)))
    torch.testing.assert_close(seen["images"], want["image"])  # the model's own normalisation


def test_the_plot_draws_each_alpha_and_the_reference_on_labelled_axes(tmp_path, monkeypatch):
    import mmssl.visualize.figures as figures

    drawn = {}
    real_save = figures.save_png

    def save(figure, path):
        drawn["figure"] = figure
        return real_save(figure, path)

    monkeypatch.setattr(figures, "save_png", save)
    report = {"targets": ["t1", "t2"], "keep": ["k"], "reference": {"path": "ref.ckpt", "keep_mean": 0.2,
                                                                        "target_mean": 0.9},
              "points": [{"alpha": 0.0, "keep_mean": 0.8, "target_mean": 0.3},
                         {"alpha": 0.5, "keep_mean": None, "target_mean": 0.5},
                         {"alpha": 1.0, "keep_mean": 0.4, "target_mean": 0.7}]}
    path = str(tmp_path / "w.png")
    assert plot_wise_ft(report, path) == path
    from PIL import Image

    assert Image.open(path).size == (640, 480)
    ax = drawn["figure"].axes[0]
    mixes, ref = ax.lines
    assert list(mixes.get_xdata()) == [0.8, 0.4] and list(mixes.get_ydata()) == [0.3, 0.7]
    assert mixes.get_marker() == "o" and mixes.get_label() == "mixes (alpha)"
    assert list(ref.get_xdata()) == [0.2] and list(ref.get_ydata()) == [0.9]
    assert ref.get_label() == "reference: ref.ckpt"
    assert ref.get_marker() == "*" and ref.get_linestyle() == "None"
    assert [(t.get_text(), t.xy) for t in ax.texts] == [("0", (0.8, 0.3)), ("1", (0.4, 0.7))]
    assert ax.get_legend() is not None
    assert ax.get_xlabel() == "kept top-1 (k)" and ax.get_ylabel() == "target top-1 (t1, t2)"
    assert ax.get_title() == "WiSE-FT: alpha 0 = start, 1 = fine-tuned"
    plot_wise_ft({**report, "reference": {**report["reference"], "keep_mean": None}}, path, size=(320, 200))
    assert Image.open(path).size == (320, 200)
    assert len(drawn["figure"].axes[0].lines) == 1 and drawn["figure"].axes[0].get_legend() is None


def test_step_zero_is_the_end_classifier_built_with_the_clip_as_encoder_and_head(monkeypatch):
    """A CLIP -> classifier pair's start: the end's hyper-parameters (its file named in their errors)
    with the CLIP file as ``init_encoder`` and ``zero_shot_head``, in eval mode."""
    calls = []

    def build(kind, hparams, path, **given):
        calls.append((kind, hparams, path, given))
        return torch.nn.Linear(1, 1)

    monkeypatch.setattr(wise_ft, "build_from_args", build)
    pair = Pair.__new__(Pair)
    hparams = {"num_classes": 2, "head_classnames": ["a", "b"]}
    pair.kind, pair.paths, pair.end_ckpt = "the kind", ("clip.ckpt", "ft.ckpt"), {"hyper_parameters": hparams}
    module = pair._step_zero("clip.ckpt")
    assert calls == [("the kind", hparams, "ft.ckpt", {"init_encoder": "clip.ckpt", "zero_shot_head": "clip.ckpt"})]
    assert not module.training


def test_a_single_target_sets_mean_is_its_score_and_each_point_is_timed(monkeypatch):
    _scorers(monkeypatch, {("mix1", "t"): 0.9})
    clock = iter([100.0, 101.2345])
    monkeypatch.setattr(wise_ft, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
    [point] = wise_ft_curve(_FakePair("ImageClassifier"), [1.0], ["t"], [])["points"]
    assert point["target_mean"] == pytest.approx(0.9)
    assert point["seconds"] == 1.23  # rounded to 10 ms


def test_the_reference_is_scored_with_the_callers_arguments(monkeypatch):
    table = {("mix0", "t"): 0.2, ("ref1", "t"): 1.0}
    head, zero_shot = _scorers(monkeypatch, table)

    class RefPair(_FakePair):
        def __init__(self, start, end, ema):
            super().__init__("CLIP", paths=(start, end))

        def mix(self, alpha):
            return "ref1"

    monkeypatch.setattr(wise_ft, "Pair", RefPair)
    device = torch.device("cpu")
    wise_ft_curve(_FakePair("CLIP"), [0.0], ["t"], [], batch_size=7, num_workers=3, limit=11, device=device,
                  reference="ref.ckpt")
    assert [c[0] for c in zero_shot.calls] == ["mix0", "ref1"]
    assert all(c[2:] == (7, 3, 11, device) for c in zero_shot.calls)


def test_the_plot_is_drawn_at_100_dpi_whatever_matplotlibs_default(tmp_path):
    """Sizes in pixels at the figure's own 100 dpi (fonts in points scale with it), not at a
    matplotlibrc's ``figure.dpi``."""
    import matplotlib
    from PIL import Image

    import mmssl.visualize.figures as figures

    report = {"targets": ["t"], "keep": ["k"], "points": [{"alpha": 0.0, "keep_mean": 0.8, "target_mean": 0.3}]}
    made = []
    real = figures.new_figure

    def new_figure(*args, **kwargs):
        made.append(real(*args, **kwargs))
        return made[-1]

    path = str(tmp_path / "w.png")
    with matplotlib.rc_context({"figure.dpi": 72}), pytest.MonkeyPatch.context() as patch:
        patch.setattr(figures, "new_figure", new_figure)
        plot_wise_ft(report, path, size=(300, 150))
    assert made[0].dpi == 100 and Image.open(path).size == (300, 150)


def test_zero_shot_top1_reads_limit_samples_in_process_by_default(tiny_clip_json, tiny_demo, monkeypatch):
    torch.manual_seed(0)
    clip = CLIP(tiny_clip_json).eval()
    seen = {}

    def evaluate(model, batches, names, prompts, device):
        seen.update(workers=batches.num_workers, rows=sum(len(b["label"]) for b in batches))
        return {"top1": torch.tensor(0.5)}

    monkeypatch.setattr(wise_ft, "zero_shot_evaluate", evaluate)
    wise_ft.zero_shot_top1(clip, tiny_demo.eval_dir, batch_size=5, limit=7)
    assert seen == {"workers": 0, "rows": 7}


def test_the_plots_text_marker_and_grid_styles(tmp_path, monkeypatch):
    import matplotlib

    import mmssl.visualize.figures as figures

    drawn = {}
    monkeypatch.setattr(figures, "save_png", lambda figure, path: drawn.setdefault("figure", figure) and path)
    report = {"targets": ["t1", "t2"], "keep": ["k1", "k2"], "reference": {"path": "r", "keep_mean": 0.2,
                                                                           "target_mean": 0.9},
              "points": [{"alpha": 0.25, "keep_mean": 0.8, "target_mean": 0.3}]}
    with matplotlib.rc_context({"font.size": 13}), warnings.catch_warnings():  # every size is the plot's own
        warnings.simplefilter("error")  # matplotlib's, for a grid both off and styled, say
        plot_wise_ft(report, str(tmp_path / "w.png"))
    ax = drawn["figure"].axes[0]
    [label] = ax.texts
    assert label.get_text() == "0.25" and label.xyann == (4, 4) and label.anncoords == "offset points"
    assert label.get_fontsize() == 8
    assert ax.lines[1].get_markersize() == 12
    assert [t.get_fontsize() for t in ax.get_legend().get_texts()] == [7, 7]
    assert ax.xaxis.label.get_fontsize() == 8 and ax.yaxis.label.get_fontsize() == 8
    assert ax.get_xlabel() == "kept top-1 (k1, k2)" and ax.title.get_fontsize() == 10
    gridlines = ax.xaxis.get_gridlines()
    assert gridlines and all(g.get_visible() and g.get_alpha() == 0.3 for g in gridlines)


def test_a_pair_passes_each_files_path_and_the_kinds_to_what_it_calls(monkeypatch):
    """The paths name the files in the merge's, the build's and the mixing's refusals; the kinds
    tell the mixing a CLIP -> classifier pair's start from another architecture."""
    kinds = {"s.ckpt": types.SimpleNamespace(name="CLIP"), "e.ckpt": types.SimpleNamespace(name="ImageClassifier")}
    calls = []
    monkeypatch.setattr(wise_ft, "read_lightning", lambda path, ema: {"path": path, "hyper_parameters": {"h": 1}})
    monkeypatch.setattr(wise_ft, "checkpoint_kind", lambda path, ckpt: kinds[path])
    monkeypatch.setattr(wise_ft, "merged_checkpoint", lambda path, ckpt, kind: calls.append(("merge", path, kind.name))
                        or ckpt)
    monkeypatch.setattr(wise_ft, "build_module", lambda path, ckpt, kind: calls.append(("build", path, kind.name))
                        or torch.nn.Linear(1, 1))
    monkeypatch.setattr(Pair, "_step_zero", lambda self, path: torch.nn.Linear(1, 1))
    monkeypatch.setattr(wise_ft, "interpolate_checkpoints", lambda s, e, alpha, names, kinds: calls.append(
        ("mix", alpha, names, kinds)) or {"mixed": alpha})
    pair = Pair("s.ckpt", "e.ckpt")
    assert calls == [("merge", "s.ckpt", "CLIP"), ("merge", "e.ckpt", "ImageClassifier"), ("build", "s.ckpt", "CLIP"),
                     ("mix", 0.0, ("s.ckpt", "e.ckpt"), ("ImageClassifier", "ImageClassifier"))]
    calls.clear()
    pair.mix(0.5)
    assert calls == [("mix", 0.5, ("s.ckpt", "e.ckpt"), ("ImageClassifier", "ImageClassifier")),
                     ("build", "e.ckpt (alpha 0.5)", "ImageClassifier")]


def test_the_loader_reads_with_the_models_own_normalisation_and_the_callers_workers(tiny_demo):
    from mmssl.data.transforms import eval_transform

    model = types.SimpleNamespace(image_size=16, image_mean=(0.1, 0.2, 0.3), image_std=(0.5, 0.25, 0.125))
    loader = wise_ft._loader(model, tiny_demo.eval_dir, 4, 0, 4)
    assert loader.num_workers == 0 and wise_ft._loader(model, tiny_demo.eval_dir, 4, 1, 4).num_workers == 1
    from mmssl.data.labeled import labeled_loader

    want = next(iter(labeled_loader(tiny_demo.eval_dir, eval_transform(16, (0.1, 0.2, 0.3), (0.5, 0.25, 0.125)), 4)))
    torch.testing.assert_close(next(iter(loader))["image"], want["image"])
