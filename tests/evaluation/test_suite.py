"""The evaluation suite: its file checked before a model runs, the bootstrap, the protocols against
hand references, and ``tools/evaluate.py`` end to end on a tiny CLIP (each image encoded once)."""

from __future__ import annotations

import csv
import json
import runpy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from mmssl.evaluation import protocols
from mmssl.evaluation.bootstrap import ClassRecall, Ratio, draw_counts, paired_difference, percentile_interval
from mmssl.evaluation.suite import SuiteError, load_suite, parse_suite
from tests.data.shard_helpers import sample_members, write_tar

REPO = Path(__file__).resolve().parents[2]


def _labelled(folder: Path, n: int, classes: int = 4, bad: int = 0, classnames: bool = True) -> str:
    """A clip_benchmark split of n samples (label i % classes) in 2 shards, ``bad`` broken JPEGs first."""
    folder.mkdir(parents=True)
    members = [
        m for b in range(bad) for m in ((f"bad{b}.jpg", b"not a jpeg"), (f"bad{b}.txt", b"x"), (f"bad{b}.cls", b"0"))
    ]
    members += [m for i in range(n // 2) for m in sample_members(i, i % classes)]
    write_tar(folder / "0.tar", members)
    write_tar(folder / "1.tar", [m for i in range(n // 2, n) for m in sample_members(i, i % classes)])
    (folder / "nshards.txt").write_text("2")
    if classnames:
        (folder.parent / "classnames.txt").write_text("\n".join(f"class {c}" for c in range(classes)) + "\n")
        (folder.parent / "zeroshot_classification_templates.txt").write_text("a photo of a {c}.\n{c}\n")
    return str(folder)


@pytest.fixture(scope="module")
def sets(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("sets")
    return {"test": _labelled(root / "s" / "test", 24, bad=2), "train": _labelled(root / "s" / "train", 40),
            "unnamed": _labelled(root / "u" / "test", 8, classnames=False)}


def test_a_bad_suite_is_refused_naming_the_entry(sets, tmp_path):
    def refused(spec: dict, *words: str) -> None:
        with pytest.raises(SuiteError) as err:
            parse_suite({"sets": {"a": spec}}, "s.yaml")
        assert all(w in str(err.value) for w in ("s.yaml", *words)), str(err.value)

    refused({"test": sets["test"], "tasks": ["zero_shot", "segmentation"]}, "sets.a.tasks", "'segmentation'")
    refused({"test": str(tmp_path / "gone"), "tasks": ["zero_shot"]}, "sets.a.test", "gone")
    refused({"test": sets["unnamed"], "tasks": ["zero_shot"]}, "sets.a.tasks.zero_shot", "classnames.txt")
    refused({"test": sets["test"], "tasks": ["knn"]}, "sets.a.tasks.knn", "train")
    refused({"test": sets["test"], "train": sets["train"], "tasks": {"knn": {"protocols": ["faiss"]}}}, "'faiss'")
    refused({"test": sets["test"], "tasks": {"retrieval": {"recall": [1]}}}, "sets.a.tasks.retrieval", "'recall'")
    refused(
        {
            "test": sets["test"],
            "train": sets["train"],
            "tasks": {"linear_probe": {"clip_benchmark": {"lr": 0.1, "wd": 1}}},
        },
        "sets.a.tasks.linear_probe.clip_benchmark",
        "'wd'",
    )
    (tmp_path / "s.yaml").write_text("sets: [")
    with pytest.raises(SuiteError, match="not YAML"):
        load_suite(str(tmp_path / "s.yaml"))


def test_bootstrap_is_seeded_and_figures_weigh_their_units():
    correct, labels = torch.tensor([1.0, 0, 1, 1, 0, 1]), torch.tensor([0, 0, 1, 1, 2, 2])
    acc, recall = Ratio(correct, torch.ones(6)), ClassRecall(correct, labels, 3)
    assert acc.point() == pytest.approx(4 / 6) and recall.point() == pytest.approx((0.5 + 1 + 0.5) / 3)
    w = draw_counts(6, 200, seed=3)
    assert torch.equal(w, draw_counts(6, 200, seed=3)) and not torch.equal(w, draw_counts(6, 200, seed=4))
    assert torch.all(w.sum(dim=1) == 6)
    # a draw of units 0, 0, 0, 1, 4, 5: accuracy 4/6; class 0 recall 3/4, class 1 absent, class 2 1/2
    one = torch.tensor([[3.0, 1, 0, 0, 1, 1]])
    assert acc.values(one).item() == pytest.approx(4 / 6) and recall.values(one).item() == pytest.approx(0.625)
    low, high = percentile_interval(acc.values(draw_counts(6, 1000, 0)))
    assert low < 4 / 6 < high


def test_paired_difference_on_shared_units():
    units = torch.arange(200)
    a = Ratio((torch.arange(200) % 2 == 0).float(), torch.ones(200))  # 50%
    same = paired_difference(a, units, a, units, 300, 0)
    assert same.difference == 0 and same.p_value == 1.0 and same.low == same.high == 0
    better = Ratio(((torch.arange(200) % 2 == 0) | (torch.arange(200) % 5 == 1)).float(), torch.ones(200))  # + 20 units
    diff = paired_difference(a, units, better, units, 300, 0)
    assert diff.difference == pytest.approx(0.1) and diff.low > 0 and diff.p_value < 0.01
    # B could not read unit 0: only the other 199 units are compared, in id order
    shuffled = torch.randperm(199, generator=torch.Generator().manual_seed(0)) + 1
    b = Ratio(a.numerator[shuffled], torch.ones(199))
    assert paired_difference(a, units, b, shuffled, 50, 0).num_units == 199
    assert paired_difference(a, units, b, shuffled, 50, 0).difference == 0


def test_parametric_search_follows_clip_a3():
    assert len(protocols.CLIP_LAMBDAS) == 97 and protocols.CLIP_LAMBDAS[0] == pytest.approx(1e-6)
    assert protocols.CLIP_LAMBDAS[8] == pytest.approx(1e-5) and protocols.CLIP_LAMBDAS[-1] == pytest.approx(1e6)
    for peak in (0, 37, 50, 96):
        tried: list[int] = []

        def score(i: int) -> float:
            tried.append(i)
            return -abs(i - peak)  # one peak: the search must land on it

        assert protocols.parametric_search(score) == peak
        assert len(set(tried)) <= 7 + 2 * 4  # 7 starting points, then at most 2 new ones per halving
    assert protocols.parametric_search(lambda i: 1.0) == 0  # ties keep the first


def test_retrieval_matches_clip_benchmark_recall_definition():
    torch.manual_seed(0)
    image = F.normalize(torch.randn(6, 8), dim=1)
    owner = torch.tensor([0, 0, 1, 2, 3, 3, 3, 4, 5, 5])  # 10 captions, images with 1-3 each
    text = F.normalize(image[owner] + 0.9 * torch.randn(10, 8), dim=1)
    figures = protocols.retrieval(image, text, owner, [1, 2, 5])
    for k in (1, 2, 5):  # clip_benchmark: per caption, its image in the top k; per image, any caption in it
        top_images = (text @ image.T).topk(k, dim=1).indices
        want_i = (top_images == owner[:, None]).any(dim=1).float().mean()
        top_texts = (image @ text.T).topk(k, dim=1).indices
        want_t = (owner[top_texts] == torch.arange(6)[:, None]).any(dim=1).float().mean()
        assert figures[f"image_retrieval_recall@{k}"].point() == pytest.approx(float(want_i))
        assert figures[f"text_retrieval_recall@{k}"].point() == pytest.approx(float(want_t))


def _suite(tmp_path: Path, sets: dict[str, str]) -> str:
    path = tmp_path / "suite.yaml"
    path.write_text(f"""resamples: 50
sets:
  shapes:
    test: {sets['test']}
    train: {sets['train']}
    tasks:
      zero_shot: {{}}
      linear_probe: {{protocols: [clip, mae], mae: {{epochs: 2, optimizer: sgd}}}}
      knn: {{}}
      retrieval: {{recall_k: [1, 5]}}
""")
    return str(path)


def _tiny_clip(tmp_path: Path, tiny_clip_json: str, seed: int) -> str:
    from mmssl.models.clip import CLIP

    torch.manual_seed(seed)
    path = tmp_path / f"clip{seed}.pt"
    torch.save(CLIP(model_name=tiny_clip_json).model.state_dict(), path)
    return str(path)


def test_evaluate_writes_clip_benchmark_json_csv_and_table_encoding_each_image_once(sets, tmp_path, tiny_clip_json,
                                                                                  monkeypatch):
    from mmssl.models.clip import CLIP

    calls: list[int] = []
    encode = CLIP.encode_image
    monkeypatch.setattr(CLIP, "encode_image", lambda self, x, *a, **k: calls.append(len(x)) or encode(self, x, *a, **k))
    main = runpy.run_path(str(REPO / "tools" / "evaluate.py"), run_name="not_main")["main"]
    out = tmp_path / "out"
    ckpt = _tiny_clip(tmp_path, tiny_clip_json, 0)
    argv = ["--ckpt", ckpt, "--model", tiny_clip_json, "--suite", _suite(tmp_path, sets), "--output", str(out),
            "--batch-size", "16"]
    assert main(argv) == 0
    assert sum(calls) == 24 + 40  # test and train images once each, for all six results
    zs = json.loads((out / "shapes_zero_shot_clip.json").read_text())
    assert {k: zs[k] for k in ("dataset", "pretrained", "task")} == {"dataset": "shapes", "pretrained": ckpt,
                                                                     "task": "zeroshot_classification"}
    assert set(zs["metrics"]) == {"acc1", "mean_per_class_recall"} and zs["skipped"] == 2 and zs["num_samples"] == 24
    assert zs["ci95"]["acc1"][0] <= zs["metrics"]["acc1"] <= zs["ci95"]["acc1"][1]
    lp = json.loads((out / "shapes_linear_probe_clip.json").read_text())
    assert lp["task"] == "linear_probe" and "lp_acc1" in lp["metrics"] and lp["settings"]["lambdas_tried"] <= 15
    rt = json.loads((out / "shapes_retrieval_clip.json").read_text())
    assert set(rt["metrics"]) == {"image_retrieval_recall@1", "text_retrieval_recall@1", "image_retrieval_recall@5",
                                  "text_retrieval_recall@5", "mean_recall@1"} and rt["task"] == "zeroshot_retrieval"
    assert {json.loads(p.read_text())["protocol"] for p in out.glob("shapes_knn_*.json")} == {"lightly", "dino"}
    rows = list(csv.DictReader((out / "results.csv").open()))
    assert len(rows) == 2 + 2 * 2 + 2 * 2 + 5 and rows[0]["skipped"] == "2"  # 4 classes: no acc5
    summary = json.loads((out / "summary.json").read_text())
    assert (
        len(summary["suite_average"]) == 6
        and "| shapes | zero_shot | clip | acc1 |" in (out / "results.md").read_text()
    )
    assert main(argv) == 1  # an earlier run's results are not overwritten without --overwrite


def test_compare_pairs_two_checkpoints(sets, tmp_path, tiny_clip_json):
    main = runpy.run_path(str(REPO / "tools" / "evaluate.py"), run_name="not_main")["main"]
    suite = tmp_path / "suite.yaml"
    suite.write_text(f"resamples: 50\nsets:\n  shapes:\n    test: {sets['test']}\n    tasks: [zero_shot, retrieval]\n")
    a, b = _tiny_clip(tmp_path, tiny_clip_json, 0), _tiny_clip(tmp_path, tiny_clip_json, 1)
    out = tmp_path / "cmp"
    assert main(["--compare", a, b, "--model", tiny_clip_json, "--suite", str(suite), "--output", str(out)]) == 0
    rows = json.loads((out / "compare.json").read_text())["comparison"]
    assert [(r["task"], r["metric"]) for r in rows] == [("zero_shot", "acc1"), ("retrieval", "mean_recall@1")]
    for r in rows:
        assert r["difference"] == pytest.approx(r["b"] - r["a"]) and r["ci95"][0] <= r["ci95"][1]
        assert 0 <= r["p_value"] <= 1 and r["num_samples"] == 24
    assert (out / "a" / "shapes_zero_shot_clip.json").is_file() and "B - A" in (out / "compare.md").read_text()


def test_the_clip_benchmark_peer_runs_cuda_code_on_the_cpu():
    peer = runpy.run_path(str(REPO / "benchmarks" / "clip_benchmark_peer.py"), run_name="not_main")
    linear, to, cuda = torch.nn.Linear(2, 2), torch.Tensor.to, torch.nn.Module.cuda
    with peer["cuda_on_cpu"]():
        assert torch.zeros(2).to("cuda").device.type == "cpu" and linear.cuda() is linear
        assert torch.zeros(2).to(device="cuda:0").device.type == "cpu" and torch.zeros(1).cuda().device.type == "cpu"
    assert torch.Tensor.to is to and torch.nn.Module.cuda is cuda  # restored on exit
    if torch.cuda.is_available():
        return
    pytest.importorskip("clip_benchmark", reason="clip-benchmark is installed only in the benchmark's own venv")
    from clip_benchmark import cli

    peer["patch_linear_probe"]()
    assert cli.linear_probe.evaluate.__wrapped__.__module__ == "clip_benchmark.metrics.linear_probe"


def test_the_side_by_side_benchmark_scores_both_probes_against_clip_benchmarks(sets, tmp_path):
    """benchmarks/eval_suite.py: its suite file is one the suite accepts, with CLIP_benchmark's
    probe recipe and CLIP A.3's, and each is set against CLIP_benchmark's linear_probe figure."""
    bench = runpy.run_path(str(REPO / "benchmarks" / "eval_suite.py"), run_name="not_main")
    root = tmp_path / "wds" / "toy"
    _labelled(root / "train", 8)  # two shards: one trains, one is the held-out split
    _labelled(root / "test", 8, classnames=False)
    name = bench["make_layout"](root, tmp_path / "work", None, 1, None)
    suite = load_suite(bench["suite_yaml"](tmp_path / "work", [name]))
    [probe] = [t for t in suite.sets[0].tasks if t.name == "linear_probe"]
    assert probe.protocols == ("clip", "clip_benchmark")
    cb, ours = tmp_path / "cb", tmp_path / "ours"
    cb.mkdir(), ours.mkdir()
    for task, key, value in (("zeroshot", "acc1", 0.5), ("retrieval", "image_retrieval_recall@1", 0.25),
                             ("linear_probe", "lp_acc1", 0.195)):
        (cb / f"toy_{task}.json").write_text(json.dumps({"metrics": {key: value}}))
    for stem, key, value in (
        ("zero_shot_clip", "acc1", 0.5),
        ("retrieval_clip", "image_retrieval_recall@1", 0.25),
        ("linear_probe_clip_benchmark", "lp_acc1", 0.193),
        ("linear_probe_clip", "lp_acc1", 0.404),
    ):
        (ours / f"toy_{stem}.json").write_text(json.dumps({"metrics": {key: value}, "ci95": {key: [0, 1]}}))
    rows = {(r["task"], r["protocol"]): r["points"] for r in bench["compare_figures"](cb, ours, ["toy"])}
    assert rows == {("zeroshot", "clip"): 0, ("retrieval", "clip"): 0, ("linear_probe", "clip_benchmark"): -0.2,
                    ("linear_probe", "clip"): 20.9}
