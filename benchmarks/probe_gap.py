"""Why CLIP_benchmark's linear probe and the suite's differ: both optimisers on the same features.

    cb_venv/bin/python benchmarks/probe_gap.py --features CB_FEATURE_DIR --output-json gap.json

``CB_FEATURE_DIR`` is what CLIP_benchmark's ``linear_probe`` cached (``--feature_root``:
``features_{train,val,test}.pt``, L2-normalised, and ``targets_*.pt``), so both probes see
exactly the same features. Run with the Python of the CLIP_benchmark venv: its own ``train`` /
``infer`` (AdamW, cosine schedule, batch 64, ``--fewshot_lr`` 0.1, ``--fewshot_epochs`` 10) are
called, on the CPU as ``benchmarks/clip_benchmark_peer.py`` runs them. Each row: the optimiser,
its regularisation, the test top-1 and the mean training cross-entropy it reached (without the
penalty), so an under-trained fit shows as a higher loss at the same regularisation.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.clip_benchmark_peer import cuda_on_cpu  # noqa: E402
from mmssl.evaluation.linear import fit_logistic  # noqa: E402


def _load(folder: str, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.load(os.path.join(folder, f"features_{split}.pt")),
            torch.load(os.path.join(folder, f"targets_{split}.pt")))


def _figures(model: torch.nn.Module, train: tuple, test: tuple) -> dict[str, float]:
    with torch.no_grad():
        return {"test_acc1": float((model(test[0]).argmax(1) == test[1]).float().mean()),
                "train_ce": float(F.cross_entropy(model(train[0]), train[1]))}


def adamw(train: tuple, test: tuple, weight_decay: float, lr: float, epochs: int) -> dict[str, float]:
    """CLIP_benchmark's own probe training (``linear_probe.train``) at one weight decay."""
    from clip_benchmark.metrics.linear_probe import FeatureDataset
    from clip_benchmark.metrics.linear_probe import train as cb_train

    loader = DataLoader(FeatureDataset(*train), batch_size=64, shuffle=True)
    with cuda_on_cpu():
        model = cb_train(loader, train[0].shape[1], int(train[1].max()) + 1, weight_decay, lr, epochs,
                         False, "cuda", 0)
    return _figures(model, train, test)


def lbfgs(train: tuple, test: tuple, lam: float) -> dict[str, float]:
    """The suite's probe fit (``fit_logistic``, scikit-learn's lambda = 1 / C) at one lambda, from zeros."""
    x = train[0]
    model = fit_logistic(x, train[1], int(train[1].max()) + 1, weight_decay=lam / x.shape[0], max_iter=1000,
                         tolerance_grad=1e-4)
    return _figures(model, train, test)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--features", required=True, help="CLIP_benchmark's feature folder of one model and set")
    p.add_argument("--cb-weight-decay", type=float, default=1e-6, help="the weight decay CLIP_benchmark chose")
    p.add_argument("--suite-lambda", type=float, required=True, help="the lambda the suite chose")
    p.add_argument("--output-json")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    train_x, train_y = _load(args.features, "train")
    val_x, val_y = _load(args.features, "val")
    # Both final fits use training + held-out rows (CLIP A.3; CLIP_benchmark's train_val loader).
    train = (torch.cat([train_x, val_x]), torch.cat([train_y, val_y]))
    test = _load(args.features, "test")
    wd, lam = args.cb_weight_decay, args.suite_lambda
    rows = [
        {"fit": "AdamW, lr 0.1, 10 epochs (CLIP_benchmark)", "regularisation": f"weight decay {wd:g}",
         **adamw(train, test, wd, 0.1, 10)},
        {"fit": "AdamW, lr 0.1, 100 epochs", "regularisation": f"weight decay {wd:g}",
         **adamw(train, test, wd, 0.1, 100)},
        {"fit": "AdamW, lr 0.001, 10 epochs", "regularisation": f"weight decay {wd:g}",
         **adamw(train, test, wd, 0.001, 10)},
        {"fit": "AdamW, lr 0.001, 100 epochs", "regularisation": f"weight decay {wd:g}",
         **adamw(train, test, wd, 0.001, 100)},
        {"fit": "L-BFGS (suite)", "regularisation": f"lambda {lam:g}", **lbfgs(train, test, lam)},
        {"fit": "L-BFGS (suite)", "regularisation": "lambda 1e-06", **lbfgs(train, test, 1e-6)},
    ]
    for row in rows:
        print(f"{row['fit']:>44}  {row['regularisation']:>22}: test top-1 {100 * row['test_acc1']:6.2f}  "
              f"train CE {row['train_ce']:.4f}")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps({"features": args.features, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
