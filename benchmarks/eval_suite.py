"""``tools/evaluate.py`` against CLIP_benchmark 1.6.2: the same export, sets and tasks; figures and time.

    python benchmarks/eval_suite.py --ckpt runs/demo_clip/version_0/checkpoints/last.ckpt \
        --data ~/.cache/mmssl/demo --cb-python cb_venv/bin/python --work /tmp/cb_vs_suite \
        --output-json benchmarks/results/eval_suite_vs_clip_benchmark.json

Per ``--data`` root (a clip_benchmark ``wds/`` set with ``train/`` and a test split), a layout both
read is made of links: ``train/`` (the first training shards), ``lpval/`` (the last
``--val-shards`` of them: the held-out split of the linear probe's regularisation search, given
to CLIP_benchmark as ``--val_split``, to the suite as ``val``), ``test/``, and a ``NAME_retrieval``
root whose ``dataset_type.txt`` says ``retrieval`` (CLIP_benchmark reads captions only then).
The checkpoint is exported once (``--format open_clip_hf``) and both score that folder.

CLIP_benchmark runs three commands per set (``zeroshot_classification``, ``zeroshot_retrieval``
with ``--recall_k 1 5 10``, ``linear_probe``), each with ``--no_amp`` (fp32, as the suite) and a
fresh ``--feature_root``; the suite runs one command over all sets with the same tasks (zero-shot,
the linear probe as CLIP_benchmark trains it (protocol ``clip_benchmark``) and as CLIP A.3 does
(``clip``), retrieval) and its bootstrap intervals. Each side is timed as whole
processes, ``--runs`` times, alternating; the medians are compared.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
SIDE_FILES = ("classnames.txt", "zeroshot_classification_templates.txt")


def _link_split(shards: list[Path], folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for i, shard in enumerate(shards):
        (folder / f"{i}.tar").symlink_to(shard.resolve())
    (folder / "nshards.txt").write_text(str(len(shards)))


def _shards(split: Path) -> list[Path]:
    n = int((split / "nshards.txt").read_text().strip())
    return [split / f"{i}.tar" for i in range(n)]


def make_layout(root: Path, work: Path, train_shards: Optional[int], val_shards: int, test_split: Optional[str]) -> str:
    """The comparison layout of one set (see the module docstring); returns its name."""
    name = root.name
    test_split = test_split or ("test" if (root / "test").is_dir() else "val")
    train = _shards(root / "train")[: train_shards or None]
    if len(train) <= val_shards:
        raise ValueError(f"{root}/train: {len(train)} shards, need more than --val-shards {val_shards}")
    out = work / name
    _link_split(train[:-val_shards], out / "train")
    _link_split(train[-val_shards:], out / "lpval")
    _link_split(_shards(root / test_split), out / "test")
    for side in SIDE_FILES:
        if (root / side).is_file():
            shutil.copy(root / side, out / side)
    retrieval = work / f"{name}_retrieval"
    retrieval.mkdir()
    (retrieval / "test").symlink_to((out / "test").resolve())
    (retrieval / "dataset_type.txt").write_text("retrieval")
    return name


def suite_yaml(work: Path, names: list[str]) -> str:
    """The suite of the same sets and tasks."""
    lines = ["sets:"]
    for name in names:
        lines += [f"  {name}:", f"    test: {work / name / 'test'}", f"    train: {work / name / 'train'}",
                  "    tasks:", "      zero_shot: {}",
                  f"      linear_probe: {{protocols: [clip, clip_benchmark], val: {work / name / 'lpval'}}}",
                  "      retrieval: {recall_k: [1, 5, 10]}"]
    path = work / "suite.yaml"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def cb_commands(cb_python: str, export: str, work: Path, names: list[str], out: Path, workers: int) -> list[list[str]]:
    """CLIP_benchmark's commands for the same sets and tasks."""
    base = [cb_python, str(REPO / "benchmarks" / "clip_benchmark_peer.py"), "eval", "--model", f"local-dir:{export}",
            "--pretrained", "mmssl", "--no_amp", "--num_workers", str(workers), "--quiet"]
    commands = []
    for name in names:
        commands += [
            [
                *base,
                "--dataset",
                f"wds/{name}",
                "--dataset_root",
                str(work / name),
                "--split",
                "test",
                "--task",
                "zeroshot_classification",
                "--output",
                str(out / f"{name}_zeroshot.json"),
            ],
            [
                *base,
                "--dataset",
                f"wds/{name}",
                "--dataset_root",
                str(work / f"{name}_retrieval"),
                "--split",
                "test",
                "--task",
                "zeroshot_retrieval",
                "--recall_k",
                "1",
                "5",
                "10",
                "--output",
                str(out / f"{name}_retrieval.json"),
            ],
            [
                *base,
                "--dataset",
                f"wds/{name}",
                "--dataset_root",
                str(work / name),
                "--split",
                "test",
                "--train_split",
                "train",
                "--val_split",
                "lpval",
                "--task",
                "linear_probe",
                "--feature_root",
                str(out / "features"),
                "--output",
                str(out / f"{name}_linear_probe.json"),
            ],
        ]
    return commands


def _timed(commands: list[list[str]], env: dict, log: Path) -> float:
    """Wall seconds of the commands run one after another; their output appended to ``log``."""
    start = time.perf_counter()
    with open(log, "a", encoding="utf-8") as out:
        for command in commands:
            out.write(f"$ {' '.join(command)}\n")
            out.flush()
            done = subprocess.run(command, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(command[:4])} ... failed (rc {done.returncode}): see {log}")
    return time.perf_counter() - start


def compare_figures(cb_out: Path, suite_out: Path, names: list[str]) -> list[dict]:
    """Each figure of both, and the difference in points."""
    probe = ["lp_acc1", "lp_acc5", "lp_mean_per_class_recall"]
    pairs = [
        ("zeroshot", "zero_shot", "clip", ["acc1", "acc5", "mean_per_class_recall"]),
        (
            "retrieval",
            "retrieval",
            "clip",
            [f"{w}_retrieval_recall@{k}" for k in (1, 5, 10) for w in ("image", "text")],
        ),
        # CLIP_benchmark's probe against the suite's protocol of the same recipe, and against CLIP A.3's
        ("linear_probe", "linear_probe", "clip_benchmark", probe),
        ("linear_probe", "linear_probe", "clip", probe),
    ]
    rows = []
    for name in names:
        for cb_task, suite_task, protocol, keys in pairs:
            cb = json.loads((cb_out / f"{name}_{cb_task}.json").read_text())["metrics"]
            ours = json.loads((suite_out / f"{name}_{suite_task}_{protocol}.json").read_text())
            for key in keys:
                if key in cb and key in ours["metrics"]:
                    rows.append(
                        {
                            "set": name,
                            "task": cb_task,
                            "protocol": protocol,
                            "metric": key,
                            "clip_benchmark": cb[key],
                            "suite": ours["metrics"][key],
                            "ci95": ours["ci95"][key],
                            "points": round(100 * (ours["metrics"][key] - cb[key]), 3),
                        }
                    )
    return rows


def _report(work: Path, names: list[str], times: dict, load: dict) -> dict:
    medians = {k: statistics.median(v) for k, v in times.items()}
    return {"sets": names, "seconds": times, "load_average_1min": load, "cpu_count": os.cpu_count(),
            "median_seconds": medians, "speedup": medians["clip_benchmark"] / medians["suite"],
            "figures": compare_figures(work / "cb_0", work / "suite_0", names)}


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", required=True, help="mmssl CLIP checkpoint, or an open_clip_hf export folder")
    p.add_argument("--data", nargs="+", required=True, help="clip_benchmark wds/ roots with train/ and a test split")
    p.add_argument("--test-split", help="the scored split of every root (default: test, else val as the demo's)")
    p.add_argument("--train-shards", type=int, help="use the first N training shards only")
    p.add_argument("--val-shards", type=int, default=1, help="training shards held out for the lambda search")
    p.add_argument("--cb-python", required=True, help="python of the venv with clip-benchmark==1.6.2")
    p.add_argument("--work", required=True, help="scratch folder (replaced)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument(
        "--num-workers", type=int, default=1, help="loader workers of both (at most the fewest shards of a split)"
    )
    p.add_argument("--output-json", help="write figures and times here")
    args = p.parse_args(argv)
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    names = [make_layout(Path(os.path.expanduser(d)), work, args.train_shards, args.val_shards, args.test_split)
             for d in args.data]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    export = args.ckpt
    if not os.path.isdir(export):
        export = str(work / "export")
        subprocess.run([sys.executable, str(REPO / "tools" / "export.py"), "--ckpt", args.ckpt, "--format",
                        "open_clip_hf", "--output", export], env=env, check=True)
    suite = suite_yaml(work, names)
    times: dict[str, list[float]] = {"clip_benchmark": [], "suite": []}
    # The 1-minute load average when each timed side starts and ends: the machine is shared.
    load: dict[str, list[tuple[float, float]]] = {"clip_benchmark": [], "suite": []}
    for run in range(args.runs):
        cb_out, suite_out = work / f"cb_{run}", work / f"suite_{run}"
        cb_out.mkdir()
        sides = {"clip_benchmark": cb_commands(args.cb_python, export, work, names, cb_out, args.num_workers),
                 "suite": [[sys.executable, str(REPO / "tools" / "evaluate.py"), "--ckpt", export, "--suite",
                            suite, "--output", str(suite_out), "--num-workers", str(args.num_workers)]]}
        for side, commands in sides.items():
            before = os.getloadavg()[0]
            times[side].append(_timed(commands, env, work / f"{side}_{run}.log"))
            load[side].append((before, os.getloadavg()[0]))
        print(f"run {run}: clip_benchmark {times['clip_benchmark'][-1]:.1f} s, suite {times['suite'][-1]:.1f} s, "
              f"load {load['clip_benchmark'][-1]} / {load['suite'][-1]}", flush=True)
        report = _report(work, names, times, load)
        if args.output_json:  # after every run, so that a cut-short series keeps what it measured
            Path(args.output_json).write_text(json.dumps(report, indent=2))
    rows = report["figures"]
    medians = report["median_seconds"]
    for row in rows:
        print(
            f"{row['set']:>14} {row['task']:>13} {row['protocol']:>14} {row['metric']:>28}: "
            f"clip_benchmark {100 * row['clip_benchmark']:6.2f}"
            f"  suite {100 * row['suite']:6.2f}  ({row['points']:+.2f} points)"
        )
    print(f"median: clip_benchmark {medians['clip_benchmark']:.1f} s, suite {medians['suite']:.1f} s, "
          f"{report['speedup']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
