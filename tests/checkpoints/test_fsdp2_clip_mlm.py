"""CLIPMLM (CLIP + MLM + ITM) under FSDP2 through the real CLI (2 gloo processes, validation on one
held-out shard, so rank 1 validates nothing): it trains the weights a DDP run trains and logs the same
held-out figures, and a SIGKILL then ``--ckpt_path last`` ends bit-exactly where the uninterrupted
run ends.

The run that hung (#47): FSDP2 keeps the order of unit forwards until a backward ends and prefetches
by it, and the sanity-check validation ran on rank 0 alone, its steps ending in a text block of their
own (the corrupted captions' call). The first backward then made rank 0 all-gather that block while
rank 1 reduce-scattered another (mmssl.models.clip_mlm's docstring).
"""

from __future__ import annotations

import json
import signal

import pytest
import torch

from mmssl.checkpoints.read import read_checkpoint
from mmssl.checkpoints.resume import inspect_checkpoint
from tests.checkpoints.test_fsdp2 import DDP, FSDP2, _args, _ok, _params
from tests.cli_runs import last_metrics, run_mmssl
from tests.models.test_clip_mlm import MICRO


def test_fsdp2_clip_mlm_trains_as_ddp_and_a_sigkill_resumes_bit_exactly(tmp_path, tiny_demo):
    config = tmp_path / "clip_mlm_micro.json"
    config.write_text(json.dumps(MICRO))
    model = [f"--model.init_args.model_name={config}", "--model.init_args.warmup_steps=1"]
    runs = {name: tmp_path / name for name in ("fsdp2", "ddp", "killed")}
    outputs = {}
    for name, strategy in (("fsdp2", FSDP2), ("ddp", DDP)):
        outputs[name] = run_mmssl([*_args("clip_mlm", runs[name], tiny_demo, model, 4), *strategy], tmp_path,
                                  timeout=240)
        _ok(outputs[name])
    assert "view tensor" not in outputs["fsdp2"].stdout  # FSDP2 warns when a root output is a view
    kill = ["--trainer.callbacks+=tests.helpers.KillAtStep", "--trainer.callbacks.step=3"]
    killed = run_mmssl([*_args("clip_mlm", runs["killed"], tiny_demo, model, 4), *FSDP2, *kill], tmp_path,
                       timeout=240, killed=True)
    assert killed.returncode == -signal.SIGKILL, killed.stdout[-4000:]
    _ok(run_mmssl([*_args("clip_mlm", runs["killed"], tiny_demo, model, 4), *FSDP2, "--ckpt_path", "last"],
                  tmp_path, timeout=240))

    fsdp2, ddp, resumed = _params(runs["fsdp2"]), _params(runs["ddp"]), _params(runs["killed"])
    assert fsdp2.keys() == ddp.keys() and any("mlm_head" in k for k in ddp) and any("itm_head" in k for k in ddp)
    start = _params(runs["fsdp2"], "start_rank0.pt")
    assert all(not torch.equal(fsdp2[k], start[k]) for k in ("mlm_head.bias", "itm_head.head.weight")), \
        "the heads never trained"
    for key in ddp:  # reduce-scatter against all-reduce; logit_scale is (1,) in the sharded module
        torch.testing.assert_close(fsdp2[key].reshape(ddp[key].shape), ddp[key], rtol=1e-4, atol=1e-5, msg=key)
    assert all(torch.equal(fsdp2[k], _params(runs["fsdp2"], "rank1.pt")[k]) for k in fsdp2)  # one model
    differ = [k for k in fsdp2 if not torch.equal(fsdp2[k], resumed[k])]
    assert not differ, f"the resumed run ends elsewhere than the uninterrupted one: {differ}"
    # The resume started from the step-2 folder (the kill came before step 3's checkpoint).
    restart = _params(runs["killed"], "start_rank0.pt")
    saved = read_checkpoint(str(runs["killed"] / "kept" / "step=2.ckpt"))
    assert saved["global_step"] == 2
    assert all(torch.equal(restart[k], saved["state_dict"][k].reshape(restart[k].shape)) for k in restart)

    got, want = last_metrics(runs["fsdp2"] / "version_0"), last_metrics(runs["ddp"] / "version_0")
    for key in ("val/loss", "val/contrastive_loss", "val/mlm_loss", "val/mlm_top1", "val/itm_loss",
                "val/itm_accuracy", "val/t2i_R@1", "val/zero_shot_top1"):
        assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-5), key
    last = runs["killed"] / "version_0" / "checkpoints" / "last.ckpt"
    assert last.is_dir() and (last / ".metadata").is_file() and inspect_checkpoint(str(last)) == (4, None)
    torch.testing.assert_close(read_checkpoint(str(runs["fsdp2"] / "kept" / "step=4.ckpt"))["state_dict"][
        "itm_head.head.weight"], fsdp2["itm_head.head.weight"], rtol=0, atol=0)
