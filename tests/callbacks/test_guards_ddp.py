"""NonFiniteGuard's sync-free path (fused AdamW) through the real CLI on 2 gloo processes.

Rank 1 alone gets a NaN gradient on step 1 and every rank on step 2; both ranks must skip both
(the decision is an all-reduce of a device flag, no host read: a MAX, so a step bad on two ranks
counts once), end with identical weights, and log the skip count of a one-process run poisoned on
the same steps.
"""

from __future__ import annotations

import torch

from tests.cli_runs import PG_TIMEOUT, REPO, last_metrics, run_mmssl, run_one_process


def test_fused_skip_is_taken_by_every_rank_and_counted_as_in_one_process(
    tmp_path, tiny_demo, tiny_clip_json, monkeypatch
):
    monkeypatch.syspath_prepend(str(REPO / "tests"))  # the one-process run imports the helpers here
    counts = []
    for processes in (1, 2):
        folder = tmp_path / f"p{processes}"
        folder.mkdir()
        args = [
            "fit",
            "--config",
            str(REPO / "configs/demo/clip.yaml"),
            f"--model.init_args.model_name={tiny_clip_json}",
            "--model.init_args.optimizer.init_args.fused=true",
            f"--data.init_args.demo_dir={tiny_demo.root}",
            f"--data.init_args.val_data={tiny_demo.val}",
            "--data.init_args.batch_size=4",
            "--data.init_args.num_workers=1",
            f"--trainer.default_root_dir={folder / 'runs'}",
            "--trainer.enable_progress_bar=false",
            "--trainer.max_epochs=1",
            "--trainer.limit_train_batches=6",
            "--trainer.log_every_n_steps=3",
            "--trainer.limit_val_batches=1",
            "--nonfinite_guard.max_consecutive=3",
            "--trainer.callbacks+=guard_helpers.PoisonGrads",
            f"--trainer.callbacks.rank={processes - 1}",
            "--trainer.callbacks.steps=[1]",
            "--trainer.callbacks.every_rank_steps=[2]",
            "--trainer.callbacks+=helpers.DumpParams",
            f"--trainer.callbacks.folder={folder / 'params'}",
        ]
        if processes == 2:
            out = run_mmssl([*args, "--config", str(REPO / "configs/trainer/ddp_cpu.yaml"), PG_TIMEOUT], folder)
        else:
            out = run_one_process(args)
        assert out.returncode == 0, out.stdout[-3000:]
        metrics = last_metrics(folder / "runs" / "version_0", prefixes=("train/nonfinite", "val/loss"))
        assert metrics["val/loss"] == metrics["val/loss"]  # validated, not NaN
        counts.append(metrics["train/nonfinite_skipped"])
    assert counts == [2.0, 2.0]
    rank0, rank1 = (torch.load(tmp_path / "p2" / "params" / f"rank{r}.pt") for r in (0, 1))
    for name in rank0:
        assert torch.isfinite(rank0[name]).all(), name
        torch.testing.assert_close(rank0[name], rank1[name], rtol=0, atol=0, msg=name)
