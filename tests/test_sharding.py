"""mmssl.sharding in one process: which modules become FSDP2 units, the policy's keys, and the
refusal of a model that would train unsynchronised replicas (the 2-process runs through the CLI
are in tests/checkpoints/test_fsdp2.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch import LightningModule

from mmssl.checkpoints.sharded import FSDP2Strategy
from mmssl.sharding import ShardingPolicy, check_sharded, shard_units


def test_units_are_the_outermost_transformer_blocks_of_every_tower(tiny_clip_json):
    from mmssl.models.clip import CLIP
    from mmssl.models.mae import MAE

    mae = MAE(image_size=32, patch_size=8, embed_dim=32, depth=3, num_heads=2, decoder_embed_dim=32,
              decoder_depth=2, decoder_num_heads=2)
    assert shard_units(mae) == [*mae.encoder.blocks, *mae.decoder.blocks]
    clip = CLIP(model_name=tiny_clip_json)
    blocks = [*clip.model.visual.transformer.resblocks, *clip.model.transformer.resblocks]
    assert shard_units(clip) == blocks and len(blocks) == 2  # one block per tower in the tiny config


def test_the_policy_takes_fsdp2_mixed_precision_and_refuses_unknown_dtypes():
    from torch.distributed.fsdp import MixedPrecisionPolicy

    kwargs = ShardingPolicy("bfloat16", "float32", reshard_after_forward=False).fully_shard_kwargs()
    assert kwargs == {"reshard_after_forward": False,
                      "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
    assert ShardingPolicy().fully_shard_kwargs() == {"reshard_after_forward": True}  # fp32: no policy
    with pytest.raises(ValueError, match="trainer.strategy.init_args.param_dtype: 'bf16'"):
        FSDP2Strategy(param_dtype="bf16")


def test_a_model_that_applies_no_fully_shard_is_refused_naming_it():
    class Replica(LightningModule):
        def configure_model(self) -> None:  # satisfies Lightning's check, shards nothing
            pass

    trainer = SimpleNamespace(strategy=FSDP2Strategy())
    with pytest.raises(ValueError, match="Replica does not support ModelParallelStrategy"):
        check_sharded(Replica(), trainer)
    check_sharded(Replica(), SimpleNamespace(strategy=None))  # any other strategy: nothing to check


def test_lora_is_refused_under_fsdp2_at_start_up_naming_the_key():
    from mmssl.models.lora import LoraCheckpoint
    from mmssl.sharding import shard_model

    class Adapted(LoraCheckpoint, LightningModule):
        lora_base = {"pretrained": {"path": "base.pth", "sha256": "0" * 64}}

    with pytest.raises(ValueError, match=r"Adapted under FSDP2Strategy \(FSDP2\): model.init_args.lora: .*DDP"):
        shard_model(Adapted(), SimpleNamespace(strategy=FSDP2Strategy()))
    assert not shard_model(Adapted(), SimpleNamespace(strategy=None))  # DDP / one device: nothing to shard
