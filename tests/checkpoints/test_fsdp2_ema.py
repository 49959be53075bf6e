"""mmssl.callbacks.EMA under FSDP2, through the real CLI (the tiny CLIP on 2 gloo processes,
validation on one held-out shard, so rank 1 validates nothing).

What users rely on: the average is kept sharded like the weights and is the DDP run's average
(within the float tolerance of FSDP2's reduce-scatter against DDP's all-reduce), validation
scores it (``evaluate: both`` and ``ema``) as under DDP, the checkpoint folder holds it shard by
shard and a SIGKILL and ``--ckpt_path last`` end with exactly the uninterrupted run's raw weights
and average; a folder resumes on another number of processes, and a DDP run's file under FSDP2,
with exactly the saved average.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from mmssl.checkpoints.read import read_checkpoint, read_dcp_metadata
from mmssl.checkpoints.sharded import AVERAGED_WEIGHTS
from tests.checkpoints.test_fsdp2 import DDP, FSDP2, ONE, _args, _ok
from tests.cli_runs import last_metrics, run_mmssl

EMA = ["--trainer.callbacks+=mmssl.callbacks.EMA", "--trainer.callbacks.decay=0.6",
       "--trainer.callbacks.warmup_power=0.75"]


class DumpEMA(pl.Callback):
    """Rank R's whole raw weights and average (``ema/NAME``) at train start and end, to
    ``{folder}/{start,end}_rank{R}.pt`` (DTensors made whole: a collective every rank joins)."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def _dump(self, trainer, pl_module, when: str) -> None:
        def whole(t):
            return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu().clone()

        state = {k: whole(v) for k, v in pl_module.state_dict().items()}
        for callback in trainer.callbacks:
            average = getattr(callback, "averaged_module", lambda: None)()
            if average is not None:
                state.update({f"ema/{k}": whole(v) for k, v in average.state_dict().items()})
        os.makedirs(self.folder, exist_ok=True)
        torch.save(state, os.path.join(self.folder, f"{when}_rank{trainer.global_rank}.pt"))

    def on_train_start(self, trainer, pl_module) -> None:
        self._dump(trainer, pl_module, "start")

    def on_train_end(self, trainer, pl_module) -> None:
        self._dump(trainer, pl_module, "end")


def _ema_args(root: Path, demo, steps: int, evaluate: str, clip_json: str) -> list[str]:
    args = _args("clip", root, demo, [f"--model.init_args.model_name={clip_json}"], steps)
    args = [a for a in args if a not in ("--trainer.callbacks+=tests.helpers.DumpParams",
                                         "--trainer.callbacks+=tests.helpers.DumpStartParams")]
    args = [a for a in args if not a.startswith("--trainer.callbacks.folder=")]
    return [*args, *EMA, f"--trainer.callbacks.evaluate={evaluate}",
            "--trainer.callbacks+=tests.checkpoints.test_fsdp2_ema.DumpEMA", f"--trainer.callbacks.folder={root}/dump"]


def _dump(root: Path, when: str = "end", rank: int = 0) -> dict[str, torch.Tensor]:
    return torch.load(root / "dump" / f"{when}_rank{rank}.pt", weights_only=True)


@pytest.fixture(scope="module")
def ema_runs(tmp_path_factory, tiny_demo, tiny_clip_json):
    """2-process runs of the tiny CLIP (its retrieval, zero-shot and health figures: callbacks that
    enter the average's towers through named stages, on a rank with no held-out batch too), 4 steps
    with an EMA: FSDP2 and DDP with ``evaluate: both``, and an FSDP2 run with ``evaluate: ema``
    SIGKILLed at step 3 (newest checkpoint: step 2), resumed."""
    tmp = tmp_path_factory.mktemp("fsdp2_ema")
    runs = {name: tmp / name for name in ("fsdp2", "ddp", "killed")}
    _ok(run_mmssl([*_ema_args(runs["fsdp2"], tiny_demo, 4, "both", tiny_clip_json), *FSDP2], tmp, timeout=240))
    _ok(run_mmssl([*_ema_args(runs["ddp"], tiny_demo, 4, "both", tiny_clip_json), *DDP], tmp, timeout=240))
    kill = ["--trainer.callbacks+=tests.helpers.KillAtStep", "--trainer.callbacks.step=3"]
    killed = run_mmssl([*_ema_args(runs["killed"], tiny_demo, 4, "ema", tiny_clip_json), *FSDP2, *kill], tmp,
                       timeout=240, killed=True)
    assert killed.returncode == -signal.SIGKILL, killed.stdout[-4000:]
    _ok(run_mmssl([*_ema_args(runs["killed"], tiny_demo, 4, "ema", tiny_clip_json), *FSDP2, "--ckpt_path", "last"], tmp,
                  timeout=240))
    return tmp, runs


def test_fsdp2_ema_is_the_ddp_average_validated_and_resumed_bit_exactly(ema_runs):
    tmp, runs = ema_runs
    fsdp2, ddp, resumed = _dump(runs["fsdp2"]), _dump(runs["ddp"]), _dump(runs["killed"])
    averaged = [k for k in fsdp2 if k.startswith("ema/")]
    assert averaged and fsdp2.keys() == ddp.keys()
    for key in fsdp2:  # the raw weights and the average, FSDP2 against DDP (CLIP's scalars: (1,) against 0-d)
        torch.testing.assert_close(fsdp2[key].reshape(ddp[key].shape), ddp[key], rtol=1e-4, atol=1e-5, msg=key)
    assert any(not torch.equal(fsdp2[k], fsdp2[k[4:]]) for k in averaged), "the average is the raw weights"
    # One average, sharded: every rank ends with the same whole tensors.
    assert all(torch.equal(fsdp2[k], _dump(runs["fsdp2"], rank=1)[k]) for k in fsdp2)
    # SIGKILL, then --ckpt_path last (evaluate: ema swaps the average in and out of the shards at
    # each validation, and leaves it in the module when fit ends): the uninterrupted run's average,
    # and its raw weights in the last checkpoint, bit for bit.
    differ = [k for k in averaged if not torch.equal(fsdp2[k], resumed[k]) or not torch.equal(fsdp2[k], resumed[k[4:]])]
    last = _from_folder(runs["killed"] / "kept" / "step=4.ckpt", "state_dict")  # the raw weights
    differ += [k for k in last if not torch.equal(fsdp2[k], last[k])]
    assert not differ, f"the resumed run ends elsewhere than the uninterrupted one: {differ}"
    # Validation: raw and average as under DDP; evaluate: ema scores the average as both's _ema keys.
    got, want = last_metrics(runs["fsdp2"] / "version_0"), last_metrics(runs["ddp"] / "version_0")
    assert {"val/loss", "val/loss_ema", "val/zero_shot_top1_ema"} <= set(got)
    assert got["val/loss"] != got["val/loss_ema"]
    for key in set(want) | set(got):
        assert got[key] == pytest.approx(want[key], abs=1e-4), key
    assert last_metrics(runs["killed"] / "version_0")["val/loss"] == pytest.approx(got["val/loss_ema"], rel=1e-6)
    # The folder: raw weights as state_dict, the average beside them, each a sharded entry.
    folder = runs["fsdp2"] / "kept" / "step=4.ckpt"
    metadata = read_dcp_metadata(str(folder))
    assert any(k.startswith(f"{AVERAGED_WEIGHTS}.") for k in metadata.state_dict_metadata)
    meta = read_checkpoint(str(folder / "meta.pt"))
    assert meta["global_step"] == 4 and int(meta["averaging_state"]["n_averaged"]) == 4
    average = _from_folder(folder)
    assert average.keys() and all(torch.equal(average[k], fsdp2[f"ema/{k}"]) for k in average)


def test_the_one_reader_consolidates_a_folder_with_its_average(ema_runs, tmp_path):
    """read_checkpoint(folder) as a file of WeightAveraging's layout: tools read the raw weights,
    ``--ema`` the average (here: the export tool)."""
    import runpy
    import sys

    from tests.cli_runs import REPO

    _, runs = ema_runs
    fsdp2, folder = _dump(runs["fsdp2"]), runs["fsdp2"] / "kept" / "step=4.ckpt"
    checkpoint = read_checkpoint(str(folder))
    raw = checkpoint.get("current_model_state", {})
    assert raw.keys() and all(torch.equal(raw[k], fsdp2[k].reshape(raw[k].shape)) for k in raw)
    average = checkpoint["state_dict"]
    assert all(torch.equal(average[k], fsdp2[f"ema/{k}"].reshape(average[k].shape)) for k in average)
    out = tmp_path / "ema.pth"
    argv = sys.argv
    sys.argv = ["export.py", "--ckpt", str(folder), "--format", "open_clip", "--output", str(out), "--ema"]
    try:
        with pytest.raises(SystemExit) as exit_:
            runpy.run_path(str(REPO / "tools" / "export.py"), run_name="__main__")
    finally:
        sys.argv = argv
    assert not exit_.value.code
    exported = torch.load(out, weights_only=True)
    assert torch.equal(exported["visual.conv1.weight"], fsdp2["ema/model.visual.conv1.weight"])


@pytest.mark.parametrize("where", ["fsdp2 on 1 from the folder", "fsdp2 from a ddp file", "ddp from the folder"])
def test_an_ema_checkpoint_resumes_elsewhere_with_exactly_its_average(where, ema_runs, tiny_demo, tiny_clip_json):
    """DCP reshards the average of a 2-process folder to 1 process; a DDP run's file (average
    whole, in WeightAveraging's layout) is scattered into the shards; a DDP run reads the folder
    through the one reader (raw weights and average consolidated whole). Training starts from the
    raw weights and the saved average, exactly."""
    tmp, runs = ema_runs
    if where.endswith("ddp file"):
        source, world = runs["ddp"] / "kept" / "step=2.ckpt", FSDP2
        saved = read_checkpoint(str(source))
        raw, average = saved["current_model_state"], saved["state_dict"]
    else:
        source = runs["fsdp2"] / "kept" / "step=2.ckpt"
        world = DDP if where.startswith("ddp") else [*FSDP2, *ONE]
        raw, average = _from_folder(source, "state_dict"), _from_folder(source)
    root = tmp / where.replace(" ", "_")
    args = _ema_args(root, tiny_demo, 3, "both", tiny_clip_json)
    _ok(run_mmssl([*args, *world, "--ckpt_path", str(source)], tmp, timeout=300))
    start = _dump(root, "start")
    differ = [k for k in raw if not torch.equal(start[k].reshape(raw[k].shape), raw[k])]
    differ += [f"ema/{k}" for k in average if not torch.equal(start[f"ema/{k}"].reshape(average[k].shape), average[k])]
    assert not differ, f"{where}: resumed other weights than the checkpoint's: {differ}"


def _from_folder(folder: Path, entry: str = AVERAGED_WEIGHTS) -> dict[str, torch.Tensor]:
    """One entry of a checkpoint folder (the raw ``state_dict``, or the average), whole tensors,
    read in this process as data."""
    import warnings

    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from mmssl.checkpoints.read import load_dcp

    metadata = read_dcp_metadata(str(folder))
    prefix = f"{entry}."
    state = {entry: {k[len(prefix):]: torch.empty(v.size, dtype=v.properties.dtype)
                     for k, v in metadata.state_dict_metadata.items()
                     if k.startswith(prefix) and isinstance(v, TensorStorageMetadata)}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        load_dcp(str(folder), state)
    return state[entry]


def test_validate_of_a_folder_scores_the_raw_and_averaged_weights_as_fit_did(ema_runs, tiny_demo, tiny_clip_json):
    """``mmssl validate`` under FSDP2, ``evaluate: both``: the raw weights from the folder's
    ``state_dict``, the average read shard by shard into a sharded copy; the figures fit logged."""
    tmp, runs = ema_runs
    root = tmp / "validate"
    args = _ema_args(root, tiny_demo, 4, "both", tiny_clip_json)
    args[0] = "validate"
    _ok(run_mmssl([*args, *FSDP2, "--ckpt_path", str(runs["fsdp2"] / "kept" / "step=4.ckpt")], tmp, timeout=240))
    got, want = last_metrics(root / "version_0"), last_metrics(runs["fsdp2"] / "version_0")
    assert {"val/loss", "val/loss_ema", "val/zero_shot_top1_ema"} <= set(got)
    for key in got:
        assert got[key] == pytest.approx(want[key], abs=1e-6), key
